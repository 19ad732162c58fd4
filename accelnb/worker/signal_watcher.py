"""A rank's watcher: the one thread a rank starts at once. It hears the kernel's signals even while
the main thread is stuck in native code (a collective), through Python's wakeup fd:

- SIGTERM (the supervisor stops the other ranks when one fails): flush what the rank printed and
  reported, then die of it, as the rank would have without us (:func:`watch_signals`);
- ``ASK_FOR_STACKS`` (``wire/stack_signals.py``): write every thread's stack, holding the GIL
  (``worker/interactive/stack_dump.py``).

It also reads what it is given to read (:meth:`Watcher.read_too`: the rank's control socket,
``worker/main.py``) and starts what can wait (:meth:`Watcher.start_in_a_while`: the flusher). Each
thread a rank starts at a launch cost it 1.5-2 ms of CPU on 2 cores (its start, and its first wait
handing the GIL back and forth), and a call that ends within a few tens of milliseconds needs no
more than this one: three threads at launch made launches back to back 12-17 % slower.

A local rank's own: a Ray actor is stopped by Ray, and its stacks are read by a method call.
"""

from __future__ import annotations

import collections
import ctypes
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from accelnb.wire.stack_signals import ASK_FOR_STACKS
from accelnb.worker import report
from accelnb.worker.interactive import stack_dump
from accelnb.worker.rank_body import flush_streams_and_metrics

SIGTERM_FLUSH_LIMIT_S = 1.0
# Written to the wakeup pipe to make the watcher look at what it was given: no signal is 0.
NUDGE = b"\0"

Reader = Callable[[], bool]  # reads its fd once it is readable; False: never watch it again


@dataclass
class Watcher:
    """The watcher: ``terminating`` is set once SIGTERM came; :meth:`read_too` and
    :meth:`start_in_a_while` give it more to do (safe from any thread), :meth:`start` starts it."""

    terminating: threading.Event
    _nudge: Callable[[], None]
    _thread: threading.Thread
    _given_readers: collections.deque[tuple[int, Reader]] = field(default_factory=collections.deque)
    _given_starts: collections.deque[tuple[float, Callable[[], object]]] = field(default_factory=collections.deque)

    def read_too(self, fd: int, reader: Reader) -> None:
        """Call ``reader()`` in the watcher's thread whenever ``fd`` is readable, until it returns
        False. It must not block: the watcher hears the signals between two reads."""
        self._given_readers.append((fd, reader))
        self._nudge_if_started()

    def start_in_a_while(self, delay: float, start: Callable[[], object]) -> None:
        """Call ``start()`` in the watcher's thread ``delay`` s from now: for a thread that a call
        ending before then never needs."""
        self._given_starts.append((time.monotonic() + delay, start))
        self._nudge_if_started()

    def start(self) -> None:
        """Start the thread (what it was given before, it has from its first look: no wake-up)."""
        self._thread.start()

    def _nudge_if_started(self) -> None:
        if self._thread.is_alive():
            self._nudge()


def watch_signals(wake: Callable[[], None], *, start: bool = True) -> Watcher:
    """The rank's watcher thread, started unless ``start`` is False (:meth:`Watcher.start`).

    Die of accelnb's SIGTERM only after flushing output and metrics.

    The supervisor SIGTERMs the other ranks when one fails; dying at once would drop what they
    printed or reported in their last 50 ms, often the very lines that explain the failure. So
    SIGTERM gets a handler of ours, and Python's wakeup fd tells a thread of ours the moment it
    arrives, even while the main thread is stuck in native code (a collective). That thread
    flushes (for at most a second: a stream could be wedged), then acts on the disposition the
    function left:

    - ours (the function set none): the process dies of SIGTERM, as it would have without us;
    - ignored: the signal never arrives, and the supervisor's SIGKILL ends the rank after its grace;
    - a handler of the function's own (a checkpoint on pre-emption): Python runs it in the main
      thread, then the worker leaves instead of waiting for more work. The handler is pending
      before the thread hears of the signal, so ``wake``, which unblocks a worker idle between
      calls, can never let the worker leave before the handler runs.

    SIGTERM is not blocked in any thread: a blocked signal stays blocked in every process the
    rank starts (the mask survives ``exec``), and ``proc.terminate()`` on one would wait forever.
    (Code that takes over the wakeup fd, as asyncio's ``add_signal_handler`` does, leaves our
    handler to act alone: it runs when the main thread next runs Python.)

    The same watcher writes the rank's stacks when the kernel asks for them (``ASK_FOR_STACKS``):
    it is a thread that can take the GIL whenever the main thread lets go of it. The signals come
    first at each wake-up, then what it reads for others (:meth:`Watcher.read_too`).
    """
    received = threading.Event()
    acting = threading.Lock()  # the watcher and our handler may both hear it: one acts
    wakeup_read, wakeup_write = os.pipe()
    for fd in (wakeup_read, wakeup_write):
        os.set_blocking(fd, False)

    def act_on_sigterm() -> None:
        if not acting.acquire(blocking=False):
            return
        received.set()
        dying = signal.getsignal(signal.SIGTERM) is die_after_flushing
        if dying:
            report.seal()  # what the code reports from here on would miss the last flush
        flushing = threading.Thread(target=flush_streams_and_metrics, daemon=True)
        flushing.start()
        flushing.join(SIGTERM_FLUSH_LIMIT_S)
        if dying:
            _die_of_sigterm()
        wake()

    def die_after_flushing(signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread when it next runs Python (the watcher may have acted already),
        # and that may be in the middle of our own flush or a print, holding the lock the flush
        # needs: acting here, the main thread would wait for the flushing thread and that thread
        # for the main thread, until the limit ran out and the rank died with that batch unsent
        # (a failed attempt's last reports, once in a full test run). So it acts from a thread.
        threading.Thread(target=act_on_sigterm, name="accelnb-sigterm-act", daemon=True).start()

    def watch() -> None:
        readers: dict[int, Reader] = {}
        starts: list[tuple[float, Callable[[], object]]] = []
        while True:
            while watcher._given_readers:
                fd, reader = watcher._given_readers.popleft()
                readers[fd] = reader
            while watcher._given_starts:
                starts.append(watcher._given_starts.popleft())
            now = time.monotonic()
            for due in [start for start in starts if start[0] <= now]:
                starts.remove(due)
                due[1]()
            timeout = max(0.0, min(at for at, _ in starts) - now) if starts else None
            readable, _, _ = select.select([wakeup_read, *readers], [], [], timeout)
            if wakeup_read in readable:
                try:
                    heard = os.read(wakeup_read, 512)  # one byte per signal that has a Python handler
                except BlockingIOError:
                    heard = b""
                if ASK_FOR_STACKS in heard:  # first: a timeout's stacks come before its SIGTERM
                    stack_dump.write_stacks()
                if signal.SIGTERM in heard:
                    act_on_sigterm()
            for fd in readable:
                if fd != wakeup_read and not _read_or_give_up(readers[fd]):
                    del readers[fd]

    def forget_in_forked_child() -> None:
        # A fork (a DataLoader worker) must die of SIGTERM plainly, not wake our watcher: it
        # shares the wakeup pipe. SIGTERM stays blocked from before the fork until this is done.
        signal.set_wakeup_fd(-1)
        if signal.getsignal(signal.SIGTERM) is die_after_flushing:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in (wakeup_read, wakeup_write):
            os.close(fd)

    signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, die_after_flushing)
    _hold_sigterm_across_fork(in_child=forget_in_forked_child)
    watcher = Watcher(received, _nudge=lambda: _write_quietly(wakeup_write, NUDGE),
                      _thread=threading.Thread(target=watch, name="accelnb-signals", daemon=True))
    if start:
        watcher.start()
    return watcher


def _read_or_give_up(reader: Reader) -> bool:
    """A reader's failure ends its reading, not the watcher: the signals still need hearing."""
    try:
        return reader()
    except Exception:
        return False


def _write_quietly(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:  # full (the watcher wakes for what is there) or closed (a forked child's)
        pass


def _hold_sigterm_across_fork(in_child: Callable[[], None]) -> None:
    """Block SIGTERM in the forking thread around ``os.fork``, until ``in_child`` has run in the
    child: a SIGTERM sent the moment the child exists would otherwise find it still in our
    state. The parent gets any SIGTERM meanwhile in another thread, and the child once ready."""
    terminate = {signal.SIGTERM}
    held = threading.local()

    def before() -> None:
        held.mask = signal.pthread_sigmask(signal.SIG_BLOCK, terminate)

    def restore() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, held.mask)

    def in_child_then_restore() -> None:
        in_child()
        restore()

    os.register_at_fork(before=before, after_in_parent=restore, after_in_child=in_child_then_restore)


def _die_of_sigterm() -> None:
    """Die of SIGTERM from any thread: ``signal.signal`` is for the main thread only, so the
    default disposition is restored through libc, then the signal is sent to this thread."""
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGTERM, None)  # SIG_DFL is the null handler
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
