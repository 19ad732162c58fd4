"""``%%distributed --ranks`` and ``Session.run(ranks=)``: a cell on some ranks of a session.

One real kernel (nbclient) runs the whole flow: state set on rank 1 only, seen there and not on
rank 0, prefixed output, names from the first rank listed, usage errors before anything runs, and
a collective bounded by ``--timeout``. Worker pids are read inside the kernel that owns them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from accelnb import Session
from accelnb.errors import LaunchConfigError
from tests.conftest import error_of, result_of, run_named_cells, stream_text, worker_processes

ROOT = str(Path(__file__).resolve().parent.parent)
PIDS = "print(sorted(p.pid for p in worker_processes()))"

CELLS = {
    "load": (f"%load_ext accelnb\nimport sys; sys.path.insert(0, {ROOT!r})\n"
             "from tests.conftest import worker_processes"),
    "without_session": "%%distributed --ranks 1\nprint('ran')",
    "start": "%distributed start --procs 2 --cpu --quiet",
    "everyone": "%%distributed\nstep = 0",
    "on_rank_1": ("%%distributed --ranks 1\n"
                  "step = 41\n"
                  "secret = f'set on rank {rank}'\n"
                  "print('rank', rank, 'now at step', step)"),
    "notebook_sees": "print(secret, step)",
    "each_rank_sees": "%%distributed --output all\nprint('secret' in globals(), step)",
    "first_listed": "%%distributed --ranks 1,0\nwho = rank\nprint('here', rank)\nrank * 10",
    "who": "print('who =', who)",
    "out_of_range": "%%distributed --ranks 5\nprint('ran')",
    "twice": "%%distributed --ranks 1,1\nprint('ran')",
    "not_a_number": "%%distributed --ranks x\nprint('ran')",
    "still_running": "%%distributed\nprint('session alive', step)",
    "collective": ("%%distributed --ranks 1 --timeout 3\n"
                   "import torch.distributed as dist\n"
                   "dist.barrier()"),
    "after_timeout": PIDS + "\nprint(get_ipython().magics_manager.registry['DistributedMagics'].session)",
}


@pytest.fixture(scope="module")
def outputs() -> dict[str, Any]:
    return run_named_cells(CELLS)


def test_state_set_on_one_rank_stays_on_that_rank(outputs: dict[str, Any]) -> None:
    assert error_of(outputs["start"]) is None and error_of(outputs["on_rank_1"]) is None
    text = stream_text(outputs["on_rank_1"])
    assert "[rank 1] rank 1 now at step 41" in text
    assert "[rank 0]" not in text  # rank 0 did not run it
    assert "accelnb: brought back from rank 1: step, secret" in text
    assert stream_text(outputs["notebook_sees"]).strip() == "set on rank 1 41"
    seen = stream_text(outputs["each_rank_sees"])
    assert "[rank 0] False 0" in seen and "[rank 1] True 41" in seen


def test_value_and_names_come_from_the_first_rank_listed(outputs: dict[str, Any]) -> None:
    text = stream_text(outputs["first_listed"])
    assert "[rank 0] here 0" in text and "[rank 1] here 1" in text
    assert "accelnb: brought back from rank 1: who" in text
    assert result_of(outputs["first_listed"]) == "10"
    assert stream_text(outputs["who"]).strip() == "who = 1"


def test_bad_ranks_are_usage_errors_before_anything_runs(outputs: dict[str, Any]) -> None:
    said = {name: stream_text(outputs[name], "stderr")
            for name in ("without_session", "out_of_range", "twice", "not_a_number")}
    assert "UsageError: --ranks runs the cell on some ranks of a running session, and no session" in \
        said["without_session"] and "%distributed start --procs 2" in said["without_session"]
    assert "UsageError: --ranks [5]: this session has 2 ranks (0 to 1), so there is no rank 5" in said["out_of_range"]
    assert "UsageError: --ranks [1, 1] lists rank 1 more than once; give each rank once." in said["twice"]
    assert "UsageError: --ranks ['x'] is not a choice of ranks; give rank numbers, e.g. --ranks [1]" in \
        said["not_a_number"]
    for name in said:
        assert "ran" not in stream_text(outputs[name])
        assert error_of(outputs[name]) is None  # a usage error, not a traceback
    assert "session alive 0" in stream_text(outputs["still_running"])  # refused cells left it as it was


def test_a_timeout_bounds_a_collective_on_chosen_ranks(outputs: dict[str, Any]) -> None:
    error = error_of(outputs["collective"])
    assert error is not None and error["ename"] == "LaunchTimeout"
    assert error["evalue"].startswith("The call ran on rank 1 only (ranks=[1]): a collective in it")
    assert "in barrier" in error["evalue"]  # rank 1's stack shows where it waited
    assert "The session was closed with its workers" in error["evalue"]
    assert stream_text(outputs["after_timeout"]).split() == ["[]", "None"]


def test_session_run_with_ranks_from_python(no_leftovers: None) -> None:
    def remember(value: int) -> int:
        import builtins
        builtins.remembered = value  # type: ignore[attr-defined]
        return value

    def recall() -> int | None:
        import builtins
        return getattr(builtins, "remembered", None)

    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        assert session.run(remember, (7,), ranks=[1]).values == {1: 7}
        assert session.run(recall).values == {0: None, 1: 7}
        assert session.run(recall, ranks=[1], collect="rank0").value == 7
        with pytest.raises(LaunchConfigError, match=r"ranks=\[2\]: this session has 2 ranks"):
            session.run(recall, ranks=[2])
        # A call's keywords are checked once while they repeat (Session._call_options); a list
        # changed in place since, or a new bad value, is checked again, before anything runs.
        chosen = [1]
        assert session.run(recall, ranks=chosen, collect="rank0").value == 7
        chosen.append(1)
        with pytest.raises(LaunchConfigError, match="more than once"):
            session.run(recall, ranks=chosen, collect="rank0")
        assert session.run(recall, collect="rank0", timeout=30).value is None
        assert session.run(recall, collect="rank0", timeout=30).value is None
        with pytest.raises(LaunchConfigError, match="timeout"):
            session.run(recall, collect="rank0", timeout=-1)
        assert session.alive
    assert worker_processes() == []
