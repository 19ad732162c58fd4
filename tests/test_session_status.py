"""Sessions: what ``%distributed status`` shows about the ranks, and how a session's workers end.

Every test here checks, by pid, that no worker outlives it (``no_leftovers``); the lifecycle
tests also assert it right where the workers must be gone, not only at the end.
"""

from __future__ import annotations

import gc
import os

import psutil
import pytest

from accelnb import LaunchConfigError, Session
from accelnb.kernel.planning.inventory import GpuInfo, GpuProcess, Inventory
from accelnb.session import gpu_memory_of
from tests.conftest import worker_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")

MIB = 2**20


def gpu(uuid: str, *processes: GpuProcess) -> GpuInfo:
    return GpuInfo(index=0, name="Test GPU", uuid=uuid, pci_bus_id="0000:01:00.0",
                   memory_total=81_559 * MIB, memory_used=0, processes=processes)


def test_gpu_memory_is_the_ranks_own_process_as_nvml_lists_it() -> None:
    inventory = Inventory(gpus=(gpu("GPU-a", GpuProcess(11, 512 * MIB), GpuProcess(12, 7 * MIB)),
                                gpu("GPU-b", GpuProcess(13, None))))
    assert gpu_memory_of(11, "GPU-a", inventory) == "512 MiB of 81,559 MiB"
    assert gpu_memory_of(13, "GPU-b", inventory) == "in use, amount not reported by the driver, of 81,559 MiB"
    assert gpu_memory_of(99, "GPU-a", inventory) == "none listed for this pid of 81,559 MiB"
    assert gpu_memory_of(11, "GPU-gone", inventory) == "unknown (GPU not found by NVML)"


def test_a_cpu_session_lists_ranks_pids_and_host_memory() -> None:
    session = Session.start(num_processes=2, cpu=True, quiet=True)
    try:
        pids = session.run(os.getpid).values
        lines = session.status().splitlines()
    finally:
        session.stop()
    assert lines[0] == "accelnb session: 2 rank(s), backend gloo, running"
    for rank in (0, 1):
        assert lines[1 + rank].startswith(f"  rank {rank} → cpu  pid {pids[rank]}  memory ")
        assert lines[1 + rank].endswith(" MiB") and "GPU memory" not in lines[1 + rank]
    ended = session.status().splitlines()
    assert ended[0] == "accelnb session: 2 rank(s), backend gloo, ended"
    assert all(line.endswith("memory gone") for line in ended[1:])
    assert worker_processes() == []


def ten_ddp_steps() -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()


def test_status_shows_each_ranks_progress_in_the_last_call() -> None:
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        session.run(ten_ddp_steps)
        lines = session.status().splitlines()
    assert lines[3] == "progress in the last call:", lines
    for rank in (0, 1):
        assert lines[4 + rank].startswith(f"  rank {rank}: step 10 · "), lines
        assert " steps/s · waiting " in lines[4 + rank] and " · host " in lines[4 + rank], lines


def _gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids)


def test_leaving_the_with_block_stops_every_worker() -> None:
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        pids = list(session.run(os.getpid).values.values())
        assert sorted(p.pid for p in worker_processes()) == sorted(pids)
    assert not session.alive
    assert worker_processes() == [] and _gone(pids)
    session.stop()  # stopping again is harmless


def test_an_exception_in_the_with_block_still_stops_the_workers() -> None:
    with pytest.raises(KeyError), Session.start(num_processes=2, cpu=True, quiet=True) as session:
        assert len(worker_processes()) == 2
        raise KeyError("the user's own bug")
    assert not session.alive and worker_processes() == []


def test_a_dropped_session_stops_its_workers() -> None:
    session = Session.start(num_processes=2, cpu=True, quiet=True)
    pids = list(session.run(os.getpid).values.values())
    del session  # reassigning the notebook variable, or `del`, drops the last reference
    gc.collect()
    assert worker_processes() == [] and _gone(pids)


def test_a_stopped_session_refuses_calls_with_a_way_forward() -> None:
    session = Session.start(num_processes=2, cpu=True, quiet=True)
    session.stop()
    with pytest.raises(LaunchConfigError, match=r"This session has ended. Start a new one with Session.start\(\)"):
        session.run(os.getpid)
