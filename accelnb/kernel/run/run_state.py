"""The state of the run in progress, for displays that show it (panels, side panel).

The supervisor writes one :class:`RankState` per rank as workers start, run and end; displays
subscribe with :func:`on_run_change`. Only the latest run is kept. ``request_stop()`` asks the
running launch to stop; it is safe to call from any thread (a widget callback, a comm handler).

    >>> unsubscribe = on_run_change(lambda run: print(run.states if run else None))

While a launch blocks the kernel's main thread, displays that need that thread (a Stop button's
comm messages, the live metrics redraw) register a wait hook with :func:`add_wait_hook`. The
supervisor calls :func:`run_wait_hooks` on every wake-up of its wait loop, which under an output
flood is thousands of times a second; this module, not the call site, keeps the hooks to
:data:`WAIT_HOOK_RATE_HZ` rounds a second (see :class:`WaitHooks`).

Run listeners and wait hooks follow the one observer policy of :mod:`accelnb.kernel.watched_state.observers`:
one that raises is logged and skipped; the launch goes on.

Module-level state, one per kernel, since a kernel shows one run at a time and its panels watch
that one: ``_current_run`` and ``_run_ids`` (ids only grow), ``_run_listeners`` and
``_stop_listeners`` (the displays and sweeps subscribed), ``_lock`` (the current run is set from
the launching thread and read from any), ``_wait_hooks`` (the launching thread's hooks) and
``_hookless`` (which threads leave the hooks to another: per thread by design).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from accelnb.kernel.display.rank_activity import RankFigures
from accelnb.kernel.watched_state.observers import Listeners

RankPhase = Literal["starting", "running", "done", "failed", "stopped"]

# Rounds of wait hooks per second while a launch waits: a Stop click is seen within 50 ms, and
# hooks cost the wait loop at most twenty calls a second whatever the workers print.
WAIT_HOOK_RATE_HZ = 20.0


@dataclass
class RankState:
    rank: int
    device: str  # "cuda:0 (GPU 3)" or "cpu"
    phase: RankPhase = "starting"
    pid: int | None = None
    detail: str = ""  # failure summary, exit signal…
    progress: str = ""  # its step, speed, waits, GPU (RankRow.describe), at most once a second
    figures: RankFigures | None = None  # the same as numbers; None until its first step


# Run ids only grow, so a display can tell a new run from the one it shows even when the
# new run's objects reuse the old one's memory (id() would repeat).
_run_ids = itertools.count(1)


def next_run_id() -> int:
    return next(_run_ids)


@dataclass
class RunState:
    run_id: int
    ranks: list[RankState]
    started_at: float = field(default_factory=time.time)
    finished: bool = False
    # The ranks were asked to stop at their next stop_requested() check, by this press, and are
    # saving: a display offers "Stop now" (the second press). None: no request is pending.
    stop_pending: str | None = None
    # Every live rank's current stacks without stopping anything; safe from any thread (the
    # supervisor's WorkerGroup.collect_stacks). None for a run that cannot be asked.
    collect_stacks: Callable[[float], dict[int, str]] | None = field(default=None, repr=False)
    # A Stop pressed from another thread (a panel, a sweep, SIGTERM's handler), not yet taken by
    # the call's wait loop, which decides what it means (kernel/run/group/stop_presses.py).
    _pressed_by: str | None = field(default=None, repr=False)
    _press_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def states(self) -> dict[int, RankPhase]:
        return {r.rank: r.phase for r in self.ranks}

    def press_stop(self, by: str) -> None:
        """A Stop press on this run by ``by`` (named in the cell's message); safe from any thread."""
        with self._press_lock:
            self._pressed_by = by

    def take_stop_press(self) -> str | None:
        """What pressed Stop since the last take, if anything (the call's wait loop takes it)."""
        with self._press_lock:
            by, self._pressed_by = self._pressed_by, None
            return by

    @property
    def stop_pressed(self) -> bool:
        """A press is waiting for the wait loop (a display shows "stopping…" meanwhile)."""
        return self._pressed_by is not None


RunListener = Callable[[RunState | None], None]
_current_run: RunState | None = None
_run_listeners = Listeners[[RunState | None]]("run-state listener")
_lock = threading.Lock()


def current_run() -> RunState | None:
    return _current_run


def begin_run(run: RunState) -> None:
    global _current_run
    with _lock:
        _current_run = run
    publish()


def publish() -> None:
    """Tell listeners the current run changed (call after mutating its ranks)."""
    _run_listeners.notify(_current_run)


def on_run_change(listener: RunListener) -> Callable[[], None]:
    """Call ``listener`` after every run change; returns a function that unsubscribes it."""
    return _run_listeners.add(listener)


def run_listener_count() -> int:
    """How many run listeners are subscribed (a closed or collected display leaves none)."""
    return len(_run_listeners)


_stop_listeners = Listeners[[str]]("stop listener")


def on_stop_request(listener: Callable[[str], object]) -> Callable[[], None]:
    """Have ``listener`` called by every :func:`request_stop` (a sweep, whose several runs one Stop
    ends); returns a function that unsubscribes it."""
    return _stop_listeners.add(listener)


def request_stop(by: str) -> bool:
    """Ask the run in progress (and whatever listens, see :func:`on_stop_request`) to stop;
    ``by`` says what asked, in the cell's message. Returns False when nothing is running."""
    heard = len(_stop_listeners) > 0
    _stop_listeners.notify(by)
    run = _current_run
    if heard or run is None or run.finished:  # a listener (a sweep) stops its runs, the current one included:
        return heard  # setting it again here could read as a second press
    run.press_stop(by)
    return True


WaitHook = Callable[[], object]  # what a hook returns is ignored


class WaitHooks:
    """Hooks run at most ``rate`` rounds a second, however often :meth:`run` is called.

    Rounds keep to a fixed schedule (one every ``1 / rate`` s), so a wait loop that wakes a
    little early still gets the full rate; after a pause (a slow round, no wake-ups) the next call
    runs at once and the schedule restarts from there, never with a burst of rounds to catch up.
    A round that ran late on the schedule leaves the next at least ``SPACING`` of an interval
    away (a round late by nearly an interval was followed by the next within a millisecond: 8
    rounds in 0.306 s at 20 a second, once in a full test run). In any window of T seconds
    there are at most ``T * rate + 1 + (1 - SPACING)`` rounds. ``clock`` is injectable for tests;
    it defaults to :func:`time.monotonic`.
    """

    SPACING = 7 / 8  # of an interval, at least, between two rounds

    def __init__(self, rate: float = WAIT_HOOK_RATE_HZ, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be a positive number of rounds per second, got {rate!r}.")
        self._interval = 1.0 / rate
        self._clock = clock
        self._hooks = Listeners[[]]("launch wait hook")
        self._due = -math.inf

    def add(self, hook: WaitHook) -> Callable[[], None]:
        """Register ``hook``; returns a function that removes it."""
        return self._hooks.add(hook)

    def run(self) -> bool:
        """Run every hook if a round is due; returns whether one ran."""
        now = self._clock()
        if now < self._due:
            return False
        on_schedule = now - self._due < self._interval
        scheduled = (self._due if on_schedule else now) + self._interval
        self._due = max(scheduled, now + self._interval * self.SPACING)
        self._hooks.notify()
        return True

    def __len__(self) -> int:
        return len(self._hooks)


_wait_hooks = WaitHooks()


def add_wait_hook(hook: WaitHook) -> Callable[[], None]:
    """Have ``hook`` called from the launching thread while a launch waits (rate-limited)."""
    return _wait_hooks.add(hook)


_hookless = threading.local()


@contextmanager
def wait_hooks_run_elsewhere() -> Iterator[None]:
    """In this thread, :func:`run_wait_hooks` runs nothing: a sweep's trial threads each wait on
    a launch, while the thread that started the sweep runs the hooks (a Stop button's comm
    messages must be read by the kernel's main thread, and a round a trial thread took would be
    a round the main thread lost to the rate limit)."""
    _hookless.active = True
    try:
        yield
    finally:
        _hookless.active = False


def run_wait_hooks() -> bool:
    """The supervisor's wait loop calls this on every wake-up; hooks run at the limited rate."""
    if getattr(_hookless, "active", False):
        return False
    return _wait_hooks.run()


def wait_hook_count() -> int:
    """How many wait hooks are registered."""
    return len(_wait_hooks)
