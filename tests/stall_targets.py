"""What the ranks of tests/test_stall.py run: a collective that never completes, and loops that make
progress only through ``report()`` or only through output.

A module of its own, importing nothing but accelnb's rank side: the ranks import it by name, and
a test module with the kernel's imports took a loaded machine longer to import than the
``stall_timeout`` the progress tests give, which showed a stall before the first step.
"""

from __future__ import annotations

import time

import accelnb


def mismatched_collective() -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()
    else:
        dist.all_reduce(torch.ones(1))


def reports_without_printing(steps: int) -> int:
    for step in range(steps):
        accelnb.report(step=step, loss=1.0 / (step + 1))
        time.sleep(0.3)  # the work of a step
    return steps


def prints_without_reporting(steps: int) -> int:
    for step in range(steps):
        print(f"step {step}", flush=True)
        time.sleep(0.3)
    return steps
