"""The notebook's cell sources on the worker side: in the template's ``linecache``, and a rank's.

A function defined in a notebook cell has a code object whose file exists only in the kernel's
``linecache`` (``kernel/helper/cell_sources.py``). Its text reaches a rank two ways: the template
registers what the kernel sent it with a launch's spawn request (``worker/template/helper.py``)
before it forks, so every rank forked afterwards has it; and a call carries what its ranks still lack (the newest
cells, and all those a child forked earlier, while the template waited, was not given).

:class:`TemplateSources` keeps how many sources the template had when it forked each waiting
child: the kernel sends sources in order, oldest batch first, so a count says exactly which.

    >>> register_cell_sources((("/tmp/ipykernel_1/2.py", "x = 1\\n"),))
    >>> held = TemplateSources()
    >>> held.add((("/tmp/ipykernel_1/3.py", "y = 2\\n"),), count=1); held.count
    1
"""

from __future__ import annotations

import linecache
from collections.abc import Iterable


def register_cell_sources(sources: Iterable[tuple[str, str]]) -> None:
    """Notebook cells' text, so that the debugger and tracebacks show the lines of notebook code."""
    for filename, text in sources:
        if filename not in linecache.cache:
            linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)


class TemplateSources:
    """The cell sources a template was given (``count``, in the kernel's order), and how many of
    them each of its waiting children was forked with."""

    def __init__(self) -> None:
        self.count = 0
        self._at_fork: dict[int, int] = {}  # waiting child's pid -> count when it was forked

    def add(self, sources: tuple[tuple[str, str], ...], count: int) -> None:
        """Register ``sources``; the kernel says how many it has given in all (``count``): its
        numbering, so that a batch it sends again (a Ctrl-C kept it from noting the first send)
        is not counted twice."""
        register_cell_sources(sources)
        self.count = count

    def forked(self, pid: int) -> None:
        """A waiting child was forked now: it has every source given so far, and no later one."""
        self._at_fork[pid] = self.count

    def held_by(self, pids: Iterable[int]) -> int:
        """How many sources every one of these ranks has (a rank forked at launch: all of them);
        they are ranks now, so their counts are dropped."""
        return min((self._at_fork.pop(pid, self.count) for pid in pids), default=self.count)

    def forget(self, pid: int) -> None:
        """``pid`` was reaped: a later child given the same pid was forked with its own count."""
        self._at_fork.pop(pid, None)
