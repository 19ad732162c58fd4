"""The rank that holds the others back is named, on plain DDP code (issue 26).

Real launches of 2 CPU ranks (gloo), training loops written the way the PyTorch DDP tutorial
writes them: a DataLoader, a DDP model, ``loss.backward()``, ``optimizer.step()``; nothing of
accelnb's in them. A 0.2 s delay on rank 1, (a) in fetching the batch and (b) in the model's
forward, is named within 10 steps, with where its time goes; 200 balanced steps name nobody.
The time DDP's all-reduce makes every rank wait is equal on all ranks, so only the split before
the collective (``worker/step_timing.py``) can tell them apart.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from accelnb import launch
from accelnb.kernel.display.straggler_watch import StragglerWatch
from accelnb.kernel.run.group import call_answers
from accelnb.wire.events import StepWindow

pytestmark = pytest.mark.usefixtures("no_leftovers")

DELAY_S = 0.2


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, slow_rank: int | None) -> None:
        self.slow = slow_rank is not None and dist.get_rank() == slow_rank

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slow and index % 16 == 0:  # once per batch of 16: a slow disk, a slow decode
            time.sleep(DELAY_S)
        return torch.randn(32), torch.randn(4)


class Model(nn.Module):
    def __init__(self, slow_rank: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        self.slow = slow_rank is not None and dist.get_rank() == slow_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(DELAY_S)  # an expensive layer only this rank runs
        return self.net(x)


def train(steps: int, slow_data_rank: int | None, slow_forward_rank: int | None) -> int:
    model = DDP(Model(slow_forward_rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Samples(slow_data_rank), batch_size=16)
    done = 0
    for inputs, targets in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        done += 1
        if done == steps:
            break
    return done


@pytest.fixture
def cell(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    written: list[str] = []
    real_sink = call_answers.notebook_sink

    def recording_sink(stream: Any, text: str) -> None:
        written.append(text)
        real_sink(stream, text)

    monkeypatch.setattr(call_answers, "notebook_sink", recording_sink)
    return written


@pytest.mark.parametrize(("where", "args", "cause"), [
    ("data", (10, 1, None), "waiting for data"),
    ("forward", (10, None, 1), "computing (the forward pass)"),
])
def test_a_delay_on_rank_1_is_named_within_10_steps(where: str, args: tuple[Any, ...], cause: str,
                                                    cell: list[str]) -> None:
    assert launch(train, args=args, num_processes=2, cpu=True, quiet=True, timeout=120).values == {0: 10, 1: 10}
    named = [text for text in cell if "holds the others back" in text]
    assert len(named) == 1, cell
    assert named[0].startswith("accelnb: rank 1 holds the others back by 0.") and cause in named[0], named[0]
    lead = float(named[0].split("back by ")[1].split(" s")[0])
    assert DELAY_S * 0.75 <= lead <= DELAY_S * 2, named[0]


def test_200_balanced_steps_name_nobody(cell: list[str]) -> None:
    values = launch(train, args=(200, None, None), num_processes=2, cpu=True, quiet=True, timeout=120).values
    assert values == {0: 200, 1: 200}
    assert not [text for text in cell if "holds the others back" in text]


def window(rank: int, step: float, data: float, forward: float) -> StepWindow:
    return StepWindow(rank, 1, step, 1, data, forward)


def test_the_watch_waits_for_every_rank_and_names_each_straggler_once() -> None:
    watch = StragglerWatch(world_size=3)
    for _ in range(5):
        watch.add(window(0, 0.3, 0.01, 0.02))
        watch.add(window(1, 0.3, 0.22, 0.02))
    assert watch.verdict() is None  # rank 2 has not been heard from
    for _ in range(5):
        watch.add(window(2, 0.3, 0.01, 0.02))
    found = watch.verdict()
    assert found is not None and found.rank == 1 and found.cause == "waiting for data"
    assert watch.verdict() is None  # once
