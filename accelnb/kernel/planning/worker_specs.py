"""From a plan to what the helper forks (or a cluster's actors set up): a ``WorkerSpec`` per rank.

The plan says where each rank runs; this adds what only the kernel knows at start time (its
working directory, ``sys.path``, the thread budget, the attempt) and has each rank's environment
built by :func:`~accelnb.kernel.planning.rank_environment.rank_environment`. It also formats the
start table the cell shows.

    >>> specs = worker_specs(plan(num_processes=2, inventory=Inventory()))   # doctest: +SKIP
    >>> threads_per_rank(2)          # on 8 cores without OMP_NUM_THREADS     # doctest: +SKIP
    4
"""

from __future__ import annotations

import os
import sys

from accelnb.errors import LaunchConfigError
from accelnb.kernel.planning import rank_plan
from accelnb.kernel.planning.rank_environment import kernel_omp_setting, rank_environment
from accelnb.wire.spec import WorkerSpec


def worker_specs(the_plan: rank_plan.LaunchPlan, persistent: bool = False, restart_count: int = 0, *,
                 threads: int | None = None, store_on_rank0: bool = True, on_this_machine: bool = True,
                 ) -> list[WorkerSpec]:
    """The per-rank specs to start ``the_plan``'s ranks from; ``restart_count``: which attempt of a
    launch with restarts they belong to. ``threads``: each rank's thread budget (default:
    :func:`threads_per_rank` of this machine). ``store_on_rank0``: rank 0 receives the rendezvous
    socket the kernel bound (only where it runs on this machine). ``on_this_machine``: the ranks
    take the kernel's environment as it is now (a cluster's ranks keep their node's)."""
    kernel_env = dict(os.environ) if on_this_machine else None
    threads = threads if threads is not None else threads_per_rank(len(the_plan.ranks))
    return [WorkerSpec(
        rank=rank.rank, local_rank=rank.local_rank, world_size=rank.world_size,
        device=rank.device, backend=the_plan.backend,
        env=rank_environment(the_plan.options, the_plan.place(rank, restart_count=restart_count, threads=threads)),
        master_addr=the_plan.master_addr, master_port=the_plan.master_port,
        # A cluster rank adds the entries that exist on its node.
        cwd=os.getcwd(), sys_path=[p for p in sys.path if p != ""] + [os.getcwd()],
        persistent=persistent,
        holds_store=store_on_rank0 and rank.rank == 0,
        threads_per_rank=threads,
        restart_count=restart_count,
        kernel_env=kernel_env,
    ) for rank in the_plan.ranks]


def threads_per_rank(rank_count: int) -> int:
    """Intra-op threads for each rank: the kernel's ``OMP_NUM_THREADS`` where set, else an even
    share of the cores. Raises :class:`LaunchConfigError` on a value OpenMP would not accept, so
    the launcher calls it before anything starts.

    OpenMP's value is a list, one count per nesting level ("4,2"); the first level is the
    number of threads a process runs, which is what torch's intra-op pool should use.
    """
    setting = kernel_omp_setting()
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

