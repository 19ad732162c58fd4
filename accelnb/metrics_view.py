"""The live metrics view drawn in the running cell (being built: issue 4).

Interface used by the launcher: ``LiveMetricsView(all_ranks)``; ``add(batch)`` for every
:class:`~accelnb.events.MetricBatch`; ``close()`` once the run ended (success or failure).
"""

from __future__ import annotations

from accelnb.events import MetricBatch


class LiveMetricsView:
    def __init__(self, all_ranks: bool) -> None:
        self.all_ranks = all_ranks

    def add(self, batch: MetricBatch) -> None:
        pass

    def close(self) -> None:
        pass
