"""``%%distributed`` in a real Jupyter kernel (nbclient), one kernel for the whole flow."""

from __future__ import annotations

from typing import Any

import pytest

from accelnb.notebook.magic import DistributedMagics
from tests.conftest import error_of, run_notebook, stream_text

CELLS = {
    "load": "%load_ext accelnb",
    "define": ("import torch, threading\n"
               "class Net(torch.nn.Module):\n"
               "    def __init__(self):\n"
               "        super().__init__()\n"
               "        self.fc = torch.nn.Linear(4, 1)\n"
               "scale = 3\n"
               "lock = threading.Lock()"),
    "run": ("%%distributed --procs 2\n"
            "import torch.distributed as dist\n"
            "net = Net()\n"
            "total = torch.tensor([float(scale * (rank + 1))])\n"
            "dist.all_reduce(total)\n"
            "print(f'rank {rank} of {world_size} on {device}: {total.item()}')\n"
            "total.item() * 2"),
    "check": "print(type(net).__name__, total.device, total.item(), _distributed.plan.world_size)",
    "unpicklable": "%%distributed --procs 2\nlock.locked()",
    "fails": ("%%distributed --procs 2\n"
              "x = 1\n"
              "if rank == 1:\n"
              "    raise ValueError('boom on rank 1')\n"),
    "bad_option": "%%distributed --procs two\nprint(1)",
    "bad_gpu": "%%distributed --gpus 5\nprint(1)",
    "no_return": "%%distributed --procs 2 --return none --output all\nsecret = rank\nprint('hi')",
    "secret_absent": "print('secret' in globals())",
    "start": "%distributed start --procs 2 --quiet",
    "session_1": "%%distributed\nmodel = Net()\nw0 = model.fc.weight.sum().item()",
    "session_2": ("%%distributed\nwith torch.no_grad():\n    model.fc.weight.add_(1.0)\n"
                  "round(model.fc.weight.sum().item() - w0, 3)"),
    "status": "%distributed status",
    "stop": "%distributed stop",
    "after_stop": "%%distributed\nprint(1)",
}


@pytest.fixture(scope="module")
def outputs() -> dict[str, Any]:
    results = run_notebook(list(CELLS.values()))
    return dict(zip(CELLS, results, strict=True))


def result_of(outputs: list[Any]) -> str | None:
    return next((o["data"]["text/plain"] for o in outputs if o["output_type"] == "execute_result"), None)


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


def test_usage_errors_are_short(outputs: dict[str, Any]) -> None:
    assert "UsageError: argument --procs: invalid int value: 'two'" in stream_text(outputs["bad_option"], "stderr")
    bad_gpu = stream_text(outputs["bad_gpu"], "stderr")
    assert "UsageError: GPU 5 does not exist on this machine" in bad_gpu and "--procs N" in bad_gpu
    assert error_of(outputs["bad_gpu"]) is None  # a usage error, not a traceback


def test_return_none_and_output_all(outputs: dict[str, Any]) -> None:
    text = stream_text(outputs["no_return"])
    assert "[rank 0] hi" in text and "[rank 1] hi" in text
    assert stream_text(outputs["secret_absent"]).strip() == "False"


def test_a_session_keeps_each_ranks_variables_between_cells(outputs: dict[str, Any]) -> None:
    assert error_of(outputs["start"]) is None
    assert result_of(outputs["session_2"]) == "4.0"  # the same model object, changed in place
    status = stream_text(outputs["status"])
    assert "accelnb session: 2 rank(s), backend gloo, running" in status and "pid" in status
    assert "every worker has exited" in stream_text(outputs["stop"])
    assert "No GPU is visible" in stream_text(outputs["after_stop"], "stderr")


def test_help_lists_every_option() -> None:
    doc = DistributedMagics.distributed.__doc__ or ""
    for option in ("--gpus", "--procs", "--backend", "--port", "--timeout", "--output", "--mixed-precision",
                   "--return"):
        assert option in doc
