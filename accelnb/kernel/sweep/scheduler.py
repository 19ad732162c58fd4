"""Trials onto slots: one thread per running trial, a queue, and one stop for all of them.

    >>> ending = run_trials(trials, slots, run_trial, fail_fast=False, tick=table.refresh)  # doctest: +SKIP

Why threads, one per running trial, each driving one whole launch with the engine as it is: the
engine's wait (``WorkerGroup.call``) blocks the thread that calls it in its own selector loop over
its ranks' pipes, and that loop is where output is routed, metrics delivered, failures decided and
the stop ladder run. Driving several launches from one thread would need a second, non-blocking
engine. A thread per launch keeps one engine, and what each launch owns (its group, pipes,
selector, output router, metric route, rendezvous port) stays its own. What is global was made
safe for it, or is kept off the trial threads:

- accelnb's helper process is shared: :class:`~accelnb.kernel.helper.client.WorkerHelper` holds a
  lock around every exchange on its socket (a spawn request and its answer are one);
- the wait hooks (a Stop button's comm messages, which only the kernel's main thread may read)
  run on the thread that called :func:`run_trials`, never on a trial thread
  (:func:`~accelnb.kernel.run.run_state.wait_hooks_run_elsewhere`);
- the run state's "current run" is the latest trial to start (the side panel's per-rank rows);
  which trial each GPU runs is published apart (:mod:`~accelnb.kernel.sweep.sweep_state`);
- nothing of a trial is printed in the cell: the caller runs trials with ``output="none"`` and
  keeps each trial's output with the trial;
- SIGINT (the kernel's interrupt, Ctrl-C) raises ``KeyboardInterrupt`` in the main thread only.
  This loop, in the main thread, turns it (and a panel's Stop, :func:`~accelnb.kernel.run.run_state.request_stop`)
  into a stop request to every running trial's launch: the same ``stop_requested`` a panel's
  Stop sets on one launch, so each launch ends its ranks with its own stop ladder (SIGTERM, a
  grace, SIGKILL) and frees what it holds. The loop then waits for every trial thread; a trial
  not started yet is skipped.

With ``fail_fast=True`` the first failed trial stops the others the same way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

from accelnb.kernel.run import run_state
from accelnb.kernel.run.group.stop_presses import STOP_BUTTON
from accelnb.kernel.sweep.slots import Slot
from accelnb.kernel.sweep.trials import Trial

TICK_S = 0.05  # how often the waiting loop wakes: wait hooks (a Stop click), the table's throttle
STOP_WAIT_S = 60.0  # after a stop, how long to wait for the trial threads (each launch's ladder is seconds)

SweepEnding = Literal["finished", "failed_fast", "stopped"]


class SweepStop:
    """Stops every running trial from any thread: each trial's launch registers its stop event."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[int, run_state.RunState] = {}
        self.requested = threading.Event()
        self._asked_by = STOP_BUTTON

    def attach(self, trial: int, run: run_state.RunState) -> None:
        """A trial's launch started; a stop of the sweep is a press on its run (at once if the
        sweep stops already)."""
        with self._lock:
            self._runs[trial] = run
            if self.requested.is_set():
                self._press(run)

    def detach(self, trial: int) -> None:
        with self._lock:
            self._runs.pop(trial, None)

    def stop_all(self, by: str = STOP_BUTTON) -> None:
        """Press Stop on every running trial (``by`` names the press in each trial's messages)."""
        with self._lock:
            self._asked_by = by
            self.requested.set()
            for run in self._runs.values():
                self._press(run)

    def _press(self, run: run_state.RunState) -> None:
        run.press_stop(self._asked_by)


RunTrial = Callable[[Trial, Slot, SweepStop], None]  # runs one trial to its end, recording it; raises nothing


def run_trials(trials: Sequence[Trial], slots: Sequence[Slot], run_trial: RunTrial, *, fail_fast: bool,
               tick: Callable[[], None], on_change: Callable[[], None] = lambda: None) -> SweepEnding:
    """Run every trial, at most one per slot at a time, in order; returns how the sweep ended.

    ``tick`` runs on this thread about every :data:`TICK_S` (the table's throttled redraw);
    ``on_change`` after a trial starts or ends. An interrupt (``KeyboardInterrupt`` here) or a
    Stop request stops every running trial, waits for them, and ends as ``"stopped"``.
    """
    pending = deque(trials)
    free = deque(slots)
    ended: queue.SimpleQueue[tuple[Trial, Slot]] = queue.SimpleQueue()
    running: dict[int, threading.Thread] = {}
    stop = SweepStop()
    failed_fast = False
    unsubscribe = run_state.on_stop_request(stop.stop_all)
    try:
        try:
            while pending or running:
                while pending and free and not stop.requested.is_set():
                    trial, slot = pending.popleft(), free.popleft()
                    _start(trial, slot, run_trial, stop, ended, running)
                    on_change()
                if not running:
                    break
                _wait_for_one(ended, running, free, tick)
                on_change()
                if fail_fast and not failed_fast and any(t.state == "failed" for t in trials):
                    failed_fast = True
                    stop.stop_all("fail_fast=True: a trial failed")
        except KeyboardInterrupt:
            stop.stop_all()
            _wait_for_all(ended, running, free, tick, stop)
        for trial in trials:  # queued, or whose thread an interrupt kept from starting
            if trial.state == "queued" or (trial.state == "running" and trial.index not in running):
                trial.skip()
        on_change()
    finally:
        unsubscribe()
    if failed_fast:
        return "failed_fast"
    return "stopped" if stop.requested.is_set() else "finished"


def _start(trial: Trial, slot: Slot, run_trial: RunTrial, stop: SweepStop,
           ended: queue.SimpleQueue[tuple[Trial, Slot]], running: dict[int, threading.Thread]) -> None:
    """Run ``trial`` on ``slot`` in a thread of its own, registered in ``running`` before it starts
    (an interrupt between the two leaves a thread that never started, which the stop skips)."""

    def body() -> None:
        try:
            with run_state.wait_hooks_run_elsewhere():
                run_trial(trial, slot, stop)
        except BaseException as error:  # run_trial records what it can; a bug still ends the trial
            if trial.state in ("queued", "running"):
                trial.fail(error)
        finally:
            ended.put((trial, slot))

    trial.begin(slot.gpus)
    thread = threading.Thread(target=body, name=f"accelnb-trial-{trial.index}", daemon=True)
    running[trial.index] = thread
    thread.start()


def _wait_for_one(ended: queue.SimpleQueue[tuple[Trial, Slot]], running: dict[int, threading.Thread],
                  free: deque[Slot], tick: Callable[[], None]) -> None:
    """Until one trial ends: tick, and run the wait hooks (on this thread, where they belong)."""
    while True:
        run_state.run_wait_hooks()
        tick()
        try:
            trial, slot = ended.get(timeout=TICK_S)
        except queue.Empty:
            continue
        running.pop(trial.index).join()
        free.append(slot)
        return


def _wait_for_all(ended: queue.SimpleQueue[tuple[Trial, Slot]], running: dict[int, threading.Thread],
                  free: deque[Slot], tick: Callable[[], None], stop: SweepStop) -> None:
    """After a stop: until every trial thread ended (each launch stops its ranks by its own ladder).
    Another interrupt meanwhile does not cut this short (leaving now would leave ranks running):
    it is a second press to every trial, which ends at once one whose code was saving on the first
    (``stop_requested()``), as a second press does in a launch."""
    for index, thread in list(running.items()):
        if thread.ident is None:  # registered, never started: nothing of it runs
            running.pop(index)
    deadline = time.monotonic() + STOP_WAIT_S
    while running and time.monotonic() < deadline:
        try:
            _wait_for_one(ended, running, free, tick)
        except KeyboardInterrupt:
            stop.stop_all()
