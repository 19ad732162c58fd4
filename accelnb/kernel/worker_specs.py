"""From a plan to what the helper forks: one :class:`~accelnb.wire.spec.WorkerSpec` per rank.

The plan says where each rank runs; this adds what only the kernel knows at launch time (its
working directory, ``sys.path``, thread budget, loopback interfaces for gloo and NCCL), and
formats the start table the cell shows.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from accelnb.kernel import planning
from accelnb.wire.spec import WorkerSpec


def worker_specs(the_plan: planning.LaunchPlan, persistent: bool = False) -> list[WorkerSpec]:
    """The per-rank specs the helper forks workers from."""
    cpus = os.cpu_count() or 1
    threads = max(1, cpus // len(the_plan.ranks))
    specs = []
    for rank in the_plan.ranks:
        env = dict(rank.env)
        if the_plan.master_addr == "127.0.0.1":
            # Keep gloo's and NCCL's own sockets on loopback too (they otherwise bind the
            # address the hostname resolves to).
            env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            env.setdefault("NCCL_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", "lo"))
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(threads)
        specs.append(WorkerSpec(
            rank=rank.rank, local_rank=rank.local_rank, world_size=rank.world_size,
            device=rank.device, backend=the_plan.backend, env=env,
            master_addr=the_plan.master_addr, master_port=the_plan.master_port,
            cwd=os.getcwd(), sys_path=[p for p in sys.path if p != ""] + [os.getcwd()],
            persistent=persistent,
            holds_store=rank.rank == 0,
            threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", threads)),
        ))
    return specs


def describe_start(the_plan: planning.LaunchPlan, pids: Sequence[int]) -> str:
    lines = the_plan.table().splitlines()
    return "\n".join([lines[0]] + [f"{line}  (pid {pid})" for line, pid in zip(lines[1:], pids, strict=True)])
