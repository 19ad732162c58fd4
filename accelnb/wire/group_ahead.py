"""A launch's group, joined ahead of the launch: when ranks forked before a launch can serve it.

Making a 2-rank gloo group costs a launch 15-20 ms on a 2-core machine (the store, gloo's mesh of
connections, the join barrier), most of a one-shot launch of a short function. The template
forks the next launch's ranks while idle (``worker/template/standby_ranks.py``); those children
can also join the next launch's group while they wait, on a rendezvous socket the kernel bound
for it, if they know what that group will be. Most launches of a notebook are alike, so the
kernel bets that the next launch is like this one: with every spawn it sends a
:class:`GroupAhead` (and a freshly bound socket), and the next launch uses that socket only if
:func:`group_ahead` of its own specs is the same. The template checks the same before it hands
a launch its joined children; anything else gets ranks that join at launch, as before.

Only what the join depends on is compared, so a group joined ahead is exactly the group the
ranks would have made: the number of ranks, CPU ranks on gloo (a GPU rank's NCCL group is bound
to its device, which a waiting child must not touch), on this machine with rank 0 holding the
store, and the variables gloo and ``torch.distributed`` read while joining (``GLOO_*``,
``TORCH_*``, and accelnb's own group timeout), which the waiting child takes before it joins.
A ``master_port`` the user chose is honoured by binding it, so such a launch never uses one.

    >>> from accelnb.wire.spec import WorkerSpec
    >>> spec = WorkerSpec(rank=0, local_rank=0, world_size=1, device="cpu", backend="gloo",
    ...                   env={"GLOO_SOCKET_IFNAME": "lo"}, master_addr="127.0.0.1", master_port=0,
    ...                   cwd="/", sys_path=[], holds_store=True, kernel_env={"PATH": "/bin"})
    >>> group_ahead([spec])
    GroupAhead(world_size=1, join_env=(('GLOO_SOCKET_IFNAME', 'lo'),))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from accelnb.wire.spec import GROUP_TIMEOUT_ENV, LOOPBACK, WorkerSpec

JOIN_ENV_PREFIXES = ("GLOO_", "TORCH_")
MAX_WORLD_AHEAD = 16  # the most ranks the template keeps waiting (standby_ranks.MAX_STANDBY)


@dataclass(frozen=True)
class GroupAhead:
    """What a launch's default group is, as far as joining it goes."""

    world_size: int
    join_env: tuple[tuple[str, str], ...]  # sorted: the join's variables the ranks have (unlisted: unset)


def is_join_variable(name: str) -> bool:
    """Whether gloo or ``torch.distributed`` may read ``name`` while a rank joins its group."""
    return name.startswith(JOIN_ENV_PREFIXES) or name == GROUP_TIMEOUT_ENV


def group_ahead(specs: Sequence[WorkerSpec]) -> GroupAhead | None:
    """The group the ranks of ``specs`` join, when ranks forked ahead can join it for them; None
    for a launch whose group cannot be joined ahead (see the module docstring)."""
    if not 0 < len(specs) <= MAX_WORLD_AHEAD:
        return None
    join_env: tuple[tuple[str, str], ...] | None = None
    for position, spec in enumerate(specs):
        if (spec.rank != position or spec.world_size != len(specs) or spec.device != "cpu"
                or spec.backend != "gloo" or spec.master_addr != LOOPBACK or spec.holds_store != (position == 0)
                or spec.kernel_env is None):
            return None
        env = {**spec.kernel_env, **spec.env}
        mine = tuple(sorted((name, value) for name, value in env.items() if is_join_variable(name)))
        if join_env is not None and mine != join_env:
            return None
        join_env = mine
    assert join_env is not None
    return GroupAhead(len(specs), join_env)
