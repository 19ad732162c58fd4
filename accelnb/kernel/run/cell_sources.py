"""The notebook's cell sources, for the ranks: their debugger and tracebacks show the lines.

A function defined in a notebook cell has a code object whose file (``/tmp/ipykernel_<pid>/…py``)
exists only in the kernel's ``linecache``, registered by IPython with no modification time. A
rank has line numbers but no text, so ``(Pdb)`` would show ``> …(7)fn()`` without the line. Each
call carries these in-memory sources (:class:`~accelnb.wire.events.RunCall` ``sources``), and the
worker registers them in its own ``linecache``.

    >>> in_memory_sources()          # doctest: +SKIP
    (('/tmp/ipykernel_7220/3242403043.py', 'def fn():\\n    x = 3\\n'),)
"""

from __future__ import annotations

import linecache
from collections.abc import Collection

# Past this many characters of cell sources, the newest cells only: a call stays small.
SOURCES_LIMIT_CHARS = 1 << 20


def in_memory_sources(limit: int = SOURCES_LIMIT_CHARS,
                      already_sent: Collection[str] = ()) -> tuple[tuple[str, str], ...]:
    """(filename, text) of every source ``linecache`` holds that is not on disk, newest first,
    leaving out ``already_sent`` (a session's ranks keep what earlier calls gave them: a cell's
    file name is never reused for other text)."""
    chosen: list[tuple[str, str]] = []
    total = 0
    for filename, entry in reversed(list(linecache.cache.items())):
        if len(entry) != 4 or entry[1] is not None or filename in already_sent:
            continue  # a file on disk (the rank reads it itself), lazily loaded, or sent before
        text = "".join(entry[2])
        total += len(text)
        if total > limit:
            break
        chosen.append((filename, text))
    return tuple(chosen)
