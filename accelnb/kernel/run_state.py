"""The state of the run in progress, for displays that show it (panels, side panel).

The supervisor writes one :class:`RankState` per rank as workers start, run and end; displays
subscribe with :func:`on_run_change`. Only the latest run is kept. ``request_stop()`` asks the
running launch to stop; it is safe to call from any thread (a widget callback, a comm handler).

    >>> unsubscribe = on_run_change(lambda run: print(run.states if run else None))
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

RankPhase = Literal["starting", "running", "done", "failed", "stopped"]


@dataclass
class RankState:
    rank: int
    device: str  # "cuda:0 (GPU 3)" or "cpu"
    phase: RankPhase = "starting"
    pid: int | None = None
    detail: str = ""  # failure summary, exit signal…


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
    stop_requested: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def states(self) -> dict[int, RankPhase]:
        return {r.rank: r.phase for r in self.ranks}


RunListener = Callable[[RunState | None], None]
_current_run: RunState | None = None
_listeners: list[RunListener] = []
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
    for listener in list(_listeners):
        try:
            listener(_current_run)
        except Exception:  # a broken display must never break the launch
            pass


def on_run_change(listener: RunListener) -> Callable[[], None]:
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def request_stop() -> bool:
    """Ask the run in progress to stop. Returns False when nothing is running."""
    run = _current_run
    if run is None or run.finished:
        return False
    run.stop_requested.set()
    return True


# While a launch blocks the kernel's main thread, the kernel processes no widget or comm
# messages. Displays that need them (a Stop button) register a hook here; the launcher calls
# every hook about ten times a second from the waiting thread.
WaitHook = Callable[[], None]
_wait_hooks: list[WaitHook] = []


def add_wait_hook(hook: WaitHook) -> Callable[[], None]:
    _wait_hooks.append(hook)
    return lambda: _wait_hooks.remove(hook) if hook in _wait_hooks else None


def run_wait_hooks() -> None:
    for hook in list(_wait_hooks):
        try:
            hook()
        except Exception:  # a broken display must never break the launch
            pass
