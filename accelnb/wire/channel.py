"""Framed pickled messages over a private ``AF_UNIX`` stream socket: the wire between kernel and workers.

Each worker has two such sockets (``socketpair``, so nobody else can connect to them; that is
why no authentication is needed, see the security notes in ``worker/template/helper.py``): its inbox
(kernel → worker) and its events (worker → kernel). They are sockets, not pipes, because a frame
may carry a file descriptor: the control plane (small pickled messages) and the data plane (big
buffers in shared memory, ``wire/shared_memory.py``) travel together.

A message is pickled once with protocol 5; every out-of-band buffer it holds (a
:class:`pickle.PickleBuffer`: tensors and arrays packed by ``wire/buffers.py``, numpy arrays) is
set aside. If they add up to less than :data:`INLINE_LIMIT_BYTES` they follow the pickle inside
the frame; otherwise they are written once into a memfd whose fd is attached (``SCM_RIGHTS``) to
the frame's first byte, and the receiver maps it. The same :class:`Frame` can be sent to every
rank: one copy of the data, whatever the number of ranks.

Frame: ``!Q`` length of the rest, then ``!IB`` (buffer count, placement), one ``!Q`` size per
buffer, the pickle, and the buffers when inline. On a stream socket, fds arrive with the first
byte of the ``sendmsg`` that carried them, so every read uses ``recvmsg`` and fds are queued in
arrival order; frames consume them in the same order.

    >>> a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    >>> send_frame(a, encode(("hello", 1)))
    >>> MessageReceiver(b).receive()
    ('hello', 1)
"""

from __future__ import annotations

import array
import collections
import mmap
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any

from accelnb.wire.shared_memory import layout_of, map_buffers, write_buffers

_LENGTH = struct.Struct("!Q")
_HEAD = struct.Struct("!IB")
_SIZE = struct.Struct("!Q")
_FD = array.array("i")
_NO_BUFFERS, _INLINE, _SHARED = 0, 1, 2
# Out-of-band bytes per frame from which a memfd beats copying through the socket (see the
# numbers in wire/buffers.py): below it, creating, mapping and unmapping a file costs more.
INLINE_LIMIT_BYTES = 1 << 20
WRITE_CHUNK_BYTES = 1 << 20
# What one read takes at most: more than an AF_UNIX stream socket holds queued (its send buffer,
# 208 KiB by default), so a bigger buffer would never fill. Each reader reads into a buffer of its
# own, reused read after read: a fresh 1 MiB bytes object per read (what ``recvmsg(1 << 20)``
# allocates, then shrinks) cost 80 µs of a session cell's 1 ms round trip on 2 cores.
RECEIVE_BYTES = 1 << 18
MAX_FDS_PER_READ = 64
_ANCILLARY_BYTES = socket.CMSG_LEN(MAX_FDS_PER_READ * _FD.itemsize)
# As a plain int: ``flags & socket.MSG_CTRUNC`` runs ``enum.Flag``'s Python operator and builds a
# flag member on every read (1.3 µs hot, every read of every message).
_TRUNCATED = int(socket.MSG_CTRUNC)


def read_buffer(size: int) -> mmap.mmap:
    """A buffer of ``size`` bytes for reads to go into, reused read after read: an anonymous
    mapping, whose pages the OS provides as reads first write them. A ``bytearray`` of the same
    size is zeroed whole as it is made: 65 page faults for 256 KiB, 0.1-0.2 ms of CPU, in each rank
    and for each rank's channels in the kernel at every launch, where a read of a small message
    writes one page."""
    return mmap.mmap(-1, size)


class ProtocolError(RuntimeError):
    """A frame that cannot be taken apart: a bug in accelnb, never the user's doing."""


class Frame:
    """One encoded message, ready to send to one or many sockets; :meth:`close` frees its memfd."""

    def __init__(self, data: bytes, fd: int | None = None) -> None:
        self.data = data
        self.fd = fd

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self) -> Frame:
        return self

    def __del__(self) -> None:  # a frame dropped unsent (an interrupt while encoding) frees its memfd
        self.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode(message: Any, inline_limit: int = INLINE_LIMIT_BYTES) -> Frame:
    """Pickle ``message`` once; its out-of-band buffers go inline or into one memfd."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    views = [buffer.raw() for buffer in buffers]
    sizes = [view.nbytes for view in views]
    if not views:
        placement, tail = _NO_BUFFERS, b""
    elif sum(sizes) < inline_limit:
        placement, tail = _INLINE, b"".join(views)
    else:
        placement, tail = _SHARED, b""
    rest = b"".join([_HEAD.pack(len(sizes), placement), *(_SIZE.pack(s) for s in sizes), body, tail])
    frame = Frame(_LENGTH.pack(len(rest)) + rest)
    if placement == _SHARED:
        frame.fd = write_buffers(views)[0]  # no signal check between the return and the store
    return frame


def send_frame(sock: socket.socket, frame: Frame, after_each_write: Callable[[int], None] | None = None) -> None:
    """Write all of ``frame`` to the blocking ``sock``, its fd (if any) with the first byte.

    ``after_each_write(bytes_left)`` runs after each write: a caller that must know whether a
    frame went out whole (an interrupt can land between two writes) observes the progress here.
    """
    view = memoryview(frame.data)
    if frame.fd is not None:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [frame.fd]))]
        view = view[sock.sendmsg([view[:WRITE_CHUNK_BYTES]], rights, socket.MSG_NOSIGNAL):]
        if after_each_write is not None:
            after_each_write(len(view))
    while view:
        view = view[sock.send(view[:WRITE_CHUNK_BYTES], socket.MSG_NOSIGNAL):]
        if after_each_write is not None:
            after_each_write(len(view))


def _receive_chunk(sock: socket.socket, into: mmap.mmap) -> tuple[memoryview, list[int]]:
    """One read into ``into``: a view of the bytes that came (valid until ``into`` is read into
    again; empty at end of file) and the fds that came with them (close-on-exec)."""
    # Not socket.recv_fds: it drops its flags argument, and received fds must be close-on-exec.
    nbytes, ancillary, flags, _ = sock.recvmsg_into([into], _ANCILLARY_BYTES, socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % _FD.itemsize])
    if flags & _TRUNCATED:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("more file descriptors arrived in one read than accelnb expects")
    return memoryview(into)[:nbytes], list(fds)


class MessageWriter:
    """Sends whole messages on a blocking socket; safe to share between threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with encode(message) as frame, self._lock:
            send_frame(self.sock, frame)


class MessageReader:
    """Reassembles messages from chunks of bytes and the fds that came with them."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._fds: collections.deque[int] = collections.deque()
        self._scratch: mmap.mmap | None = None  # what each read goes into, from the first read on

    def receive_from(self, sock: socket.socket) -> list[Any] | None:
        """Read ``sock`` once: the messages it completed (often none, or one); None at end of file."""
        if self._scratch is None:
            self._scratch = read_buffer(RECEIVE_BYTES)
        chunk, fds = _receive_chunk(sock, self._scratch)
        if not chunk:
            return None
        with chunk:
            return self.feed(chunk, fds)

    def feed(self, chunk: bytes | memoryview, fds: Iterable[int] = ()) -> list[Any]:
        self._buffer += chunk
        self._fds.extend(fds)
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            with memoryview(self._buffer) as whole:
                messages.append(self._decode(whole[_LENGTH.size:end]))
            try:
                del self._buffer[:end]
            except BufferError:
                # A view of the buffer outlived the decoding: a frame of it that someone keeps (a
                # sampling profiler, a debugger, a signal handler) holds its locals. Resizing
                # is refused, and the message just decoded would be lost with the exception;
                # the rest moves to a buffer of its own instead.
                self._buffer = self._buffer[end:]
        return messages

    def close(self) -> None:
        """Close the fds of frames that will never be read whole (the sender died mid-frame)."""
        while self._fds:
            os.close(self._fds.popleft())

    def _decode(self, frame: memoryview) -> Any:
        count, placement = _HEAD.unpack_from(frame)
        at = _HEAD.size
        sizes = [_SIZE.unpack_from(frame, at + i * _SIZE.size)[0] for i in range(count)]
        at += count * _SIZE.size
        inline = sum(sizes) if placement == _INLINE else 0
        body = frame[at:len(frame) - inline]
        buffers: list[memoryview] = []
        if placement == _INLINE:
            at = len(frame) - inline
            for size in sizes:  # copied: writable, and the reader's buffer moves on
                buffers.append(memoryview(bytearray(frame[at:at + size])))
                at += size
        elif placement == _SHARED:
            if not self._fds:
                raise ProtocolError("a frame refers to shared memory, but no file descriptor came with it")
            fd = self._fds.popleft()
            try:
                buffers = map_buffers(fd, layout_of(sizes))
            finally:
                os.close(fd)  # the mapping keeps the pages
        return pickle.loads(body, buffers=buffers)


class MessageReceiver:
    """Blocking reads of whole messages from a socket (a worker's inbox)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = MessageReader()
        self._ready: collections.deque[Any] = collections.deque()

    def receive(self) -> Any | None:
        """The next message; None at end of file."""
        while not self._ready:
            messages = self._reader.receive_from(self.sock)
            if messages is None:
                self._reader.close()
                return None
            self._ready.extend(messages)
        return self._ready.popleft()
