"""Naming the rank that holds the others back, from each rank's step windows.

Under DDP every rank's step lasts as long as the slowest rank's, so the step times of the ranks
all look alike. What differs is the time a rank spends before it reaches the all-reduce: getting
its batch (*data*) and its forward pass (*forward*), measured in each rank on unchanged code
(``worker/step_timing.py``) and sent as :class:`~accelnb.wire.events.StepWindow` events. This
compares the ranks' recent medians: when one rank's time before the collective exceeds the
others' by more than :data:`MIN_LEAD_S` and :data:`MIN_SHARE` of a step, over its last
:data:`RECENT_STEPS` steps (at least :data:`MIN_STEPS` of them), it is the straggler, and the cell
says which, by how much, and where its time goes. Once per rank and call; a balanced run says
nothing.

    >>> watch = StragglerWatch(world_size=2)
    >>> watch.add(StepWindow(1, 1, 0.25, 1, 0.21, 0.01))   # one step of rank 1 (and so on)
    >>> watch.verdict()                                      # None until it is sure
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from accelnb.wire.events import StepWindow

RECENT_STEPS = 10  # each rank's steps that count
MIN_STEPS = 3  # steps each rank needs before any verdict
MIN_LEAD_S = 0.05  # a lead shorter than this is noise on a busy machine
MIN_SHARE = 0.2  # ... and so is one under this share of a step


@dataclass
class _RankSteps:
    steps: int = 0
    recent: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    # each: (step s, data s, forward s) per step, averaged within a window


@dataclass(frozen=True)
class Straggler:
    rank: int
    lead_s: float  # how much longer than the others it takes to reach the collective, per step
    step_s: float
    data_s: float
    others_data_s: float
    forward_s: float
    others_forward_s: float

    @property
    def cause(self) -> str:
        data_lead = self.data_s - self.others_data_s
        forward_lead = self.forward_s - self.others_forward_s
        if max(data_lead, forward_lead) < self.lead_s / 2:
            return "elsewhere"
        return "waiting for data" if data_lead >= forward_lead else "computing (the forward pass)"

    def describe(self) -> str:
        return (f"accelnb: rank {self.rank} holds the others back by {self.lead_s:.2f} s per step "
                f"({self.lead_s / self.step_s:.0%} of a {self.step_s:.2f} s step): {self.cause}. "
                f"Per step, rank {self.rank} / the others: data {self.data_s:.3f} / {self.others_data_s:.3f} s, "
                f"forward {self.forward_s:.3f} / {self.others_forward_s:.3f} s.")


class StragglerWatch:
    """Step windows in, a :class:`Straggler` out (once per rank)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ranks: dict[int, _RankSteps] = {}
        self.named: set[int] = set()

    def add(self, window: StepWindow) -> None:
        seen = self.ranks.setdefault(window.rank, _RankSteps())
        seen.steps += window.steps
        if window.split_steps:
            split = window.split_steps
            seen.recent.append((window.step_s / window.steps, window.data_s / split, window.forward_s / split))

    def verdict(self) -> Straggler | None:
        """The straggler, the first time it is certain; else None."""
        if len(self.ranks) < max(2, self.world_size) or any(len(r.recent) < MIN_STEPS for r in self.ranks.values()):
            return None
        ahead = {rank: statistics.median(d + f for _, d, f in seen.recent) for rank, seen in self.ranks.items()}
        slowest = max(ahead, key=lambda rank: ahead[rank])
        others = [rank for rank in ahead if rank != slowest]
        lead = ahead[slowest] - statistics.median(ahead[rank] for rank in others)
        step = statistics.median(s for s, _, _ in self.ranks[slowest].recent)
        if slowest in self.named or lead < MIN_LEAD_S or lead < MIN_SHARE * step:
            return None
        self.named.add(slowest)

        def median_of(rank_set: list[int], index: int) -> float:
            return statistics.median(v[index] for rank in rank_set for v in self.ranks[rank].recent)

        return Straggler(slowest, lead, step, median_of([slowest], 1), median_of(others, 1),
                         median_of([slowest], 2), median_of(others, 2))
