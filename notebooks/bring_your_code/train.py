"""A training script written for torchrun, nothing accelnb-specific:

    torchrun --nproc-per-node 2 train.py --epochs 1 --steps 5

reads its rank from the environment torchrun sets, makes its own process group, trains a tiny
model with DistributedDataParallel on random data and prints from rank 0.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(rank)  # each rank its own shard of random data
    for epoch in range(args.epochs):
        for _ in range(args.steps):
            x = torch.randn(16, 8, generator=generator)
            y = x.sum(dim=1, keepdim=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        # the average loss over the ranks, the same number on each
        average = loss.detach().clone()
        dist.all_reduce(average)
        average /= world_size
        if rank == 0:
            print(f"epoch {epoch}: loss {average.item():.4f} ({world_size} ranks, backend {dist.get_backend()})")
    print(f"rank {rank} (local rank {local_rank}) done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
