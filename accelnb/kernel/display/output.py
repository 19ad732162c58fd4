"""Worker output, from raw pipe bytes to what the cell (or terminal) shows.

Readers only *feed* bytes here; one throttled :meth:`OutputRouter.tick` draws. That keeps the
notebook safe from floods: Jupyter silently drops output beyond its IOPub rate limit (1 MB/s,
1000 msg/s by default), so at most ``max_bytes_per_tick`` per stream leave per tick (10 ticks a
second), and when a rank prints faster the oldest pending output is skipped with a notice saying
what was skipped: whole lines are counted ("skipped 1,204 lines (80.3 KB)"), and a line too long
to show is measured ("skipped 5.2 MB of a line"), so one giant line without a newline is shown as
its last ``max_bytes_per_tick`` characters after an honest notice. ``\\r``-updated progress bars
(tqdm) are collapsed to their latest state per tick, so a bar renders as one updating line. Every
rank's output, skipped parts included, is also retained (the last ``RETAINED_BYTES_PER_RANK``) for
error reports and for :meth:`LaunchResult.output`.

    >>> router = OutputRouter(live_ranks={0}, prefix=False, sink=lambda stream, text: print(text, end=""))
    >>> router.feed(0, "stdout", b"epoch 1\\n"); router.tick(force=True)
    epoch 1
"""

from __future__ import annotations

import codecs
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from accelnb.kernel.display.byte_sizes import human_bytes

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
    pending_bytes: int = 0  # what ``pending`` was decoded from: sizes the notices without re-encoding
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
                 max_bytes_per_tick: int = MAX_BYTES_PER_TICK,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.live_ranks = set(live_ranks)
        self.prefix = prefix
        self.sink = sink
        self.max_bytes_per_tick = max_bytes_per_tick
        self._clock = clock  # injectable, so tests can step through the tick throttle
        self.retained: dict[int, RetainedOutput] = {}
        self._streams: dict[tuple[int, Stream], _StreamState] = {}
        self._last_tick = -math.inf  # the first tick always draws
        self.skipped_lines = 0  # whole lines left out of the live view, all ranks and streams
        self.skipped_bytes = 0  # everything left out of the live view, lines and parts of lines
        # stderr kept out of the live view while a live stack dump is on its way (see hold_stderr)
        self._held_stderr: dict[int, list[str]] = {}
        # Ranks that asked for input during the current call: shown live, prefixed (see show_rank)
        self.prompting_ranks: set[int] = set()
        # When a rank last made progress that the kernel can see: a line on stdout here, a step or
        # a report() through mark_progress. stderr does not count: a stack dump or a repeating
        # warning of a stuck rank is no progress. Read by the stall watch (stall_timeout=).
        self.progress_at = clock()

    def feed(self, rank: int, stream: Stream, data: bytes) -> None:
        state = self._streams.setdefault((rank, stream), _StreamState())
        text = state.decoder.decode(data)
        if not text:
            return
        if stream == "stdout":
            self.mark_progress()
        self.retained.setdefault(rank, RetainedOutput()).append(text)
        held = self._held_stderr.get(rank) if stream == "stderr" else None
        if held is not None:
            held.append(text)
        elif self._is_live(rank):
            state.pending.append(text)
            state.pending_bytes += len(data)

    def mark_progress(self) -> None:
        """A rank made progress (a step, a report, a line of output)."""
        self.progress_at = self._clock()

    def show_rank(self, rank: int) -> None:
        """Show ``rank``'s output live from now on, prefixed unless it is rank 0 (a rank at a prompt
        or in its debugger: what it prints between prompts must be seen). Until
        ``prompting_ranks`` is cleared, at the next call."""
        self.prompting_ranks.add(rank)

    def add_text(self, rank: int, stream: Stream, text: str) -> None:
        """Output that came by another way than the rank's pipes (its debugger's, with a prompt)."""
        if text:
            self.retained.setdefault(rank, RetainedOutput()).append(text)
            self.show(rank, stream, text)

    def _is_live(self, rank: int) -> bool:
        return rank in self.live_ranks or rank in self.prompting_ranks

    def hold_stderr(self, ranks: Iterable[int]) -> None:
        """Keep these ranks' stderr out of the live view until :meth:`release_stderr`.

        A live stack dump (on stderr) must not land in the running cell; the rank's
        own stderr of that moment is given back by the caller through :meth:`show`.
        """
        for rank in ranks:
            self._held_stderr.setdefault(rank, [])

    def held_stderr(self, rank: int) -> str:
        return "".join(self._held_stderr.get(rank, ()))

    def release_stderr(self) -> dict[int, str]:
        """End :meth:`hold_stderr`; returns what each held rank wrote to stderr meanwhile."""
        held = {rank: "".join(chunks) for rank, chunks in self._held_stderr.items()}
        self._held_stderr.clear()
        return held

    def show(self, rank: int, stream: Stream, text: str) -> None:
        """Queue already retained ``text`` for the live view (output held back for a while)."""
        if text and self._is_live(rank):
            state = self._streams.setdefault((rank, stream), _StreamState())
            state.pending.append(text)
            state.pending_bytes += len(text.encode("utf-8"))

    def tick(self, force: bool = False) -> None:
        now = self._clock()
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
                if self._is_live(rank):
                    state.pending.append(rest)
                    state.pending_bytes += len(rest.encode("utf-8"))
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
        joined = "".join(state.pending)
        bytes_per_char = 1.0 if joined.isascii() else state.pending_bytes / max(1, len(joined))  # isascii: O(1)
        text = collapse_carriage_returns(joined)
        state.pending, state.pending_bytes = [], 0
        if len(text) > self.max_bytes_per_tick:
            text = self._skip_to_budget(rank, stream, state, text, bytes_per_char)
        if self.prefix or (rank in self.prompting_ranks and rank != 0):
            text = _prefix_lines(text, f"[rank {rank}] ", state.at_line_start)
        state.at_line_start = text.endswith("\n")
        self.sink(stream, text)

    def _skip_to_budget(self, rank: int, stream: Stream, state: _StreamState, text: str,
                        bytes_per_char: float) -> str:
        """The newest ``max_bytes_per_tick`` of ``text``, after a notice of what was left out.

        The cut falls on a line start when one is in reach, else inside a line too long to show
        (the view then gets that line's tail). Nothing here copies or re-encodes the skipped part:
        under a flood it is megabytes every tick. Sizes are exact for ASCII and scaled by the
        bytes the text was decoded from otherwise.
        """
        keep_from = len(text) - self.max_bytes_per_tick
        line_start = text.find("\n", keep_from) + 1
        cut = line_start if line_start > 0 else keep_from
        lines = text.count("\n", 0, cut)
        unfinished_from = text.rfind("\n", 0, cut) + 1  # where the line the cut falls in starts
        whole_bytes = round(unfinished_from * bytes_per_char)
        unfinished_bytes = round((cut - unfinished_from) * bytes_per_char)
        self.skipped_lines += lines
        self.skipped_bytes += whole_bytes + unfinished_bytes
        # A notice must start on a line of its own, even when the skipped part continued a line
        # the previous tick left open.
        opening = "" if state.at_line_start else "\n"
        state.at_line_start = True
        what = _describe_skipped(lines, whole_bytes, unfinished_bytes)
        return (f"{opening}[accelnb: skipped {what} of rank {rank} {stream} to keep the notebook "
                f"responsive; accelnb.last_result().output({rank}) has every line]\n" + text[cut:])


def _describe_skipped(lines: int, whole_bytes: int, unfinished_bytes: int) -> str:
    """ "1,204 lines (80.3 KB)", "5.2 MB of a line", or both: what a notice says was left out."""
    parts = []
    if lines:
        parts.append(f"{lines:,} line{'s' if lines != 1 else ''} ({human_bytes(whole_bytes)})")
    if unfinished_bytes:
        parts.append(f"{human_bytes(unfinished_bytes)} of {'the next' if lines else 'a'} line")
    return " and ".join(parts)


def _prefix_lines(text: str, prefix: str, at_line_start: bool) -> str:
    pieces = text.split("\n")
    out = []
    for i, piece in enumerate(pieces):
        # A "\r" piece (a progress bar's latest state) redraws its line from the start.
        starts_line = at_line_start if i == 0 else True
        if piece and (starts_line or piece.startswith("\r")):
            piece = (("\r" + prefix + piece[1:]) if piece.startswith("\r") else prefix + piece)
        out.append(piece)
    return "\n".join(out)
