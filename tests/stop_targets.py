"""Training functions for tests/test_stop_that_saves.py, written as a DDP tutorial writes them:
the model in DDP, an SGD step, a checkpoint that rank 0 writes (to a temporary file, then
``os.replace``, so a reader never sees half a file), and resume from it when one exists.

The ranks import this module by name (it sits beside the tests), as they would a project's
``train.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def _ddp_model() -> tuple[int, Any, Any]:
    """This rank, a linear model in DDP, and its SGD optimizer (the same start on every rank)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    return dist.get_rank(), model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train_step(model: Any, optimizer: Any) -> Any:
    import torch

    loss = model(torch.randn(8, 16)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def _resume(path: Path, model: Any, optimizer: Any) -> int:
    """Load the checkpoint at ``path`` if there is one; the step to start from."""
    import torch

    if not path.exists():
        return 0
    state = torch.load(path)
    model.module.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]) + 1


def train_until_stopped(checkpoints: str, steps: int = 1_000_000, ignore_stop: bool = False) -> tuple[int, int]:
    """Train from the last checkpoint in ``checkpoints`` (if any) until Stop; returns this run's
    (first step, last step). Each rank also writes the step it stopped at, for the test to compare."""
    import torch
    import torch.distributed as dist

    import accelnb

    # Checked once before the set-up, as a loop `while not accelnb.stop_requested()` would: accelnb
    # then knows this code answers Stop, so a Stop (or timeout=) during the set-up is a request
    # answered at the first step, not a kill. DDP's set-up imports torch._dynamo, which takes
    # seconds on a busy machine (a timeout=3 once passed inside it).
    accelnb.stop_requested()
    rank, model, optimizer = _ddp_model()
    path = Path(checkpoints) / "checkpoint.pt"
    start = _resume(path, model, optimizer)
    step = start
    for step in range(start, steps):
        loss = _train_step(model, optimizer)
        accelnb.report(step=step, loss=loss.item())
        if step % 50 == 0 and rank == 0:
            print(f"step {step}", flush=True)
        if accelnb.stop_requested() and not ignore_stop:
            if rank == 0:
                partial = path.with_suffix(".partial")
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                           partial)
                os.replace(partial, path)
            (Path(checkpoints) / f"rank{rank}.step").write_text(str(step))
            dist.barrier()  # nobody returns before the checkpoint is whole
            return start, step
    return start, step


def train_saving_every(checkpoints: str, steps: int, save_every: int, crash_at: int) -> tuple[int, int]:
    """Save every ``save_every`` steps; in the first attempt rank 1 dies at ``crash_at``; a restart
    (``max_restarts=``) resumes from the last checkpoint, by the same code a Stop's resume runs."""
    import torch
    import torch.distributed as dist

    import accelnb

    rank, model, optimizer = _ddp_model()
    path = Path(checkpoints) / "checkpoint.pt"
    start = _resume(path, model, None)
    for step in range(start, steps):
        _train_step(model, optimizer)
        if accelnb.restart_count() == 0 and rank == 1 and step == crash_at:
            os._exit(3)  # a lost rank, as an OOM kill looks
        if (step + 1) % save_every == 0:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "step": step}, path.with_suffix(".partial"))
                os.replace(path.with_suffix(".partial"), path)
            dist.barrier()
        if accelnb.stop_requested():
            return start, step
    return start, steps - 1


if __name__ == "__main__":  # a script: python stop_targets.py CHECKPOINTS (the SIGTERM test)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from accelnb import notebook_launcher

    first, last = notebook_launcher(train_until_stopped, (sys.argv[1],), num_processes=2, cpu=True, quiet=True)
    print(f"returned {first} {last}", flush=True)
