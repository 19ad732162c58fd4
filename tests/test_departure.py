"""A one-shot launch ends when its ranks have answered and left nothing behind, not when the OS has
finished freeing their processes (about 20 ms for a torch-sized one, nearly half a short launch).

A rank that leaves nothing (no process it started is left, no CUDA context, the store's port no
longer listening) says ``Departing`` and closes its channels; the kernel counts it gone at end of
file, and the helper reaps it afterwards. Each test checks what must hold the moment the launch
returns, by pid and by ``/proc/net/tcp``, before anything waits for the helper, and then that the
helper reaped the departed ranks with exit code 0. A rank that leaves a process, and a session's
ranks, and (on a GPU machine) a rank that used CUDA, are waited for as before.

Real launches: 2 CPU ranks, gloo, accelnb's helper process and its workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import psutil
import pytest

import accelnb
from accelnb.kernel.helper.payload import pack_call
from accelnb.kernel.helper.template import take_departed_crashes, wait_for_departed_ranks
from accelnb.kernel.planning import rank_plan
from accelnb.kernel.planning.inventory import Inventory, read_inventory
from accelnb.kernel.run.call_settings import CallSettings
from accelnb.kernel.run.engine import run_on_group, start_workers
from accelnb.kernel.run.supervisor import WorkerGroup
from tests.gpu.gpukit import needs_gpus

pytestmark = pytest.mark.usefixtures("no_leftovers")

LAST_WORDS_LINES = 20_000  # ~0.5 MB printed just before returning: more than a pipe holds


def cpu_plan() -> rank_plan.LaunchPlan:
    return rank_plan.plan(None, 2, inventory=Inventory(source="none"), cpu=True)


def pid_after_all_reduce() -> int:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return os.getpid()


def rank_one_leaves_a_sleeper() -> tuple[int, int | None]:
    import torch.distributed as dist

    if dist.get_rank() != 1:
        return os.getpid(), None
    # Detached as logging services detach: its own session, never waited for.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    return os.getpid(), sleeper.pid


def last_words() -> int:
    import torch.distributed as dist

    for line in range(LAST_WORDS_LINES):
        print(f"rank {dist.get_rank()} line {line}")
    return os.getpid()


def listening_ports() -> set[int]:
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return {int(row[1].split(":")[1], 16) for row in rows if row[3] == "0A"}


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_one_shot(function: Callable[..., object], output: str = "none") -> tuple[WorkerGroup, accelnb.LaunchResult]:
    group = start_workers(cpu_plan(), None, persistent=False, quiet=True)
    result = run_on_group(group, pack_call(function, (), {}), CallSettings(timeout=120, output=output))
    return group, result


def test_ranks_that_leave_nothing_depart_and_the_helper_reaps_them_after() -> None:
    group, result = run_one_shot(pid_after_all_reduce)
    port = result.plan.master_port
    assert group.closed
    assert [worker.departed for worker in group.workers] == [True, True]
    assert port not in listening_ports()  # rank 0 stopped listening before it said so
    assert wait_for_departed_ranks()
    assert not any(running(pid) for pid in result.values.values())
    assert take_departed_crashes() == {}


def test_the_port_of_a_launch_is_free_for_the_next_one_at_once() -> None:
    first = accelnb.launch(pid_after_all_reduce, num_processes=2, cpu=True, quiet=True)
    again = accelnb.launch(pid_after_all_reduce, num_processes=2, cpu=True, quiet=True,
                           master_port=first.plan.master_port)
    assert len(again.values) == 2 and first.plan.master_port not in listening_ports()


def test_what_a_rank_printed_last_is_all_in_the_result() -> None:
    """The kernel counts a departing rank gone only at end of file on its pipes: nothing it wrote is lost."""
    group, result = run_one_shot(last_words, output="all")
    assert [worker.departed for worker in group.workers] == [True, True]
    for rank in (0, 1):
        lines = result.outputs[rank].splitlines()
        assert len(lines) == LAST_WORDS_LINES and lines[-1] == f"rank {rank} line {LAST_WORDS_LINES - 1}"


def test_a_rank_that_leaves_a_process_is_waited_for_and_the_process_ended() -> None:
    group, result = run_one_shot(rank_one_leaves_a_sleeper)
    (_, none), (rank_one, sleeper) = result.values[0], result.values[1]
    assert none is None and sleeper is not None
    assert [worker.departed for worker in group.workers] == [True, False]
    # Both at once, before anything waits for the helper: the launch waited for rank 1's reap,
    # which comes after the helper ended what it left.
    assert not running(rank_one) and not running(sleeper)


def test_a_sessions_ranks_are_waited_for() -> None:
    group = start_workers(cpu_plan(), None, persistent=True, quiet=True)
    try:
        pids = run_on_group(group, pack_call(pid_after_all_reduce, (), {}), CallSettings(timeout=120)).values
    finally:
        group.shutdown()
    assert [worker.departed for worker in group.workers] == [False, False]
    assert not any(running(pid) for pid in pids.values())


def pid_of_a_cuda_rank() -> int:
    import torch

    torch.ones(1, device="cuda").sum().item()
    return os.getpid()


@pytest.mark.gpu
@needs_gpus(1)
def test_a_rank_that_used_cuda_is_waited_for() -> None:
    """Its device memory is freed only when its process is gone, and the cell must not end before."""
    the_plan = rank_plan.plan([0], inventory=read_inventory())
    group = start_workers(the_plan, None, persistent=False, quiet=True)
    result = run_on_group(group, pack_call(pid_of_a_cuda_rank, (), {}), CallSettings(timeout=120))
    assert [worker.departed for worker in group.workers] == [False]
    assert not running(result.values[0])
