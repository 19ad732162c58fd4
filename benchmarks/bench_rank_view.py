"""What the live per-rank view costs a training loop (issue 26): paired runs with it and without.

    python benchmarks/bench_rank_view.py [--pairs 8] [--write]

The view has two halves: in every rank, a step counter on torch's global optimizer-step hook and
a timer around DDP's forward (``worker/step_timing.py``); in the kernel, folding the ranks' step
windows, reading NVML and ``/proc`` once a second and redrawing the cell at most once a second
(``kernel/display/rank_activity.py``, ``notebook/rank_table.py``). ``ACCELNB_STEP_TIMING=off`` turns
the rank half off, and with no step counted the kernel half draws nothing: that is the run
"without".

Two loops, both DDP on 2 CPU ranks (gloo), Adam, batch 64, 20 warm-up steps then the timed steps,
steps/s measured inside rank 0:

- ``small``: the launch benchmark's loop, Linear(64,256)-ReLU-Linear(256,10), about 2 ms a step:
  the worst case, where a fixed cost per step shows most;
- ``mnist``: an MNIST-sized MLP, Linear(784,512)-ReLU-Linear(512,512)-ReLU-Linear(512,10).

Each is run where users run it: in a real Jupyter kernel (``jupyter_client``; the view draws in
the cell) and from a plain script (this process; nothing is drawn until the end). "With" and
"without" alternate (A B A B …), so a burst of load hits both; the table gives the medians and the
median of the pair ratios. A benchmark, not a test: nothing is asserted. With ``--write`` the
tables replace this script's section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any

from results_file import replace_section  # benchmarks/ is on sys.path as the script's folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = "## Live per-rank view: its cost to training throughput (issue 26)"
LOOPS = {"small": (64, 256, 1, 2000), "mnist": (784, 512, 2, 600)}  # in, hidden, hidden layers, timed steps
WARMUP = 20

LOOP_SOURCE = '''
import os, time, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import accelnb

def ddp_loop(width_in, hidden, layers, steps, warmup):
    torch.manual_seed(1234 + dist.get_rank())
    blocks = [nn.Linear(width_in, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = DDP(nn.Sequential(*blocks, nn.Linear(hidden, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(64, width_in), torch.randint(0, 10, (64,))
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
    return steps / (time.perf_counter() - started)

def measured(view, loop_args):
    """Rank 0's steps/s, and the CPU seconds the launching process (the kernel) spent on the run."""
    os.environ["ACCELNB_STEP_TIMING"] = "on" if view else "off"
    cpu = time.process_time()
    value = accelnb.launch(ddp_loop, args=loop_args, num_processes=2, quiet=True).value
    return value, time.process_time() - cpu
'''


class Kernel:
    """A real Jupyter kernel on this working tree, driven cell by cell."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        self.manager, self.client = start_new_kernel(kernel_name="python3", env=env, cwd=REPO)
        self.run(LOOP_SOURCE)

    def run(self, code: str) -> str:
        msg_id = self.client.execute(code)
        printed, displays = [], 0
        while True:
            message = self.client.get_iopub_msg(timeout=600)
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            if kind == "stream":
                printed.append(message["content"]["text"])
            elif kind == "error":
                raise RuntimeError("\n".join(message["content"]["traceback"]))
            elif kind in ("display_data", "update_display_data"):
                displays += 1
            elif kind == "status" and message["content"]["execution_state"] == "idle":
                self.displays = displays
                return "".join(printed)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def pairs(where: str, loop: str, count: int, kernel: Kernel | None) -> dict[str, Any]:
    width_in, hidden, layers, steps = LOOPS[loop]
    args = (width_in, hidden, layers, steps, WARMUP)
    runs: dict[str, list[float]] = {"with": [], "without": []}
    kernel_cpu: dict[str, list[float]] = {"with": [], "without": []}
    draws: list[int] = []
    if kernel is None:
        namespace: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(LOOP_SOURCE, "<bench_rank_view>", "exec"), namespace)
    for _ in range(count):
        for view in (True, False):
            if kernel is not None:
                printed = kernel.run(f"print(*measured({view}, {args}))")
                value, cpu = map(float, printed.strip().splitlines()[-1].split())
                if view:
                    draws.append(kernel.displays)
            else:
                value, cpu = namespace["measured"](view, args)
            runs["with" if view else "without"].append(value)
            kernel_cpu["with" if view else "without"].append(cpu / (steps / value))  # CPU s per s of loop
    ratios = [a / b for a, b in zip(runs["with"], runs["without"], strict=True)]
    return {"where": where, "loop": loop, "steps": steps, "runs": runs, "ratios": ratios, "draws": draws,
            "kernel_cpu": kernel_cpu}


def per_step_cost(blocks: int, steps: int) -> dict[str, float]:
    """The rank half alone, without the noise of two ranks and a kernel sharing two cores: one
    process, a world of 1 (gloo), the small loop's step timed with and without
    ``step_timing.install()`` in alternating blocks (what it installed is removed between blocks)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accelnb.worker import step_timing

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.set_num_threads(1)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(2 * blocks):
        counting = block % 2 == 0
        uninstall = step_timing.install() if counting else None
        started = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        times[counting].append((time.perf_counter() - started) / steps)
        if uninstall is not None:
            uninstall()
            step_timing.take_window(0)
    dist.destroy_process_group()
    with_s, without_s = statistics.median(times[True]), statistics.median(times[False])
    return {"with_us": with_s * 1e6, "without_us": without_s * 1e6, "blocks": blocks, "steps": steps}


def cpu_table(results: list[dict[str, Any]]) -> str:
    rows = ["| where | loop | launching process CPU, with the view | without | difference: share of one core |",
            "| --- | --- | --: | --: | --: |"]
    for r in results:
        with_view, without = (statistics.median(r["kernel_cpu"][k]) for k in ("with", "without"))
        share = (with_view - without) * 100
        rows.append(f"| {r['where']} | {r['loop']} | {with_view:.3f} | {without:.3f} | {share:+.1f} % |")
    return "\n".join(rows)


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| where | loop | steps | with the view, median steps/s | without, median steps/s | "
            "median of pair ratios (with / without) | min–max ratio | cost | pairs | cell updates per run |",
            "| --- | --- | --: | --: | --: | --: | --- | --: | --: | --- |"]
    for r in results:
        with_view, without = statistics.median(r["runs"]["with"]), statistics.median(r["runs"]["without"])
        ratio = statistics.median(r["ratios"])
        draws = f"{min(r['draws'])}–{max(r['draws'])}" if r["draws"] else "0 (drawn once, at the end)"
        rows.append(f"| {r['where']} | {r['loop']} | {r['steps']} | {with_view:,.0f} | {without:,.0f} | {ratio:.3f} | "
                    f"{min(r['ratios']):.3f}–{max(r['ratios']):.3f} | {(1 - ratio) * 100:+.1f} % | "
                    f"{len(r['ratios'])} | {draws} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--write", action="store_true")
    opts = parser.parse_args()
    sys.path.insert(0, REPO)
    import torch

    load_start = os.getloadavg()
    started = time.monotonic()
    results = []
    kernel = Kernel()
    try:
        for loop in LOOPS:
            results.append(pairs("Jupyter kernel", loop, opts.pairs, kernel))
    finally:
        kernel.close()
    for loop in LOOPS:
        results.append(pairs("script", loop, opts.pairs, None))
    micro = per_step_cost(blocks=10, steps=500)
    text = "\n".join([
        HEADING, "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, 2 CPU ranks (gloo)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load_start)}, at end "
        f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}; whole run {time.monotonic() - started:.0f} s",
        "",
        "Steps/s measured inside rank 0; \"without\" is `ACCELNB_STEP_TIMING=off` (no step counted in the "
        "ranks, so the kernel draws no per-rank table). Cost = 1 − the median pair ratio; the target is at most "
        "2 %. Cell updates: the view's display messages in the cell during one run with the view.",
        "", table(results), "",
        "The pair ratios above spread by ±10 % on this machine (two ranks and the kernel share 2 cores), more "
        "than the 2 % asked about, so the two halves were also measured apart, where the noise is smaller:",
        "",
        "- the kernel half: CPU seconds the launching process (the kernel, or the script) spent per second "
        "of the training loop, medians; on 2 cores every such second is taken from a rank:",
        "", cpu_table(results), "",
        f"- the rank half: one process, a world of 1, the small loop's step with the step counting installed "
        f"and without, alternating {micro['blocks']} blocks of {micro['steps']} steps each, medians: "
        f"{micro['with_us']:,.0f} µs with, {micro['without_us']:,.0f} µs without "
        f"({(micro['with_us'] / micro['without_us'] - 1) * 100:+.1f} %).",
        ""])
    print(text)
    if opts.write:
        replace_section(HEADING, text)


if __name__ == "__main__":
    main()
