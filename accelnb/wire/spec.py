"""What the kernel hands the helper for each worker it should fork: a :class:`WorkerSpec` and its
:class:`RankFds`.

The spec is built on the kernel side from the plan (``accelnb.kernel.planning.worker_specs``) and
read on the worker side (``accelnb.worker.main``). The fds are opened by the kernel
(``kernel/run/group/channel_pump.py``) and travel beside the specs with ``SCM_RIGHTS``, which
carries a flat list: :meth:`RankFds.flat` and :func:`split_fds` are the only code that knows the
order, so every other place names the fd it means.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"  # the rendezvous address of ranks on the kernel's machine
# Where a rank reads the timeout of the group accelnb makes for it (``group_timeout=``): set by the
# planner (``kernel/planning/rank_environment.py``), read by ``worker/other_launchers/process_group.py``.
GROUP_TIMEOUT_ENV = "ACCELNB_GROUP_TIMEOUT_S"


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


@dataclass(frozen=True)
class RankFds:
    """The fds one rank is handed: its output pipes, its three sockets to the kernel, and for the
    rank that holds it (``WorkerSpec.holds_store``) the rendezvous store's bound listening socket.

    The kernel's messages to the rank come on two sockets, by who reads them: the calls on
    ``inbox``, which the rank's main thread reads itself between calls (a call wakes one thread,
    not a reader thread that then wakes the main one), and what comes while a call runs on
    ``control``, which a thread of the rank reads while the main thread runs the code."""

    stdout: int  # a pipe's write end: becomes the rank's fd 1
    stderr: int  # likewise fd 2
    events: int  # stream socket: the rank's events to the kernel (wire/events.py)
    inbox: int  # stream socket: the kernel's calls and its Shutdown
    control: int  # stream socket: the kernel's stop requests and input replies, beside a running call
    store: int | None = None

    def flat(self) -> list[int]:
        """In the order :func:`split_fds` reads them back."""
        return [self.stdout, self.stderr, self.events, self.inbox, self.control,
                *(() if self.store is None else (self.store,))]


FDS_PER_RANK = 5  # RankFds without the store
# The fds of a launch's local ranks cross in one SCM_RIGHTS message, which holds at most 253: every
# rank's, the store's and the socket bound for the next launch's group.
MAX_LOCAL_RANKS = (253 - 2) // FDS_PER_RANK


def split_fds(flat: Sequence[int], specs: Sequence[WorkerSpec]) -> list[RankFds]:
    """Each spec's :class:`RankFds` from the flat list that crossed the socket (the ranks' in order)."""
    needed = sum(FDS_PER_RANK + spec.holds_store for spec in specs)
    if needed != len(flat):
        raise ValueError(f"{len(flat)} fds for {len(specs)} ranks, which take {needed}")
    taken: list[RankFds] = []
    position = 0
    for spec in specs:
        stdout, stderr, events, inbox, control = flat[position:position + FDS_PER_RANK]
        position += FDS_PER_RANK
        store = flat[position] if spec.holds_store else None
        position += spec.holds_store
        taken.append(RankFds(stdout, stderr, events, inbox, control, store))
    return taken
