"""One policy for telling displays about changes: a broken display never breaks the caller.

The selection (:mod:`accelnb.kernel.watched_state.selection`), the run state and the launch's wait hooks
(:mod:`accelnb.kernel.run.run_state`) keep their subscribers in a :class:`Listeners`. The callers are
``set_selection`` and a running launch; the subscribers are displays (the widget panel, the
JupyterLab side panel, the live metrics view). A subscriber that raises must not turn a launch
or a selection into an error, so :meth:`Listeners.notify` catches its ``Exception``, lets the
other subscribers run, and logs the error with :mod:`logging` (logger ``accelnb.kernel.watched_state.observers``).

The first failure of each subscriber is logged as a WARNING with its traceback: with no logging
set up, Python's last-resort handler prints that to ``sys.stderr``, which in a notebook is the
cell, so the user sees that a display broke. Later failures of the same subscriber are logged
at DEBUG: a wait hook failing twenty times a second must not flood the cell.
``KeyboardInterrupt`` (not an ``Exception``) still stops the launch, as it should.

    >>> changes = Listeners[[int]]("example change")
    >>> unsubscribe = changes.add(print)
    >>> changes.notify(3)
    3
    >>> unsubscribe()
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Generic, ParamSpec

P = ParamSpec("P")

_log = logging.getLogger(__name__)


class Listeners(Generic[P]):
    """Subscribers called with the same arguments on every :meth:`notify`, in subscription order.

    Safe to use from several threads: subscribing or unsubscribing during a notification takes
    effect from the next one.
    """

    def __init__(self, what: str) -> None:
        self._what = what  # names the subscribers in log messages: "selection listener"
        self._entries: dict[int, Callable[P, object]] = {}
        self._keys = itertools.count()
        self._failed_before: set[int] = set()
        self._lock = threading.Lock()

    def add(self, listener: Callable[P, object]) -> Callable[[], None]:
        """Subscribe ``listener``; returns a function that unsubscribes it (calling it twice is harmless)."""
        with self._lock:
            key = next(self._keys)
            self._entries[key] = listener

        def unsubscribe() -> None:
            with self._lock:
                self._entries.pop(key, None)
                self._failed_before.discard(key)

        return unsubscribe

    def notify(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Call every subscriber; one that raises is logged and skipped (see the module docstring)."""
        with self._lock:
            entries = list(self._entries.items())
        for key, listener in entries:
            try:
                listener(*args, **kwargs)
            except Exception:
                self._log_failure(key, listener)

    def __len__(self) -> int:
        return len(self._entries)

    def _log_failure(self, key: int, listener: Callable[P, object]) -> None:
        with self._lock:
            repeated = key in self._failed_before
            self._failed_before.add(key)
        if repeated:
            _log.debug("accelnb: %s %r failed again", self._what, listener, exc_info=True)
        else:
            _log.warning("accelnb: a %s (%r) raised; it is skipped, the launch or selection goes on. "
                         "Further failures of it are logged at DEBUG.", self._what, listener, exc_info=True)
