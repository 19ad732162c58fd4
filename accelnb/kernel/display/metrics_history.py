"""The kernel's record of every metric the workers reported, in arrival order.

    >>> result = accelnb.launch(train, num_processes=2)           # doctest: +SKIP
    >>> result.metrics                                            # doctest: +SKIP
    MetricHistory(2,000 records from ranks 0, 1; metrics: loss, lr)
    >>> result.metrics.series("loss")           # rank 0: [(step, value), …]   # doctest: +SKIP
    >>> result.metrics.records[0]      # {"rank": 0, "attempt": 0, "step": 0, "time": …, "loss": 2.3}
    >>> result.metrics.to_pandas()              # one row per report, NaN where a metric is absent

A launch with restarts (``max_restarts=``) keeps one history for all its attempts: each record
says which ``attempt`` it came from (``accelnb.restart_count()`` on the rank that reported), so
where an attempt began is where that column changes, and ``series(name, attempt=k)`` is one
attempt's curve. Without restarts every record is attempt 0.

Every report is kept (nothing is thinned: that is the live view's business), stored as columns of
machine numbers rather than one dict per report, about 20 bytes per report plus 16 per value,
so a long run reporting every step stays small; ``records`` builds the dicts when asked.
"""

from __future__ import annotations

from array import array
from typing import Any

from accelnb.wire.events import MetricBatch

_NO_STEP = -(2**63)  # stands for step=None in the int64 step column


class MetricHistory:
    """Every reported scalar: rank, step, wall time and values, in arrival order."""

    def __init__(self) -> None:
        self._ranks = array("i")
        self._attempts = array("i")
        self._steps = array("q")
        self._times = array("d")
        # metric name → (record indices, values): a metric need not be in every record
        self._columns: dict[str, tuple[array[int], array[float]]] = {}
        self._records_cache: list[dict[str, Any]] | None = None

    def add(self, batch: MetricBatch, attempt: int = 0) -> None:
        """Append one worker batch (the launcher calls this for every batch, in arrival order),
        reported during ``attempt`` of the launch."""
        if not batch.records:
            return
        self._records_cache = None
        columns = self._columns
        index = len(self._times)
        for step, when, values in batch.records:
            self._steps.append(_NO_STEP if step is None else step)
            self._times.append(when)
            for name, value in values.items():
                column = columns.get(name)
                if column is None:
                    column = columns[name] = (array("q"), array("d"))
                column[0].append(index)
                column[1].append(value)
            index += 1
        self._ranks.extend([batch.rank] * len(batch.records))
        self._attempts.extend([attempt] * len(batch.records))

    # ── reading ─────────────────────────────────────────────────────────────────────────────
    @property
    def records(self) -> list[dict[str, Any]]:
        """One dict per report: ``{"rank", "attempt", "step", "time", <metric>: value, …}``."""
        if self._records_cache is None:
            records: list[dict[str, Any]] = [
                {"rank": rank, "attempt": attempt, "step": None if step == _NO_STEP else step, "time": when}
                for rank, attempt, step, when in zip(self._ranks, self._attempts, self._steps, self._times,
                                                     strict=True)]
            for name, (indices, values) in self._columns.items():
                for index, value in zip(indices, values, strict=True):
                    records[index][name] = value
            self._records_cache = records
        return self._records_cache

    def series(self, name: str, rank: int = 0, attempt: int | None = None) -> list[tuple[int | None, float]]:
        """``[(step, value), …]`` of one metric on one rank, in the order reported (empty when
        that metric was never reported there); ``attempt``: only what that attempt reported."""
        column = self._columns.get(name)
        if column is None:
            return []
        ranks, steps, attempts = self._ranks, self._steps, self._attempts
        return [(None if steps[i] == _NO_STEP else steps[i], value)
                for i, value in zip(*column, strict=True)
                if ranks[i] == rank and (attempt is None or attempts[i] == attempt)]

    def latest(self, name: str, rank: int = 0) -> float | None:
        """The last value of ``name`` that ``rank`` reported, or None."""
        column = self._columns.get(name)
        if column is None:
            return None
        for i in range(len(column[0]) - 1, -1, -1):
            if self._ranks[column[0][i]] == rank:
                return column[1][i]
        return None

    @property
    def names(self) -> list[str]:
        """Metric names, in the order first reported."""
        return list(self._columns)

    @property
    def ranks(self) -> list[int]:
        """The ranks that reported anything, ascending."""
        return sorted(set(self._ranks))

    def to_pandas(self) -> Any:
        """The history as a pandas DataFrame: columns rank, attempt, step, time, then one per metric
        (NaN where a report did not include it). Needs pandas."""
        try:
            import pandas
        except ImportError:
            raise ImportError("MetricHistory.to_pandas() needs pandas: pip install pandas "
                              "(or use .records, a list of dicts)") from None
        count = len(self._times)
        steps = [None if step == _NO_STEP else step for step in self._steps]
        data: dict[str, Any] = {"rank": list(self._ranks), "attempt": list(self._attempts), "step": steps,
                                "time": list(self._times)}
        for name, (indices, values) in self._columns.items():
            full = [float("nan")] * count
            for index, value in zip(indices, values, strict=True):
                full[index] = value
            data[name] = full
        frame = pandas.DataFrame(data)
        if any(step is None for step in steps):
            frame["step"] = frame["step"].astype("Int64")  # missing steps as <NA>, not floats
        return frame

    def __len__(self) -> int:
        return len(self._times)

    def __repr__(self) -> str:
        if not self._times:
            return "MetricHistory(empty: nothing was reported)"
        ranks = ", ".join(map(str, self.ranks))
        return (f"MetricHistory({len(self):,} records from rank{'s' if len(self.ranks) > 1 else ''} "
                f"{ranks}; metrics: {', '.join(self.names)})")
