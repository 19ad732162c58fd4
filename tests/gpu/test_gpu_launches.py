"""Launches on real GPUs: what users do with accelnb on a GPU machine, checked against nvidia-smi.

CUDA initialised in the kernel, then a launch and a ``%%distributed`` cell; NCCL all_reduce; each
rank's ``cuda:N`` is the physical GPU the plan named (UUIDs from ``nvidia-smi``), also under a
``CUDA_VISIBLE_DEVICES`` set in the kernel; ``%torchrun --nproc-per-node gpu``; a sweep with one
trial per GPU; bf16 (and fp8 where the GPU and a backend allow) through Accelerate; the per-rank
view's GPU figures; the doctor's GPU checks. Every test runs on however many GPUs there are; one
that needs more skips and says how many.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch

import accelnb
from accelnb import launch
from tests.gpu.gpukit import bare_uuid, cuda_gpu_count, needs_gpus, nvidia_smi_gpus, run_in_a_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_leftovers"), needs_gpus(1)]


# ── CUDA in the kernel, then launches ──────────────────────────────────────────────────────────
KERNEL_CELLS = [
    "import torch, accelnb\n"
    "torch.zeros(1).cuda()  # what breaks every fork-the-kernel launcher\n"
    "print('kernel cuda initialised:', torch.cuda.is_initialized())",
    "def where():\n"
    "    import torch, torch.distributed as dist\n"
    "    total = torch.ones(1, device='cuda') * (dist.get_rank() + 1)\n"
    "    dist.all_reduce(total)\n"
    "    return str(total.device), dist.get_backend(), total.item()\n"
    "print(sorted(accelnb.launch(where, quiet=True).values.items()))",
    "%load_ext accelnb",
    "%%distributed --output all\n"
    "import torch\n"
    "import torch.distributed as dist\n"
    "print('on', torch.zeros(1, device=device).device, dist.get_backend())",
]


def test_cuda_initialised_in_the_kernel_then_a_launch_and_a_cell_run_on_every_gpu() -> None:
    count = cuda_gpu_count()
    initialised, launched, _, cell = run_in_a_kernel(KERNEL_CELLS)
    assert "kernel cuda initialised: True" in initialised.stdout, initialised
    total = count * (count + 1) / 2
    assert launched.stdout.strip().splitlines()[-1] == str([(r, (f"cuda:{r}", "nccl", total)) for r in range(count)]), \
        launched
    assert not cell.errors, cell
    for rank in range(count):
        assert f"on cuda:{rank} nccl" in cell.stdout, cell


def all_reduce_a_large_tensor() -> tuple[str, str, float]:
    import torch
    import torch.distributed as dist

    values = torch.full((16 * 2**20,), float(dist.get_rank() + 1), device="cuda")  # 64 MiB
    dist.all_reduce(values)
    return dist.get_backend(), str(values.device), values.min().item()


def test_nccl_all_reduce_on_every_gpu() -> None:
    count = cuda_gpu_count()
    values = launch(all_reduce_a_large_tensor, quiet=True, timeout=300).values
    assert values == {r: ("nccl", f"cuda:{r}", count * (count + 1) / 2) for r in range(count)}


# ── rank → cuda:N → physical GPU ───────────────────────────────────────────────────────────────
def physical_gpu() -> tuple[str, str]:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    return str(device), str(torch.cuda.get_device_properties(device).uuid)


def test_each_rank_runs_on_the_physical_gpu_nvidia_smi_numbers_so() -> None:
    smi = nvidia_smi_gpus()
    result = launch(physical_gpu, quiet=True)
    assert len(result.values) == cuda_gpu_count()
    for rank, (device, uuid) in result.values.items():
        assert device == f"cuda:{rank}"
        assert bare_uuid(uuid) == bare_uuid(smi[rank].uuid), (rank, uuid, smi)
        assert result.plan.ranks[rank].gpu is not None
        assert bare_uuid(result.plan.ranks[rank].gpu.uuid) == bare_uuid(smi[rank].uuid)


@needs_gpus(2)
def test_gpus_given_in_reverse_order_put_rank_0_on_the_last_gpu() -> None:
    smi = nvidia_smi_gpus()
    order = list(reversed(range(cuda_gpu_count())))
    values = launch(physical_gpu, gpus=order, quiet=True).values
    assert {rank: bare_uuid(uuid) for rank, (_, uuid) in values.items()} == {
        rank: bare_uuid(smi[index].uuid) for rank, index in enumerate(order)}


def test_cuda_visible_devices_of_the_kernel_names_the_gpu_the_rank_gets() -> None:
    # The kernel is told to see only the last GPU, by UUID (CUDA's other spelling): the launch's
    # one rank runs there, and the plan names it by its nvidia-smi index.
    last = nvidia_smi_gpus()[-1]
    cell = ("import accelnb\n"
            "def physical_gpu():\n"
            "    import torch\n"
            "    device = torch.device('cuda', torch.cuda.current_device())\n"
            "    return str(device), str(torch.cuda.get_device_properties(device).uuid)\n"
            "result = accelnb.launch(physical_gpu, quiet=True)\n"
            "print('values', result.values)\n"
            "print('planned', [r.gpu.index for r in result.plan.ranks])")
    (shown,) = run_in_a_kernel([cell], CUDA_VISIBLE_DEVICES=last.uuid)
    assert not shown.errors, shown
    assert f"planned [{last.index}]" in shown.stdout, shown
    values = eval(shown.stdout.split("values ")[1].splitlines()[0])
    assert [(device, bare_uuid(uuid)) for device, uuid in values.values()] == [("cuda:0", bare_uuid(last.uuid))]


# ── %torchrun and sweeps ───────────────────────────────────────────────────────────────────────
TORCHRUN_SCRIPT = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
total = torch.ones(1, device="cuda")
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on cuda:{local} sum {total.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_nproc_per_node_gpu_runs_one_rank_per_gpu(tmp_path: Path) -> None:
    count = cuda_gpu_count()
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    _, ran = run_in_a_kernel(["%load_ext accelnb", f"%torchrun --nproc-per-node gpu --output all {script}"])
    assert not ran.errors, ran
    for rank in range(count):
        assert f"rank {rank} of {count} on cuda:{rank} sum {count}" in ran.stdout, ran


def trial_on_its_gpu(config: int) -> tuple[int, str, int]:
    import torch

    return config, str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid), torch.cuda.device_count()


def test_a_sweep_runs_one_trial_per_gpu_each_on_its_own() -> None:
    smi = nvidia_smi_gpus()
    count = cuda_gpu_count()
    trials = accelnb.sweep(trial_on_its_gpu, list(range(count)), timeout=300)
    assert [trial.error for trial in trials] == [None] * count
    assert sorted(trial.value[0] for trial in trials) == list(range(count))
    assert all(trial.value[2] == 1 for trial in trials)  # a trial sees its own GPU only
    assert {trial.gpus for trial in trials} == {(gpu.index,) for gpu in smi[:count]}
    for trial in trials:
        assert bare_uuid(trial.value[1]) == bare_uuid(smi[trial.gpus[0]].uuid)


# ── mixed precision through Accelerate ─────────────────────────────────────────────────────────
def accelerate_step() -> tuple[str, str, str, float]:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    optimizer = torch.optim.AdamW(model.parameters())
    inside: list[torch.dtype] = []  # what the first layer computed in: the model's output is not it,
    # since Accelerate's prepare() converts a mixed-precision model's outputs back to float32
    model[0].register_forward_hook(lambda _module, _args, output: inside.append(output.dtype))
    model, optimizer = accelerator.prepare(model, optimizer)
    with accelerator.autocast():
        loss = model(torch.randn(32, 64, device=accelerator.device)).float().pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    return accelerator.mixed_precision, str(inside[0]), str(accelerator.device), loss.item()


def test_bf16_through_accelerate() -> None:
    pytest.importorskip("accelerate")
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"needs a GPU with bf16; GPU 0 is {torch.cuda.get_device_name(0)}")
    precision, dtype, device, loss = launch(accelerate_step, gpus="0", mixed_precision="bf16", quiet=True,
                                            timeout=300).value
    assert (precision, dtype, device) == ("bf16", "torch.bfloat16", "cuda:0") and loss == loss


def test_fp8_through_accelerate_where_the_gpu_and_a_backend_allow() -> None:
    pytest.importorskip("accelerate")
    capability = torch.cuda.get_device_capability(0)
    if capability < (8, 9):
        pytest.skip(f"needs a GPU with fp8 (compute capability 8.9+); GPU 0 has {capability}")
    if not any(importlib.util.find_spec(name) for name in ("transformer_engine", "torchao", "msamp")):
        pytest.skip("needs an fp8 backend for Accelerate: transformer_engine, torchao or msamp")
    precision, _, device, loss = launch(accelerate_step, gpus="0", mixed_precision="fp8", quiet=True,
                                        timeout=300).value
    assert (precision, device) == ("fp8", "cuda:0") and loss == loss


# ── what the cell shows about the GPUs ─────────────────────────────────────────────────────────
RANK_VIEW_CELL = """
import time, torch, accelnb
from torch.nn.parallel import DistributedDataParallel as DDP

def train(steps):
    model = DDP(torch.nn.Linear(1024, 1024).cuda())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        time.sleep(0.05)
        optimizer.zero_grad()
        model(torch.randn(64, 1024, device="cuda")).sum().backward()
        optimizer.step()
    return steps

result = accelnb.launch(train, args=(60,), gpus="0", quiet=True)
samples = result.ranks[0].gpu_samples
print("samples", len(samples), [(s.gpu, s.synthetic, s.memory_used > 0, s.memory_total) for s in samples[-1:]])
"""


def test_the_per_rank_view_shows_the_real_gpus_figures() -> None:
    (shown,) = run_in_a_kernel([RANK_VIEW_CELL])
    assert not shown.errors, shown
    total = nvidia_smi_gpus()[0].memory_total_mib
    count = int(shown.stdout.split("samples ")[1].split()[0])
    assert count >= 1, shown.stdout
    (gpu, synthetic, used, memory_total), = eval(shown.stdout.split(f"samples {count} ")[1].splitlines()[0])
    assert (gpu, synthetic, used) == (0, False, True) and abs(memory_total / 2**20 - total) < 0.02 * total, shown.stdout
    final = shown.displays[-1]["text/plain"]
    assert "accelnb ranks (final)" in final and "rank 0: step 60" in final, final
    assert "GPU 0" in final and "synthetic" not in final, final


def test_the_doctor_checks_the_real_gpus() -> None:
    torch.zeros(1).cuda()  # CUDA in this process: the doctor says so, and that accelnb is fine with it
    smi = nvidia_smi_gpus()
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, check=True).stdout.splitlines()[0].strip()
    report = accelnb.doctor(show=False)
    gpus = report.by_name("GPUs")
    assert gpus.status == "ok" and f"driver {driver}" in gpus.detail, gpus
    for gpu in smi:
        assert f"{gpu.index} (" in gpus.detail, gpus
    assert report.by_name("CUDA in this kernel").detail.startswith("initialised: fine for accelnb"), report
    on_gpus = [check for check in report if check.name.startswith(("GPU", "peer-to-peer"))]
    assert all(check.status != "fail" for check in on_gpus), str(report)
    if len(smi) >= 2:
        assert report.by_name("peer-to-peer").status in ("ok", "warn"), report
