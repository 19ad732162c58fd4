"""``%%distributed`` in a real Jupyter kernel (nbclient), one kernel for the whole flow, plus the
magic's grammars (generated from the options) and its worker half, tested without a kernel.

Whether a session's workers exist is asserted by pid, inside the kernel that owns them, with
``worker_processes()`` from this folder's conftest; not inferred from a message.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

from accelnb import launch, read_inventory, synthetic_inventory
from accelnb.notebook.magic import CellReturns, magic_wording, parse_cell_line, parse_start_options
from accelnb.options import described_fields
from accelnb.wire.cell_contract import DEFAULT_RETURN_LIMIT, CellRequest
from accelnb.wire.result_pickling import loads_in_kernel
from accelnb.worker.cell_runner import run_cell
from tests.conftest import error_of, result_of, run_named_cells, stream_text

ROOT = str(Path(__file__).resolve().parent.parent)
PIDS = "print(sorted(p.pid for p in worker_processes()))"

CELLS = {
    "load": "%load_ext accelnb",
    "define": ("import torch, threading\n"
               "class Net(torch.nn.Module):\n"
               "    def __init__(self):\n"
               "        super().__init__()\n"
               "        self.fc = torch.nn.Linear(4, 1)\n"
               "scale = 3\n"
               "lock = threading.Lock()"),
    "run": ("%%distributed --procs 2 --cpu\n"
            "import torch.distributed as dist\n"
            "net = Net()\n"
            "total = torch.tensor([float(scale * (rank + 1))])\n"
            "dist.all_reduce(total)\n"
            "print(f'rank {rank} of {world_size} on {device}: {total.item()}')\n"
            "total.item() * 2"),
    "check": "print(type(net).__name__, total.device, total.item(), _distributed.plan.world_size)",
    "unpicklable": "%%distributed --procs 2 --cpu\nlock.locked()",
    "fails": ("%%distributed --procs 2 --cpu\n"
              "x = 1\n"
              "if rank == 1:\n"
              "    raise ValueError('boom on rank 1')\n"),
    "bad_option": "%%distributed --procs two\nprint(1)",
    "expansion_names": "n_procs, keep, command = 2, 'kept', 'status'",
    "expanded_cell": "%%distributed --procs {n_procs} --cpu --return $keep\nkept = world_size * 10\nnot_kept = 1",
    "expanded_value": "print(kept, 'not_kept' in globals())",
    "expanded_line": "%distributed {command}",
    "bad_gpu": "%%distributed --gpus 99\nprint(1)",
    "no_return": "%%distributed --procs 2 --cpu --return none --output all\nsecret = rank\nprint('hi')",
    "secret_absent": "print('secret' in globals())",
    "restarts": ("%%distributed --procs 2 --cpu --max-restarts 1 --quiet\n"
                 "import os, accelnb\n"
                 "if rank == 1 and accelnb.restart_count() == 0:\n"
                 "    os._exit(1)\n"
                 "print('attempt', accelnb.restart_count(), os.environ['TORCHELASTIC_RESTART_COUNT'])"),
    "stop_with_option": "%distributed stop --gpus 0",
    "options_without_command": "%distributed --procs 2",
    "command_on_a_cell": "%%distributed start\nprint(1)",
    "observe": (f"import sys; sys.path.insert(0, {ROOT!r})\n"
                "from tests.conftest import worker_processes\n"
                "magic = get_ipython().magics_manager.registry['DistributedMagics']\n" + PIDS),
    "start": "%distributed start --procs 2 --cpu --quiet",
    "pids_started": PIDS,
    "session_1": "%%distributed\nmodel = Net()\nw0 = model.fc.weight.sum().item()",
    "session_2": ("%%distributed\nwith torch.no_grad():\n    model.fc.weight.add_(1.0)\n"
                  "round(model.fc.weight.sum().item() - w0, 3)"),
    "same_names_1": "%%distributed\nrepeated = rank + 1",
    "same_names_2": "%%distributed\nrepeated = rank + 2",
    "new_names": "%%distributed\nrepeated = rank + 3\nalso = 4",
    "brought_back": "print(repeated, also)",
    "kernel_names": "lr, late = 0.1, 5",
    "assigns_then_fails": "%%distributed\nlr = 0.2 + rank\nraise ValueError('diverged')\nlate = 1",
    "after_the_failure": "%%distributed --output all\nprint(f'rank {rank}: lr {lr}, late {late}')",
    "devices_are_fixed": "%%distributed --procs 3 --cpu\nprint(1)",
    "no_restarts_in_a_session": "%%distributed --max-restarts 2\nprint(1)",
    "status": "%distributed status",
    "bad_restart": "%distributed restart --procs 0",
    "pids_after_bad_restart": PIDS,
    "restart_with_new_options": "%distributed restart --procs 1 --cpu --quiet",
    "status_new": "%distributed status",
    "restart_as_before": "%distributed restart",
    "status_again": "%distributed status",
    "variables_are_new": "%%distributed\n'model' in globals()",
    "syntax_error": "%%distributed\nbefore_the_error = 1\ny = (",
    "nothing_ran": "%%distributed\n'before_the_error' in globals()",
    "fails_in_value": "%%distributed\nz = 0; 1 / z",
    "shell_escape": "%%distributed\nimport os\n!nvidia-smi",
    "no_value": "%%distributed\nquiet = 5\nquiet * 2;",
    "stop": "%distributed stop",
    "after_stop": PIDS + "\nprint(magic.session)",
}


@pytest.fixture(scope="module")
def outputs() -> dict[str, Any]:
    return run_named_cells(CELLS)


def pids_in(text: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"pid (\d+)", text)]


def test_cell_runs_on_every_rank_with_notebook_names_and_rank0_value(outputs: dict[str, Any]) -> None:
    text = stream_text(outputs["run"])
    assert "rank 0 of 2 on cpu: 9.0" in text
    assert "rank 1 of 2" not in text  # rank 0 only, by default
    assert "accelnb: brought back from rank 0: net, total" in text
    assert result_of(outputs["run"]) == "18.0"
    assert stream_text(outputs["check"]).strip() == "Net cpu 9.0 2"


def test_an_unpicklable_notebook_name_is_named_with_its_type(outputs: dict[str, Any]) -> None:
    error = error_of(outputs["unpicklable"])
    assert error is not None and error["ename"] == "UnpicklableError"
    assert "The notebook variable 'lock' of type _thread.lock cannot be sent" in error["evalue"]
    assert "Create it inside the %%distributed cell" in error["evalue"]


def test_a_failing_rank_shows_the_cells_own_lines(outputs: dict[str, Any]) -> None:
    error = error_of(outputs["fails"])
    assert error is not None and error["ename"] == "ValueError"
    shown = "\n".join(error["traceback"])
    assert '[rank 1]   File "<cell In[6]>", line 4, in <module>' in shown
    assert "[rank 1]     raise ValueError('boom on rank 1')" in shown
    assert "supervisor.py" not in shown  # launcher internals stay hidden


def test_a_cell_python_cannot_parse_is_shown_at_its_line_and_no_rank_runs_any_of_it(outputs: dict[str, Any]) -> None:
    error = error_of(outputs["syntax_error"])
    assert error is not None and error["ename"] == "CellSyntaxError"
    shown = "\n".join(error["traceback"])
    assert re.search(r'File "<cell In\[\d+\]>", line 3\n    y = \(\n        \^\n'
                     r"SyntaxError: '\(' was never closed$", shown)
    assert "magic.py" not in shown and "interactiveshell" not in shown  # Python's display, no frames
    assert result_of(outputs["nothing_ran"]) == "False"
    escape = error_of(outputs["shell_escape"])  # IPython's syntax, which a rank's Python lacks: how instead
    assert escape is not None and escape["ename"] == "CellSyntaxError"
    assert "line 3\n    !nvidia-smi\n    ^\nSyntaxError: invalid syntax\nA %%distributed cell runs as plain Python" in (
        "\n".join(escape["traceback"]))


def test_a_cells_value_that_fails_is_shown_at_its_line(outputs: dict[str, Any]) -> None:
    error = error_of(outputs["fails_in_value"])
    assert error is not None and error["ename"] == "ZeroDivisionError"
    shown = "\n".join(error["traceback"])
    assert re.search(r'\[rank 0\]   File "<cell In\[\d+\]>", line 2, in <module>\n\[rank 0\]     z = 0; 1 / z\n'
                     r'\[rank 0\]  +~~\^~~', shown)


def test_a_cell_ending_with_a_semicolon_shows_no_value_as_a_plain_cell(outputs: dict[str, Any]) -> None:
    assert result_of(outputs["no_value"]) is None
    assert "brought back from rank 0: quiet" in stream_text(outputs["no_value"])


def test_usage_errors_are_short(outputs: dict[str, Any]) -> None:
    assert "UsageError: argument --procs: invalid int value: 'two'" in stream_text(outputs["bad_option"], "stderr")
    bad_gpu = stream_text(outputs["bad_gpu"], "stderr")
    assert "UsageError: GPU 99 does not exist on this machine" in bad_gpu
    # What this machine has (the kernel inherits this process's environment, so it sees these GPUs):
    # the ones there are, or how to run CPU ranks instead.
    visible = read_inventory().visible
    assert (f"GPUs visible to this kernel: {visible[0].index} (" if visible else "--procs N") in bad_gpu, bad_gpu
    assert error_of(outputs["bad_gpu"]) is None  # a usage error, not a traceback


def test_the_line_expands_notebook_names_as_ipython_does(outputs: dict[str, Any]) -> None:
    """``{name}`` and ``$name`` in the magic's line, expanded by accelnb (IPython's own expansion,
    which copies the whole namespace before every cell, is turned off for the magic)."""
    assert error_of(outputs["expanded_cell"]) is None, stream_text(outputs["expanded_cell"], "stderr")
    assert stream_text(outputs["expanded_value"]) == "20 False\n"  # 2 ranks; only `kept` came back
    assert "no session" in stream_text(outputs["expanded_line"]), outputs["expanded_line"]


def test_each_form_has_its_own_grammar(outputs: dict[str, Any]) -> None:
    said = {name: stream_text(outputs[name], "stderr")
            for name in ("stop_with_option", "options_without_command", "command_on_a_cell")}
    assert "UsageError: %distributed stop takes no options, got '--gpus 0'." in said["stop_with_option"]
    assert "UsageError: Unknown command '--procs'" in said["options_without_command"]
    assert "UsageError: Unexpected 'start' on the %%distributed line" in said["command_on_a_cell"]
    assert ast.literal_eval(stream_text(outputs["observe"]).strip()) == []  # none of them started a worker


def test_return_none_and_output_all(outputs: dict[str, Any]) -> None:
    text = stream_text(outputs["no_return"])
    assert "[rank 0] hi" in text and "[rank 1] hi" in text
    assert stream_text(outputs["secret_absent"]).strip() == "False"


def test_a_session_keeps_each_ranks_variables_between_cells(outputs: dict[str, Any]) -> None:
    assert error_of(outputs["start"]) is None
    started = ast.literal_eval(stream_text(outputs["pids_started"]).strip())
    assert len(started) == 2
    assert result_of(outputs["session_2"]) == "4.0"  # the same model object, changed in place
    status = stream_text(outputs["status"])
    assert "accelnb session: 2 rank(s), backend gloo, running" in status
    assert sorted(pids_in(status)) == started
    fixed = stream_text(outputs["devices_are_fixed"], "stderr")
    assert "UsageError: A persistent session is running" in fixed and "--procs" in fixed


def test_the_names_brought_back_are_named_when_they_change(outputs: dict[str, Any]) -> None:
    assert "accelnb: brought back from rank 0: repeated" in stream_text(outputs["same_names_1"])
    assert "brought back" not in stream_text(outputs["same_names_2"])  # the same names: nothing new to say
    assert "accelnb: brought back from rank 0: repeated, also" in stream_text(outputs["new_names"])
    assert stream_text(outputs["brought_back"]).strip() == "3 4"  # said or not, they came back


def test_what_a_failed_cell_assigned_stays_on_the_ranks(outputs: dict[str, Any]) -> None:
    """As in a plain kernel, where a cell that assigns and then raises leaves the name assigned:
    the notebook's own ``lr`` must not be shipped over the ranks' (an interrupted training cell's
    model, say). A name the cell never reached still comes from the notebook."""
    error = error_of(outputs["assigns_then_fails"])
    assert error is not None and "diverged" in error["evalue"]
    text = stream_text(outputs["after_the_failure"])
    assert "rank 0: lr 0.2, late 5" in text and "rank 1: lr 1.2, late 5" in text, text


def test_max_restarts_restarts_a_one_shot_cell_and_is_refused_in_a_session(outputs: dict[str, Any]) -> None:
    assert error_of(outputs["restarts"]) is None
    shown = stream_text(outputs["restarts"])
    assert "accelnb: attempt 1 of 2 ended after" in shown and "rank 1 failed: exited with code 1" in shown
    assert shown.rstrip().endswith("attempt 1 1")
    refused = stream_text(outputs["no_restarts_in_a_session"], "stderr")
    assert "UsageError: A persistent session is running, and --max-restarts cannot apply to it" in refused


def test_restart_checks_new_options_first_then_reuses_or_replaces_them(outputs: dict[str, Any]) -> None:
    started = ast.literal_eval(stream_text(outputs["pids_started"]).strip())
    assert "UsageError: --procs must be at least 1, got 0." in stream_text(outputs["bad_restart"], "stderr")
    assert ast.literal_eval(stream_text(outputs["pids_after_bad_restart"]).strip()) == started  # untouched

    new = stream_text(outputs["status_new"])
    assert "accelnb session: 1 rank(s), backend gloo, running" in new
    again = stream_text(outputs["status_again"])
    assert "accelnb session: 1 rank(s), backend gloo, running" in again  # the options it had: --procs 1 --cpu
    assert len({*started, *pids_in(new), *pids_in(again)}) == 4  # fresh workers each time
    assert result_of(outputs["variables_are_new"]) == "False"


def test_stop_ends_every_worker_and_the_session(outputs: dict[str, Any]) -> None:
    assert error_of(outputs["stop"]) is None
    assert stream_text(outputs["after_stop"]).split("\n")[:2] == ["[]", "None"]


# ── the grammars, generated from the options ───────────────────────────────────────────────
SAMPLES = {  # a flag's text, and the value LaunchOptions must get from it
    "gpus": ("0,1", "0,1"), "num_processes": ("2", 2), "cpu": (None, True), "backend": ("gloo", "gloo"),
    "master_port": ("29555", 29555), "mixed_precision": ("fp8", "fp8"), "quiet": (None, True),
    "timeout": ("2.5", 2.5), "output": ("all", "all"), "log_dir": ("runs/exp1", "runs/exp1"),
    "max_restarts": ("2", 2), "restart_delay": ("0.5", 0.5),
    "gpus_per_rank": ("2", 2), "config_file": ("fsdp.yaml", "fsdp.yaml"), "ranks": ("0,2", [0, 2]),
    "cluster": ("ray", "ray"), "nodes": ("2", 2), "gpus_per_node": ("4", 4), "group_timeout": ("90", 90.0),
    "stall_timeout": ("30", 30.0),
    "stop_grace": ("30", 30.0),
}


def test_the_cell_grammar_has_every_flag_the_options_describe_and_fills_them_in() -> None:
    flagged = {each.name: info.flag for each, info in described_fields() if info.flag is not None}
    assert set(flagged) == set(SAMPLES)
    for name, flag in flagged.items():
        text, value = SAMPLES[name]
        given, returns = parse_cell_line(f"{flag} {text}" if text is not None else flag)
        assert given == {name: value} and returns == CellReturns(None, DEFAULT_RETURN_LIMIT)
    given, returns = parse_cell_line("--procs 2 --return a,b --return-limit 1GB")
    assert given == {"num_processes": 2} and returns == CellReturns(["a", "b"], 10**9)
    assert parse_cell_line("--return-limit none")[1].limit is None


def test_start_takes_only_the_options_that_place_ranks() -> None:
    assert parse_start_options("--procs 2 --quiet") == {"num_processes": 2, "quiet": True}
    for per_call in ("--timeout 5", "--output all", "--return x"):
        with pytest.raises(UsageError, match="unrecognized arguments"):
            parse_start_options(per_call)
    with pytest.raises(UsageError, match="invalid choice: 'fp32'"):
        parse_cell_line("--mixed-precision fp32")


def test_api_wording_becomes_the_magics() -> None:
    assert magic_wording("Pass num_processes=N, or cpu=True with gpus=.") == "Pass --procs N, or --cpu with --gpus ."
    assert magic_wording("master_port must be a port number") == "--port must be a port number"


# ── the worker half: the cell's device is the planned one ──────────────────────────────────
@pytest.mark.usefixtures("no_leftovers")
def test_a_cell_gets_the_planned_device_not_one_it_derives() -> None:
    # A synthetic inventory plans cpu ranks; on a GPU host the cell used to get cuda:N anyway.
    request = CellRequest.read("import os\n(str(device), os.environ['CUDA_VISIBLE_DEVICES'])",
                               filename="<cell In[1]>", header="%%distributed", names={}, modules={},
                               return_names=[])
    result = launch(run_cell, (request,), gpus="1,3", inventory=synthetic_inventory(8), quiet=True,
                    collect="rank0")
    assert [r.device for r in result.plan.ranks] == ["cpu", "cpu"]
    assert loads_in_kernel(result.value.last_value) == ("cpu", "1,3")


# ── the worker half: the notebook's names never replace what a cell bound on the rank ───────
def cell(source: str, **names: Any) -> CellRequest:
    return CellRequest.read(source, filename="<cell In[1]>", header="%%distributed", names=names,
                            modules={"torch": "torch"}, return_names=[])


@pytest.mark.usefixtures("no_leftovers")
def test_a_name_a_failed_cell_rebound_stays_the_ranks_and_a_shipped_object_is_not_kept_alive() -> None:
    import torch

    from accelnb import RankFailed, Session

    notebook_model = torch.nn.Linear(3, 3)  # the notebook's own model, which a rank's cell replaces
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        def run(request: CellRequest) -> Any:
            outcome = session.run(run_cell, (request,)).value
            return loads_in_kernel(outcome.last_value) if outcome.last_value is not None else None

        assert run(cell("model.in_features", model=notebook_model)) == 3
        with pytest.raises(RankFailed, match="diverged"):  # the same object's address may come back
            run(cell("model = None\nimport gc\ngc.collect()\nmodel = torch.nn.Linear(2, 2)\n"
                     "raise ValueError('diverged')", model=notebook_model))
        assert run(cell("model.in_features", model=notebook_model)) == 2
        assert run(cell("import weakref\nref = weakref.ref(shipped)\ndel shipped", shipped=torch.ones(4))) is None
        assert run(cell("import gc\ngc.collect()\nref() is None")) is True
