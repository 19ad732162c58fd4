"""Hold a Ctrl-C while a new fd is being handed to its owner, or a call to the ranks, then deliver it.

CPython checks for signals right after a call into C returns. ``os.pipe()``, ``memfd_create``
and ``recvmsg`` hand back bare fds, so an interrupt can surface as ``KeyboardInterrupt`` before
the fds are stored anywhere that a ``finally`` could close: they leak, one or two per unlucky
Ctrl-C (seen as 2 fds left in the kernel by the 20-moment interrupt sweep of
``tests/faults/test_own_faults.py``). Inside :func:`held_interrupts` the interrupt is only
recorded; it is raised when the block ends, once the fds have an owner.

    >>> import os
    >>> with held_interrupts():
    ...     read_end, write_end = os.pipe()
    ...     owned = [read_end, write_end]        # an interrupt here waits until this line ran
    >>> for fd in owned: os.close(fd)

The kernel also holds a Ctrl-C while it writes a call to a session's ranks
(``kernel/run/group/rank_inboxes.py``): cut between two ranks' frames, the call would run on some
ranks only, and the session would have to be closed. Held, it interrupts the call once every rank
has it, and the session goes on.

Only the main thread gets ``KeyboardInterrupt`` (and ``signal.signal`` works only there): in any
other thread the block runs as it is. Workers use it too, for the same fds on their side.

A session call holds SIGINT while it writes the call and for each read, and changes what SIGINT
means while it waits (a Stop press). Each of those setting a handler and putting the old one back
took 12 ``signal.signal``/``getsignal`` calls a cell (8 µs a hold: both convert every handler to an
enum), 54 µs of the kernel's CPU per cell between cells. Inside :func:`routed_interrupts` (the
kernel's whole call) one handler of ours stays in place: a hold is a counter, and
:func:`sigint_goes_to` changes where SIGINT goes without telling the OS. The route's own two
handler changes skip the enum conversions (``wire/signal_handlers.py``), and a route holds while
its handler goes in and out: a Ctrl-C landing at that moment is neither lost (the route did not
know where to send it yet) nor raised between the holds of a block (``tests/faults/test_own_faults.py``
lands one at each such moment, and at each of a launch). Module-level state:
``_route``, the route in place; a process has one SIGINT handler, so at most one route.

    >>> with routed_interrupts():
    ...     with held_interrupts():
    ...         pass                             # held by the route, no handler set
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import FrameType

from accelnb.wire.signal_handlers import Handler, handler_of, set_handler


class _Route:
    """SIGINT's handler while a route is in place: each SIGINT goes on to ``target``, or is
    counted while a :func:`held_interrupts` block inside runs.

    Only the count is kept, never the frame the SIGINT landed in: a kept frame keeps its locals
    alive after it returns. One landed while the kernel decoded a rank's answer, and the
    memoryview of the channel's buffer that the decoding frame held made the buffer impossible to
    resize (``BufferError``): the answer was lost, and the session closed for want of it. A held
    SIGINT reaches its handler with ``frame=None``, as Python allows."""

    def __init__(self) -> None:
        self.target: Handler = None
        self.holds = 0  # held_interrupts blocks running (nested ones count too)
        self.second_goes_through = False  # the innermost hold's wish
        self.heard = 0  # SIGINTs that came during the holds, not yet delivered

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.holds:
            deliver_sigint(self.target, frame)
            return
        self.heard += 1
        if self.second_goes_through and self.heard == 2:
            self.heard = 0  # this one is delivered now: nothing is left for the hold's end
            deliver_sigint(self.target, frame)

    def let_go(self) -> None:
        """One hold fewer; what was heard during the holds is delivered once none is left."""
        self.holds -= 1
        if not self.holds and self.heard:
            self.heard = 0
            deliver_sigint(self.target, None)


_route: _Route | None = None  # the route in place (main thread only)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def routed_interrupts() -> Iterator[None]:
    """One SIGINT handler for the whole block, through which the holds and handler changes inside
    it cost no system call. SIGINT means inside what it meant before, unless changed by
    :func:`sigint_goes_to`. Nested, or outside the main thread: the block runs as it is."""
    with _route_in_place():
        yield


@contextmanager
def _route_in_place() -> Iterator[_Route | None]:
    """The route in place, or one put in place for the block; None outside the main thread."""
    if not _on_main_thread():
        yield None
        return
    if _route is not None:
        yield _route
        return
    route = _put_route_in_place(holds=1)
    try:
        route.let_go()  # a SIGINT that came as the handler went in is delivered now, inside the block
        yield route
    finally:
        _take_route_away(route)


def _put_route_in_place(holds: int) -> _Route:
    """A route in place, holding ``holds`` (at least one) from its handler's first instant: a
    SIGINT that lands the moment the handler changes, before ``target`` is known, is counted, and
    delivered by whoever lets go of the last hold. Not one lost, nor one raised in between."""
    global _route
    route = _Route()
    route.holds = holds
    route.target = set_handler(signal.SIGINT, route)
    _route = route
    return route


def _take_route_away(route: _Route) -> None:
    """The handler the route found goes back, unless code inside set its own, which stays. A
    SIGINT that lands before the handler has changed is held and delivered after; one after it,
    by the handler put back. Either way none lands between "no route" and "the route's handler"."""
    global _route
    route.holds += 1
    _route = None
    if handler_of(signal.SIGINT) is route:
        set_handler(signal.SIGINT, route.target)
    route.let_go()


@contextmanager
def sigint_goes_to(handler_for: Callable[[Handler], Handler]) -> Iterator[None]:
    """SIGINT goes to ``handler_for(previous)`` while the block runs (``previous``: where it went
    before), then where it went before; inside a route, without a system call. Main thread only:
    elsewhere the block runs as it is."""
    with _route_in_place() as route:
        if route is None:
            yield
            return
        previous = route.target
        route.target = handler_for(previous)
        try:
            yield
        finally:
            route.target = previous


def held_interrupts(second_one_goes_through: bool = False) -> AbstractContextManager[None]:
    """Defer SIGINT's handler to the end of the block (main thread only): the route's, or one put
    in place for the block.

    ``second_one_goes_through``: for a block that is quick unless something else is stuck
    (writing a call to ranks that read it): a second Ctrl-C while the first is held raises at once,
    so a user can always get out."""
    return _Hold(second_one_goes_through)


class _Hold:
    """One :func:`held_interrupts` block. A class rather than a generator: a session call enters
    ~11 (its write, each read), and a generator's block, nested in the route's, cost 5 µs each."""

    __slots__ = ("_outer_wish", "_owns_route", "_route", "_second_goes_through")

    def __init__(self, second_goes_through: bool) -> None:
        self._second_goes_through = second_goes_through
        self._route: _Route | None = None
        self._owns_route = False
        self._outer_wish = False

    def __enter__(self) -> None:
        if not _on_main_thread():
            return  # the block runs as it is
        route = _route
        if route is None:
            route = _put_route_in_place(holds=1)
            self._owns_route = True
        else:
            route.holds += 1
        self._route = route
        self._outer_wish, route.second_goes_through = route.second_goes_through, self._second_goes_through

    def __exit__(self, *exception: object) -> None:
        route = self._route
        if route is None:
            return
        try:
            route.second_goes_through = self._outer_wish
            route.let_go()
        finally:
            if self._owns_route:
                _take_route_away(route)


def deliver_sigint(handler: object, frame: FrameType | None) -> None:
    """What SIGINT would have done under ``handler``: raise, run it, ignore, or die. Also what a
    rank's held SIGINT does once its call's code runs (``worker/interactive/rank_interrupts.py``)."""
    if callable(handler):
        handler(signal.SIGINT, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # not back into a route's handler
        signal.raise_signal(signal.SIGINT)
    # SIG_IGN (or None: a handler set from C): nothing would have happened
