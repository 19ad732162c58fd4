"""Faults in accelnb's own machinery, as a user meets them (rows 13–15 of docs/faults.md).

13. accelnb's helper process is SIGKILLed (the OOM killer picks it, or a user's ``kill``) while
    the ranks run: the launch raises within 2 s, naming the helper and the signal; every worker
    is gone; the next launch starts a fresh helper and works.
14. Ctrl-C lands at one of many moments of start-up and of sending the call: KeyboardInterrupt
    (or, when it lands after the run ended, a normal return), never a worker left, no fd or
    ``/dev/shm`` growth in this process, and the next launch works at once. Also at each read of
    a template's report, one read at a time: no report is lost (a lost worker's exit left a
    departed rank waited for forever).
15. A rank starts a process in its own session (``start_new_session=True``, as logging daemons
    do) and returns, or raises: that process is gone when the launch is.

This pytest process plays the kernel, as in ``test_rank_faults.py``.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from faultkit import ok_target, read_report, report, wait_for_report, wait_gone

import accelnb
from accelnb.kernel.helper import client
from accelnb.kernel.helper.template import shared_helper, sockets_held_ahead
from tests.conftest import wait_until_no_workers, worker_processes

HELPER_DEATH_BOUND_S = 2.0
GONE_BOUND_S = 5.0
# Offsets (ms) at which Ctrl-C lands after the call starts: dense over the first 100 ms, where
# start-up (binding the port, forking, sending the call) happens on a warm helper.
INTERRUPT_OFFSETS_MS = (0, 1, 2, 3, 5, 7, 10, 13, 16, 20, 25, 30, 40, 50, 65, 80, 100, 150, 250, 400)


def sleeping_target(report_dir: str) -> None:
    """Report this rank's pid, then wait (in Python) until accelnb ends the run."""
    import torch.distributed as dist

    report(report_dir, dist.get_rank(), pid=os.getpid())
    time.sleep(3600)


def detached_child_target(report_dir: str, then: str) -> int:
    """Start a process in its own session (as a logging daemon does), then return or raise."""
    import torch.distributed as dist

    rank = dist.get_rank()
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    report(report_dir, rank, pid=os.getpid(), child_pid=child.pid)
    if then == "raise" and rank == 1:
        wait_for_report(report_dir, 0, "child_pid")  # so that the test knows both pids
        raise RuntimeError("rank 1 fails after starting a detached process")
    return rank


def open_fds() -> set[str]:
    """This process's fds but the socket it holds for its template's next launch (``wire/group_ahead.py``)."""
    return set(os.listdir("/proc/self/fd")) - {str(held.fileno()) for held in sockets_held_ahead()}


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_helper_killed_mid_run(tmp_path: Path, fault_record: dict[str, Any]) -> None:
    helper = shared_helper().pid
    killed_at: list[float] = []

    def kill_helper_once_both_ranks_run() -> None:
        for rank in (0, 1):
            wait_for_report(str(tmp_path), rank, "pid")
        killed_at.append(time.monotonic())
        os.kill(helper, signal.SIGKILL)

    killer = threading.Thread(target=kill_helper_once_both_ranks_run)
    killer.start()
    with pytest.raises(accelnb.AccelnbError) as raised:
        accelnb.launch(sleeping_target, (str(tmp_path),), num_processes=2, cpu=True, quiet=True, timeout=60)
    seconds_to_raise = time.monotonic() - killed_at[0]
    killer.join()
    message = str(raised.value)
    pids = [read_report(tmp_path / f"rank{rank}.json")["pid"] for rank in (0, 1)]
    gone = wait_gone(pids, GONE_BOUND_S)
    fault_record.update(fault="helper_killed", rank="–", phase="-", raised=type(raised.value).__name__,
                        first_line=message.splitlines()[0], cleanup_s=seconds_to_raise,
                        bound_s=HELPER_DEATH_BOUND_S, measured_from="the kill, until the launch raised")

    assert seconds_to_raise < HELPER_DEATH_BOUND_S, f"the launch raised {seconds_to_raise:.2f} s after the kill"
    assert "helper" in message and "SIGKILL" in message, message
    assert gone is not None, f"workers outlived their helper: {pids}"
    assert accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}
    assert shared_helper().pid != helper


def test_interrupt_at_many_moments_of_start_up(fault_record: dict[str, Any]) -> None:
    accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)  # warm: the helper is running
    fds_before, shm_before = open_fds(), shm_names()
    main = threading.get_ident()
    interrupted = returned = 0
    started = time.monotonic()
    for offset_ms in INTERRUPT_OFFSETS_MS:
        fired = threading.Event()

        def interrupt(at: float = offset_ms / 1000, fired: threading.Event = fired) -> None:
            time.sleep(at)  # this *is* the moment under test, not a wait for something
            signal.pthread_kill(main, signal.SIGINT)
            fired.set()

        sender = threading.Thread(target=interrupt)
        completed = False
        try:
            sender.start()
            accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)
            completed = True
            fired.wait()  # a Ctrl-C after the run is still delivered inside this try
            time.sleep(0)  # lets the interpreter run the pending handler here
        except KeyboardInterrupt:
            pass
        sender.join()
        interrupted, returned = interrupted + (not completed), returned + completed
        assert worker_processes() == [] or wait_until_no_workers(GONE_BOUND_S) < GONE_BOUND_S
        assert accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}
    leaked_fds = open_fds() - fds_before
    fault_record.update(fault="interrupt_start", rank="–", phase="-",
                        raised=f"RunInterrupted at {interrupted} of {len(INTERRUPT_OFFSETS_MS)} moments "
                               f"(at {returned} the run had already returned)",
                        first_line="", cleanup_s=time.monotonic() - started, bound_s=GONE_BOUND_S,
                        label=f"{len(INTERRUPT_OFFSETS_MS)} moments, 0–400 ms after the call",
                        measured_from="the first interrupt, for all moments together")

    assert interrupted >= 5, f"only {interrupted} interrupts landed inside a launch: the sweep misses start-up"
    assert not leaked_fds, f"fds left open in the kernel: {sorted(leaked_fds)}"
    assert shm_names() == shm_before


class InterruptAtReport:
    """A Ctrl-C raised in this (the main) thread right after the kernel decoded the ``at``-th
    report of its template (counting from 1; 0: none), the moment between reading a report and
    noting it, where a Ctrl-C once lost it. A profile hook, because no timer lands on a moment
    of microseconds every time; ``reads`` counts the reports decoded, so that a test notices
    when the client no longer decodes them this way, rather than passing without a Ctrl-C."""

    def __init__(self, at: int) -> None:
        self.at, self.reads = at, 0

    def __enter__(self) -> InterruptAtReport:
        sys.setprofile(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _on_event(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and arg is pickle.loads and frame.f_code.co_filename == client.__file__:
            self.reads += 1
            if self.reads == self.at:
                signal.raise_signal(signal.SIGINT)  # handled at the caller's next instruction


def test_interrupt_at_each_report_of_the_template() -> None:
    accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)  # warm: the helper is running
    with InterruptAtReport(at=0) as counted:
        accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)
        wait_until_no_workers(GONE_BOUND_S)
        accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)  # reads the last launch's exits
    assert counted.reads >= 2, f"{counted.reads} reports decoded in two launches: the hook no longer sees them"
    fired = interrupted = 0
    for at in range(1, counted.reads + 1):
        interrupt = InterruptAtReport(at)
        try:
            with interrupt:
                accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)
                wait_until_no_workers(GONE_BOUND_S)
                accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)
        except KeyboardInterrupt:
            interrupted += 1
        fired += interrupt.reads >= at  # the same two launches may read a report fewer
        assert worker_processes() == [] or wait_until_no_workers(GONE_BOUND_S) < GONE_BOUND_S
        assert accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}
        assert wait_until_no_workers(GONE_BOUND_S) < GONE_BOUND_S, f"a worker outlived a Ctrl-C at report {at}"
    assert fired >= 2 and interrupted == fired, f"of {fired} Ctrl-Cs at a report, {interrupted} reached the launch"


@pytest.mark.parametrize("then", ["return", "raise"])
def test_detached_grandchild_is_gone_with_its_rank(then: str, tmp_path: Path,
                                                    fault_record: dict[str, Any]) -> None:
    error: BaseException | None = None
    try:
        accelnb.launch(detached_child_target, (str(tmp_path), then), num_processes=2, cpu=True, quiet=True)
    except accelnb.RankFailed as failed:
        error = failed
    ended = time.time()
    children = [read_report(tmp_path / f"rank{rank}.json")["child_pid"] for rank in (0, 1)]
    gone = wait_gone(children, GONE_BOUND_S)
    fault_record.update(fault="detached_child", rank=1 if then == "raise" else "both",
                        phase="-", raised="RankFailed" if error else "(the value)",
                        first_line=str(error).splitlines()[0] if error else "",
                        cleanup_s=None if gone is None else max(0.0, gone - ended), bound_s=GONE_BOUND_S,
                        label="then returns" if then == "return" else "then rank 1 raises",
                        measured_from="the launch's end")

    assert (error is None) == (then == "return")
    assert gone is not None, f"a process the rank started in its own session outlived the launch: {children}"
