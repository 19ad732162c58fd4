"""What the engine needs from a group of ranks, whatever runs them: the boundary between backends.

:class:`~accelnb.kernel.run.supervisor.WorkerGroup` (ranks forked on this machine) and
``accelnb.cluster.ray_group.RayRankGroup`` (one Ray actor per rank across a cluster) both have
this shape, so :mod:`accelnb.kernel.run.engine`, restarts and sessions drive either without knowing
which. A third backend (Slurm, Kubernetes) implements it and needs no change above it:

    >>> outcome = group.call(payload, value_ranks={0}, timeout=None)     # doctest: +SKIP
    >>> group.usable, outcome.ending                                      # doctest: +SKIP
    (False, 'answered')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from accelnb.kernel.display.output import OutputRouter
from accelnb.kernel.planning.rank_plan import LaunchPlan
from accelnb.kernel.run.call_outcome import CallOutcome
from accelnb.wire.buffers import Packed
from accelnb.wire.events import MetricBatch, StepWindow


class RankGroup(Protocol):
    """The live ranks of one launch or session.

    ``call`` raises nothing for what happens to the ranks (its :class:`CallOutcome` says it) and
    leaves no rank that should be gone; a ``KeyboardInterrupt`` that escapes it (one that landed
    before the call went out, or once it had ended) leaves no rank running the call, so a group
    still ``usable`` can take the next one. ``shutdown`` ends ranks that finished, ``close`` ends
    everything and frees what the group holds; both are safe to call twice.
    """

    plan: LaunchPlan
    persistent: bool
    output: OutputRouter
    metric_sink: Callable[[MetricBatch | StepWindow], None] | None

    @property
    def usable(self) -> bool: ...

    def call(self, payload: Packed, value_ranks: set[int], timeout: float | None,
             ranks: frozenset[int] | None = None, *, stall_timeout: float | None = None,
             stop_grace: float | None = None) -> CallOutcome: ...

    def collect_stacks(self, wait: float = ...) -> dict[int, str]: ...

    def shutdown(self) -> None: ...

    def close(self) -> None: ...
