"""Length-prefixed pickled messages over a pipe: the only wire format between kernel and workers.

Pipes are private to the processes that hold their ends, so nobody else can write into them;
that is why no authentication is needed here (see the security notes in ``worker/helper.py``).

    >>> reader = MessageReader()
    >>> reader.feed(encode(("hello", 1)) + encode("world"))
    [('hello', 1), 'world']
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
from typing import Any

_HEADER = struct.Struct("!Q")


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class MessageWriter:
    """Writes whole messages to a blocking fd; safe to share between threads."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            _write_all(self.fd, _HEADER.pack(len(body)))
            _write_all(self.fd, body)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[: 1 << 20])
        view = view[written:]


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
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)
