"""What a finished launch hands back: every rank's value, the metric history, the output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from accelnb.kernel.metrics_history import MetricHistory
from accelnb.kernel.planning import LaunchPlan


@dataclass
class LaunchResult:
    """The outcome of :func:`accelnb.launch`.

    ``value`` is rank 0's return value; ``values[r]`` is rank r's (collected for every rank by
    ``launch``, for rank 0 only by ``notebook_launcher``).
    """

    values: dict[int, Any]
    plan: LaunchPlan
    seconds: float
    metrics: MetricHistory = field(default_factory=lambda: MetricHistory())
    outputs: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def value(self) -> Any:
        return self.values.get(0)

    def output(self, rank: int = 0) -> str:
        """Everything rank ``rank`` printed (the last few MB), stdout and stderr interleaved."""
        return self.outputs.get(rank, "")
