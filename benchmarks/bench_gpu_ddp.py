"""DDP training throughput on GPUs: the same loop under accelnb and under torchrun.

    python benchmarks/bench_gpu_ddp.py [--gpus N] [--repeats 3] [--write]

One loop, run by both launchers on the same N GPUs (default: every GPU), NCCL, one rank per GPU:
an MLP of ``depth`` square Linear layers in DistributedDataParallel, SGD, random data made on the
GPU (so no data loading is timed). Two sizes:

``small``
    width 1024, depth 4, batch 256: a step of about a millisecond, where any per-step cost of the
    launcher (a thread, a hook, a step counter) would show.
``large``
    width 8192, depth 8, batch 1024: tens of milliseconds, where the GPU and NCCL dominate.

Each rank runs ``--warmup`` steps, synchronises, then times ``--steps`` steps (``time.perf_counter``
around the loop, ``torch.cuda.synchronize()`` before reading it); rank 0's time is the run's. The
launch itself (process start, imports, NCCL set-up) is not timed: that is bench_launch.py's subject.
Runs alternate between the launchers, so a burst of load hits both; the table shows the median
time per step of each and the ratio of throughputs (accelnb / torchrun, 1.00 = the same speed).
A benchmark, not a test: nothing is asserted. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

SIZES = {"small": (1024, 4, 256), "large": (8192, 8, 1024)}  # width, depth, batch
RESULT_PREFIX = "BENCH_GPU_DDP_RESULT "


@dataclass(frozen=True)
class Loop:
    width: int
    depth: int
    batch: int
    warmup: int
    steps: int


def time_ddp_steps(loop: Loop) -> float:
    """Seconds per step of DDP training on this rank's GPU (the process group is up)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cuda", torch.cuda.current_device())
    layers = [torch.nn.Linear(loop.width, loop.width) for _ in range(loop.depth)]
    model = DDP(torch.nn.Sequential(*layers).to(device), device_ids=[device.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = torch.randn(loop.batch, loop.width, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        optimizer.step()

    for _ in range(loop.warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(loop.steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / loop.steps


def under_accelnb(loop: Loop, gpus: int) -> float:
    import accelnb

    return accelnb.launch(time_ddp_steps, args=(loop,), gpus=list(range(gpus)), quiet=True, timeout=600).values[0]


def under_torchrun(loop: Loop, gpus: int) -> float:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               os.path.abspath(__file__), "--as-torchrun-rank", json.dumps(loop.__dict__)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return float(lines[0].removeprefix(RESULT_PREFIX))


def as_torchrun_rank(loop_json: str) -> None:
    """What each of torchrun's ranks runs: the same loop, in the group torchrun's environment names."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    seconds = time_ddp_steps(Loop(**json.loads(loop_json)))
    if dist.get_rank() == 0:
        print(RESULT_PREFIX + repr(seconds), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each launcher per size")
    parser.add_argument("--steps-small", type=int, default=1000, help="timed steps of the small loop")
    parser.add_argument("--steps-large", type=int, default=50, help="timed steps of the large loop")
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of RESULTS.md")
    parser.add_argument("--as-torchrun-rank", metavar="LOOP", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_torchrun_rank:
        as_torchrun_rank(args.as_torchrun_rank)
        return

    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = args.gpus or have
    if have == 0 or gpus > have:
        print(f"bench_gpu_ddp: skipped: needs {max(gpus, 1)} CUDA GPU(s), this machine has {have}")
        return
    rows = []
    for name, (width, depth, batch) in SIZES.items():
        steps = args.steps_small if name == "small" else args.steps_large
        loop = Loop(width, depth, batch, warmup=max(10, steps // 10), steps=steps)
        times: dict[str, list[float]] = {"accelnb": [], "torchrun": []}
        for _ in range(args.repeats):
            times["accelnb"].append(under_accelnb(loop, gpus))
            times["torchrun"].append(under_torchrun(loop, gpus))
        ours, theirs = statistics.median(times["accelnb"]), statistics.median(times["torchrun"])
        rows.append(f"| {name} ({width}×{depth}, batch {batch}) | {steps} | {ours * 1e3:.3f} | {theirs * 1e3:.3f} "
                    f"| {theirs / ours:.3f} |")
        print(f"{name}: accelnb {ours * 1e3:.3f} ms/step, torchrun {theirs * 1e3:.3f} ms/step, "
              f"throughput ratio accelnb/torchrun {theirs / ours:.3f} "
              f"(runs: accelnb {[round(t * 1e3, 3) for t in times['accelnb']]}, "
              f"torchrun {[round(t * 1e3, 3) for t in times['torchrun']]})", flush=True)
    table = "\n".join([
        "## DDP on GPUs: accelnb vs torchrun (bench_gpu_ddp.py)", "",
        f"{gpus} × {torch.cuda.get_device_name(0)}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; median of {args.repeats} runs each, alternating; rank 0's loop time.", "",
        "| size | timed steps | accelnb ms/step | torchrun ms/step | throughput accelnb/torchrun |",
        "|---|---|---|---|---|", *rows])
    print(table)
    if args.write:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from results_file import replace_section

        replace_section("## DDP on GPUs", table)


if __name__ == "__main__":
    main()
