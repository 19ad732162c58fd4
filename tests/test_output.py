"""What the cell shows of a rank's output, and what is kept: the flood notices, giant lines,
``\\r`` progress bars under the tick throttle, ``[rank N]`` prefixes.

Most tests drive :class:`OutputRouter` directly, with a recording sink and an injected clock (no
sleeps). One real 2-rank launch prints a 5 MB line without a newline, end to end.
"""

from __future__ import annotations

import re

import pytest

from accelnb import last_result, launch
from accelnb.kernel.display.output import MAX_BYTES_PER_TICK, TICK_INTERVAL_S, OutputRouter, Stream

FIVE_MB = 5 * 2**20
NOTICE = re.compile(r"\[accelnb: skipped (?P<what>[^\]]*?) of rank (?P<rank>\d+) (?P<stream>\w+) to keep the "
                    r"notebook responsive; accelnb\.last_result\(\)\.output\((?P=rank)\) has every line\]\n")


class Cell:
    """A sink that records what the cell would show, and a clock the test moves."""

    def __init__(self) -> None:
        self.shown: list[tuple[Stream, str]] = []
        self.now = 1000.0

    def sink(self, stream: Stream, text: str) -> None:
        self.shown.append((stream, text))

    def clock(self) -> float:
        return self.now

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.shown)


def giant_line(size: int) -> str:
    """``size`` characters without a newline, numbered, so that any slice can be told from another."""
    numbered = "".join(f"{i:07d}," for i in range(size // 8 + 1))
    return numbered[:size]


def feed_in_pipe_reads(router: OutputRouter, rank: int, data: bytes, chunk: int = 1 << 16) -> None:
    for start in range(0, len(data), chunk):
        router.feed(rank, "stdout", data[start:start + chunk])


@pytest.fixture
def cell() -> Cell:
    return Cell()


def test_a_giant_line_is_announced_by_its_size_and_kept_whole(cell: Cell) -> None:
    line = giant_line(FIVE_MB)
    router = OutputRouter(live_ranks={0}, prefix=False, sink=cell.sink, clock=cell.clock)
    feed_in_pipe_reads(router, 0, line.encode())
    router.finish()

    notices = NOTICE.findall(cell.text)
    assert [what for what, _, _ in notices] == ["5.2 MB of a line"]  # 5,242,880 - 49,152 bytes
    assert "0 lines" not in cell.text
    shown_tail = NOTICE.split(cell.text)[-1]
    assert shown_tail == line[-MAX_BYTES_PER_TICK:]
    assert router.skipped_bytes == FIVE_MB - MAX_BYTES_PER_TICK and router.skipped_lines == 0
    assert router.text_since(0, 0) == line  # every byte kept, for accelnb.last_result().output(0)


def test_skipped_lines_are_counted_with_the_start_of_a_long_line(cell: Cell) -> None:
    router = OutputRouter(live_ranks={0}, prefix=False, sink=cell.sink, clock=cell.clock)
    lines = "".join(f"line {i:05d}\n" for i in range(20_000))  # 11 bytes each: 220 KB
    unfinished = "y" * 150_000
    feed_in_pipe_reads(router, 0, (lines + unfinished).encode())
    router.tick()

    assert NOTICE.findall(cell.text) == [("20,000 lines (220.0 KB) and 100.8 KB of the next line", "0", "stdout")]
    assert NOTICE.split(cell.text)[-1] == "y" * MAX_BYTES_PER_TICK
    assert router.skipped_lines == 20_000


def test_a_flood_of_short_lines_is_cut_at_a_line_start(cell: Cell) -> None:
    router = OutputRouter(live_ranks={0}, prefix=False, sink=cell.sink, clock=cell.clock)
    feed_in_pipe_reads(router, 0, "".join(f"line {i:05d}\n" for i in range(20_000)).encode())
    router.tick()

    (what, _, _), = NOTICE.findall(cell.text)
    skipped = int(what.split()[0].replace(",", ""))
    assert what == f"{skipped:,} lines ({skipped * 11 / 1000:.1f} KB)"
    shown = NOTICE.split(cell.text)[-1]
    assert shown.startswith(f"line {skipped:05d}\n") and shown.endswith("line 19999\n")
    assert len(shown) <= MAX_BYTES_PER_TICK


def test_a_notice_starts_on_its_own_line_after_an_open_one(cell: Cell) -> None:
    router = OutputRouter(live_ranks={0}, prefix=False, sink=cell.sink, clock=cell.clock)
    router.feed(0, "stdout", b"loading: ")
    router.tick()
    assert cell.text == "loading: "

    cell.now += TICK_INTERVAL_S
    router.feed(0, "stdout", b"." * 100_000)
    router.tick()
    assert cell.shown[-1][1].startswith("\n[accelnb: skipped 50.8 KB of a line of rank 0 stdout")


def test_prefixed_ranks_keep_their_prefix_through_a_skipped_line(cell: Cell) -> None:
    router = OutputRouter(live_ranks={0, 1}, prefix=True, sink=cell.sink, clock=cell.clock)
    router.feed(1, "stderr", b"z" * 200_000)
    router.tick()
    stream, text = cell.shown[-1]
    assert stream == "stderr"
    notice, tail = text.split("\n", 1)
    assert notice.startswith("[rank 1] [accelnb: skipped 150.8 KB of a line of rank 1 stderr")
    assert tail == "[rank 1] " + "z" * MAX_BYTES_PER_TICK

    cell.now += TICK_INTERVAL_S
    router.feed(1, "stderr", b"zz end\nnext\n")  # the same line goes on: no prefix in its middle
    router.tick()
    assert cell.shown[-1] == ("stderr", "zz end\n[rank 1] next\n")


def test_progress_bars_under_the_tick_throttle_show_their_latest_state(cell: Cell) -> None:
    router = OutputRouter(live_ranks={0, 1}, prefix=True, sink=cell.sink, clock=cell.clock)
    for percent in range(0, 50, 10):
        router.feed(1, "stdout", f"\rtraining {percent}%".encode())
    router.tick()
    assert cell.shown == [("stdout", "\r[rank 1] training 40%")]

    for percent in range(50, 80, 10):
        router.feed(1, "stdout", f"\rtraining {percent}%".encode())
    first_tick = cell.now
    cell.now = first_tick + TICK_INTERVAL_S / 2
    router.tick()  # too soon: nothing drawn, nothing lost
    assert len(cell.shown) == 1

    cell.now = first_tick + TICK_INTERVAL_S
    router.tick()
    assert cell.shown[-1] == ("stdout", "\r[rank 1] training 70%")

    cell.now += TICK_INTERVAL_S
    router.feed(1, "stdout", b"\rtraining 100%\ndone\n")
    router.tick()
    assert cell.shown[-1] == ("stdout", "\r[rank 1] training 100%\n[rank 1] done\n")
    assert router.text_since(1, 0).count("\r") == 9  # the retained copy has every update


def print_a_five_megabyte_line() -> None:
    import sys

    import torch.distributed as dist

    if dist.get_rank() == 0:
        print("x" * (5 * 2**20 - 3) + "end", end="")
        sys.stdout.flush()


def test_a_real_launch_printing_a_giant_line(capfd: pytest.CaptureFixture[str], no_leftovers: None) -> None:
    launch(print_a_five_megabyte_line, num_processes=2, cpu=True, quiet=True)
    shown = capfd.readouterr().out

    notices = NOTICE.findall(shown)
    assert notices, "a 5 MB line cannot be shown whole, so the cell must say what it skipped"
    assert all(re.fullmatch(r"[\d.]+ [KM]B of a line", what) for what, _, _ in notices), notices
    assert "0 lines" not in shown
    assert shown.endswith("xxend")
    assert len(shown) < 2**20  # the cell got a small part of it, however the reads fell into ticks
    result = last_result()
    assert result is not None and result.output(0) == "x" * (FIVE_MB - 3) + "end"
