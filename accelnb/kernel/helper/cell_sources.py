"""The notebook's cell sources, for the ranks: their debugger and tracebacks show the lines.

A function defined in a notebook cell has a code object whose file (``/tmp/ipykernel_<pid>/…py``)
exists only in the kernel's ``linecache``, registered by IPython with no modification time. A
rank has line numbers but no text, so ``(Pdb)`` would show ``> …(7)fn()`` without the line. Each
call carries these in-memory sources (:class:`~accelnb.wire.events.RunCall` ``sources``), and the
worker registers them in its own ``linecache``.

A session sends each source once (``already_sent``). Cells enter ``linecache`` in the order they
run, and a dict keeps that order, so a session's call looks from the newest entry back to the first
one every rank has: the cells older than it went out before. Looking at every entry, a notebook
that had run 3,000 distinct cells paid 2 ms more for each ``%%distributed`` cell: 0.25 ms looking,
and the garbage collections that a list of 3,000 entries set off (``benchmarks/RESULTS.md``).

    >>> in_memory_sources()          # doctest: +SKIP
    (('/tmp/ipykernel_7220/3242403043.py', 'def fn():\\n    x = 3\\n'),)
"""

from __future__ import annotations

import linecache
from collections.abc import Collection, Iterable

# Past this many characters of cell sources, the newest cells only: a call stays small.
SOURCES_LIMIT_CHARS = 1 << 20


def in_memory_sources(limit: int = SOURCES_LIMIT_CHARS,
                      already_sent: Collection[str] = ()) -> tuple[tuple[str, str], ...]:
    """(filename, text) of every source ``linecache`` holds that is not on disk, newest first,
    down to the newest one in ``already_sent`` (a session's ranks keep what earlier calls gave
    them: a cell's file name is never reused for other text, and every older cell went out with
    it or before it)."""
    try:
        return _newest_sources(reversed(linecache.cache), limit, already_sent)
    except RuntimeError:  # another thread added a file meanwhile (a traceback it formatted)
        return _newest_sources(reversed(list(linecache.cache)), limit, already_sent)  # one copy, made at once


def _newest_sources(newest_first: Iterable[str], limit: int,
                    already_sent: Collection[str]) -> tuple[tuple[str, str], ...]:
    chosen: list[tuple[str, str]] = []
    total = 0
    for filename in newest_first:
        entry = linecache.cache.get(filename)
        if entry is None or len(entry) != 4 or entry[1] is not None:
            continue  # gone meanwhile, a file on disk (the rank reads it itself), or lazily loaded
        if filename in already_sent:
            break  # it and everything older went out before
        text = "".join(entry[2])
        total += len(text)
        if total > limit:
            break
        chosen.append((filename, text))
    return tuple(chosen)
