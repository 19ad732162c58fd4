"""Which notebook cell sources a call carries to the ranks (``kernel/run/cell_sources.py``)."""

from __future__ import annotations

import linecache
from collections.abc import Iterator

import pytest

from accelnb.kernel.run.cell_sources import in_memory_sources

CELLS = {"/tmp/ipykernel_1/a.py": "x = 1\n", "/tmp/ipykernel_1/b.py": "def f():\n    return 2\n"}


@pytest.fixture
def cells_in_linecache() -> Iterator[None]:
    saved = dict(linecache.cache)
    for name, text in CELLS.items():  # as IPython registers a cell: no modification time
        linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)
    yield
    linecache.cache.clear()
    linecache.cache.update(saved)


def test_in_memory_cells_newest_first_and_files_on_disk_left_out(cells_in_linecache: None) -> None:
    linecache.getline(__file__, 1)  # a file on disk: the rank reads it itself
    sent = [(n, t) for n, t in in_memory_sources() if n in CELLS]
    assert sent == [("/tmp/ipykernel_1/b.py", CELLS["/tmp/ipykernel_1/b.py"]),
                    ("/tmp/ipykernel_1/a.py", CELLS["/tmp/ipykernel_1/a.py"])]
    assert all(name != __file__ for name, _ in in_memory_sources())


def test_cells_already_sent_are_not_sent_again(cells_in_linecache: None) -> None:
    names = [n for n, _ in in_memory_sources(already_sent={"/tmp/ipykernel_1/a.py"}) if n in CELLS]
    assert names == ["/tmp/ipykernel_1/b.py"]


def test_past_the_limit_only_the_newest_cells_go(cells_in_linecache: None) -> None:
    newest_only = in_memory_sources(limit=len(CELLS["/tmp/ipykernel_1/b.py"]))
    assert [n for n, _ in newest_only] == ["/tmp/ipykernel_1/b.py"]
