"""Lightning, Fabric, Accelerate's ``notebook_launcher`` and ``mp.spawn`` inside an accelnb launch
run on accelnb's ranks (``worker/other_launchers/launches_inside.py``; the ranks are born clean
from the template, never forks of the kernel: ``kernel/helper/template.py``).

Real kernels whose first cell imports torch and Lightning, as Lightning's notebooks do: Lightning
then decides, once, at import, that it runs interactively, and a rank forked from that kernel
inherited the answer (when ranks were forks of it). That was the case that hung:
``Trainer(devices=2)`` picked its fork strategy in each rank and started 2 processes more per
rank, which waited for peers that never came. The
code in the cells is written the way the projects' own docs write it (a ``LightningModule`` and a
``Trainer``; ``Fabric`` with ``launch``/``setup``/``backward``; Accelerate's ``training_function``
handed to ``notebook_launcher``; the PyTorch DDP tutorial's ``demo_basic`` and ``run_demo``), on
tiny random data, 2 CPU ranks (gloo). Two kernels, one per group of tests (module fixtures), keep
the file near half a minute on two busy cores.

What would differ without each feature:

- ``Trainer`` with its default strategy: the fork strategy is picked in the rank and
  ``mp.start_processes(join=False)`` is refused (or, with no refusal either, hangs);
- ``strategy="ddp_notebook"``: processes started inside each rank, rendezvous that never completes;
- ``notebook_launcher``: the function runs in forked children (the caller's list stays empty);
  ``mp.spawn``: its spawned children cannot unpickle a notebook's function ("Can't pickle
  demo_basic"); for 3 or 4 processes, no ``LaunchInsideLaunchError`` naming the numbers;
- the refusal's numbers: Accelerate rewrites ``WORLD_SIZE`` before calling ``elastic_launch``,
  and a refusal reading the environment then said "an accelnb launch of 3 ranks".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import json
from typing import Any

import pytest
import torch

from tests.conftest import REPO, error_of, run_named_cells, stream_text

# Each rank (and a cell) prints its findings as one line "RESULT {json}"; the rest of the output
# (Lightning's banners, accelnb's "[rank N]" prefixes) is ignored.
MARK = "RESULT "

# Lightning's notebooks start like this; accelnb is imported with them. The kernel's own answer
# to "interactive?" is printed: True here is what makes the tests below mean something.
FIRST_CELL = """
import os, time, json
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import lightning as L
import accelnb
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
print("RESULT", json.dumps({"kernel_interactive": _IS_INTERACTIVE}))
"""

# After the launches: no process of this kernel's launches is left (asserted by pid).
NOTHING_LEFT = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from tests.conftest import wait_until_no_workers, worker_processes
wait_until_no_workers(10.0)
print("RESULT", json.dumps({{"workers_left": len(worker_processes())}}))
"""


def results(outputs: list[Any]) -> list[Any]:
    """Every ``RESULT`` line's value in a cell's stdout, in order."""
    text = stream_text(outputs)
    return [json.loads(line.split(MARK, 1)[1]) for line in text.splitlines() if MARK in line]


def no_error(outputs: list[Any]) -> None:
    error = error_of(outputs)
    assert error is None, "\n".join(error["traceback"])


def only_result(outputs: list[Any]) -> Any:
    no_error(outputs)
    found = results(outputs)
    assert len(found) == 1, (stream_text(outputs), stream_text(outputs, "stderr"))
    return found[0]


# ── Lightning: Trainer and Fabric ────────────────────────────────────────────────────────────
LIGHTNING_CELLS = {
    "imports": FIRST_CELL,
    "define": """
import psutil

class LitRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.step_pids = set()
        self.step_children = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        # Where the step runs, and whether this process started any: with a fork or spawn
        # strategy the steps would run in children of the rank.
        self.step_pids.add(os.getpid())
        self.step_children = max(self.step_children, len(psutil.Process().children(recursive=True)))
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def train(**strategy):
    torch.manual_seed(0)
    train_loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=8)
    model = LitRegressor()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **strategy)
    trainer.fit(model=model, train_dataloaders=train_loader)
    return {"world_size": trainer.world_size, "global_rank": trainer.global_rank,
            "strategy": type(trainer.strategy).__name__,
            "processes_started": len(getattr(trainer.strategy.launcher, "procs", [])),
            "pid": os.getpid(), "step_pids": sorted(model.step_pids), "step_children": model.step_children,
            "global_step": trainer.global_step,
            "weight": [round(w, 6) for w in model.layer.weight.detach().flatten().tolist()]}

def launch_train(**strategy):
    started = time.monotonic()
    values = accelnb.launch(train, num_processes=2, cpu=True, kwargs=strategy, quiet=True, timeout=60).values
    print("RESULT", json.dumps({"ranks": [values[0], values[1]], "seconds": time.monotonic() - started}))
""",
    "default_strategy": "launch_train()",
    "ddp": 'launch_train(strategy="ddp")',
    "ddp_notebook": """
started = time.monotonic()
try:
    launch_train(strategy="ddp_notebook")
except accelnb.LaunchInsideLaunchError as error:
    print("RESULT", json.dumps({"type": type(error).__name__, "message": str(error),
                                "seconds": time.monotonic() - started}))
""",
    "fabric": """
def fabric_train():
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    dataloader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)),
                                                     batch_size=8))
    x, y = next(iter(dataloader))
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
    return {"world_size": fabric.world_size, "global_rank": fabric.global_rank, "all_reduce": float(total),
            "strategy": type(fabric.strategy).__name__,
            "processes_started": len(getattr(fabric.strategy.launcher, "procs", [])),
            "children": len(psutil.Process().children(recursive=True)),
            "weight": [round(w, 6) for w in model.weight.detach().flatten().tolist()]}

values = accelnb.launch(fabric_train, num_processes=2, cpu=True, quiet=True, timeout=60).values
print("RESULT", json.dumps([values[0], values[1]]))
""",
    "nothing_left": NOTHING_LEFT,
}


@pytest.fixture(scope="module")
def lightning_kernel() -> dict[str, list[Any]]:
    pytest.importorskip("lightning")
    return run_named_cells(LIGHTNING_CELLS, timeout=120)


def test_the_kernel_is_what_lightning_calls_interactive(lightning_kernel: dict[str, list[Any]]) -> None:
    # Without this the Trainer tests would pass for the wrong reason (Lightning picking "ddp" by itself).
    assert only_result(lightning_kernel["imports"]) == {"kernel_interactive": True}
    assert only_result(lightning_kernel["nothing_left"]) == {"workers_left": 0}


def assert_trained_on_accelnbs_two_ranks(found: dict[str, Any]) -> None:
    first, second = found["ranks"]
    for rank, seen in enumerate((first, second)):
        assert (seen["world_size"], seen["global_rank"], seen["strategy"]) == (2, rank, "DDPStrategy"), seen
        # The steps ran in the rank itself, which started no process (Lightning's launcher neither).
        assert (seen["step_pids"], seen["step_children"], seen["processes_started"]) == ([seen["pid"]], 0, 0), seen
        assert seen["global_step"] == 2  # 32 samples, batches of 8, split between 2 ranks
    assert first["pid"] != second["pid"]
    assert first["weight"] == second["weight"]  # DDP averaged the two ranks' gradients: one model


def test_a_trainer_with_its_default_strategy_fits_on_accelnbs_ranks(lightning_kernel: dict[str, list[Any]]) -> None:
    found = only_result(lightning_kernel["default_strategy"])
    assert_trained_on_accelnbs_two_ranks(found)
    print(f"Trainer(devices=2) on 2 ranks: {found['seconds']:.1f} s")


def test_a_trainer_with_strategy_ddp_fits_on_accelnbs_ranks(lightning_kernel: dict[str, list[Any]]) -> None:
    found = only_result(lightning_kernel["ddp"])
    assert_trained_on_accelnbs_two_ranks(found)
    print(f"Trainer(strategy='ddp', devices=2) on 2 ranks: {found['seconds']:.1f} s")


def test_strategy_ddp_notebook_inside_a_launch_fails_at_once_saying_what_to_write(
        lightning_kernel: dict[str, list[Any]]) -> None:
    found = only_result(lightning_kernel["ddp_notebook"])
    message = found["message"]
    assert "LaunchInsideLaunchError" in found["type"]
    assert "a launch inside a launch" in message and "strategy='ddp_notebook'" in message, message
    assert "Use strategy='ddp'" in message and "accelnb's 2 ranks" in message, message
    assert found["seconds"] < 30, f"the refusal took {found['seconds']:.1f} s"  # not the launch's timeout
    print(f"strategy='ddp_notebook' refused in {found['seconds']:.2f} s")


def test_fabric_runs_on_accelnbs_ranks(lightning_kernel: dict[str, list[Any]]) -> None:
    first, second = only_result(lightning_kernel["fabric"])
    for rank, seen in enumerate((first, second)):
        assert (seen["world_size"], seen["global_rank"], seen["strategy"]) == (2, rank, "DDPStrategy"), seen
        assert seen["all_reduce"] == 3.0  # 1 + 2: the two ranks are one group
        assert (seen["children"], seen["processes_started"]) == (0, 0), seen
    assert first["weight"] == second["weight"]  # different batches, averaged gradients: one model


# ── Accelerate's notebook_launcher and the PyTorch tutorial's mp.spawn ──────────────────────
# The PyTorch DDP tutorial's code, defined in a cell of the notebook; %%distributed cells run it.
TUTORIAL = """
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'
    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))

def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10) * (rank + 1))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    print("RESULT", json.dumps({"demo_rank": rank, "pid": os.getpid(), "world_size": dist.get_world_size(),
                                "weight": [round(w, 6) for w in model.net2.weight.detach().flatten()[:5].tolist()]}))
    cleanup()

def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)
"""

LAUNCHER_CELLS = {
    "imports": FIRST_CELL,
    "accelerate": """
from accelerate import Accelerator, notebook_launcher
from accelerate.utils import set_seed

def training_function(seed, batch_size, seen):
    accelerator = Accelerator(cpu=True)
    set_seed(seed)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_dataloader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=batch_size)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    model.train()
    for inputs, targets in train_dataloader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
    # `seen` is the caller's list only if this runs in the caller's process.
    seen.append({"pid": os.getpid(), "num_processes": accelerator.num_processes,
                 "process_index": accelerator.process_index, "distributed_type": accelerator.distributed_type.value,
                 "weight": [round(w, 6) for w in accelerator.unwrap_model(model).weight.detach().flatten().tolist()]})

def launches_with_accelerate(num_processes):
    seen = []
    notebook_launcher(training_function, args=(42, 8, seen), num_processes=num_processes)
    return {"pid": os.getpid(), "seen": seen}

values = accelnb.launch(launches_with_accelerate, args=(2,), num_processes=2, cpu=True, quiet=True, timeout=60).values
print("RESULT", json.dumps([values[0], values[1]]))
""",
    "accelerate_3": """
started = time.monotonic()
try:
    accelnb.launch(launches_with_accelerate, args=(3,), num_processes=2, cpu=True, quiet=True, timeout=60)
except accelnb.LaunchInsideLaunchError as error:
    print("RESULT", json.dumps({"type": type(error).__name__, "message": str(error),
                                "seconds": time.monotonic() - started}))
""",
    "load_magic": "%load_ext accelnb",
    "tutorial_code": TUTORIAL,
    # The tutorial's `if __name__ == "__main__":` block, in a cell of 2 ranks.
    "tutorial": ("%%distributed --procs 2 --cpu --timeout 60 --output all\n"
                 "world_size = 2  # the tutorial: torch.cuda.device_count()\n"
                 "run_demo(demo_basic, world_size)\n"
                 'print("RESULT", json.dumps({"cell_rank": rank, "pid": os.getpid()}))\n'),
    "before_4": "started = time.monotonic()",
    # The tutorial as written for a machine with 4 GPUs.
    "tutorial_4": "%%distributed --procs 2 --cpu --timeout 60\nrun_demo(demo_basic, 4)\n",
    "after_4": 'print("RESULT", json.dumps({"seconds": time.monotonic() - started}))',
    "nothing_left": NOTHING_LEFT,
}


@pytest.fixture(scope="module")
def launcher_kernel() -> dict[str, list[Any]]:
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    return run_named_cells(LAUNCHER_CELLS, timeout=120)


def test_the_second_kernel_is_interactive_too_and_keeps_nothing(launcher_kernel: dict[str, list[Any]]) -> None:
    assert only_result(launcher_kernel["imports"]) == {"kernel_interactive": True}
    assert only_result(launcher_kernel["nothing_left"]) == {"workers_left": 0}


def test_accelerates_notebook_launcher_inside_a_launch_runs_in_place(launcher_kernel: dict[str, list[Any]]) -> None:
    first, second = only_result(launcher_kernel["accelerate"])
    for rank, ran in enumerate((first, second)):
        assert len(ran["seen"]) == 1, ran  # once per rank, in the rank: the caller's list has the entry
        seen = ran["seen"][0]
        assert (seen["pid"], seen["num_processes"], seen["process_index"]) == (ran["pid"], 2, rank), ran
        assert seen["distributed_type"] == "MULTI_CPU"
    assert first["pid"] != second["pid"]
    assert first["seen"][0]["weight"] == second["seen"][0]["weight"]  # Accelerate's DDP: one model


def test_notebook_launcher_for_another_number_of_processes_fails_at_once(
        launcher_kernel: dict[str, list[Any]]) -> None:
    found = only_result(launcher_kernel["accelerate_3"])
    message = found["message"]
    assert "LaunchInsideLaunchError" in found["type"]
    assert "a launch inside a launch" in message and "nproc_per_node=3" in message, message
    assert "notebook_launcher" in message, message
    # accelnb's numbers, though Accelerate set WORLD_SIZE=3 before calling elastic_launch.
    assert "of an accelnb launch of 2 ranks" in message and "ask for 2 processes" in message, message
    assert "3 ranks" not in message, message
    assert found["seconds"] < 30, f"the refusal took {found['seconds']:.1f} s"  # not the launch's timeout


def test_the_tutorials_mp_spawn_runs_in_place_in_a_distributed_cell(launcher_kernel: dict[str, list[Any]]) -> None:
    outputs = launcher_kernel["tutorial"]
    no_error(outputs)
    found = results(outputs)
    cells = {seen["cell_rank"]: seen["pid"] for seen in found if "cell_rank" in seen}
    demos = sorted((seen["demo_rank"], seen["pid"], seen["world_size"]) for seen in found if "demo_rank" in seen)
    assert sorted(cells) == [0, 1] and cells[0] != cells[1], stream_text(outputs)
    # demo_basic ran once per rank, in the rank itself (its pid), as process `rank` of 2.
    assert demos == [(0, cells[0], 2), (1, cells[1], 2)], stream_text(outputs)
    weights = [seen["weight"] for seen in found if "demo_rank" in seen]
    assert weights[0] == weights[1]  # DDP averaged the gradients of inputs scaled by rank + 1


def test_the_tutorials_mp_spawn_for_4_processes_on_2_ranks_fails_at_once(launcher_kernel: dict[str, list[Any]]) -> None:
    outputs = launcher_kernel["tutorial_4"]
    error = error_of(outputs)
    assert error is not None, outputs
    message = error["evalue"]
    assert "LaunchInsideLaunchError" in message, outputs
    assert "torch.multiprocessing.spawn()" in message and "nprocs=4" in message, message
    assert "accelnb launch of 2 ranks" in message and "This machine runs 2 ranks" in message, message
    seconds = only_result(launcher_kernel["after_4"])["seconds"]
    assert seconds < 30, f"the refusal took {seconds:.1f} s"  # not the launch's timeout


# A rank's RankFailed is also an instance of the rank's exception type (here a LaunchConfigError):
# the magic turned it into IPython's short UsageError on stderr until it let LaunchFailed through.
def test_a_refusal_in_a_ranks_cell_is_the_cells_error_not_a_usage_error(
        launcher_kernel: dict[str, list[Any]]) -> None:
    outputs = launcher_kernel["tutorial_4"]
    assert "UsageError" not in stream_text(outputs, "stderr")
    error = error_of(outputs)
    assert error is not None and "LaunchInsideLaunchError" in error["ename"] + error["evalue"], outputs


# ── what the patches rely on, in the versions installed ───────────────────────────────────────
def test_torch_and_lightning_still_have_what_the_ranks_replace() -> None:
    import torch.multiprocessing as mp
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The module: `import torch.multiprocessing.spawn as ...` gives torch.multiprocessing's
    # attribute of that name, the function.
    spawn_module = importlib.import_module("torch.multiprocessing.spawn")

    versions = {name: importlib.metadata.version(name) for name in ("torch", "lightning", "accelerate")}
    print(", ".join(f"{name} {version}" for name, version in versions.items()))
    # The torch loaded is the one installed (a CUDA build says +cu130 where its metadata may not).
    assert torch.__version__.split("+")[0] == versions["torch"].split("+")[0]
    # launches_inside.install() replaces both names in both modules, and binds the call's
    # arguments by these parameter names.
    for name in ("spawn", "start_processes"):
        function = getattr(spawn_module, name)
        assert getattr(mp, name) is function, f"torch.multiprocessing.{name} is not torch.multiprocessing.spawn's"
        parameters = inspect.signature(function).parameters
        for parameter in ("fn", "args", "nprocs", "join"):
            assert parameter in parameters, f"torch.multiprocessing.{name} has no {parameter!r} any more"
    # Accelerate calls elastic_launch(config=..., entrypoint=...)(*args); the replacement reads these fields.
    assert list(inspect.signature(elastic_launch).parameters)[:2] == ["config", "entrypoint"]
    fields = {field.name for field in dataclasses.fields(LaunchConfig)}
    assert {"nproc_per_node", "max_nodes", "min_nodes", "start_method"} <= fields, fields
    # The kernel's cell below reads Lightning's import-time answer by this name.
    import lightning.fabric.utilities.imports as imports

    assert isinstance(getattr(imports, "_IS_INTERACTIVE", None), bool), "lightning's _IS_INTERACTIVE"
