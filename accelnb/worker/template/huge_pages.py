"""The template's memory moved onto 2 MiB pages while it is idle: cheaper forks, cheaper rank exits.

A fork copies one page-table entry for every private page the template has written, and the
child's exit walks and frees them again. An interpreter that imported torch holds about 145 MiB of
such memory (250 MiB with transformers), 37,000-64,000 entries of 4 KiB pages. Measured on the
2-core machine (``benchmarks/bench_huge_pages.py``: ``fork``, ``os._exit`` at once, ``wait4``;
medians of 20, wall time from fork to reaped and the child's CPU time, most of it the exit):

========================  ===================  ==================
template                  4 KiB pages          2 MiB pages
========================  ===================  ==================
torch                     24.0 ms, 13.7 CPU    7.5 ms, 4.9 CPU
torch and transformers    43.8 ms, 24.6 CPU    13.4 ms, 9.3 CPU
========================  ===================  ==================

Every launch pays one fork and one exit per rank: on the launch's path when no waiting child is
left (``standby_ranks.py``), and as CPU the next launch competes with when launches come back to
back on few cores. There, a 2-rank launch took 72 ms on 4 KiB pages and 47 ms on 2 MiB pages,
the whole machine spending 117 and 77 ms of CPU per launch.

So once the template has had nothing to do for a moment (no rank running, no import asked for, no
waiting child to replace, and nothing from the kernel or a rank for
:data:`QUIET_BEFORE_COLLAPSE_S`), it asks the kernel to collapse its written private memory into
transparent huge pages (``MADV_COLLAPSE``, Linux 6.1+: synchronous, and independent of the
system's THP settings, it fails only where the process or a mapping opted out), one 4 MiB piece
per turn of its loop, so that a request waits for at most one piece (about 10 ms). A pass costs
0.2-0.4 s of CPU, once per template and again after it imported more; waiting for a quiet moment
keeps that out of a burst of launches (a script's loop), which it would slow, while a notebook's
pauses between cells leave plenty. A fork then copies one entry per 2 MiB, and a rank that writes
a page gets a copy of that 4 KiB page only (the kernel splits the shared huge page's mapping in
the writer), so a rank's memory grows no more than before. The children already waiting stay as
they are; the next ones are forks of the collapsed memory.

Only 2 MiB ranges that are nearly all in memory already (``mincore``: at least 7/8 of their
pages) are collapsed: collapsing fills a range's missing pages with zeros, and a library's
reserved-but-untouched buffer must not become resident. Where the kernel cannot do it (older than
6.1, built without THP, ``PR_SET_THP_DISABLE``), the first pass collapses nothing and the
template never tries again: forks work as before.

``_libc`` is this process's C library (``madvise`` and ``mincore``, which Python's ``mmap``
module offers only for a mapping of its own): a process has exactly one.

    >>> pages = HugePages()                 # due at once: the start-up's imports      # doctest: +SKIP
    >>> pages.memory_changed()              # after each import                        # doctest: +SKIP
    >>> while pages.due(): pages.step()     # one piece per idle turn                  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections import deque

HUGE_PAGE = 1 << 21
PIECE = 2 * HUGE_PAGE  # per turn of the template's loop: about 10 ms of the kernel's work
MADV_COLLAPSE = 25  # linux/mman.h; Python's mmap module has it only from 3.12 on Linux 6.1+
MIN_RESIDENT_FRACTION = 7 / 8
QUIET_BEFORE_COLLAPSE_S = 0.1  # launches back to back come every 40-60 ms; cells seconds apart
# A benchmark's switch, not a user setting: ``benchmarks/bench_huge_pages.py`` measures the
# template both ways.
OFF_ENV = "ACCELNB_BENCH_HUGE_PAGES_OFF"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


class HugePages:
    """The 2 MiB ranges of this process's written private memory still to be collapsed."""

    def __init__(self) -> None:
        self._pieces: deque[tuple[int, int]] = deque()  # (start, length), each a multiple of 2 MiB
        # None until a pass shows whether the kernel can
        self._supported: bool | None = False if os.environ.get(OFF_ENV) == "1" else None
        self._collapsed_this_pass = 0
        self._stale = self._supported is None

    def memory_changed(self) -> None:
        """Memory grew (an import), or may have: collapse again before the next fork. Ranges
        already on huge pages cost little; the ranges are read when next asked what is due."""
        self._stale = self._supported is not False

    def due(self) -> bool:
        if self._stale:
            self._plan()
        return bool(self._pieces)

    def step(self) -> None:
        """Collapse the next piece, 2 MiB at a time, skipping ranges mostly not in memory."""
        start, length = self._pieces.popleft()
        for huge in range(start, start + length, HUGE_PAGE):
            if _resident_fraction(huge) < MIN_RESIDENT_FRACTION:
                continue
            if _libc.madvise(huge, HUGE_PAGE, MADV_COLLAPSE) == 0:
                self._collapsed_this_pass += HUGE_PAGE
        if not self._pieces and self._supported is None:
            # EINVAL for an unknown advice looks like EINVAL for a range it will not take, so
            # judge by the whole pass: nothing collapsed anywhere means the kernel cannot.
            self._supported = self._collapsed_this_pass > 0

    def _plan(self) -> None:
        self._stale = False
        self._pieces.clear()
        self._collapsed_this_pass = 0
        for start, end in _private_anonymous_ranges():
            first = -(-start // HUGE_PAGE) * HUGE_PAGE
            last = end // HUGE_PAGE * HUGE_PAGE
            for piece in range(first, last, PIECE):
                self._pieces.append((piece, min(PIECE, last - piece)))


def _private_anonymous_ranges() -> list[tuple[int, int]]:
    """Writable private mappings with no file behind them (the heap, malloc's and Python's arenas,
    torch's anonymous buffers); not the stack, whose growth a huge page would not follow."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            perms = fields[1]
            path = fields[5] if len(fields) > 5 else ""
            if perms[1] == "w" and perms[3] == "p" and path in ("", "[heap]"):
                low, high = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((low, high))
    return ranges


def _resident_fraction(start: int) -> float:
    vector = ctypes.create_string_buffer(HUGE_PAGE // mmap.PAGESIZE)
    if _libc.mincore(start, HUGE_PAGE, vector) != 0:
        return 0.0  # unmapped since the plan, or not ours to ask about: leave it
    return 1 - vector.raw.count(0) / len(vector.raw)  # a byte per page, its low bit set if resident
