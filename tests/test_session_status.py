"""``%distributed status``: what a session shows about its ranks, GPU memory included."""

from __future__ import annotations

import os

from accelnb.kernel.inventory import GpuInfo, GpuProcess, Inventory
from accelnb.session import Session, _gpu_memory_of

MIB = 2**20


def gpu(uuid: str, *processes: GpuProcess) -> GpuInfo:
    return GpuInfo(index=0, name="Test GPU", uuid=uuid, pci_bus_id="0000:01:00.0",
                   memory_total=81_559 * MIB, memory_used=0, processes=processes)


def test_gpu_memory_is_the_ranks_own_process_as_nvml_lists_it() -> None:
    inventory = Inventory(gpus=(gpu("GPU-a", GpuProcess(11, 512 * MIB), GpuProcess(12, 7 * MIB)),
                                gpu("GPU-b", GpuProcess(13, None))))
    assert _gpu_memory_of(11, "GPU-a", inventory) == "512 MiB of 81,559 MiB"
    assert _gpu_memory_of(13, "GPU-b", inventory) == "in use, amount not reported by the driver, of 81,559 MiB"
    assert _gpu_memory_of(99, "GPU-a", inventory) == "none listed for this pid of 81,559 MiB"
    assert _gpu_memory_of(11, "GPU-gone", inventory) == "unknown (GPU not found by NVML)"


def test_a_cpu_session_lists_ranks_pids_and_host_memory() -> None:
    session = Session.start(num_processes=2, quiet=True)
    try:
        pids = session.run(os.getpid).values
        lines = session.status().splitlines()
    finally:
        session.stop()
    assert lines[0] == "accelnb session: 2 rank(s), backend gloo, running"
    for rank in (0, 1):
        assert lines[1 + rank].startswith(f"  rank {rank} → cpu  pid {pids[rank]}  memory ")
        assert lines[1 + rank].endswith(" MiB") and "GPU memory" not in lines[1 + rank]
    assert session.status().splitlines()[0] == "accelnb session: 2 rank(s), backend gloo, ended"
