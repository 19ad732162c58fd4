"""The five channels of each local rank, and the one selector that reads them.

Each worker gets stdout and stderr pipes and three ``AF_UNIX`` stream sockets: ``events`` (rank to
kernel: results, errors, metrics, prompts; big buffers travel as memfds, see ``wire/channel.py``),
and ``inbox`` and ``control`` (kernel to rank, written by
:mod:`~accelnb.kernel.run.group.rank_inboxes`: the calls, read by the rank's main thread between
them, and what comes beside a running call, read by a thread of the rank; ``wire/spec.py``).
:class:`ChannelPump` opens them, hands the workers' ends to the helper, and reads the kernel's
ends, together with the helper's socket, in one selector: output goes to the
:class:`~accelnb.kernel.display.output.OutputRouter`, each decoded event to the handler the caller
passes for that pump (the call it belongs to).

    >>> pump = ChannelPump(router, on_step=None)                       # doctest: +SKIP
    >>> their_ends = pump.open(rank=0)                                 # doctest: +SKIP
    >>> pump.close_their_ends(); pump.watch(helper.fileno(), helper.collect)   # doctest: +SKIP
    >>> pump.pump(0.05, lambda rank, event: ...)                       # doctest: +SKIP

An interrupt can land between any two steps of opening: every fd is owned by this object the
moment it exists, so :meth:`ChannelPump.close` frees them all whatever happened.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import selectors
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from accelnb.kernel.display.output import OutputRouter
from accelnb.kernel.helper.client import StepHook
from accelnb.wire.channel import MessageReader, read_buffer
from accelnb.wire.held_interrupts import held_interrupts
from accelnb.wire.spec import RankFds

PIPE_SIZE = 1 << 20  # bigger pipes: fewer wake-ups for floods and large results
PIPE_READ_BYTES = 1 << 18  # one read's most: a full pipe takes a few reads, with no wait between them
F_SETPIPE_SZ = 1031

Channel = Literal["stdout", "stderr", "events"]
EVERY_CHANNEL: tuple[Channel, ...] = ("stdout", "stderr", "events")
EventHandler = Callable[[int, Any], None]  # (rank, event)


@dataclass
class RankChannels:
    """The kernel's ends of one rank's channels (the sockets the kernel writes are blocking: a
    frame goes out whole)."""

    rank: int
    stdout_fd: int = -1
    stderr_fd: int = -1
    events: socket.socket | None = None  # non-blocking, read by the selector loop
    inbox: socket.socket | None = None  # calls and Shutdown
    control: socket.socket | None = None  # stop requests and input replies, beside a running call
    event_reader: MessageReader = field(default_factory=MessageReader)

    def fd(self, channel: Channel) -> int:
        if channel == "events":
            return self.events.fileno() if self.events is not None else -1
        return self.stdout_fd if channel == "stdout" else self.stderr_fd

    def close(self) -> None:
        with held_interrupts():  # all of them: a Ctrl-C after the first close would keep the rest
            for fd in (self.stdout_fd, self.stderr_fd):
                _close_quietly(fd)
            for sock in (self.events, self.inbox, self.control):
                if sock is not None:
                    sock.close()
            self.event_reader.close()  # fds of a frame that never arrived whole


class ChannelPump:
    """Every rank's channels, and the selector over them and the helper's socket."""

    def __init__(self, output: OutputRouter, on_step: StepHook | None = None) -> None:
        self.output = output
        self.ranks: list[RankChannels] = []
        self._by_rank: dict[int, RankChannels] = {}
        self._on_step = on_step
        self._selector: selectors.BaseSelector | None = None
        self._fd_owner: dict[int, tuple[RankChannels, Channel]] = {}
        self._helper_fd = -1
        self._on_helper: Callable[[], None] = _nothing
        self._their_ends: list[int] = []  # the workers' ends, until the helper has them
        # Every pipe read goes into this, reused: a fresh 1 MiB bytes object per read (what
        # ``os.read(fd, 1 << 20)`` allocates, then shrinks) costs more than a small read itself.
        self._pipe_scratch: mmap.mmap | None = None

    def get(self, rank: int) -> RankChannels | None:
        return self._by_rank.get(rank)

    # ── opening ─────────────────────────────────────────────────────────────────────────────
    def open(self, rank: int) -> RankFds:
        """One rank's five channels; returns the ends it gets."""
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
        channels = RankChannels(rank)
        self.ranks.append(channels)
        self._by_rank[rank] = channels
        theirs: list[int] = []
        for name in ("stdout", "stderr"):
            with held_interrupts():  # bare fds: owned before a Ctrl-C may surface
                read_end, write_end = os.pipe()
                setattr(channels, f"{name}_fd", read_end)
                self._their_ends.append(write_end)
            theirs.append(write_end)
            self._step("pipe-opened")
            _enlarge(read_end)
            os.set_blocking(read_end, False)
        for name in ("events", "inbox", "control"):
            ours, their_socket = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            setattr(channels, name, ours)
            their_end = their_socket.detach()  # a plain fd from now on: _their_ends owns it
            self._their_ends.append(their_end)
            theirs.append(their_end)
            self._step("pipe-opened")
        assert channels.events is not None
        channels.events.setblocking(False)
        stdout, stderr, events, inbox, control = theirs
        return RankFds(stdout=stdout, stderr=stderr, events=events, inbox=inbox, control=control)

    def close_their_ends(self) -> None:
        """The workers hold their ends now: closing ours makes end of file work both ways."""
        # Held: a Ctrl-C between taking an fd off the list and closing it would keep it open,
        # and closing first could close the fd's number twice, the second time someone else's.
        with held_interrupts():
            while self._their_ends:
                _close_quietly(self._their_ends.pop())

    def watch(self, helper_fd: int, on_helper: Callable[[], None]) -> None:
        """Start reading every rank's channels, and the helper's socket (``on_helper`` reads it)."""
        assert self._selector is not None
        for channels in self.ranks:
            for name in EVERY_CHANNEL:
                fd = channels.fd(name)
                self._selector.register(fd, selectors.EVENT_READ)
                self._fd_owner[fd] = (channels, name)
        self._helper_fd, self._on_helper = helper_fd, on_helper
        self._selector.register(helper_fd, selectors.EVENT_READ)

    # ── reading ─────────────────────────────────────────────────────────────────────────────
    def pump(self, timeout: float, on_event: EventHandler) -> None:
        """Read what is ready within ``timeout`` s: a chunk per ready channel, the helper's reports."""
        assert self._selector is not None
        for key, _ in self._selector.select(timeout):
            fd = int(key.fd)  # type: ignore[arg-type]
            if fd == self._helper_fd:
                self._on_helper()
                continue
            channels, name = self._fd_owner[fd]
            self._read(channels, name, fd, on_event)

    def drain(self, rank: int, on_event: EventHandler, names: tuple[Channel, ...] = EVERY_CHANNEL) -> None:
        """Read everything ``rank`` wrote so far (a dead rank: all it ever wrote)."""
        channels = self.get(rank)
        if channels is None or self._selector is None:
            return
        for name in names:
            fd = channels.fd(name)
            while fd in self._selector.get_map() and self._read(channels, name, fd, on_event):
                pass

    def _read(self, channels: RankChannels, name: Channel, fd: int, on_event: EventHandler) -> bool:
        """Read one chunk if there is one; True when data came (more may follow)."""
        if name == "events":
            return self._read_events(channels, fd, on_event)
        if self._pipe_scratch is None:
            self._pipe_scratch = read_buffer(PIPE_READ_BYTES)
        with held_interrupts():  # what was read reaches the router before a Ctrl-C may surface
            try:
                size = os.readv(fd, [self._pipe_scratch])
            except BlockingIOError:
                return False
            if size:
                with memoryview(self._pipe_scratch) as scratch:
                    self.output.feed(channels.rank, name, bytes(scratch[:size]))
        if not size:
            self._unwatch(fd)
            return False
        return True

    def _read_events(self, channels: RankChannels, fd: int, on_event: EventHandler) -> bool:
        assert channels.events is not None
        try:
            # What was read is handled before a Ctrl-C may surface: the fds it brought are queued,
            # and no event is lost (a rank's answer read but dropped left a session's interrupt
            # waiting for it, and the session closed).
            with held_interrupts():
                events = channels.event_reader.receive_from(channels.events)
                for event in events or ():
                    on_event(channels.rank, event)
        except BlockingIOError:
            return False
        except ConnectionResetError:
            events = None
        if events is None:
            self._unwatch(fd)
            return False
        return True

    def all_closed(self, rank: int) -> bool:
        """Whether each of ``rank``'s channels reached end of file (and was read to it)."""
        channels = self.get(rank)
        watched = self._selector.get_map() if self._selector is not None else {}
        return channels is not None and all(channels.fd(name) not in watched for name in EVERY_CHANNEL)

    def unwatch_helper(self) -> None:
        self._unwatch(self._helper_fd)

    def _unwatch(self, fd: int) -> None:
        assert self._selector is not None
        if fd in self._selector.get_map():
            self._selector.unregister(fd)

    def close(self) -> None:
        """Free every fd, ours and the workers' ends not handed over yet, whatever Ctrl-C lands
        meanwhile (it comes once they are closed)."""
        with held_interrupts():
            for channels in self.ranks:
                channels.close()
            self.close_their_ends()
            if self._selector is not None:
                self._selector.close()

    def _step(self, name: str) -> None:
        if self._on_step is not None:
            self._on_step(name)


def _nothing() -> None:
    pass


def _enlarge(fd: int) -> None:
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:  # capped by /proc/sys/fs/pipe-max-size; the default still works
        pass


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
