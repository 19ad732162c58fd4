"""What the ranks run in the tracker tests: Accelerate training with ``log_with=`` a tracker and a
DataLoader that forks workers. A light module: each fresh worker imports it."""

from __future__ import annotations

import os
from typing import Any


def train_with_tracker(log_with: str, project_dir: str, env: dict[str, str]) -> dict[str, Any]:
    """Four logged steps per rank; returns every process this rank started, with its start time,
    while they still run (the tracker's service, the DataLoader's workers)."""
    import psutil
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    os.environ.update(env)  # the helper process keeps the environment it started with: set it here
    accelerator = Accelerator(log_with=log_with, project_dir=project_dir)
    accelerator.init_trackers("tracked", config={"lr": 0.1})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, num_workers=2,
                      persistent_workers=True)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for step, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
    started = [(p.pid, p.create_time(), p.name()) for p in psutil.Process().children(recursive=True)]
    accelerator.end_training()
    return {"main": accelerator.is_main_process, "pid": os.getpid(), "started": started}
