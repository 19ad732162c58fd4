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


def test_a_session_looks_back_only_to_the_newest_cell_its_ranks_have(cells_in_linecache: None) -> None:
    # Cells enter linecache in the order they run: what is older than a cell the ranks have went
    # out with it or before it, and is not looked at again (a long notebook's calls stay cheap).
    newer = "/tmp/ipykernel_1/c.py"
    linecache.cache[newer] = (6, None, ["y = 2\n"], newer)
    assert [n for n, _ in in_memory_sources(already_sent={"/tmp/ipykernel_1/b.py"})] == [newer]
    assert in_memory_sources(already_sent={newer}) == ()


def test_a_file_added_by_another_thread_meanwhile_costs_no_source(cells_in_linecache: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A traceback formatted in another thread adds a file to linecache while a call looks through it.
    class GrowsOnFirstLook(dict):  # type: ignore[type-arg]
        looked = False

        def get(self, key: str, default: object = None) -> object:
            if not GrowsOnFirstLook.looked:
                GrowsOnFirstLook.looked = True
                self["/somewhere/else.py"] = (1, 1.0, ["\n"], "/somewhere/else.py")
            return super().get(key, default)

    monkeypatch.setattr(linecache, "cache", GrowsOnFirstLook(linecache.cache))
    assert [n for n, _ in in_memory_sources() if n in CELLS] == ["/tmp/ipykernel_1/b.py", "/tmp/ipykernel_1/a.py"]
    assert GrowsOnFirstLook.looked
