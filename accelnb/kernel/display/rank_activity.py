"""Every rank's progress while a launch runs: its steps, speed, waits, GPU and host memory.

Fed on the kernel side from what the ranks already send: their step windows
(:class:`~accelnb.wire.events.StepWindow`, counted on unchanged code at every optimizer step by
``worker/step_timing.py``, or at every DDP forward without autograd for an inference loop), and
their ``report(step=…)`` batches for code with neither. GPU figures come from NVML through the launch's inventory reader
(:func:`accelnb.kernel.planning.inventory.read_inventory`, which never initialises CUDA in the
kernel), host memory from ``/proc``; both are read only when someone looks (:meth:`RankActivity.sample`,
at most once a second), so a launch nobody watches pays nothing for them.

    >>> activity = RankActivity(clock=lambda: 10.0)
    >>> activity.watch({0: 4242, 1: 4243}, {0: None, 1: None})       # pids and GPUs of the ranks
    >>> activity.add_window(StepWindow(0, 4, 1.0, 4, 0.2, 0.3), now=10.0)
    >>> activity.rows()[0].steps
    4

What DDP hides: every rank's step lasts as long as the slowest rank's, so "time per step" is alike
everywhere. What differs is the time a rank spends *before* it reaches the collective (getting its
batch, its forward pass). The rank that takes longest there makes the others wait; each rank's
*waiting* is estimated as how much sooner it got there than the slowest one, per step, as a share
of the step (``kernel/display/straggler_watch.py`` names the straggler from the same figures).

The record is kept for :class:`~accelnb.kernel.run.launch_result.LaunchResult` afterwards
(:meth:`RankActivity.summary`): per rank, every window's step time, data and forward times, and
every GPU sample taken.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from accelnb.kernel.display.byte_sizes import gpu_memory
from accelnb.kernel.display.straggler_watch import MIN_LEAD_S, MIN_SHARE
from accelnb.kernel.planning.inventory import GpuInfo, Inventory, read_inventory
from accelnb.wire.events import MetricBatch, StepWindow

RATE_WINDOW_S = 10.0  # steps per second over this much recent time
MIN_RATE_SPAN_S = 1.0  # ... once windows span at least this much
RECENT_WINDOWS = 20  # windows that make the "recent" time per step and waiting figures
SAMPLE_INTERVAL_S = 1.0  # NVML and /proc at most this often
MAX_KEPT = 10_000  # windows and samples kept per rank for the result (a long run keeps its latest)


@dataclass(frozen=True)
class RankFigures:
    """A rank's progress as numbers, for displays that draw it (the side panel's bars)."""

    steps: int
    steps_per_s: float | None = None
    gpu_utilization: int | None = None  # percent, of the GPU the rank runs on
    gpu_memory_used: int | None = None  # bytes
    gpu_memory_total: int | None = None  # bytes


@dataclass(frozen=True)
class GpuSample:
    """One NVML reading of the GPU a rank runs on."""

    time: float  # wall clock
    gpu: int  # nvidia-smi index
    utilization: int | None  # percent
    memory_used: int  # bytes
    memory_total: int
    power_w: float | None
    synthetic: bool = False  # a synthetic inventory's made-up figures


@dataclass(frozen=True)
class StepRecord:
    """One window of a rank's steps: how many, and their mean times (seconds per step)."""

    time: float  # wall clock when it arrived
    steps: int
    step_s: float | None  # None: only an untimed first step
    data_s: float | None  # None: no DDP forward to split the step at
    forward_s: float | None


@dataclass(frozen=True)
class RankRow:
    """What the live view shows for one rank, now."""

    rank: int
    steps: int
    steps_per_s: float | None
    step_s: float | None
    before_collective_s: float | None  # data + forward, per step
    waiting_share: float | None  # of a step, waiting for the slowest rank (estimate, see the module)
    host_memory: int | None  # bytes resident
    gpu: GpuSample | None
    seconds_since_step: float | None
    slowest: bool = False  # takes longest to reach the collective, by a margin that matters

    def describe(self) -> str:
        """One compact line: ``step 120 · 3.2 steps/s · waiting 12% · GPU 87% 10.2 / 80.0 GiB 250 W · host 1.2 GB``
        (what the side panel and a session's status show)."""
        parts = [f"step {self.steps:,}"]
        if self.steps_per_s is not None:
            rate = self.steps_per_s
            parts.append(f"{rate:,.1f} steps/s" if rate >= 1 else f"{rate:.2f} steps/s")
        if self.waiting_share is not None:
            parts.append(f"waiting {self.waiting_share:.0%}")
        if self.gpu is not None:
            util = "" if self.gpu.utilization is None else f" {self.gpu.utilization}%"
            power = "" if self.gpu.power_w is None else f" {self.gpu.power_w:.0f} W"
            parts.append(f"GPU{util} {gpu_memory(self.gpu.memory_used, self.gpu.memory_total)}{power}")
        if self.host_memory is not None:
            parts.append(f"host {self.host_memory / 1e9:.1f} GB")
        if self.slowest:
            parts.append("slowest")
        return " · ".join(parts)

    def figures(self) -> RankFigures:
        """What :meth:`describe` says, as numbers (the side panel draws them as bars)."""
        gpu = self.gpu
        return RankFigures(steps=self.steps, steps_per_s=self.steps_per_s,
                           gpu_utilization=gpu.utilization if gpu else None,
                           gpu_memory_used=gpu.memory_used if gpu else None,
                           gpu_memory_total=gpu.memory_total if gpu else None)


@dataclass
class RankSummary:
    """One rank's record for :class:`~accelnb.kernel.run.launch_result.LaunchResult`."""

    rank: int
    steps: int = 0
    windows: list[StepRecord] = field(default_factory=list)
    gpu_samples: list[GpuSample] = field(default_factory=list)
    host_memory_peak: int | None = None

    @property
    def step_times(self) -> list[float]:
        """The mean step time of every window that had a timed step, in order."""
        return [w.step_s for w in self.windows if w.step_s is not None]

    @property
    def waits(self) -> list[float]:
        """Per window with a DDP forward: the time before the collective (data + forward)."""
        return [w.data_s + w.forward_s for w in self.windows if w.data_s is not None and w.forward_s is not None]


@dataclass
class _Rank:
    pid: int | None = None
    gpu: GpuInfo | None = None
    steps: int = 0
    report_step: int | None = None  # the latest report(step=…), for code without an optimizer step
    inference_steps: int = 0  # DDP forwards without autograd, while the rank took no optimizer step
    last_step_at: float | None = None  # monotonic
    arrivals: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))  # (monotonic, steps)
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=RECENT_WINDOWS))
    kept: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=MAX_KEPT))
    gpu_samples: deque[GpuSample] = field(default_factory=lambda: deque(maxlen=MAX_KEPT))
    host_memory: int | None = None
    host_memory_peak: int | None = None


class RankActivity:
    """The kernel's running picture of every rank's progress (one per launch, across attempts)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 inventory: Callable[[], Inventory] = read_inventory,
                 host_memory: Callable[[int], int | None] | None = None) -> None:
        self._clock = clock
        self._inventory = inventory
        self._host_memory = host_memory or resident_bytes
        self._ranks: dict[int, _Rank] = {}
        self._last_sample = -float("inf")
        self.changed = False  # something new since the view last drew

    # ── feeding ─────────────────────────────────────────────────────────────────────────────
    def watch(self, pids: Mapping[int, int | None], gpus: Mapping[int, GpuInfo | None]) -> None:
        """The ranks of the attempt starting now: their pids on this machine (None on another
        node, whose current memory is not read from here; its peak comes in its step windows) and
        the physical GPU each runs on."""
        for rank, pid in pids.items():
            seen = self._ranks.setdefault(rank, _Rank())
            seen.pid, seen.gpu = pid, gpus.get(rank)

    def add_window(self, window: StepWindow, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        seen = self._ranks.setdefault(window.rank, _Rank())
        count = window.steps + window.untimed_steps
        if count or seen.steps:  # training: optimizer steps
            seen.steps += count
        else:  # no optimizer step yet: an inference loop's DDP forwards are its steps
            count = window.forward_steps
            seen.inference_steps += count
        seen.last_step_at = now
        seen.arrivals.append((now, count))
        split = window.split_steps
        record = StepRecord(time.time(), count,
                            window.step_s / window.steps if window.steps else None,
                            window.data_s / split if split else None,
                            window.forward_s / split if split else None)
        if record.step_s is not None:
            seen.recent.append(record)
        seen.kept.append(record)
        if window.peak_host_memory is not None:  # the rank's own reading: on any node
            seen.host_memory_peak = max(seen.host_memory_peak or 0, window.peak_host_memory)
        self.changed = True

    def add_reports(self, batch: MetricBatch, now: float | None = None) -> None:
        """A ``report(step=…)`` batch: the rank's step where it counts no optimizer steps."""
        steps = [step for step, _, _ in batch.records if step is not None]
        if not steps:
            return
        seen = self._ranks.setdefault(batch.rank, _Rank())
        seen.report_step = max(steps)
        seen.last_step_at = self._clock() if now is None else now
        self.changed = True

    @property
    def counting(self) -> bool:
        """Whether any rank counted a step (an optimizer step, or a ``report(step=…)``)."""
        return any(r.steps or r.inference_steps or r.report_step is not None for r in self._ranks.values())

    # ── reading the machine ─────────────────────────────────────────────────────────────────
    def sample(self, force: bool = False) -> None:
        """Read the ranks' GPUs (NVML) and host memory (``/proc``), at most once a second."""
        now = self._clock()
        if not force and now - self._last_sample < SAMPLE_INTERVAL_S:
            return
        self._last_sample = now
        with_gpu = [r for r in self._ranks.values() if r.gpu is not None]
        if with_gpu:
            inventory = self._inventory()
            for seen in with_gpu:
                assert seen.gpu is not None
                info = inventory.by_uuid(seen.gpu.uuid) or inventory.by_index(seen.gpu.index)
                if info is not None:
                    seen.gpu_samples.append(GpuSample(time.time(), info.index, info.utilization, info.memory_used,
                                                      info.memory_total, info.power_w, inventory.synthetic))
        for seen in self._ranks.values():
            resident = None if seen.pid is None else self._host_memory(seen.pid)
            if resident is not None:  # a rank that ended keeps its last reading
                seen.host_memory = resident
                seen.host_memory_peak = max(seen.host_memory_peak or 0, resident)
        self.changed = True

    # ── what the view and the result show ───────────────────────────────────────────────────
    def rows(self) -> list[RankRow]:
        now = self._clock()
        before = {rank: _median_before(seen) for rank, seen in self._ranks.items()}
        known = {rank: value for rank, value in before.items() if value is not None}
        slowest = max(known, key=lambda rank: known[rank]) if len(known) >= 2 else None
        rows = []
        for rank, seen in sorted(self._ranks.items()):
            step_s = statistics.median(r.step_s for r in seen.recent if r.step_s is not None) if seen.recent else None
            waiting = None
            if slowest is not None and before[rank] is not None and step_s:
                waiting = max(0.0, known[slowest] - known[rank]) / step_s
            rows.append(RankRow(
                rank=rank, steps=_steps_of(seen),
                steps_per_s=_rate(seen.arrivals, now, step_s), step_s=step_s, before_collective_s=before[rank],
                waiting_share=waiting, host_memory=seen.host_memory,
                gpu=seen.gpu_samples[-1] if seen.gpu_samples else None,
                seconds_since_step=None if seen.last_step_at is None else now - seen.last_step_at,
                slowest=rank == slowest and _holds_back(known, rank, step_s)))
        return rows

    def summary(self) -> dict[int, RankSummary]:
        return {rank: RankSummary(rank, _steps_of(seen), list(seen.kept),
                                  list(seen.gpu_samples), seen.host_memory_peak)
                for rank, seen in sorted(self._ranks.items())}


def _steps_of(seen: _Rank) -> int:
    """Optimizer steps; else an inference loop's forwards; else the latest ``report(step=…)``."""
    return seen.steps or seen.inference_steps or (seen.report_step or 0)


def _median_before(seen: _Rank) -> float | None:
    split = [r.data_s + r.forward_s for r in seen.recent if r.data_s is not None and r.forward_s is not None]
    return statistics.median(split) if split else None


def _rate(arrivals: deque[tuple[float, int]], now: float, step_s: float | None) -> float | None:
    """Steps per second over the recent windows; over less than a second of arrivals (a short
    run, the last flush right after the one before), one over the time per step."""
    recent = [(t, n) for t, n in arrivals if now - t <= RATE_WINDOW_S]
    span = recent[-1][0] - recent[0][0] if len(recent) >= 2 else 0.0
    if span >= MIN_RATE_SPAN_S:
        return sum(n for _, n in recent[1:]) / span
    return 1 / step_s if step_s else None


def _holds_back(before: Mapping[int, float], rank: int, step_s: float | None) -> bool:
    """The straggler watch's own thresholds: a lead that is not noise."""
    others = [value for other, value in before.items() if other != rank]
    if not others or not step_s:
        return False
    lead = before[rank] - statistics.median(others)
    return lead >= MIN_LEAD_S and lead >= MIN_SHARE * step_s


def resident_bytes(pid: int) -> int | None:
    """A process's resident memory (``VmRSS``), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
