"""The kernel's record of every metric the workers reported, in arrival order.

    >>> history = MetricHistory()
    >>> history.records   # [{"rank": 0, "step": 1, "time": …, "loss": 0.5}, …]
    []
"""

from __future__ import annotations

from typing import Any

from accelnb.events import MetricBatch


class MetricHistory:
    """Records as dicts: ``{"rank", "step", "time", <metric>: value, …}``."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def add(self, batch: MetricBatch) -> None:
        for step, when, values in batch.records:
            self.records.append({"rank": batch.rank, "step": step, "time": when, **values})

    def series(self, name: str, rank: int = 0) -> list[tuple[int | None, float]]:
        """``[(step, value), …]`` of one metric on one rank."""
        return [(r["step"], r[name]) for r in self.records if r["rank"] == rank and name in r]

    @property
    def names(self) -> list[str]:
        seen: dict[str, None] = {}
        for record in self.records:
            for key in record:
                if key not in ("rank", "step", "time"):
                    seen.setdefault(key)
        return list(seen)

    def to_pandas(self) -> Any:
        """The history as a pandas DataFrame (needs pandas)."""
        try:
            import pandas
        except ImportError:
            raise ImportError("MetricHistory.to_pandas() needs pandas: pip install pandas") from None
        return pandas.DataFrame.from_records(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"MetricHistory({len(self.records)} records, metrics: {', '.join(self.names) or 'none'})"
