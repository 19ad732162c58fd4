"""Making dumps in faulthandler's format readable: only the user's threads and frames.

A worker's dump (asked for at a timeout and for live stacks, ``worker/interactive/stack_dump.py``; or
faulthandler's own, on a segfault) lists accelnb's own
helper threads and the frames that lead from the helper process into the user's function. Neither
helps anyone find a hang, so they are dropped here; everything else is kept verbatim. A thread
left with no frame at all (a rank's main thread in accelnb's own code, waiting for its next call)
says so, rather than showing a bare header.

A live dump arrives on the rank's stderr mixed with whatever the rank itself writes there;
:func:`split_stack_dump` tells the two apart, so the rank's own lines still reach the cell.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ONLY_OUR_FRAMES = "  (accelnb's own frames only: waiting for the next call, or handling one)"
# accelnb/ (this file is accelnb/kernel/stacks/…) with a trailing separator: every frame under it is
# ours, whichever subpackage.
_PACKAGE_ROOT = str(Path(os.path.abspath(__file__)).parents[2]) + os.sep
_THREAD_HEADER = re.compile(r"^(Thread|Main thread|Current thread) 0x[0-9a-f]+")
_THREAD_RUN = re.compile(r'threading\.py", line \d+ in run$')  # Thread.run calls the thread's target


def dump_has_begun(text: str) -> bool:
    """Whether a rank's ``text`` holds a dump's first thread header (every one says this)."""
    return "(most recent call first)" in text


def split_stack_dump(text: str) -> tuple[str, str]:
    """``(dump, rest)``: faulthandler's thread blocks, and every other line, each in order.

    A block is a thread header, its indented frame lines, and the blank line that ends it.
    """
    dump: list[str] = []
    rest: list[str] = []
    in_block = False
    for line in text.splitlines(keepends=True):
        if _THREAD_HEADER.match(line):
            in_block = True
        elif in_block and not (line.startswith("  ") or not line.strip()):
            in_block = False
        (dump if in_block else rest).append(line)
        if in_block and not line.strip():
            in_block = False  # the blank line closes the block
    return "".join(dump), "".join(rest)


def clean_stack_dump(text: str) -> str:
    """Drop accelnb's own threads and frames from a faulthandler dump."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _THREAD_HEADER.match(line) or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    kept: list[str] = []
    for block in blocks:
        if _is_our_thread(block):
            continue
        lines = [line for line in block
                 if not (_PACKAGE_ROOT in line or "<frozen runpy>" in line or line.startswith("Extension modules:"))]
        if lines and _THREAD_HEADER.match(lines[0]) and not any(line.strip() for line in lines[1:]):
            lines.insert(1, ONLY_OUR_FRAMES)  # a main thread in accelnb alone: a bare header says nothing
        kept.extend(lines)
    return "\n".join(kept).strip("\n")


def _is_our_thread(block: list[str]) -> bool:
    """A thread whose target is accelnb's (the worker's watcher and flusher),
    told by where its target lives rather than by function names that may change."""
    for index, line in enumerate(block):
        if _THREAD_RUN.search(line.rstrip()):
            return index > 0 and _PACKAGE_ROOT in block[index - 1]
    return False
