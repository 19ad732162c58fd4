"""From a plan to what the helper forks: one :class:`~accelnb.wire.spec.WorkerSpec` per rank.

The plan says where each rank runs; this adds what only the kernel knows at launch time (its
working directory, ``sys.path``, thread budget, loopback interfaces for gloo and NCCL), and
formats the start table the cell shows.

    >>> specs = worker_specs(plan(num_processes=2, inventory=Inventory()))   # doctest: +SKIP
    >>> threads_per_rank(2)          # on 8 cores without OMP_NUM_THREADS     # doctest: +SKIP
    4
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from accelnb.errors import LaunchConfigError
from accelnb.kernel.planning import rank_plan
from accelnb.wire.spec import WorkerSpec


def worker_specs(the_plan: rank_plan.LaunchPlan, persistent: bool = False,
                 restart_count: int = 0) -> list[WorkerSpec]:
    """The per-rank specs the helper forks workers from; ``restart_count``: which attempt of a
    launch with restarts they belong to."""
    threads = threads_per_rank(len(the_plan.ranks))
    specs = []
    for rank in the_plan.ranks:
        env = dict(rank.env)
        # Every plan is one machine rendezvousing on loopback: keep gloo's and NCCL's own
        # sockets there too (they otherwise bind the address the hostname resolves to).
        env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        env.setdefault("NCCL_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", "lo"))
        # The kernel's own setting ("4,2" included) reaches the ranks as written.
        env.setdefault("OMP_NUM_THREADS", _kernel_omp_setting() or str(threads))
        # What torchelastic sets (torchrun --max-restarts), so code written for it finds its attempt.
        env["TORCHELASTIC_RESTART_COUNT"] = str(restart_count)
        specs.append(WorkerSpec(
            rank=rank.rank, local_rank=rank.local_rank, world_size=rank.world_size,
            device=rank.device, backend=the_plan.backend, env=env,
            master_addr=the_plan.master_addr, master_port=the_plan.master_port,
            cwd=os.getcwd(), sys_path=[p for p in sys.path if p != ""] + [os.getcwd()],
            persistent=persistent,
            holds_store=rank.rank == 0,
            threads_per_rank=threads,
            restart_count=restart_count,
        ))
    return specs


def threads_per_rank(rank_count: int) -> int:
    """Intra-op threads for each rank: the kernel's ``OMP_NUM_THREADS`` where set, else an even
    share of the cores. Raises :class:`LaunchConfigError` on a value OpenMP would not accept, so
    the launcher calls it before anything starts.

    OpenMP's value is a list, one count per nesting level ("4,2"); the first level is the
    number of threads a process runs, which is what torch's intra-op pool should use.
    """
    setting = _kernel_omp_setting()
    if setting is None:
        return max(1, (os.cpu_count() or 1) // rank_count)
    first_level = setting.split(",")[0].strip()
    if not first_level.isdigit() or int(first_level) < 1:
        raise LaunchConfigError(
            f"OMP_NUM_THREADS={setting!r} in the kernel's environment is not a thread count. OpenMP "
            "takes a positive integer (\"4\") or one per nesting level (\"4,2\"). Set it to one of "
            "those, or remove it (del os.environ['OMP_NUM_THREADS']) to give each rank an even "
            "share of the cores.")
    return int(first_level)


def _kernel_omp_setting() -> str | None:
    setting = os.environ.get("OMP_NUM_THREADS", "").strip()
    return setting or None  # set but empty: OpenMP ignores it, and so do we


def describe_start(the_plan: rank_plan.LaunchPlan, pids: Sequence[int]) -> str:
    if len(pids) != len(the_plan.ranks):
        raise ValueError(f"{len(pids)} pid(s) for {len(the_plan.ranks)} rank(s)")
    return the_plan.table(pids)
