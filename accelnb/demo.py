"""A real distributed run in one command: ``python -m accelnb.demo`` (or ``make demo``).

Trains a small MLP with DistributedDataParallel on 2 ranks (2 CPU ranks on gloo without a GPU,
the first 2 GPUs on NCCL with them), streams rank 0's progress, then shows what every rank
returned and the loss history reported with ``accelnb.report``.
"""

from __future__ import annotations

import sys
from typing import Any

import accelnb


def train(steps: int = 60, lr: float = 0.05) -> dict[str, Any]:
    """Ordinary DDP code: nothing accelnb-specific except the optional ``accelnb.report``."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(rank)  # each rank sees its own shard of data
    true_w = torch.arange(16, dtype=torch.float32) / 16
    for step in range(steps):
        x = torch.randn(128, 16, generator=generator)
        y = (x @ true_w).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()  # DDP averages gradients across ranks here
        optimizer.step()
        accelnb.report(step=step, loss=loss)
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}  (rank {rank} of {world}, {device})", flush=True)
    return {"rank": rank, "final_loss": loss.item()}


def main() -> int:
    inventory = accelnb.read_inventory()
    on_gpus = len(inventory.visible) >= 2 and not inventory.synthetic
    print(f"accelnb demo: training an MLP with DDP on 2 ranks ({'GPUs' if on_gpus else 'CPU, gloo'})\n")
    if on_gpus:
        result = accelnb.launch(train, gpus=[g.index for g in inventory.visible[:2]])
    else:
        result = accelnb.launch(train, num_processes=2, cpu=True)
    print(f"\nfinished in {result.seconds:.2f} s")
    for rank, value in sorted(result.values.items()):
        print(f"  rank {rank} returned {value}")
    losses = result.metrics.series("loss")
    print(f"  {len(result.metrics)} metric records; rank 0 loss went {losses[0][1]:.4f} → {losses[-1][1]:.4f}")
    return 0 if losses[-1][1] < losses[0][1] else 1


if __name__ == "__main__":
    sys.exit(main())
