"""Length-prefixed pickled messages over a pipe: the only wire format between kernel and workers.

Pipes are private to the processes that hold their ends, so nobody else can write into them;
that is why no authentication is needed here (see the security notes in ``worker/helper.py``).

A frame is an 8-byte big-endian length, then the pickled message. :func:`encode` makes one,
:func:`write_all` writes any bytes to a blocking fd, and :class:`MessageWriter` does both for
threads sharing one fd; :class:`MessageReader` (non-blocking fds) and :func:`read_message`
(blocking fds) take frames apart again.

    >>> reader = MessageReader()
    >>> reader.feed(encode(("hello", 1)) + encode("world"))
    [('hello', 1), 'world']
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("!Q")
WRITE_CHUNK_BYTES = 1 << 20  # one pipe's worth (accelnb enlarges its pipes to 1 MiB)


def encode(message: Any) -> bytes:
    """One whole frame: header and pickled body."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def write_all(fd: int, data: bytes, after_each_write: Callable[[int], None] | None = None) -> None:
    """Write every byte of ``data`` to the blocking ``fd``.

    ``after_each_write(bytes_left)`` runs after each write: a caller that must know whether a
    frame went out whole (an interrupt can land between two writes) observes the progress here.
    """
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:WRITE_CHUNK_BYTES]):]
        if after_each_write is not None:
            after_each_write(len(view))


class MessageWriter:
    """Writes whole messages to a blocking fd; safe to share between threads."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        frame = encode(message)
        with self._lock:
            write_all(self.fd, frame)


class MessageReader:
    """Reassembles messages from arbitrary chunks of bytes."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[Any]:
        self._buffer += chunk
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(memoryview(self._buffer)[_HEADER.size:end]))
            del self._buffer[:end]
        return messages


def read_message(fd: int) -> Any | None:
    """Block until one whole message arrives on ``fd``; None at end of file."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    body = _read_exactly(fd, length)
    return None if body is None else pickle.loads(body)


def _read_exactly(fd: int, size: int) -> bytes | None:
    parts, remaining = [], size
    while remaining:
        chunk = os.read(fd, min(remaining, WRITE_CHUNK_BYTES))
        if not chunk:
            return None
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)
