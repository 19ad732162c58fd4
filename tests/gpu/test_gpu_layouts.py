"""Ranks on real GPUs: several GPUs per rank, device_map="auto", Accelerate's FSDP (needs CUDA).

Skipped cleanly without CUDA; the layouts themselves are tested without a GPU in
``tests/test_planning.py``; stopping a generate on a model spread over the GPUs in ``test_gpu_stop.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from accelnb import launch, notebook_launcher
from tests.gpu.gpukit import needs_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_leftovers"), needs_gpus(1)]


def what_the_rank_sees() -> tuple[str, int, str, str]:
    import torch

    return (os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.device_count(), f"cuda:{torch.cuda.current_device()}",
            str(torch.zeros(1, device="cuda").device))


def test_gpus_per_rank_with_the_one_gpu() -> None:
    assert notebook_launcher(what_the_rank_sees, gpus="0", gpus_per_rank=1, quiet=True) == ("0", 1, "cuda:0", "cuda:0")


@needs_gpus(2)
def test_one_rank_owns_two_gpus_as_cuda_0_and_1() -> None:
    assert notebook_launcher(what_the_rank_sees, gpus="0,1", gpus_per_rank=2, quiet=True) == ("0,1", 2, "cuda:0",
                                                                                               "cuda:0")


@needs_gpus(4)
def test_two_ranks_of_two_gpus_see_only_their_own() -> None:
    values = launch(what_the_rank_sees, gpus="0,1,2,3", gpus_per_rank=2, quiet=True).values
    assert values == {0: ("0,1", 2, "cuda:0", "cuda:0"), 1: ("2,3", 2, "cuda:1", "cuda:1")}


def generate_on_gpu(path: str) -> tuple[list[list[int]], str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    tokens = model.generate(torch.tensor([[1, 2, 3]], device=model.device), max_new_tokens=4, do_sample=False,
                            pad_token_id=0)
    return tokens.tolist(), str(model.device), getattr(model, "hf_device_map", None)


def test_device_map_auto_generates_on_the_gpu(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokens, device, _ = notebook_launcher(generate_on_gpu, args=(str(tmp_path),), gpus="0", quiet=True, timeout=300)
    assert device == "cuda:0" and len(tokens[0]) == 7


FSDP_ONE_RANK = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_min_num_params: 1
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_reshard_after_forward: true
mixed_precision: 'no'
num_processes: 1
"""


def accelerate_fsdp_step() -> tuple[str, int, str, float]:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(4, 8, device=accelerator.device), torch.randn(4, 1, device=accelerator.device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    return (accelerator.distributed_type.value, accelerator.state.fsdp_plugin.fsdp_version, str(accelerator.device),
            loss.item())


def test_accelerate_fsdp_with_one_rank_from_a_config_file(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    config = tmp_path / "fsdp.yaml"
    config.write_text(FSDP_ONE_RANK)
    kind, version, device, loss = notebook_launcher(accelerate_fsdp_step, config_file=str(config), gpus="0",
                                                    quiet=True, timeout=300)
    assert (kind, version, device) == ("FSDP", 2, "cuda:0") and loss == loss
