"""Ending ranks that hold GPUs: Stop and timeout= give the GPU memory back (read from NVML).

A rank that holds most of a GPU's memory is stopped with the notebook's Stop (SIGINT to this
process, as Jupyter sends the kernel); a rank hung in an NCCL collective, and one waiting on a
GPU that never finishes, are ended by ``timeout=``; a ``device_map="auto"`` generate is stopped
midway. Each time every rank is gone and NVML shows the memory free within 3 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import accelnb
from accelnb import launch
from accelnb.kernel.run import run_state
from tests.conftest import worker_processes
from tests.gpu.gpukit import StopWhenMarked, cuda_gpu_count, memory_used, needs_gpus, nvidia_smi_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_leftovers"), needs_gpus(1)]

FREED_WITHIN_S = 3.0


def assert_freed_by(deadline: float, gpus: list[int], baseline: dict[int, int], held: int) -> None:
    """Each of ``gpus`` is back within ``held / 2`` bytes of its baseline use before ``deadline``."""
    while True:
        now_used = {gpu: memory_used(gpu) for gpu in gpus}
        if all(now_used[gpu] < baseline[gpu] + held // 2 for gpu in gpus):
            return
        assert time.monotonic() < deadline, f"GPU memory not freed: {now_used}, before the run {baseline}"
        time.sleep(0.02)


def hold_most_of_the_gpu(marker: str, share: float) -> None:
    """Allocate ``share`` of the free memory of this rank's GPU, say so, and keep it."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    block = torch.ones(int(free * share), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    Path(marker).write_text(str(block.numel()))
    while True:
        time.sleep(0.05)


def test_stop_while_a_rank_holds_most_of_a_gpu_frees_it_within_3_s(tmp_path: Path) -> None:
    gpu = nvidia_smi_gpus()[cuda_gpu_count() - 1].index  # the last GPU, so that cuda:0 is not assumed
    marker = tmp_path / "holding"
    baseline = {gpu: memory_used(gpu)}
    press = StopWhenMarked(marker)
    remove_hook = run_state.add_wait_hook(press)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(hold_most_of_the_gpu, args=(str(marker), 0.8), gpus=[gpu], quiet=True, timeout=300)
    finally:
        remove_hook()
    held = int(marker.read_text())
    assert press.pressed_at and held > 0
    assert_freed_by(press.pressed_at[0] + FREED_WITHIN_S, [gpu], baseline, held)
    assert worker_processes() == []


def hang_in_all_reduce_on_rank_0(marker_dir: str) -> None:
    """Rank 0 waits in an NCCL all_reduce that rank 1 never joins; both hold GPU memory."""
    import torch
    import torch.distributed as dist

    free, _ = torch.cuda.mem_get_info()
    block = torch.ones(int(free * 0.5), dtype=torch.uint8, device="cuda")
    Path(marker_dir, f"rank{dist.get_rank()}").write_text(str(block.numel()))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()  # NCCL runs on the GPU: the wait is here
    while True:
        time.sleep(0.05)


@needs_gpus(2)
def test_a_timeout_in_a_hung_nccl_collective_ends_every_rank_and_frees_the_gpus(tmp_path: Path) -> None:
    gpus = [gpu.index for gpu in nvidia_smi_gpus()[:2]]
    baseline = {gpu: memory_used(gpu) for gpu in gpus}
    with pytest.raises(accelnb.LaunchTimeout):
        launch(hang_in_all_reduce_on_rank_0, args=(str(tmp_path),), gpus=gpus, quiet=True, timeout=15)
    ended = time.monotonic()
    held = min(int(path.read_text()) for path in tmp_path.glob("rank*"))
    assert_freed_by(ended + FREED_WITHIN_S, gpus, baseline, held)
    assert worker_processes() == []


def wait_on_a_gpu_that_never_finishes(marker: str) -> None:
    """An NCCL all_reduce queued behind a GPU kernel that spins for hours: the rank waits on the GPU."""
    import torch
    import torch.distributed as dist

    free, _ = torch.cuda.mem_get_info()
    block = torch.ones(int(free * 0.5), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    Path(marker).write_text(str(block.numel()))
    torch.cuda._sleep(10**13)  # about two hours of GPU clock cycles
    total = torch.ones(1, device="cuda")
    dist.all_reduce(total)
    total.item()


def test_a_timeout_while_a_rank_waits_on_its_gpu_ends_it_and_frees_the_gpu(tmp_path: Path) -> None:
    gpu = nvidia_smi_gpus()[0].index
    marker = tmp_path / "holding"
    baseline = {gpu: memory_used(gpu)}
    with pytest.raises(accelnb.LaunchTimeout):
        launch(wait_on_a_gpu_that_never_finishes, args=(str(marker),), gpus=[gpu], quiet=True, timeout=15)
    ended = time.monotonic()
    assert_freed_by(ended + FREED_WITHIN_S, [gpu], baseline, int(marker.read_text()))
    assert worker_processes() == []


# ── a model spread over every GPU with device_map="auto" ───────────────────────────────────────
def generate_until_stopped(path: str, marker: str) -> int:
    """Generate thousands of tokens on a model spread by ``device_map="auto"``; the first token
    writes ``marker``."""
    import torch
    from transformers import AutoModelForCausalLM

    class MarkOnFirstToken:  # a generate() streamer
        def put(self, value: torch.Tensor) -> None:
            Path(marker).touch()

        def end(self) -> None:
            pass

    model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    tokens = model.generate(torch.tensor([[1, 2, 3]], device=model.device), max_new_tokens=4000,
                            min_new_tokens=4000, do_sample=False, pad_token_id=0, streamer=MarkOnFirstToken())
    return int(tokens.shape[1])


def test_stop_during_a_device_map_auto_generate_ends_it_and_frees_every_gpu(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    count = cuda_gpu_count()
    gpus = [gpu.index for gpu in nvidia_smi_gpus()[:count]]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, n_positions=4096,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "model")  # random weights: no download
    marker = tmp_path / "generating"
    baseline = {gpu: memory_used(gpu) for gpu in gpus}
    press = StopWhenMarked(marker)
    remove_hook = run_state.add_wait_hook(press)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(generate_until_stopped, args=(str(tmp_path / "model"), str(marker)), gpus=gpus,
                   gpus_per_rank=count, quiet=True, timeout=300)
    finally:
        remove_hook()
    assert press.pressed_at, "generate() never produced a token"
    assert_freed_by(press.pressed_at[0] + FREED_WITHIN_S, gpus, baseline, 2**27)  # a CUDA context alone is more
    assert worker_processes() == []
