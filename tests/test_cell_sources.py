"""Which notebook cell sources the template keeps and a call carries to the ranks
(``kernel/helper/cell_sources.py``, ``worker/cell_sources.py``).

The looks through ``linecache`` are tested on their own; what the template keeps and what each
launch's call carries, with real templates and real launches of 2 ranks.
"""

from __future__ import annotations

import linecache
from collections.abc import Iterator

import pytest

import accelnb
from accelnb.kernel.helper.cell_sources import in_memory_sources
from accelnb.kernel.helper.template import shared_helper
from accelnb.kernel.run.group import rank_inboxes
from accelnb.worker.cell_sources import TemplateSources
from tests.test_standby_ranks import waiting_children

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


def test_a_template_counts_the_sources_each_waiting_child_was_forked_with() -> None:
    held = TemplateSources()
    held.add((("/tmp/ipykernel_1/t1.py", "a = 1\n"), ("/tmp/ipykernel_1/t0.py", "b = 1\n")), count=2)
    held.forked(101)  # waited since two were given
    held.add((("/tmp/ipykernel_1/t2.py", "c = 1\n"),), count=3)
    held.forked(102)
    assert held.count == 3
    assert held.held_by([102]) == 3
    assert held.held_by([101, 555]) == 2  # 555: forked at the launch, it has all three
    assert held.held_by([101]) == 3  # 101 is a rank now: its count went with it
    held.forked(103)
    held.forget(103)  # reaped: a fork given its pid again has what the template has then
    held.add((("/tmp/ipykernel_1/t3.py", "d = 1\n"),), count=4)
    assert held.held_by([103]) == 4
    assert linecache.getline("/tmp/ipykernel_1/t2.py", 1) == "c = 1\n"  # registered in the template


# ── with real templates and launches ──────────────────────────────────────────────────────────
BIG = "/tmp/ipykernel_1/big.py"  # past what one message to the template may carry (~200 KB)
NEWER = "/tmp/ipykernel_1/newer.py"


def first_lines(names: list[str]) -> dict[str, str]:
    import linecache

    return {name: linecache.getline(name, 1) for name in names}


def lines_in_ranks(names: list[str]) -> dict[int, dict[str, str]]:
    return accelnb.launch(first_lines, (names,), num_processes=2, cpu=True, quiet=True,
                          timeout=120).values  # type: ignore[return-value]


@pytest.fixture
def carried(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The test's cells each launch's call carries to its ranks, one list per call."""
    calls: list[list[str]] = []

    def recorded(*args: object, **kwargs: object) -> tuple[tuple[str, str], ...]:
        sources = in_memory_sources(*args, **kwargs)  # type: ignore[arg-type]
        calls.append([name for name, _ in sources if name.startswith("/tmp/ipykernel_1/")])
        return sources

    monkeypatch.setattr(rank_inboxes, "in_memory_sources", recorded)
    return calls


@pytest.mark.usefixtures("no_leftovers")
def test_the_template_keeps_the_notebooks_cells_and_a_call_carries_only_what_its_ranks_lack(
        cells_in_linecache: None, carried: list[list[str]]) -> None:
    big_text = "x = 0  # " + "y" * 600_000 + "\n"
    linecache.cache[BIG] = (len(big_text), None, [big_text], BIG)
    names = [*CELLS, BIG]
    expected = {name: linecache.getline(name, 1) for name in names}
    shared_helper()
    assert lines_in_ranks(names) == {0: expected, 1: expected}

    # The next launch's ranks wait, forked with every cell the template was given; a newer cell
    # is given to the template at the launch, after they were forked: only it goes in the call.
    waiting_children(2)
    linecache.cache[NEWER] = (6, None, ["z = 3\n"], NEWER)
    carried.clear()
    assert lines_in_ranks([*names, NEWER]) == {rank: {**expected, NEWER: "z = 3\n"} for rank in (0, 1)}
    assert carried == [[NEWER]]

    # Forked since: they have it too, and the call carries none.
    waiting_children(2)
    carried.clear()
    assert lines_in_ranks([NEWER]) == {0: {NEWER: "z = 3\n"}, 1: {NEWER: "z = 3\n"}}
    assert carried == [[]]
