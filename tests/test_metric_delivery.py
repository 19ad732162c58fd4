"""What a rank reported reaches the kernel before the rank's answer, whichever thread flushes.

A rank's flusher thread sends ``report()`` batches every 50 ms; the worker flushes once more
before it sends its result or its exception, and before it dies of SIGTERM. Those two flushes can
overlap. The later one must not return while the earlier one's batch is still on its way: the
worker would answer and exit first, and the batch would be lost (a failed attempt's metrics
came back empty once in a full run of tests/test_restarts.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from accelnb.wire.events import MetricBatch
from accelnb.worker import report


class FirstSendWaits:
    """A message writer whose first send waits until released; it records what was sent, in order."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.first_send_started = threading.Event()
        self.release = threading.Event()
        self._sends = 0
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            self._sends += 1
            first = self._sends == 1
        if first:
            self.first_send_started.set()
            self.release.wait(30)
        self.sent.append(message)


@pytest.fixture
def writer() -> Iterator[FirstSendWaits]:
    writer = FirstSendWaits()
    report.attach(writer, rank=0)  # type: ignore[arg-type]  # anything with send()
    try:
        yield writer
    finally:
        writer.release.set()
        report.attach(None, rank=0)  # type: ignore[arg-type]  # outside a launch again


def test_a_flush_returns_only_once_the_batch_another_thread_took_is_sent(writer: FirstSendWaits) -> None:
    report.report(step=0, loss=1.0)
    flusher = threading.Thread(target=report.flush)  # the 50 ms flusher, caught mid-send
    flusher.start()
    assert writer.first_send_started.wait(30)

    def end_of_call() -> None:  # what the worker does when the function returns or raises
        report.flush()
        writer.send("the call's answer")

    ending = threading.Thread(target=end_of_call)
    ending.start()
    # Long enough for the answer to overtake the batch if the flush did not wait for it; only a
    # slow machine could hide the fault here, never make a correct flush fail.
    ending.join(0.5)
    writer.release.set()
    ending.join(30)
    flusher.join(30)
    assert [type(m).__name__ if isinstance(m, MetricBatch) else m for m in writer.sent] == [
        "MetricBatch", "the call's answer"]
    assert writer.sent[0].records[0][2] == {"loss": 1.0}
