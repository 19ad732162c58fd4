"""What a rank spends per training step on accelnb's own work, measured in the rank (issue 35).

    python benchmarks/bench_step_cost.py [--runs 5] [--steps 2000] [--write]

Issue 35 asks that accelnb's own work in a rank (step timing, the stop agreement, metrics,
progress, output) cost at most 1 % of a 1 ms step, measured in a rank against the same loop
under torchrun, and that a loop of about 1 ms steps run at 0.98x torchrun's steps/s or better.
Two ranks and the launching process share this machine's 2 cores, which makes steps/s of a
2-rank loop vary by +-10 % (``bench_rank_view.py``), ten times the effect in question. So this
measures where the noise is small: one rank (a world of 1, gloo, DDP), on a core of its own.

The loop is a training loop as users write it, each step calling every piece once:
``optimizer.step()`` (the step-timing hook; the DDP forward before it is timed by a wrapper),
``accelnb.stop_requested()``, ``accelnb.report(loss=...)``, one ``tqdm`` update (rank 0's bar,
mirrored to the cell) and one ``print``. That is more than a real loop does each step (most
print and report every N steps), so the figures are an upper bound.

1. **Piece by piece.** ``stop_requested``, ``report``, the bar update and the print are timed
   around each call in the loop itself, in an accelnb rank and under torchrun (where they do
   nothing of accelnb's, or what they do without accelnb: tqdm draws, print writes); accelnb's
   own is the difference. The step-timing hook and the forward wrapper run inside torch's own
   calls, so they are timed apart, in the accelnb rank: ``optimizer.step()`` and the DDP forward
   in tight loops, with ``step_timing`` installed and removed in blocks ordered without, with,
   with, without; the difference is theirs.
2. **The same loop under torchrun and under accelnb.** The loop, as a script, run by ``torchrun
   --nproc-per-node 1`` (where accelnb's calls do nothing: no launch to report to) and by
   ``accelnb.launch`` on 1 CPU rank, alternating, ``--runs`` times each; steps/s in the rank.

A benchmark, not a test: nothing is asserted. ``--write`` replaces this script's section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from results_file import replace_section, run_header  # benchmarks/ is on sys.path as the script's folder

import accelnb
from accelnb.worker.rank_body import PIECES_OFF_ENV

HEADING = "## A rank's own work per training step, against torchrun (issue 35)"
WARMUP = 100
TIGHT_CALLS, TIGHT_BLOCKS = 2000, 10

# The loop, as users write it; run as a script by torchrun, and as a function by accelnb (the same
# text, exec'd in the rank).
LOOP = '''
import os, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm
import accelnb


def train(steps, warmup):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(64, 64), torch.randint(0, 10, (64,))
    clock = time.perf_counter
    spent = {"stop_requested": 0.0, "report": 0.0, "tqdm update": 0.0, "print": 0.0}
    bar = tqdm(total=warmup + steps, desc="train")
    for step in range(warmup + steps):
        if step == warmup:
            started = clock()
            spent = dict.fromkeys(spent, 0.0)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        value = loss.item()
        t0 = clock()
        if accelnb.stop_requested():
            break
        t1 = clock()
        accelnb.report(loss=value, step=step)
        t2 = clock()
        bar.update(1)
        t3 = clock()
        print("step", step)
        t4 = clock()
        spent["stop_requested"] += t1 - t0
        spent["report"] += t2 - t1
        spent["tqdm update"] += t3 - t2
        spent["print"] += t4 - t3
    elapsed = clock() - started
    bar.close()
    return {"steps_per_s": steps / elapsed, "step_us": elapsed / steps * 1e6,
            "pieces_us": {name: s / steps * 1e6 for name, s in spent.items()}}


if __name__ == "__main__":
    result = train(int(sys.argv[1]), int(sys.argv[2]))
    print("RESULT", repr(result), file=sys.stderr)
'''


def in_rank(steps: int, warmup: int) -> dict[str, Any]:
    """Run in an accelnb rank: the loop, the clock's own cost, and the step-timing pieces apart."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accelnb.worker import step_timing

    # The rank left step timing out (PIECES_OFF_ENV, set by main), so that it is installed here,
    # with what removes it: in for the loop, as a rank has it, then in and out by turns.
    uninstall = step_timing.install()
    assert uninstall is not None, f"run with {PIECES_OFF_ENV}=step_timing"
    namespace: dict[str, Any] = {"__name__": "loop"}
    exec(compile(LOOP, "<loop>", "exec"), namespace)
    result: dict[str, Any] = namespace["train"](steps, warmup)
    uninstall()
    step_timing.take_window(0)

    clock = time.perf_counter
    # A model of one weight: what the wrappers add does not depend on the model, and the smaller
    # the call they wrap, the less of its noise hides them.
    torch.manual_seed(0)
    model = DDP(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(1, 1)
    times: dict[tuple[str, bool], list[float]] = {}
    for block in range(2 * TIGHT_BLOCKS):
        counting = block % 4 in (1, 2)  # without, with, with, without: a drift hits both alike
        uninstall = step_timing.install() if counting else None
        for kind in ("optimizer.step()", "DDP forward"):
            began = clock()
            for _ in range(TIGHT_CALLS):
                if kind == "DDP forward":
                    model(inputs)
                else:
                    optimizer.step()
            times.setdefault((kind, counting), []).append((clock() - began) / TIGHT_CALLS * 1e6)
        if uninstall is not None:
            uninstall()
            step_timing.take_window(0)
    result["step_timing_us"] = {kind: statistics.median(times[(kind, True)]) - statistics.median(times[(kind, False)])
                                for kind in ("optimizer.step()", "DDP forward")}
    result["tight_us"] = {f"{kind} {'with' if on else 'without'}": statistics.median(v)
                          for (kind, on), v in times.items()}
    return result


def under_torchrun(script: str, steps: int, warmup: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)  # this machine sets it; torchrun runs `python -u` anyway
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "1",
                           script, str(steps), str(warmup)], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    line = next(line for line in done.stderr.splitlines() if line.startswith("RESULT "))
    return dict(eval(line[len("RESULT "):]))  # our own script's repr of a dict of numbers


def under_accelnb(steps: int, warmup: int) -> dict[str, Any]:
    os.environ[PIECES_OFF_ENV] = "step_timing"  # in_rank installs it itself, to remove it by turns
    try:
        launched = accelnb.launch(in_rank, args=(steps, warmup), num_processes=1, cpu=True, quiet=True,
                                  output="none")
    finally:
        os.environ.pop(PIECES_OFF_ENV, None)
    return dict(launched.values[0])


def verdict(ratio: float) -> str:
    return "meets" if ratio >= 0.98 else "MISSES"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of RESULTS.md")
    options = parser.parse_args()
    load_before = os.getloadavg()
    began = time.monotonic()
    accelnb.launch(lambda: None, num_processes=1, cpu=True, quiet=True)  # the template is warm
    with tempfile.TemporaryDirectory(prefix="accelnb-bench-steps-") as folder:
        script = os.path.join(folder, "loop.py")
        with open(script, "w") as f:
            f.write(LOOP)
        torchrun_runs: list[dict[str, Any]] = []
        accelnb_runs: list[dict[str, Any]] = []
        for run in range(options.runs):
            for name, runs in (("torchrun", torchrun_runs), ("accelnb", accelnb_runs)):
                runs.append(under_torchrun(script, options.steps, WARMUP) if name == "torchrun"
                            else under_accelnb(options.steps, WARMUP))
                print(f"run {run + 1} {name}: {runs[-1]['step_us']:.1f} us/step", file=sys.stderr, flush=True)
    step_us = {name: statistics.median(r["step_us"] for r in runs)
               for name, runs in (("torchrun", torchrun_runs), ("accelnb", accelnb_runs))}
    # The same calls, timed the same way, in the same loop: under torchrun they do nothing of accelnb's.
    in_accelnb = {name: statistics.median(r["pieces_us"][name] for r in accelnb_runs)
                  for name in accelnb_runs[0]["pieces_us"]}
    in_torchrun = {name: statistics.median(r["pieces_us"][name] for r in torchrun_runs) for name in in_accelnb}
    pieces = {name: in_accelnb[name] - in_torchrun[name] for name in in_accelnb}
    step_timing_us = {kind: statistics.median(r["step_timing_us"][kind] for r in accelnb_runs)
                      for kind in accelnb_runs[0]["step_timing_us"]}
    # Only what accelnb adds counts: a piece cheaper in the rank (print: torchrun runs a script with
    # `python -u`, so each print is a write) does not pay for the others.
    total = sum(max(0.0, us) for us in [*pieces.values(), *step_timing_us.values()])
    rows = ["| piece, each step | in an accelnb rank, µs | under torchrun, µs | accelnb's own, µs "
            "| share of a 1 ms step |",
            "| --- | --: | --: | --: | --: |"]
    for kind, us in step_timing_us.items():
        rows.append(f"| step timing: {kind} (tight loops, with − without) | | | {us:.2f} | {us / 1000:.2%} |")
    for name, us in pieces.items():
        rows.append(f"| `{name}` | {in_accelnb[name]:.2f} | {in_torchrun[name]:.2f} | {us:.2f} | {us / 1000:.2%} |")
    rows.append(f"| **all of accelnb's own work** (the pieces that cost more in the rank) | | | **{total:.2f}** "
                f"| **{total / 1000:.2%}** |")
    ratio = step_us["torchrun"] / step_us["accelnb"]
    pair_ratios = [t["step_us"] / a["step_us"] for t, a in zip(torchrun_runs, accelnb_runs, strict=True)]
    per_run = ", ".join(f"{t['step_us']:.0f} / {a['step_us']:.0f}"
                        for t, a in zip(torchrun_runs, accelnb_runs, strict=True))
    text = "\n".join([
        *run_header(HEADING, "1 CPU rank (gloo, DDP, a world of 1)", load_before, time.monotonic() - began,
                    "python benchmarks/bench_step_cost.py"),
        "",
        f"A DDP loop (Linear(64,256)-ReLU-Linear(256,10), batch 64, SGD, one thread) whose every step calls "
        f"`optimizer.step()`, `accelnb.stop_requested()`, `accelnb.report(loss=...)`, a tqdm bar's `update(1)` and "
        f"`print`; {options.steps} timed steps after {WARMUP}, medians of {options.runs} runs. Step timing's two "
        f"pieces are measured in tight loops in the same rank, installed and removed in blocks ordered without, "
        f"with, with, without ({TIGHT_BLOCKS} blocks of {TIGHT_CALLS} calls each way); each of the others is timed "
        "around its call in the loop, in the accelnb rank and under torchrun, and accelnb's own is the difference "
        "(a negative one: noise, or a call that costs less in the rank: torchrun runs a script with `python -u`, so "
        "each `print` there is a write, where a rank's is buffered and flushed every 50 ms). The total counts the "
        "pieces that cost more in the rank only.",
        "",
        *rows, "",
        "| the same loop | µs per step | steps/s | runs (µs per step, torchrun / accelnb) |",
        "| --- | --: | --: | --- |",
        f"| torchrun --nproc-per-node 1 (accelnb's calls do nothing there) | {step_us['torchrun']:.0f} "
        f"| {1e6 / step_us['torchrun']:.0f} | {per_run} |",
        f"| accelnb.launch, 1 CPU rank | {step_us['accelnb']:.0f} | {1e6 / step_us['accelnb']:.0f} | |",
        "",
        "| target | value | verdict |",
        "| --- | --: | --- |",
        f"| accelnb's own work ≤ 1 % of a 1 ms step | {total / 1000:.2%} | {'meets' if total <= 10 else 'MISSES'} |",
        f"| steps/s ≥ 0.98× torchrun's (same loop, medians) | {ratio:.3f}× | {verdict(ratio)} |",
        f"| the same, median of the runs' pair ratios (min–max {min(pair_ratios):.3f}–{max(pair_ratios):.3f}) "
        f"| {statistics.median(pair_ratios):.3f}× | {verdict(statistics.median(pair_ratios))} |",
        "",
    ])
    print(text)
    if options.write:
        replace_section(HEADING, text)


if __name__ == "__main__":
    main()
