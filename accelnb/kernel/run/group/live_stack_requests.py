"""The local ranks' Python stacks, read while they run: a signal makes each rank print its stacks
on its stderr, and whoever drives the pipes reads the dumps. A rank that has not answered
``ASK_FOR_STACKS`` within ``FALLBACK_AFTER_S`` is sent ``STACKS_WITHOUT_THE_GIL`` (why two:
``wire/stack_signals.py``).

Two uses:

- :meth:`LiveStackRequests.collect` (any thread; a display's Stacks button, ``accelnb.stacks()``)
  stops nothing. The launching thread serves the request in its wait loop during a call
  (:meth:`LiveStackRequests.serve`, on every pump); with no call running (a session between
  cells) the asking thread serves it itself, once it holds the group's drive lock. The pipes are
  never read by two threads at once: a call, a shutdown and a self-served request each hold
  that lock. The ranks' stderr is held meanwhile, so the dumps do not reach the cell, and what
  the ranks wrote there themselves is shown afterwards.
- :meth:`LiveStackRequests.dump_all` (``timeout=`` expired, just before the ranks are stopped):
  the dumps go into the exception, not also into the cell.

    >>> requests = LiveStackRequests(router, processes, drive, pump_between_calls, closed)  # doctest: +SKIP
    >>> requests.collect(wait=1.0)                                                          # doctest: +SKIP
    {0: 'File "train.py", line 12 in step ...', 1: '...'}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from accelnb.kernel.display.output import OutputRouter
from accelnb.kernel.run.group.rank_processes import RankProcesses
from accelnb.kernel.stacks.faulthandler_dumps import clean_stack_dump, dump_has_begun, split_stack_dump
from accelnb.wire.stack_signals import ASK_FOR_STACKS, FALLBACK_AFTER_S, STACKS_WITHOUT_THE_GIL

STACK_DUMP_WAIT_S = 1.0
STACK_DUMP_QUIET_S = 0.1  # a live dump is complete once every rank wrote one and this long passed silent
WAIT_SLICE_S = 0.05


@dataclass
class _Fallback:
    """When the ranks were asked for their stacks; ``STACKS_WITHOUT_THE_GIL`` is due once,
    ``FALLBACK_AFTER_S`` later, to those whose dump has not begun."""

    asked_at: float
    sent: bool = False

    def due(self, now: float) -> bool:
        if self.sent or now - self.asked_at < FALLBACK_AFTER_S:
            return False
        self.sent = True
        return True


@dataclass
class _StackRequest:
    """A live stack dump asked for by some thread, served by whichever thread pumps the pipes."""

    wait: float
    done: threading.Event = field(default_factory=threading.Event)
    ranks: list[int] = field(default_factory=list)  # signalled; empty until the request is served
    deadline: float = 0.0
    fallback: _Fallback = field(default_factory=lambda: _Fallback(0.0))  # set when the ranks are asked
    last_held: int = -1  # bytes of held stderr last seen, to tell when the dumps went quiet
    quiet_since: float = 0.0
    stacks: dict[int, str] = field(default_factory=dict)


class LiveStackRequests:
    """Stack dumps of one group's ranks.

    ``drive`` is the group's drive lock; ``pump(timeout)`` reads the pipes when no call runs;
    ``closed()`` says whether the group is closed (then there is nothing left to ask).
    """

    def __init__(self, output: OutputRouter, processes: RankProcesses, drive: threading.RLock,
                 pump: Callable[[float], None], closed: Callable[[], bool]) -> None:
        self.output = output
        self._processes = processes
        self._drive = drive
        self._pump = pump
        self._closed = closed
        self._request: _StackRequest | None = None
        self._one_request = threading.Lock()

    def collect(self, wait: float = STACK_DUMP_WAIT_S) -> dict[int, str]:
        """Every live rank's current Python stacks, cleaned, without stopping anything.

        Safe from any thread. Returns within about ``wait`` s (sooner once every dump is in);
        a rank whose dump did not arrive in time (blocked in C code with the GIL held) maps to
        an empty string. A group that is closed returns ``{}``.
        """
        with self._one_request:
            if self._closed():
                return {}
            request = _StackRequest(wait)
            self._request = request
            try:
                # A call's wait loop serves it within one slice; with no call running, nobody
                # reads the pipes, so this thread does, once it may drive the group.
                while not request.done.wait(WAIT_SLICE_S):
                    if self._drive.acquire(blocking=False):
                        try:
                            self._serve_until_done(request)
                        finally:
                            self._drive.release()
            finally:
                self._request = None
            return request.stacks

    def _serve_until_done(self, request: _StackRequest) -> None:
        while not request.done.is_set():
            if self._closed():
                self._finish(request)
                return
            self._pump(WAIT_SLICE_S)

    def serve(self) -> None:
        """Called on every pump: start the pending request, or finish it once its dumps are in."""
        request = self._request
        if request is None or request.done.is_set():
            return
        now = time.monotonic()
        if not request.ranks:
            request.ranks = self._processes.live_ranks()
            self.output.hold_stderr(request.ranks)
            for rank in request.ranks:
                self._processes.signal(rank, ASK_FOR_STACKS)
            request.fallback, request.deadline = _Fallback(now), now + request.wait
            if not request.ranks:
                self._finish(request)
            return
        held = [self.output.held_stderr(rank) for rank in request.ranks]
        size = sum(len(text) for text in held)
        if size != request.last_held:
            request.last_held, request.quiet_since = size, now
        if request.fallback.due(now):
            self._send_fallback(dict(zip(request.ranks, held, strict=True)))
        every_rank_dumped = all(map(dump_has_begun, held))
        if now >= request.deadline or (every_rank_dumped and now - request.quiet_since >= STACK_DUMP_QUIET_S):
            self._finish(request)

    def _finish(self, request: _StackRequest) -> None:
        for rank, text in self.output.release_stderr().items():
            dump, own_output = split_stack_dump(text)
            request.stacks[rank] = clean_stack_dump(dump)
            self.output.show(rank, "stderr", own_output)  # the rank's own stderr still reaches the cell
        request.done.set()

    def dump_all(self, pump: Callable[[float], None]) -> dict[int, str]:
        """Have every live rank print its Python stacks (``timeout=`` expired); ``pump(timeout)``
        reads them. Every rank maps to its cleaned dump, "" when none came."""
        ranks = [p.rank for p in self._processes.ranks]
        marks = {rank: self.output.position(rank) for rank in ranks}
        self.output.live_ranks.clear()  # the dump goes into the exception, not also the cell
        for rank in self._processes.live_ranks():
            self._processes.signal(rank, ASK_FOR_STACKS)
        fallback = _Fallback(time.monotonic())
        while (now := time.monotonic()) < fallback.asked_at + STACK_DUMP_WAIT_S:
            if fallback.due(now):
                self._send_fallback({rank: self.output.text_since(rank, marks[rank]) for rank in ranks})
            pump(WAIT_SLICE_S)
        return {rank: clean_stack_dump(self.output.text_since(rank, marks[rank])) for rank in ranks}

    def _send_fallback(self, written: dict[int, str]) -> None:
        """``STACKS_WITHOUT_THE_GIL`` to each live rank whose dump has not begun (``written``: what
        each rank wrote to stderr since it was asked)."""
        live = set(self._processes.live_ranks())
        for rank, text in written.items():
            if rank in live and not dump_has_begun(text):
                self._processes.signal(rank, STACKS_WITHOUT_THE_GIL)
