"""A training module written the way pytorch/examples' DDP tutorial series writes one.

Its import binds ``init_process_group`` from ``torch.distributed``, as the series' ``multigpu.py``
does; a notebook imports it in its first cell and launches :func:`train` later. Written for these
tests (not copied): what matters is the import style and the set-up call in the rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_setup() -> None:
    init_process_group(backend="gloo")


def train(total_epochs: int) -> bool:
    """A few DDP steps; True when every rank ends with the same weights."""
    ddp_setup()
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(total_epochs):
        optimizer.zero_grad()
        F.mse_loss(model(torch.ones(8, 4)), torch.zeros(8, 1)).backward()
        optimizer.step()
    weights = model.module.weight.detach().clone()
    gathered = [torch.zeros_like(weights) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, weights)
    destroy_process_group()
    return all(torch.equal(weights, other) for other in gathered)
