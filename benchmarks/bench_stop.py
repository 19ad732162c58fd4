"""What ``accelnb.stop_requested()`` costs a training step, how soon a Stop is answered, and what a
SIGTERM saves under torchrun and under accelnb (issue 27).

    python benchmarks/bench_stop.py [--blocks 8] [--peer-runs 5] [--write]

A DDP loop on 2 CPU ranks (gloo), Adam, batch 64, in one launch. Inside each rank, blocks of
steps alternate between three loops, so a burst of load on this 2-core machine hits all three:

- ``plain``: the step alone;
- ``stop_requested()``: the step, then ``accelnb.stop_requested()`` (accelnb's agreement: an
  asynchronous all-reduce at check points about every 0.05 s);
- ``all-reduce a flag``: the step, then a synchronous all-reduce of a stop flag every step, which
  is what code does by hand to stop every rank at the same step (and what Accelerate's
  ``check_trigger()`` does).

Two figures per loop: the median time per step over the blocks, and, measured directly, the time
spent inside the check itself (``perf_counter`` around the call) as a share of the step: the
block medians carry this machine's noise (several %), the direct share does not. Then the Stop
itself: a panel's Stop pressed at a step, and how long until every rank returned, saved, and how
many steps they took meanwhile. Two loops: ``small`` (Linear(64,256)-ReLU-Linear(256,10), about
2 ms a step, the worst case for a fixed cost) and ``mnist`` (784-512-512-10). Nothing is asserted.
With ``--write`` the tables replace this script's section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any

from results_file import replace_section  # benchmarks/ is on sys.path as the script's folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
HEADING = "## Stop that saves: what stop_requested() costs a step (issue 27)"
LOOPS = {"small": (64, 256, 10, 1), "mnist": (784, 512, 10, 2)}  # inputs, hidden, outputs, hidden layers
VARIANTS = ("plain", "stop_requested()", "all-reduce a flag")


def measure_checks(loop: str, blocks: int, steps_per_block: int) -> dict[str, Any]:
    """In a rank: alternate blocks of the three variants; per variant the block s/step and the
    seconds inside the check."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import accelnb

    inputs, hidden, outputs, layers = LOOPS[loop]
    torch.manual_seed(0)
    parts: list[torch.nn.Module] = [torch.nn.Linear(inputs, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        parts += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*parts, torch.nn.Linear(hidden, outputs)))
    optimizer = torch.optim.Adam(model.parameters())
    data, target = torch.randn(64, inputs), torch.randint(0, outputs, (64,))
    flag = torch.zeros(1)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(data), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def check(variant: str) -> bool:
        if variant == "stop_requested()":
            return accelnb.stop_requested()
        if variant == "all-reduce a flag":
            dist.all_reduce(flag)
            return bool(flag.item())
        return False

    for _ in range(20):  # warm-up
        step()
        accelnb.stop_requested()
    per_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    inside: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(blocks):
        for variant in VARIANTS:
            checking = 0.0
            started = time.perf_counter()
            for _ in range(steps_per_block):
                step()
                before = time.perf_counter()
                check(variant)
                checking += time.perf_counter() - before
            whole = time.perf_counter() - started
            per_step[variant].append(whole / steps_per_block)
            inside[variant].append(checking / whole)
    return {"per_step": per_step, "inside": inside}


def stop_latency(loop: str, press_at: int) -> tuple[float, int]:
    """Press a panel's Stop once rank 0 reported ``press_at``; (seconds to the launch's end, steps taken after)."""
    from accelnb import launch
    from accelnb.kernel.run import run_state
    from accelnb.kernel.run.group.stop_presses import PANEL_STOP

    reached = threading.Event()
    pressed_at: list[float] = []

    def sink(batch: Any) -> None:
        if any(step is not None and step >= press_at for step, _, _ in batch.records):
            reached.set()

    def press() -> None:
        reached.wait(120)
        pressed_at.append(time.perf_counter())
        run_state.request_stop(PANEL_STOP)

    threading.Thread(target=press, daemon=True).start()
    result = launch(train_until_stopped, (loop,), num_processes=2, cpu=True, quiet=True, output="none",
                    metric_sink=sink)
    return time.perf_counter() - pressed_at[0], result.value - press_at


def train_until_stopped(loop: str) -> int:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import accelnb

    inputs, hidden, outputs, _ = LOOPS[loop]
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
                                                        torch.nn.Linear(hidden, outputs)))
    optimizer = torch.optim.Adam(model.parameters())
    data, target = torch.randn(64, inputs), torch.randint(0, outputs, (64,))
    step = 0
    while True:
        loss = torch.nn.functional.cross_entropy(model(data), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        accelnb.report(step=step, step_seen=float(step))  # what the press waits for
        if accelnb.stop_requested():
            torch.save(model.module.state_dict(), os.devnull)
            return step
        step += 1


PEER_LOOP = """
import os, sys, signal, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

def build():
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                                        torch.nn.Linear(256, 10)))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)

def save(out, rank, step, model):
    torch.save({"step": step, "weights": [p.detach().clone() for p in model.module.parameters()]},
               os.path.join(out, f"rank{rank}.pt"))
"""

# torchrun: what people write for pre-emption, a SIGTERM handler that saves where the rank is.
TORCHRUN_SCRIPT = PEER_LOOP + """
def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build()
    state = {"step": 0}
    def on_sigterm(signum, frame):
        save(out, rank, state["step"], model)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_sigterm)
    data, target = torch.randn(64, 64), torch.randint(0, 10, (64,))
    while True:
        loss = torch.nn.functional.cross_entropy(model(data), target)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        state["step"] += 1
        if rank == 0 and state["step"] % 100 == 0:
            print("step", state["step"], flush=True)

main(sys.argv[1])
"""

# accelnb: the same loop, checking stop_requested() each step; the script gets SIGTERM.
ACCELNB_SCRIPT = PEER_LOOP + """
def train(out):
    import accelnb
    rank = dist.get_rank()
    model, optimizer = build()
    data, target = torch.randn(64, 64), torch.randint(0, 10, (64,))
    step = 0
    while True:
        loss = torch.nn.functional.cross_entropy(model(data), target)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        step += 1
        if rank == 0 and step % 100 == 0:
            print("step", step, flush=True)
        if accelnb.stop_requested():
            save(out, rank, step, model)
            return step

if __name__ == "__main__":
    from accelnb import notebook_launcher
    notebook_launcher(train, (sys.argv[1],), 2, cpu=True, quiet=True)
"""


def sigterm_peer(kind: str, press_at: int = 300) -> tuple[bool, bool, bool, float]:
    """SIGTERM to the launching process (torchrun, or a script calling accelnb) once rank 0 printed
    ``press_at``; (both ranks saved, at the same step, with the same weights; seconds to exit)."""
    import subprocess
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "train.py")
        with open(script, "w") as f:
            f.write(TORCHRUN_SCRIPT if kind == "torchrun" else ACCELNB_SCRIPT)
        command = ([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2", script, out]
                   if kind == "torchrun" else [sys.executable, script, out])
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
        assert process.stdout is not None
        for line in process.stdout:
            if line.strip() == f"step {press_at}":
                break
        pressed = time.perf_counter()
        process.terminate()
        process.wait(120)
        seconds = time.perf_counter() - pressed
        saved = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in (0, 1)
                 if os.path.exists(os.path.join(out, f"rank{r}.pt"))]
    both = len(saved) == 2
    same_step = both and saved[0]["step"] == saved[1]["step"]
    same_weights = both and all(torch.equal(mine, theirs)
                                for mine, theirs in zip(saved[0]["weights"], saved[1]["weights"], strict=True))
    return both, same_step, same_weights, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--peer-runs", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from accelnb import launch

    began = time.time()
    load_before = os.getloadavg()
    rows = []
    for loop, steps in (("small", 200), ("mnist", 60)):
        result = launch(measure_checks, (loop, args.blocks, steps), num_processes=2, cpu=True, quiet=True,
                        output="none")
        mine = result.values[0]
        plain = statistics.median(mine["per_step"]["plain"])
        for variant in VARIANTS:
            median = statistics.median(mine["per_step"][variant])
            rows.append(f"| {loop} | {variant} | {median * 1e3:.3f} | {(median / plain - 1) * 100:+.1f} % | "
                        f"{statistics.median(mine['inside'][variant]) * 100:.2f} % | {args.blocks} × {steps} |")
    latencies = []
    for loop in ("small", "mnist"):
        for press_at in (50, 150, 300):
            seconds, after = stop_latency(loop, press_at)
            latencies.append(f"| {loop} | {press_at} | {seconds:.2f} | {after} |")
    peers = []
    for kind in ("torchrun", "accelnb"):
        outcomes = [sigterm_peer(kind) for _ in range(args.peer_runs)]
        peers.append(f"| {kind} | {args.peer_runs} | {sum(o[0] for o in outcomes)} | {sum(o[1] for o in outcomes)} | "
                     f"{sum(o[2] for o in outcomes)} | {statistics.median(o[3] for o in outcomes):.2f} |")
    load_after = os.getloadavg()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    import torch

    text = "\n".join([
        HEADING, "",
        f"- date: {stamp}",
        f"- machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, 2 CPU ranks (gloo)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- load average at start {load_before[0]:.1f}, at end {load_after[0]:.1f}; "
        f"whole run {time.time() - began:.0f} s",
        "",
        "Inside rank 0 of one launch, blocks of the three loops alternate. \"vs plain\" compares the "
        "block medians (this machine's noise is several %); \"inside the check\" is the time spent in the "
        "check call itself as a share of the loop's time, measured directly. The issue's bar: a collective per "
        "call is acceptable only under 1 % of a step.",
        "",
        "| loop | check each step | median ms/step | vs plain | inside the check | blocks × steps |",
        "| --- | --- | --: | --: | --: | --- |",
        *rows,
        "",
        "A panel's Stop pressed once rank 0 reported step N, in a loop that checks every step and saves "
        "its model when told: seconds from the press to the launch's end (every rank returned, workers "
        "shut down), and the steps taken after step N (a report() reaches the kernel up to 0.25 s late, so "
        "this includes steps run before the press itself).",
        "",
        "| loop | pressed at step | press to end, s | steps after |",
        "| --- | --: | --: | --: |",
        *latencies,
        "",
        "Pre-emption, against the peer: SIGTERM to the launching process once rank 0 printed step 300, the "
        "small loop (SGD) on 2 ranks. torchrun forwards SIGTERM to each rank, whose handler saves where that "
        "rank is (the usual pre-emption code); accelnb's script checks stop_requested() each step. Counted: "
        "runs where both ranks saved, where they saved the same step, and where their saved weights are "
        "identical (DDP keeps them so at every step boundary: a difference is a step torn or missed).",
        "",
        "| launcher | runs | both ranks saved | same step | same weights | SIGTERM to exit, median s |",
        "| --- | --: | --: | --: | --: | --: |",
        *peers,
    ])
    print(text)
    if args.write:
        replace_section(HEADING, text)


if __name__ == "__main__":
    main()
