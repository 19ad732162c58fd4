"""Worker output, from raw pipe bytes to what the cell (or terminal) shows.

Readers only *feed* bytes here; one throttled :meth:`OutputRouter.tick` draws. That keeps the
notebook safe from floods: Jupyter silently drops output beyond its IOPub rate limit (1 MB/s,
1000 msg/s by default), so at most ``max_bytes_per_tick`` per stream leave per tick (10 ticks a
second), and when a rank prints faster the oldest pending lines are skipped with a marker saying
how many. ``\\r``-updated progress bars (tqdm) are collapsed to their latest state per tick, so
a bar renders as one updating line. Every rank's output is also retained (bounded) for error
reports and for :meth:`LaunchResult.output`.

    >>> router = OutputRouter(live_ranks={0}, prefix=False, sink=lambda stream, text: print(text, end=""))
    >>> router.feed(0, "stdout", b"epoch 1\\n"); router.tick(force=True)
    epoch 1
"""

from __future__ import annotations

import codecs
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

Stream = Literal["stdout", "stderr"]
Sink = Callable[[Stream, str], None]

TICK_INTERVAL_S = 0.1
MAX_BYTES_PER_TICK = 48 * 1024  # ~480 KB/s per stream: under Jupyter's 1 MB/s IOPub limit
RETAINED_BYTES_PER_RANK = 8 * 2**20


def notebook_sink(stream: Stream, text: str) -> None:
    """Write to the current ``sys.stdout``/``sys.stderr``: the running cell, or the terminal."""
    import sys

    target = sys.stdout if stream == "stdout" else sys.stderr
    target.write(text)
    target.flush()


def collapse_carriage_returns(text: str) -> str:
    """Keep only the latest state of each ``\\r``-rewritten line (progress bars)."""
    if "\r" not in text:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if "\r" in line:
            parts = [p for p in line.split("\r") if p]
            lines[i] = "\r" + (parts[-1] if parts else "")
    return "\n".join(lines)


@dataclass
class _StreamState:
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    pending: list[str] = field(default_factory=list)
    pending_chars: int = 0
    at_line_start: bool = True


class RetainedOutput:
    """The last few megabytes one rank printed, stdout and stderr interleaved as received."""

    def __init__(self, limit: int = RETAINED_BYTES_PER_RANK) -> None:
        self._chunks: deque[str] = deque()
        self._size = 0
        self._limit = limit
        self.dropped_chars = 0

    def append(self, text: str) -> None:
        self._chunks.append(text)
        self._size += len(text)
        while self._size > self._limit and len(self._chunks) > 1:
            dropped = self._chunks.popleft()
            self._size -= len(dropped)
            self.dropped_chars += len(dropped)

    def text(self) -> str:
        return "".join(self._chunks)

    def position(self) -> int:
        return self.dropped_chars + self._size

    def since(self, position: int) -> str:
        text = self.text()
        return text[max(0, position - self.dropped_chars):]

    def tail(self, lines: int) -> str:
        text = self.text()
        return "\n".join(collapse_carriage_returns(text).rstrip("\n").split("\n")[-lines:])


class OutputRouter:
    """Per-rank output: retained for everyone, streamed live for ``live_ranks``."""

    def __init__(self, live_ranks: Iterable[int], prefix: bool, sink: Sink = notebook_sink,
                 max_bytes_per_tick: int = MAX_BYTES_PER_TICK) -> None:
        self.live_ranks = set(live_ranks)
        self.prefix = prefix
        self.sink = sink
        self.max_bytes_per_tick = max_bytes_per_tick
        self.retained: dict[int, RetainedOutput] = {}
        self._streams: dict[tuple[int, Stream], _StreamState] = {}
        self._last_tick = 0.0
        self.skipped_lines = 0

    def feed(self, rank: int, stream: Stream, data: bytes) -> None:
        state = self._streams.setdefault((rank, stream), _StreamState())
        text = state.decoder.decode(data)
        if not text:
            return
        self.retained.setdefault(rank, RetainedOutput()).append(text)
        if rank in self.live_ranks:
            state.pending.append(text)
            state.pending_chars += len(text)

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_tick < TICK_INTERVAL_S:
            return
        self._last_tick = now
        for (rank, stream), state in self._streams.items():
            if state.pending:
                self._draw(rank, stream, state)

    def finish(self) -> None:
        """Flush decoders and everything pending, whatever the rate."""
        for (rank, _stream), state in self._streams.items():
            rest = state.decoder.decode(b"", final=True)
            if rest:
                self.retained.setdefault(rank, RetainedOutput()).append(rest)
                if rank in self.live_ranks:
                    state.pending.append(rest)
        self.tick(force=True)

    def tail(self, rank: int, lines: int = 30) -> str:
        retained = self.retained.get(rank)
        return retained.tail(lines) if retained else ""

    def position(self, rank: int) -> int:
        retained = self.retained.get(rank)
        return retained.position() if retained else 0

    def text_since(self, rank: int, position: int) -> str:
        retained = self.retained.get(rank)
        return retained.since(position) if retained else ""

    def _draw(self, rank: int, stream: Stream, state: _StreamState) -> None:
        text = collapse_carriage_returns("".join(state.pending))
        state.pending, state.pending_chars = [], 0
        if len(text) > self.max_bytes_per_tick:
            cut = text.find("\n", len(text) - self.max_bytes_per_tick)
            cut = cut + 1 if cut != -1 else len(text) - self.max_bytes_per_tick
            skipped = text.count("\n", 0, cut)
            self.skipped_lines += skipped
            text = (f"[accelnb: skipped {skipped:,} lines of rank {rank} {stream} to keep the notebook "
                    f"responsive; accelnb.last_result().output({rank}) has every line]\n" + text[cut:])
            state.at_line_start = True
        if self.prefix:
            text, state.at_line_start = _prefix_lines(text, f"[rank {rank}] ", state.at_line_start)
        self.sink(stream, text)


def _prefix_lines(text: str, prefix: str, at_line_start: bool) -> tuple[str, bool]:
    pieces = text.split("\n")
    out = []
    for i, piece in enumerate(pieces):
        starts_line = at_line_start if i == 0 else True
        if piece and starts_line:
            piece = (("\r" + prefix + piece[1:]) if piece.startswith("\r") else prefix + piece)
        out.append(piece)
    return "\n".join(out), text.endswith("\n")
