"""Code that makes its own process group runs unchanged (``worker/other_launchers/process_group.py``).

Real launches of 2 CPU ranks (gloo). The training code is written the way the PyTorch DDP
tutorial and pytorch/examples' ddp-tutorial-series write it: a ``setup()`` that sets
``MASTER_ADDR``/``MASTER_PORT`` and calls ``init_process_group(backend, rank=rank,
world_size=world_size)``, a DDP model, a step, ``destroy_process_group()``; and the torchrun
style, ``init_process_group(backend="gloo")`` with everything from the environment, the names
imported with ``from torch.distributed import ...``. Before this, every one of them failed at
once with "trying to initialize the default process group twice!".
"""

from __future__ import annotations

import inspect
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

import accelnb
from accelnb import RankFailed, Session, launch
from tests.conftest import error_of, run_notebook, stream_text

pytestmark = pytest.mark.usefixtures("no_leftovers")


# ── the tutorial's shape ──────────────────────────────────────────────────────────────────────
class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def setup(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"  # fixed, as in the tutorial: two launches at once would collide on it
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup() -> None:
    dist.destroy_process_group()


def demo_basic(rank: int, world_size: int) -> list[float]:
    setup(rank, world_size)
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10) * (rank + 1))
    loss_fn(outputs, torch.randn(20, 5)).backward()
    optimizer.step()
    weights = [round(float(w), 6) for w in model.net2.weight.flatten()[:3]]
    cleanup()
    return weights


def run_demo_basic() -> list[float]:
    return demo_basic(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


# This hung about 1 run in 6 (rank 1 in ~ProcessGroupGloo, joining a gloo thread that waited for
# the GIL: accelnb/worker/other_launchers/process_group.py's _keep_alive); 100 runs in a row pass now.
def test_the_tutorials_setup_and_cleanup_run_unchanged() -> None:
    # timeout=: a hang (seen once in a full run) fails in 2 minutes with every rank's stack.
    result = launch(run_demo_basic, num_processes=2, cpu=True, quiet=True, collect="all", timeout=120)
    # DDP averaged the gradients: both ranks hold the same weights after the step.
    assert result.values[0] == result.values[1]


# ── the torchrun script's shape ───────────────────────────────────────────────────────────────
def ddp_setup() -> None:
    init_process_group(backend="gloo")  # rank, world size, address: all from the environment


def torchrun_style_main(total: int) -> tuple[int, int, float]:
    ddp_setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + total)])
    dist.all_reduce(value)
    destroy_process_group()
    return rank, world, float(value.item())


def test_a_torchrun_scripts_init_and_destroy_run_unchanged() -> None:
    result = launch(torchrun_style_main, args=(10,), num_processes=2, cpu=True, quiet=True, collect="all", timeout=120)
    assert result.values == {0: (0, 2, 21.0), 1: (1, 2, 21.0)}


@pytest.fixture
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def joins_by_tcp_init_method(port: int) -> tuple[int, int, float]:
    # The init method older examples use: an explicit tcp:// address, rank and world size.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return rank, world, float(value.item())


def joins_with_its_own_store(port: int) -> tuple[int, int, float]:
    # The init method for code that manages its own rendezvous: a store handed in.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return rank, world, float(value.item())


@pytest.mark.parametrize("joins", [joins_by_tcp_init_method, joins_with_its_own_store])
def test_the_codes_own_init_method_gives_a_group_over_the_launched_ranks(joins: object, free_port: int) -> None:
    result = launch(joins, args=(free_port,), num_processes=2, cpu=True, quiet=True, collect="all", timeout=120)
    assert result.values == {0: (0, 2, 3.0), 1: (1, 2, 3.0)}


# ── what the code asks for is honoured ────────────────────────────────────────────────────────
def waits_in_a_barrier_the_other_rank_skips(seconds: float) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=seconds))
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never comes: the code's own timeout must end this


def test_the_codes_own_timeout_is_the_groups() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        launch(waits_in_a_barrier_the_other_rank_skips, args=(2.0,), num_processes=2, cpu=True, quiet=True)
    took = time.monotonic() - started
    assert failed.value.failures[0].rank == 0
    assert took < 60, f"the barrier waited {took:.0f} s: the code's timeout of 2 s was not the group's"


def asks_for_four_ranks() -> None:
    dist.init_process_group("gloo", rank=dist.get_rank() if dist.is_initialized() else 0, world_size=4)


def test_a_world_size_that_contradicts_the_launch_names_both_numbers() -> None:
    with pytest.raises(RankFailed) as failed:
        launch(asks_for_four_ranks, num_processes=2, cpu=True, quiet=True)
    message = str(failed.value)
    assert "init_process_group(world_size=4)" in message and "(2 ranks in all)" in message, message


def destroys_the_group() -> str:
    dist.destroy_process_group()
    return "destroyed"


def sums_ranks() -> float:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return float(value.item())


def test_a_session_has_a_group_again_after_the_code_destroyed_it() -> None:
    with Session.start(num_processes=2, cpu=True) as session:
        assert session.run(destroys_the_group, collect="all").values == {0: "destroyed", 1: "destroyed"}
        assert session.run(sums_ranks, collect="all").values == {0: 1.0, 1: 1.0}
        assert session.run(torchrun_style_main, (0,), collect="all").values == {0: (0, 2, 1.0), 1: (1, 2, 1.0)}
        assert session.run(sums_ranks).value == 1.0  # and again after the code's own group went


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_session_lets_the_groups_the_code_destroyed_go_between_calls() -> None:
    # Each tutorial call destroys a group that accelnb keeps alive until the call is over (see
    # _keep_alive); the next call lets it go. Kept for good, every call would add its gloo threads.
    with Session.start(num_processes=2, cpu=True) as session:
        threads = []
        for _ in range(4):
            session.run(run_demo_basic)
            threads.append(session.run(native_threads, collect="all").values)
    assert threads[3] == threads[1], threads


# ── from a notebook cell, the names imported in the kernel ──────────────────────────────────
CELL_IMPORTS = """
import torch, accelnb
import torch.distributed as dist
from torch.distributed import init_process_group, destroy_process_group
"""

CELL_TRAINS = """
def main():
    init_process_group(backend="gloo")
    value = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    destroy_process_group()
    return value.item()

print(sorted(accelnb.launch(main, num_processes=2, cpu=True, quiet=True, collect="all").values.items()))
"""


def test_a_cells_function_with_names_imported_in_the_kernel() -> None:
    outputs = run_notebook([CELL_IMPORTS, CELL_TRAINS])
    assert error_of(outputs[1]) is None, outputs[1]
    assert stream_text(outputs[1]).strip() == "[(0, 3.0), (1, 3.0)]"


# ── what this relies on in torch ─────────────────────────────────────────────────────────────
def test_torch_still_has_what_the_rank_replaces() -> None:
    print("torch", torch.__version__)
    assert dist.init_process_group is c10d.init_process_group  # one function, two names
    parameters = inspect.signature(c10d.init_process_group).parameters
    for name in ("backend", "init_method", "timeout", "world_size", "rank", "store", "pg_options", "device_id"):
        assert name in parameters, f"torch's init_process_group has no {name!r} any more"
    assert callable(dist.PrefixStore) and callable(dist.TCPStore) and callable(dist.destroy_process_group)
    assert accelnb.launch is not None


# ── Accelerate's timeout reaches accelnb's group ─────────────────────────────
def accelerator_with_timeout_then_rank_1_waits_alone(seconds: float) -> None:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # Accelerate's documented way to set the group's timeout (it makes the group only where none exists).
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=seconds))])
    if accelerator.process_index == 1:
        dist.barrier()


def test_accelerates_timeout_is_the_groups() -> None:
    # The HF Trainer hands its ddp_timeout to Accelerate the same way (PartialState(timeout=...)),
    # on GPUs only: with use_cpu it passes none, under torchrun as here.
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        launch(accelerator_with_timeout_then_rank_1_waits_alone, args=(2.0,), num_processes=2, cpu=True, quiet=True,
               timeout=120)
    took = time.monotonic() - started
    assert failed.value.failures[0].rank == 1 and "Timed out" in str(failed.value)
    assert took < 60, f"the barrier waited {took:.0f} s: the timeout of 2 s did not reach accelnb's group"
