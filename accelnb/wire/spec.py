"""What the kernel tells the helper about each worker it should fork: one :class:`WorkerSpec` per rank.

Built on the kernel side from the plan (``accelnb.kernel.planning.worker_specs``), read on the worker side
(``accelnb.worker.main``); the file descriptors travel beside it with ``SCM_RIGHTS``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSpec:
    """Everything the helper hands one worker besides its file descriptors."""

    rank: int
    local_rank: int
    world_size: int
    device: str  # "cuda:N" or "cpu"
    backend: str
    env: dict[str, str]
    master_addr: str
    master_port: int
    cwd: str
    sys_path: list[str]
    persistent: bool = False
    threads_per_rank: int = 1
    holds_store: bool = False  # receives the bound rendezvous socket (rank 0 of a single node)
    restart_count: int = 0  # which attempt of a launch with restarts (accelnb.restart_count())
    # The kernel's environment when the launch started, which a rank on this machine takes as its
    # own before ``env`` (as torchrun's ranks get the shell's): a variable a cell set or deleted
    # after the helper started is seen by the ranks. None on a cluster's node, which keeps its own.
    kernel_env: dict[str, str] | None = None
