"""The big trainers run unchanged inside a launch, and see its distributed set-up (2 CPU ranks).

Each function below is what a user would write for ``torchrun``: nothing accelnb-specific. The
models are tiny (built from configs, nothing downloaded) so each test takes seconds, most of it
the libraries' own imports in a fresh rank. Also here: a one-rank launch of a model loaded with
``device_map="auto"`` (the "model bigger than one GPU" job, on CPU), with and without
``torch.distributed`` calls, and a ``generate()`` that hangs under ``timeout=``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from accelnb import LaunchTimeout, Session, launch
from tests.conftest import wait_until_no_workers

pytestmark = pytest.mark.usefixtures("no_leftovers")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer GPT-2 built from a config and saved, as a model downloaded once would be."""
    path = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


# ── Hugging Face Trainer ─────────────────────────────────────────────────────────────────────
def hf_trainer(model_path: str, output_dir: str) -> tuple[int, int, str, int, str, float]:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(model_path)
    tokens = torch.arange(1, 9)
    data = [{"input_ids": tokens, "labels": tokens} for _ in range(16)]
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, max_steps=3, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    return (args.world_size, args.process_index, args.parallel_mode.value, trainer.state.global_step,
            type(trainer.model_wrapped).__name__, result.training_loss)


def test_hf_trainer_trains_with_ddp_across_the_ranks(tiny_lm: str, tmp_path: Path) -> None:
    values = launch(hf_trainer, (tiny_lm, str(tmp_path)), num_processes=2, cpu=True, quiet=True, timeout=120).values
    assert [v[:5] for v in (values[0], values[1])] == [
        (2, 0, "distributed", 3, "DistributedDataParallel"), (2, 1, "distributed", 3, "DistributedDataParallel")]
    assert values[0][5] == values[1][5]  # one model: the ranks' losses are all-reduced


# ── Lightning ────────────────────────────────────────────────────────────────────────────────
def lightning_ddp() -> tuple[int, int, str, bool, int]:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    group = dist.group.WORLD
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), data)
    return (trainer.global_rank, trainer.world_size, type(trainer.strategy.cluster_environment).__name__,
            dist.group.WORLD is group, trainer.global_step)


def test_lightning_ddp_joins_the_launchs_ranks_and_process_group() -> None:
    pytest.importorskip("lightning")
    values = launch(lightning_ddp, num_processes=2, cpu=True, quiet=True, timeout=120).values
    # torchrun's environment (TORCHELASTIC_RUN_ID, GROUP_RANK, ...): Lightning sees ranks torchrun
    # started for it (TorchElasticEnvironment) and keeps the process group it finds instead of
    # launching its own workers.
    assert values == {0: (0, 2, "TorchElasticEnvironment", True, 4), 1: (1, 2, "TorchElasticEnvironment", True, 4)}


# ── FSDP2 ────────────────────────────────────────────────────────────────────────────────────
def fsdp2() -> tuple[str, tuple[int, ...], tuple[int, ...], list[float]]:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weight = model[0].weight
    return type(weight).__name__, tuple(weight.to_local().shape), tuple(weight.shape), losses


def test_fsdp2_fully_shard_shards_parameters_across_cpu_ranks() -> None:
    values = launch(fsdp2, num_processes=2, cpu=True, quiet=True, timeout=120).values
    for kind, local, full, losses in values.values():
        assert (kind, local, full) == ("DTensor", (8, 8), (16, 8))  # each rank holds half of each weight
        assert losses[-1] < losses[0]
    assert values[0][3] == values[1][3]


# ── torch.compile ────────────────────────────────────────────────────────────────────────────
def compiled_first_call() -> tuple[float, float, int, int, bool]:
    """What a user would time; also run in a plain process by ``benchmarks/bench_compile.py``."""
    import time

    import psutil
    import torch
    import torch._inductor.config as inductor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    compiled = torch.compile(model)
    x = torch.randn(8, 16)
    started = time.perf_counter()
    out = compiled(x)
    first = time.perf_counter() - started
    started = time.perf_counter()
    compiled(x)
    second = time.perf_counter() - started
    children = len(psutil.Process().children(recursive=True))
    return first, second, inductor.compile_threads, children, torch.allclose(out, model(x), atol=1e-5)


def test_torch_compile_compiles_in_the_rank_without_a_pool_of_compile_processes() -> None:
    values = launch(compiled_first_call, num_processes=2, cpu=True, quiet=True, timeout=240).values
    for first, second, threads, children, same in values.values():
        assert (threads, children, same) == (1, 0, True)
        assert second < first


# ── one rank, a model spread with device_map="auto" ──────────────────────────────────────────
def generate(model_path: str, use_distributed: bool) -> tuple[list[list[int]], str, int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, device_map="auto")
    tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    world = -1
    if use_distributed:
        import torch.distributed as dist

        world = dist.get_world_size()
        dist.barrier()
    return tokens.tolist(), str(model.device), world


def test_one_rank_loads_with_device_map_auto_and_generates(tiny_lm: str) -> None:
    plain = launch(generate, (tiny_lm, False), num_processes=1, cpu=True, quiet=True, timeout=120).values[0]
    distributed = launch(generate, (tiny_lm, True), num_processes=1, cpu=True, quiet=True, timeout=120).values[0]
    assert plain[:2] == distributed[:2] and plain[1] == "cpu" and len(plain[0][0]) == 7
    assert (plain[2], distributed[2]) == (-1, 1)


# ── a generate() that hangs ──────────────────────────────────────────────────────────────────
_loaded_models: dict[str, Any] = {}  # in the rank: kept between a session's calls


def load_the_model(model_path: str) -> None:
    """The slow part (importing transformers: seconds on a loaded machine), outside the timed call."""
    from transformers import AutoModelForCausalLM

    _loaded_models[model_path] = AutoModelForCausalLM.from_pretrained(model_path, device_map="auto")


def stream_from_a_generate_that_hangs(model_path: str) -> list[int]:
    """The notebook pattern: generate() in a thread, the main thread reading its streamer. A
    stopping criterion that waits for a peer that never answers stands in for a stuck collective."""
    import queue
    import threading

    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria
    from transformers.generation.streamers import BaseStreamer

    class QueueStreamer(BaseStreamer):
        def __init__(self) -> None:
            self.tokens: queue.Queue[Any] = queue.Queue()

        def put(self, value: torch.Tensor) -> None:
            self.tokens.put(value)

        def end(self) -> None:
            self.tokens.put(None)

    class WaitForAPeerThatNeverAnswers(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            threading.Event().wait()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = _loaded_models.get(model_path) or AutoModelForCausalLM.from_pretrained(model_path, device_map="auto")
    streamer = QueueStreamer()
    threading.Thread(target=model.generate, name="generate", daemon=True, kwargs={
        "input_ids": torch.tensor([[1, 2, 3]]), "max_new_tokens": 4, "pad_token_id": 0, "streamer": streamer,
        "stopping_criteria": [WaitForAPeerThatNeverAnswers()]}).start()
    received = []
    while (token := streamer.tokens.get()) is not None:  # the waiting thread
        received.append(token)
    return received


def test_a_hanging_generate_shows_the_waiting_threads_stack_and_is_killed(tiny_lm: str) -> None:
    kernel_state = {"model_path": tiny_lm}
    # A session, so that the timeout covers the hang only: with the import inside the timed call,
    # a machine loaded by four parallel test runs timed out in the import, before generate().
    with Session.start(num_processes=1, cpu=True, quiet=True) as session:
        session.run(load_the_model, (tiny_lm,))
        with pytest.raises(LaunchTimeout) as info:
            session.run(stream_from_a_generate_that_hangs, (tiny_lm,), timeout=5)
    stacks = str(info.value)
    assert "in stream_from_a_generate_that_hangs" in stacks and "in get" in stacks  # the main thread, waiting
    assert "in generate" in stacks and "in __call__" in stacks and "in wait" in stacks  # the generate thread
    wait_until_no_workers(5.0)
    assert kernel_state == {"model_path": tiny_lm} and not torch.cuda.is_initialized()
    assert launch(os.getpid, num_processes=1, cpu=True, quiet=True).values[0] != os.getpid()  # the next launch works
