"""A real distributed run in one command: ``python -m accelnb.demo`` (or ``make demo``).

Makes a 256 MiB dataset here, in the launching process, as a notebook cell would; trains a small
MLP on it with DistributedDataParallel on 2 ranks (2 CPU ranks on gloo without a GPU, the first 2
GPUs on NCCL with them), each rank on its own half of the rows; streams rank 0's progress, then
shows what every rank returned and the loss history reported with ``accelnb.report``. The ranks
map the dataset from shared memory: the kernel copies it once (``wire/shared_memory.py``).
"""

from __future__ import annotations

import sys
from typing import Any

import accelnb

ROWS = 4_000_000  # × 16 float32 features: 256 MiB


def train(features: Any, targets: Any, steps: int = 60, lr: float = 0.05) -> dict[str, Any]:
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
    my_rows = torch.arange(rank, len(features), world)  # each rank trains on its own half
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        batch = my_rows[torch.randint(len(my_rows), (128,), generator=generator)]
        x, y = features[batch], targets[batch].unsqueeze(1)
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
    print(f"accelnb demo: training an MLP with DDP on 2 ranks ({'GPUs' if on_gpus else 'CPU, gloo'})")
    import torch  # after the inventory: NVML tells the GPUs without initialising CUDA here

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(ROWS, 16, generator=generator)
    targets = features @ (torch.arange(16, dtype=torch.float32) / 16)
    print(f"dataset made here: {(features.nbytes + targets.nbytes) / 2**20:.0f} MiB, handed to both ranks\n")
    data = (features, targets)
    if on_gpus:
        result = accelnb.launch(train, data, gpus=[g.index for g in inventory.visible[:2]])
    else:
        result = accelnb.launch(train, data, num_processes=2, cpu=True)
    print(f"\nfinished in {result.seconds:.2f} s")
    for rank, value in sorted(result.values.items()):
        print(f"  rank {rank} returned {value}")
    losses = result.metrics.series("loss")
    print(f"  {len(result.metrics)} metric records; rank 0 loss went {losses[0][1]:.4f} → {losses[-1][1]:.4f}")
    return 0 if losses[-1][1] < losses[0][1] else 1


if __name__ == "__main__":
    sys.exit(main())
