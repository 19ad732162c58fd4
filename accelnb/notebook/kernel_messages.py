"""Let widget (comm) messages through while a cell blocks the kernel waiting for a run.

While a cell runs, ipykernel handles no shell message: a Stop button clicked during a launch
would only be seen after the launch ended. :func:`process_comm_messages` fixes that for the
duration of a launch. The panels register it as a launcher wait hook
(:func:`let_comm_messages_through_runs`, counted: one hook however many panels), so it runs from the
thread that waits (the kernel's main thread) at the wait hooks' rate,
:data:`accelnb.kernel.run.run_state.WAIT_HOOK_RATE_HZ` (twenty times a second)::

    >>> from accelnb.kernel.run import run_state
    >>> unregister = run_state.add_wait_hook(process_comm_messages)

How, in ipykernel 7: a "shell channel" thread receives every shell message and forwards those
for the main shell over an in-process ZMQ PAIR socket, read by a ZMQStream on the main thread's
event loop. That loop is blocked by the running cell, so messages pile up in that socket. The hook,
running on the main thread (the socket's owner), reads them:

- ``comm_open`` / ``comm_msg`` / ``comm_close`` are dispatched at once to the kernel's comm
  handlers, with the parent header restored afterwards so the cell's output stays in the cell.
  This is what ipykernel itself does for comm messages that arrive while an *async* cell awaits
  (``Kernel.shell_main``), applied to a synchronous wait.
- Anything else (``execute_request``, ``complete_request``, the kernel's internal "stop aborting"
  marker...) is handed, in arrival order, to the callback the ZMQStream would have called, just
  as if the event loop had read it. ipykernel queues it behind the running cell on the main
  shell's FIFO lock, so later cells still run after this one, in order, and are still aborted
  if this one fails.

Why not route the panel's comms to a subshell thread instead: ipykernel 7.4 can send a comm's
messages to a subshell (``BaseComm._reply_subshell_for``), but that route is reset to the sender's
subshell by every message the comm publishes, and widget handlers would then run on another
thread concurrently with every cell, not only during launches.

Outside a kernel, off the main thread, or in a kernel built differently (ipykernel 6, no shell
channel thread) the hook does nothing and :func:`comm_messages_supported` says so: the panel
then tells the user to stop the run with the kernel's interrupt button instead.

Module-level state, one per kernel, since there is one shell and one event loop: ``_route_cache``
(the main shell's route, found once, by kernel id), ``_pending`` (dispatches in flight, kept from
the garbage collector), ``_dispatching`` (a dispatch runs now: no re-entry), and the pre-execute
hook shared by every user: ``_hook_users``, ``_hook_lock`` and ``_unregister_hook``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelnb.kernel.run import run_state

COMM_MESSAGE_TYPES = frozenset({"comm_open", "comm_msg", "comm_close"})
MAX_MESSAGES_PER_CALL = 64  # the launcher's wait loop must keep pumping worker output

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _MainShellRoute:
    """Where the main shell's messages wait, and who normally reads them."""

    kernel: Any  # ipykernel.kernelbase.Kernel
    thread: threading.Thread  # the main shell's thread: the only one that may read the socket
    socket: Any  # zmq PAIR socket, shell channel thread -> main shell
    stream: Any  # the ZMQStream on that socket (its callback is ipykernel's shell_main)
    reply_socket: Any  # main shell -> shell channel thread, given to handlers as their stream
    copy: bool  # whether the stream receives bytes (True) or zmq Frames (False)


_route_cache: dict[int, _MainShellRoute | None] = {}
_pending: set[asyncio.Future[Any]] = set()
_dispatching = False


def process_comm_messages(limit: int = MAX_MESSAGES_PER_CALL) -> int:
    """Dispatch the comm messages waiting for the main shell; returns how many were handled.

    Non-comm messages read on the way are handed back to ipykernel in order (see the module
    docstring). A no-op (returning 0) outside an ipykernel 7 kernel's main thread.
    """
    route = _main_shell_route()
    if route is None or threading.current_thread() is not route.thread or _dispatching:
        return 0  # (a handler we dispatched that itself waits on a launch gets no nested round)
    if route.socket.closed or not route.stream.receiving():
        return 0  # the kernel is shutting down, or no one would take the non-comm messages
    import zmq

    handled = 0
    for _ in range(limit):
        if not route.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            break
        try:
            # as the stream would read it (zmq Frames in ipykernel 7), since it may get it back
            frames = route.socket.recv_multipart(zmq.NOBLOCK, copy=route.copy)
        except zmq.Again:
            break
        parsed = _parse_comm_message(route.kernel, frames, route.copy)
        if parsed is None:
            _hand_back(route, frames)
        else:
            _dispatch_comm(route, *parsed)
            handled += 1
    return handled


_hook_users = 0
_hook_lock = threading.Lock()
_unregister_hook: Callable[[], None] | None = None


def let_comm_messages_through_runs() -> Callable[[], None]:
    """Register :func:`process_comm_messages` as a launcher wait hook while at least one display
    (a notebook panel, a JupyterLab side panel) needs its clicks heard during a run; returns the
    release of this one (calling it again does nothing)."""
    global _hook_users, _unregister_hook
    with _hook_lock:
        _hook_users += 1
        if _unregister_hook is None:
            _unregister_hook = run_state.add_wait_hook(process_comm_messages)
    released = False

    def release() -> None:
        global _hook_users, _unregister_hook
        nonlocal released
        with _hook_lock:
            if released:
                return
            released = True
            _hook_users -= 1
            if _hook_users == 0 and _unregister_hook is not None:
                _unregister_hook()
                _unregister_hook = None

    return release


def comm_messages_supported() -> bool:
    """True when :func:`process_comm_messages` can work in this process (an ipykernel 7 kernel)."""
    return _main_shell_route() is not None


def running_in_kernel() -> bool:
    """True inside a running ipykernel (any version)."""
    return _running_kernel() is not None


def _running_kernel() -> Any | None:
    kernelbase = sys.modules.get("ipykernel.kernelbase")  # not imported: not in a kernel
    if kernelbase is None or not kernelbase.Kernel.initialized():
        return None
    return kernelbase.Kernel.instance()


def _main_shell_route() -> _MainShellRoute | None:
    kernel = _running_kernel()
    if kernel is None:
        return None
    key = id(kernel)
    if key not in _route_cache:
        _route_cache[key] = _find_route(kernel)
    return _route_cache[key]


def _find_route(kernel: Any) -> _MainShellRoute | None:
    """The main shell's inbound socket in ipykernel 7, or None for any other kernel layout."""
    channel_thread = getattr(kernel, "shell_channel_thread", None)
    needed = ("shell_handlers", "session", "set_parent", "get_parent", "_shell_parent_ident",
              "_get_shell_context_var")
    if channel_thread is None or not all(hasattr(kernel, name) for name in needed):
        return None
    try:
        manager = channel_thread.manager
        pair = manager.get_shell_channel_to_subshell_pair(None)
        reply_socket = manager.get_subshell_to_shell_channel_socket(None)
        stream = pair.to_stream
        main_thread = channel_thread.parent_thread
    except Exception:  # another ipykernel layout: say "unsupported" rather than guess
        _log.debug("accelnb: unknown ipykernel layout; comm messages wait for the cell", exc_info=True)
        return None
    if stream is None or getattr(stream, "_recv_callback", None) is None:
        return None
    return _MainShellRoute(kernel, main_thread, pair.to_socket, stream, reply_socket,
                           bool(getattr(stream, "_recv_copy", False)))


def _parse_comm_message(kernel: Any, frames: list[Any],
                        copy: bool) -> tuple[list[Any], dict[str, Any]] | None:
    """(identities, message) for a comm message; None for any other message."""
    session = kernel.session
    try:
        idents, rest = session.feed_identities(frames, copy=copy)
        header = session.deserialize(rest, content=False, copy=copy)["header"]
        if header.get("msg_type") not in COMM_MESSAGE_TYPES:
            return None
        return idents, session.deserialize(rest, content=True, copy=copy)
    except Exception:  # not a Jupyter message (ipykernel's internal markers): not ours
        return None


def _dispatch_comm(route: _MainShellRoute, idents: list[Any], message: dict[str, Any]) -> None:
    kernel = route.kernel
    handler = kernel.shell_handlers.get(message["header"]["msg_type"])
    if handler is None:
        return
    # The running cell owns the parent header: its output (rank 0's stream) must stay in the
    # cell. The comm handler runs under its own message's parent, then the cell's is put back.
    global _dispatching
    saved_ident = kernel._get_shell_context_var(kernel._shell_parent_ident)
    saved_parent = kernel.get_parent("shell")
    kernel.set_parent(idents, message, channel="shell")
    _dispatching = True
    try:
        result = handler(route.reply_socket, idents, message)
        if inspect.isawaitable(result):
            # an async handler finishes once the kernel's loop runs again, after the cell
            task = asyncio.ensure_future(result)
            _pending.add(task)
            task.add_done_callback(_pending.discard)
    except Exception:
        _log.error("accelnb: a comm handler failed while a run was waiting", exc_info=True)
    finally:
        _dispatching = False
        kernel.set_parent(saved_ident, saved_parent, channel="shell")
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()


def _hand_back(route: _MainShellRoute, frames: list[Any]) -> None:
    """Give a non-comm message to ipykernel exactly as its ZMQStream would have."""
    route.stream._run_callback(route.stream._recv_callback, frames)
