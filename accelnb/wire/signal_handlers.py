"""Set and read a signal's handler on a call's path, without the ``signal`` module's enum conversions.

``signal.signal`` and ``signal.getsignal`` are Python wrappers around C functions: each turns the
handler it hands back into a ``signal.Handlers`` member. For a handler that is a function (what
accelnb's calls set and find: ipykernel's ``default_int_handler``, the route's, a rank's), that
conversion is an enum lookup that fails, raising a ``ValueError`` it then catches: 3-4 µs hot, and
22 µs (the kernel) and 39 µs (a rank) a call between a session's cells, where caches are cold.
A session cell made four such calls in the kernel (90 µs of its main thread's CPU a cell) and one
in each rank (``benchmarks/RESULTS.md``, "Signal handlers without the enum conversions").

These call the C functions the wrappers call, from CPython's ``_signal`` (which ``signal`` imports
and re-exports). What they hand back is the same handler, but for ``SIG_DFL`` and ``SIG_IGN``,
which come back as the ints 0 and 1: they compare equal to ``signal.SIG_DFL`` and
``signal.SIG_IGN`` (``Handlers`` is an ``IntEnum``) but are not them, so compare with ``==``,
never ``is``. A Python without ``_signal`` gets the wrappers themselves, and
``tests/test_held_interrupts.py`` fails, to say so; a ``_signal`` that converted as well would
fail there too.

Only for what runs on every call; set-ups that run once a launch use ``signal`` itself.

    >>> import signal
    >>> previous = set_handler(signal.SIGUSR1, print)
    >>> previous == signal.SIG_DFL, previous is signal.SIG_DFL
    (True, False)
    >>> set_handler(signal.SIGUSR1, previous) is print
    True
"""

from __future__ import annotations

import importlib
import signal
from collections.abc import Callable
from typing import Any

# What a handler can be: a callable, SIG_DFL, SIG_IGN (or 0 and 1 from these functions), or None
# (a handler set from C).
Handler = Any


def _c_functions() -> tuple[Callable[[int, Handler], Handler], Callable[[int], Handler]]:
    try:
        c_signal = importlib.import_module("_signal")
    except ImportError:
        return signal.signal, signal.getsignal
    return c_signal.signal, c_signal.getsignal


_set_handler, _get_handler = _c_functions()


def set_handler(signum: int, handler: Handler) -> Handler:
    """``signal.signal(signum, handler)`` (main thread only), without converting what it hands back."""
    # SIG_DFL and SIG_IGN as Handlers members: the C function takes the ints. Not isinstance():
    # a call into C before the change is one more moment for a Ctrl-C to land before a route of
    # SIGINT holds it (wire/held_interrupts.py; tests/faults/test_own_faults.py lands one there).
    if handler.__class__ is signal.Handlers:
        handler = int(handler)
    return _set_handler(signum, handler)


def handler_of(signum: int) -> Handler:
    """``signal.getsignal(signum)``, without converting what it hands back."""
    return _get_handler(signum)
