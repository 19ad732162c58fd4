"""The wire between kernel and workers (``wire/channel.py``): what goes in comes out whole.

Each reader reads into one buffer of its own, over and over, so a message decoded from one read
must not change when the next read overwrites that buffer; a frame longer than one read comes
together over several; a frame over ``INLINE_LIMIT_BYTES`` brings its memfd along.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from types import FrameType

import numpy as np

from accelnb.wire.channel import INLINE_LIMIT_BYTES, RECEIVE_BYTES, MessageReceiver, MessageWriter


def send_all_then_close(sock: socket.socket, messages: list[object]) -> threading.Thread:
    """Send from a thread: a frame longer than the socket's buffer blocks until it is read."""
    def send() -> None:
        writer = MessageWriter(sock)
        for message in messages:
            writer.send(message)
        sock.close()

    sender = threading.Thread(target=send)
    sender.start()
    return sender


def test_messages_longer_than_one_read_and_short_ones_between_come_back_whole() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    long_bytes = os.urandom(3 * RECEIVE_BYTES + 17)
    array = np.arange(INLINE_LIMIT_BYTES // 16, dtype=np.int64)  # out of band, inline: half the limit
    assert RECEIVE_BYTES < array.nbytes < INLINE_LIMIT_BYTES
    messages: list[object] = [("short", 1), long_bytes, {"array": array}, "x" * 10, ("short", 2)]
    sender = send_all_then_close(theirs, messages)
    receiver = MessageReceiver(ours)
    received = []
    while (message := receiver.receive()) is not None:
        received.append(message)
    sender.join()
    ours.close()

    assert len(received) == len(messages)
    assert received[0] == ("short", 1)
    assert received[1] == long_bytes  # read over several reads into the same buffer
    assert np.array_equal(received[2]["array"], array)
    received[2]["array"][0] = -1  # writable: a copy, not a view of the reader's buffer
    assert received[3:] == ["x" * 10, ("short", 2)]


def test_a_frame_over_the_inline_limit_brings_its_memfd_and_leaves_no_fd_behind() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    before = set(os.listdir("/proc/self/fd"))
    array = np.full(INLINE_LIMIT_BYTES // 8 + 1024, 7, dtype=np.int64)
    sender = send_all_then_close(theirs, [("before", 0), {"array": array}, ("after", 1)])
    receiver = MessageReceiver(ours)
    first, shared, last, end = receiver.receive(), receiver.receive(), receiver.receive(), receiver.receive()
    sender.join()
    ours.close()

    assert (first, last, end) == (("before", 0), ("after", 1), None)
    assert np.array_equal(shared["array"], array)
    assert set(os.listdir("/proc/self/fd")) <= before  # the memfd was closed once mapped


def test_messages_come_back_whole_while_a_profiler_keeps_every_frame() -> None:
    """A frame kept after it returns (a sampling profiler, a debugger, a signal handler) keeps
    its view of the reader's buffer: the buffer cannot be resized, and the messages of the read
    must come back all the same. Before, the read raised ``BufferError`` and lost them: a rank's
    answer, and with it a session (tests/test_session_failures.py)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    messages: list[object] = [("first", 1), {"second": [2, 2]}, "third"]
    writer = MessageWriter(theirs)
    for message in messages:
        writer.send(message)  # all three are in the socket: the first read brings them together
    theirs.close()
    kept: list[FrameType] = []

    def keep_frames(frame: FrameType, event: str, arg: object) -> None:
        if event == "return":
            kept.append(frame)

    receiver = MessageReceiver(ours)
    sys.setprofile(keep_frames)
    try:
        received = [receiver.receive() for _ in range(len(messages) + 1)]
    finally:
        sys.setprofile(None)
    ours.close()
    assert kept, "the profiler saw no frame: the test checked nothing"
    assert received == [*messages, None]


def test_a_readers_buffer_costs_the_pages_its_reads_write_not_its_whole_size() -> None:
    """Each rank, and the kernel for each rank's channels, makes a reader at every launch: a
    zeroed buffer of RECEIVE_BYTES cost 65 page faults each time, the OS's work for pages that a
    small message never reaches."""
    import resource

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        MessageWriter(theirs).send(("small", 1))
        receiver = MessageReceiver(ours)
        before = faults()
        assert receiver.receive() == ("small", 1)
        taken = faults() - before
    assert taken < 20, f"{taken} page faults to read one small message ({RECEIVE_BYTES // 4096} pages in the buffer)"
