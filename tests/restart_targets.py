"""What the ranks run in the restart tests.

A module of its own that imports nothing heavy: functions defined in a test module travel by
reference, so every fresh worker of every attempt imports their module, and a test module pulls
in pytest, nbclient and the rest (seconds per attempt on a loaded 2-core machine).
"""

from __future__ import annotations

import os
import time

import accelnb


def rank_1_dies_on_the_first_attempt() -> tuple[int, str, int]:
    import torch
    import torch.distributed as dist

    attempt = accelnb.restart_count()
    for step in range(3):
        accelnb.report(step=step, loss=float(10 * attempt + step))
    accelnb.report(step=100, last_pid=float(os.getpid()))
    dist.barrier()  # both ranks reported before one dies
    if dist.get_rank() == 1 and attempt == 0:
        os._exit(1)
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return attempt, os.environ["TORCHELASTIC_RESTART_COUNT"], int(total.item())


def always_fails(where: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"attempt {accelnb.restart_count()} fails at {where}")


def sleeps_on_the_second_attempt() -> None:
    import torch.distributed as dist

    if accelnb.restart_count() == 0 and dist.get_rank() == 0:
        raise RuntimeError("first attempt fails")
    time.sleep(60 if accelnb.restart_count() == 1 else 0)


def reports_kinds_of_scalars(with_steps: bool = True) -> None:
    """Rank 0 reports each kind of scalar ``report()`` takes; rank 1 reports other values."""
    import numpy
    import torch
    import torch.distributed as dist

    offset = 1000.0 * dist.get_rank()

    def step(n: int) -> int | None:
        return n if with_steps else None

    for n in range(5):
        accelnb.report(step=step(n), loss=1.0 / (n + 1) + offset)
    accelnb.report(step=step(4), **{"val/acc": 0.75})
    if with_steps:
        accelnb.report(step=0, flag=True)
        accelnb.report(step=1, np_value=numpy.float32(2.5))
        accelnb.report(step=2, tensor_value=torch.tensor(3.0))
