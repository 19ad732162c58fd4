"""pyzmq contexts that earlier tests abandoned, ended off the garbage collector's path.

A jupyter_client kernel client or manager that is dropped without being closed leaves its zmq
context and sockets in a reference cycle. The collector clears weak references before it runs
finalizers, so the context's ``__del__`` finds its WeakSet of sockets empty, closes none, and its
``term()`` waits for those sockets, which can be finalized only after it returns: the collection
never ends. A test worker blocked so for 300 s (until pytest-timeout's alarm, raised inside
``__del__`` and swallowed, let it go on) at whatever allocation triggered the collection.

:func:`end_abandoned_contexts_off_the_collector` (installed once per test process, by
``tests/conftest.py``) makes a context's finalizer hand the context to a thread that destroys it:
``term()`` there waits until the collection has closed the sockets (and their linger, 1 s at most
for jupyter_client's), while the collection goes on. :func:`collect_garbage` is ``gc.collect()``
and the wait for those threads, for a test that counts this process's fds.

Module-level state: ``_ending``, the threads destroying contexts, kept until they are waited for.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

ENDING_WAIT_S = 5.0  # jupyter_client's sockets linger 1 s at most

_ending: list[threading.Thread] = []


def end_abandoned_contexts_off_the_collector() -> None:
    import zmq

    def end_in_a_thread(context: Any) -> None:
        if context.closed or getattr(context, "_shadow", False):  # a shadow's context is someone else's
            return
        try:
            thread = threading.Thread(target=context.destroy, kwargs={"linger": 0}, daemon=True,
                                      name="abandoned-zmq-context")
            thread.start()
        except RuntimeError:  # the interpreter is shutting down: its exit frees the context
            return
        _ending.append(thread)

    zmq.Context.__del__ = end_in_a_thread  # type: ignore[method-assign]


def collect_garbage() -> None:
    """Collect what earlier tests left, and wait until the zmq contexts among it are destroyed
    (their fds closed): a test that compares this process's fds before and after then sees only
    its own. A kernel client an earlier test stopped closes its zmq sockets only when collected."""
    gc.collect()
    deadline = time.monotonic() + ENDING_WAIT_S
    for thread in list(_ending):
        thread.join(max(0.0, deadline - time.monotonic()))
        if not thread.is_alive():
            _ending.remove(thread)
