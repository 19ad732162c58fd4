"""Where a sweep's trials run: the pool of GPUs cut into slots, or CPU slots; pure, no processes.

A slot is what one trial owns while it runs: ``gpus_per_trial`` GPUs of the pool (its ranks see
only those), or, on CPU, a share of the cores. No GPU is in two slots, so no GPU runs two trials;
a slot takes the next queued trial when its trial ends.

    >>> gpu_slots([0, 1, 2, 3], per_trial=2)
    [Slot(index=0, gpus=(0, 1)), Slot(index=1, gpus=(2, 3))]
    >>> cpu_slots(2)
    [Slot(index=0, gpus=()), Slot(index=1, gpus=())]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from accelnb.errors import LaunchConfigError


@dataclass(frozen=True)
class Slot:
    """The GPUs one running trial owns (``()`` on CPU)."""

    index: int
    gpus: tuple[int, ...]

    @property
    def label(self) -> str:
        if not self.gpus:
            return "cpu"
        return ("GPU " if len(self.gpus) == 1 else "GPUs ") + ",".join(str(g) for g in self.gpus)


def gpu_slots(pool: Sequence[int], per_trial: int, max_concurrent: int | None = None) -> list[Slot]:
    """The pool cut into slots of ``per_trial`` GPUs, in pool order, at most ``max_concurrent`` of
    them; GPUs left over (a pool of 5 by 2) stay idle. Raises :class:`LaunchConfigError` when one
    trial needs more GPUs than the pool has."""
    if per_trial > len(pool):
        raise LaunchConfigError(
            f"gpus_per_trial={per_trial} is more than the {len(pool)} GPU(s) of the sweep's pool "
            f"({', '.join(map(str, pool)) or 'none'}). Give each trial at most {len(pool)}, or pick more GPUs "
            "(gpus=, or the GPU picker).")
    count = len(pool) // per_trial
    if max_concurrent is not None:
        count = min(count, max_concurrent)
    return [Slot(i, tuple(pool[i * per_trial:(i + 1) * per_trial])) for i in range(count)]


def cpu_slots(count: int) -> list[Slot]:
    """``count`` CPU slots: that many trials at once."""
    return [Slot(i, ()) for i in range(count)]


def default_cpu_concurrency(ranks_per_trial: int, cores: int | None = None) -> int:
    """How many CPU trials run at once by default: one rank per core, at least one trial."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, cores // max(1, ranks_per_trial))


def check_concurrency(max_concurrent: int | None) -> None:
    if max_concurrent is not None and (isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int)
                                       or max_concurrent < 1):
        raise LaunchConfigError(f"max_concurrent must be a whole number of at least 1, got {max_concurrent!r}.")
