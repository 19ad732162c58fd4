"""A launch's group, joined ahead by the template's waiting children (``wire/group_ahead.py``,
``worker/template/standby_ranks.py``): a launch like the last one gets ranks that joined its group
while they waited; any other launch gets ranks that join at launch, as before.

Real templates, real launches, real gloo groups. Whether a rank's group was joined ahead is its
own answer (``process_group.joined_ahead()``); the waiting children are found by their name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psutil
import pytest

import accelnb
from accelnb.errors import RankFailed
from accelnb.kernel.helper.template import shared_helper, shutdown_helper
from accelnb.wire.group_ahead import group_ahead
from accelnb.wire.spec import WorkerSpec
from tests.conftest import error_of, run_notebook, stream_text
from tests.test_standby_ranks import waiting_children

pytestmark = pytest.mark.usefixtures("no_leftovers")


def facts(key: str) -> dict[str, Any]:
    """What a rank knows of its group, and whether MASTER_PORT is the store the group was made on."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from accelnb.worker.other_launchers import process_group

    total = torch.ones(1)
    dist.all_reduce(total)
    # Code that talks to the launch's store itself finds it at MASTER_ADDR:MASTER_PORT.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    store.set(f"{key}/{dist.get_rank()}", str(os.getpid()))
    peer = store.get(f"{key}/{1 - dist.get_rank()}").decode()
    return {"pid": os.getpid(), "ahead": process_group.joined_ahead(), "sum": int(total.item()),
            "port": int(os.environ["MASTER_PORT"]), "peer": int(peer), "rank": dist.get_rank(),
            "log_level": os.environ.get("TORCH_CPP_LOG_LEVEL")}


def launch(key: str = "k", **options: Any) -> dict[int, dict[str, Any]]:
    options.setdefault("num_processes", 2)
    result = accelnb.launch(facts, (key,), cpu=True, quiet=True, collect="all", timeout=120, **options)
    values: dict[int, dict[str, Any]] = result.values
    assert all(seen["sum"] == len(values) and seen["rank"] == rank for rank, seen in values.items())
    return values


def ahead(values: dict[int, dict[str, Any]]) -> bool:
    seen = {v["ahead"] for v in values.values()}
    assert len(seen) == 1, f"some ranks joined ahead, some not: {values}"
    return seen.pop()


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listening() -> set[int]:
    """The ports this process (the kernel) listens on."""
    return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


@pytest.fixture
def kernel_env() -> Iterator[dict[str, str]]:
    """The kernel's environment, put back afterwards."""
    before = dict(os.environ)
    yield os.environ  # type: ignore[misc]
    os.environ.clear()
    os.environ.update(before)


def test_a_launch_like_the_last_gets_the_children_that_joined_its_group_while_they_waited() -> None:
    shutdown_helper()  # a fresh template
    first = launch("first")
    assert not ahead(first)  # nothing was joined for the first launch of a template
    members = {p.pid for p in waiting_children(2)}
    bound = listening()  # the kernel holds the socket the members' store listens on: the next MASTER_PORT
    found = launch("second")
    assert ahead(found)
    assert {v["pid"] for v in found.values()} == members
    assert found[0]["peer"] == found[1]["pid"] and found[1]["peer"] == found[0]["pid"]  # one store, at MASTER_PORT
    assert found[0]["port"] in bound
    assert found[0]["port"] != first[0]["port"]
    waiting_children(2)  # and two more wait, for the launch after


def tutorial_style(rank: int, world_size: int) -> list[float]:
    """The PyTorch DDP tutorial's shape: the code makes its own group, then its own again with its own
    timeout (a group accelnb remakes on the launch's store), and tears it down."""
    import torch
    import torch.distributed as dist

    from accelnb.worker.other_launchers import process_group

    os.environ["MASTER_PORT"] = "12355"  # the tutorial's fixed port: not where accelnb's ranks meet
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    first = torch.tensor([float(rank + 1)])
    dist.all_reduce(first)
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=77))
    second = torch.tensor([float(rank + 10)])
    dist.all_reduce(second)
    dist.destroy_process_group()
    return [first.item(), second.item(), float(process_group.joined_ahead())]


def test_code_that_makes_its_own_groups_works_in_ranks_that_joined_ahead() -> None:
    shared_helper()
    launch()
    waiting_children(2)
    result = accelnb.launch(lambda: tutorial_style(int(os.environ["RANK"]), 2), num_processes=2, cpu=True,
                            quiet=True, collect="all", timeout=120)
    assert result.values == {0: [3.0, 21.0, 1.0], 1: [3.0, 21.0, 1.0]}


def joined() -> bool:
    from accelnb.worker.other_launchers import process_group

    return process_group.joined_ahead()


@pytest.fixture
def members() -> set[int]:
    """The pids of the two children waiting, after a launch like :func:`launch`'s: its group's members."""
    shared_helper()
    launch()
    return {p.pid for p in waiting_children(2)}


def test_a_launch_of_another_size_lets_the_members_go_and_its_ranks_join_at_launch(members: set[int]) -> None:
    result = accelnb.launch(joined, num_processes=3, cpu=True, quiet=True, collect="all", timeout=120)
    assert result.values == {0: False, 1: False, 2: False}
    assert all(gone(pid) for pid in members)


def test_a_changed_torch_variable_lets_the_members_go_and_the_next_members_join_with_it(
        members: set[int], kernel_env: dict[str, str]) -> None:
    kernel_env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # read by torch.distributed while a rank joins
    found = launch()
    assert not ahead(found)
    assert not {v["pid"] for v in found.values()} & members
    assert all(gone(pid) for pid in members)
    waiting_children(2)  # alike again: the new members joined with the variable the ranks have
    found = launch()
    assert ahead(found) and found[0]["log_level"] == "ERROR"


def test_a_launch_on_a_port_of_the_users_lets_the_members_go_and_makes_no_bet(members: set[int]) -> None:
    found = launch(master_port=free_port())
    assert not ahead(found)
    assert not {v["pid"] for v in found.values()} & members
    assert all(gone(pid) for pid in members)
    # The next such launch most likely chooses a port again: the children that wait join at launch.
    waiting_children(2)
    assert not ahead(launch(master_port=free_port()))


def barrier_alone(seconds_apart: float) -> None:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(seconds_apart)  # rank 1 never comes to the barrier in time
    else:
        dist.barrier()


def test_a_group_timeout_is_the_timeout_of_a_group_joined_ahead() -> None:
    shared_helper()
    accelnb.launch(lambda: None, num_processes=2, cpu=True, quiet=True, group_timeout=3, timeout=120)
    waiting_children(2)
    started = time.monotonic()
    with pytest.raises(RankFailed):
        accelnb.launch(barrier_alone, (90,), num_processes=2, cpu=True, quiet=True, group_timeout=3, timeout=120)
    took = time.monotonic() - started
    assert took < 60, f"the barrier waited {took:.0f} s: group_timeout=3 was not the group's"


def test_a_member_that_dies_lets_its_peers_go_and_the_launch_forks_its_ranks() -> None:
    shared_helper()
    launch()
    victim, survivor = waiting_children(2)
    os.kill(victim.pid, signal.SIGKILL)  # the OOM killer's choice
    victim.wait(10)
    found = launch()
    assert not ahead(found)
    assert not {v["pid"] for v in found.values()} & {victim.pid, survivor.pid}
    assert gone(survivor.pid)  # it waited for a peer that would never come
    waiting_children(2)
    assert ahead(launch())  # the launch after joins ahead again


def test_launches_back_to_back_each_get_a_working_group() -> None:
    shared_helper()
    for index in range(12):
        launch(f"launch-{index}")  # whether joined ahead or at launch, each group works


def test_the_socket_for_the_next_group_is_closed_with_the_template() -> None:
    shutdown_helper()  # an earlier test's template holds the socket for its next group
    before = listening()
    launch()
    waiting = waiting_children(2)
    assert len(listening() - before) == 1
    shutdown_helper()
    assert listening() == before
    _gone, alive = psutil.wait_procs(waiting, timeout=10)
    assert alive == []


def spec(rank: int, world_size: int = 2, **changes: Any) -> WorkerSpec:
    fields: dict[str, Any] = dict(rank=rank, local_rank=rank, world_size=world_size, device="cpu", backend="gloo",
                                  env={"GLOO_SOCKET_IFNAME": "lo", "RANK": str(rank)}, master_addr="127.0.0.1",
                                  master_port=0, cwd="/", sys_path=[], holds_store=rank == 0,
                                  kernel_env={"PATH": "/bin", "TORCH_HOME": "/t"})
    fields.update(changes)
    return WorkerSpec(**fields)


def test_what_makes_two_launches_groups_alike() -> None:
    alike = group_ahead([spec(0), spec(1)])
    assert alike is not None and alike.world_size == 2
    assert alike.join_env == (("GLOO_SOCKET_IFNAME", "lo"), ("TORCH_HOME", "/t"))
    assert group_ahead([spec(0, master_port=1234), spec(1, master_port=1234)]) == alike  # the port is not the group
    unlike = {
        "a GPU rank": [spec(0), spec(1, device="cuda:0")],
        "NCCL": [spec(0, backend="nccl"), spec(1, backend="nccl")],
        "another node": [spec(0), spec(1, master_addr="10.0.0.2")],
        "a node's ranks": [spec(0, kernel_env=None), spec(1, kernel_env=None)],
        "ranks that differ in a join variable": [spec(0), spec(1, env={"GLOO_SOCKET_IFNAME": "eth0"})],
        "ranks out of order": [spec(1), spec(0)],
        "no rank holding the store": [spec(0, holds_store=False), spec(1)],
    }
    for why, specs in unlike.items():
        assert group_ahead(specs) is None, why
    assert group_ahead([spec(0, world_size=3), spec(1, world_size=3), spec(2, world_size=3)]) != alike
    timeout = [spec(r, env={"ACCELNB_GROUP_TIMEOUT_S": "3.0"}) for r in (0, 1)]
    assert group_ahead(timeout) not in (None, alike)


# ── in a notebook, with code nobody here wrote the launcher for ─────────────────────────────────
NOTEBOOK_FIRST_CELL = """
import json, os, time
import psutil, torch, transformers
from tqdm.auto import tqdm
import accelnb
from accelnb.kernel.helper.template import running_helper_pid
from tests.ddp_series_style import train as ddp_series_train

def is_waiting_child(process):
    try:
        return process.name() == "accelnb-standby"
    except psutil.Error:  # a departed rank, reaped between the listing and the look
        return False

def joined_children():
    # The template's waiting children, once both are forked (a launch takes them only then).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = [p for p in psutil.Process(running_helper_pid()).children() if is_waiting_child(p)]
        if len(found) == 2:
            return sorted(p.pid for p in found)
        time.sleep(0.02)
    raise AssertionError("no two waiting children")

def with_accelerate(steps):
    # Accelerate's examples' shape: Accelerator(), prepare, a few steps, gather.
    import torch
    from accelerate import Accelerator
    from accelnb.worker.other_launchers import process_group
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(steps):
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(torch.ones(8, 4)), torch.zeros(8, 1)))
        optimizer.step()
    weights = accelerator.gather(accelerator.unwrap_model(model).weight.detach().reshape(1, -1))
    accelerator.wait_for_everyone()
    return [bool(torch.equal(weights[0], weights[1])), process_group.joined_ahead(), os.getpid()]
"""
NOTEBOOK_CELLS = {
    "DDP series, first": "print(json.dumps(accelnb.notebook_launcher(ddp_series_train, (2,), num_processes=2, "
                         "cpu=True)))",
    "DDP series, joined ahead": "waiting = joined_children()\n"
                                "def ddp_series_and_how(epochs):\n"
                                "    from accelnb.worker.other_launchers import process_group\n"
                                "    return [ddp_series_train(epochs), process_group.joined_ahead()]\n"
                                "print(json.dumps(accelnb.notebook_launcher(ddp_series_and_how, (2,), "
                                "num_processes=2, cpu=True)))",
    "Accelerate, joined ahead": "waiting = joined_children()\n"
                                "found = accelnb.launch(with_accelerate, (3,), num_processes=2, cpu=True, "
                                "collect='all').values\n"
                                "print(json.dumps([found[0][:2], found[1][:2], sorted(v[2] for v in found.values()) "
                                "== waiting]))",
    "Accelerate, three ranks": "found = accelnb.launch(with_accelerate, (3,), num_processes=3, cpu=True, "
                               "collect='all').values\n"
                               "print(json.dumps([v[:2] for v in found.values()]))",
}


def test_in_a_notebook_pytorch_examples_and_accelerate_run_in_ranks_that_joined_ahead() -> None:
    outputs = run_notebook([NOTEBOOK_FIRST_CELL, *NOTEBOOK_CELLS.values()], timeout=300,
                           env={"ACCELNB_TEMPLATE": "on"})
    named = dict(zip(["first", *NOTEBOOK_CELLS], outputs, strict=True))
    for name, cell in named.items():
        shown = stream_text(cell) + stream_text(cell, "stderr")
        assert error_of(cell) is None, (name, error_of(cell), shown)
        assert "from fork" not in shown and "<IPython.core.display" not in shown, (name, shown)
    last = {name: json.loads(stream_text(cell).strip().splitlines()[-1]) for name, cell in named.items()
            if name != "first"}
    assert last["DDP series, first"] is True  # every rank ended with the same weights
    assert last["DDP series, joined ahead"] == [True, True]  # its own init_process_group adopted that group
    assert last["Accelerate, joined ahead"] == [[True, True], [True, True], True]  # the waiting children's pids
    assert last["Accelerate, three ranks"] == [[True, False]] * 3  # another group: joined at launch
