"""What each piece of the rank body costs a launch, a session call and a training step (issue 35).

    python benchmarks/bench_features.py [--rounds 3] [--write]

The rank body (``accelnb/worker/rank_body.py``) installs pieces around the user's code: the hooks
that run launches inside a rank in place (``launches_inside``), the step counting behind the
per-rank view and the straggler watch (``step_timing``), rank 0's tqdm/rich mirroring
(``library_progress``), Accelerate's ``check_trigger()`` answering a Stop
(``accelerate_trigger``), and each call's stop agreement (``stop_agreement``). Each was measured
alone as cheap when it came; together they once added 10-17 ms to a launch. This turns each piece
off alone (``ACCELNB_BENCH_PIECES_OFF``, a benchmark's switch, not a user setting), then all of
them, and prints what each configuration costs against everything on, so the next piece cannot
add its milliseconds unseen.

From this process (a script), 2 CPU ranks, ``quiet=True``; configurations alternate within each
round, so a burst of load hits all of them:

- **launch**: a one-shot ``launch`` of a function that returns at once, median of 5 per round;
- **call**: a session's ``run`` of the same function, median of 20 per round (the session is
  started per configuration, since the pieces are installed when a rank joins);
- **step**: rank 0's time per step of a small DDP loop (Linear(32,64)-ReLU-Linear(64,4), SGD,
  batch 16; about 1 ms a step on a free core, 3-4 ms where two ranks and this process share two),
  1000 timed steps after 30 warm-up steps.

The table gives the median over rounds and the difference from "everything on" (negative: the
piece costs that much). A benchmark, not a test: nothing is asserted. ``--write`` replaces this
script's section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from results_file import replace_section, run_header  # benchmarks/ is on sys.path as the script's folder

import accelnb
from accelnb.worker.rank_body import PIECES, PIECES_OFF_ENV

HEADING = "## What each piece of the rank body costs (issue 35)"
CONFIGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("everything on", ()),
    *((f"without {piece}", (piece,)) for piece in PIECES),
    ("all five off", PIECES),
)
LAUNCHES, CALLS, STEPS, WARMUP = 5, 20, 1000, 30


def returns_at_once() -> int:
    return 1


def step_time(steps: int, warmup: int) -> float:
    """Seconds per step of a small DDP loop, on this rank."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(dist.get_rank())
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(16, 32), torch.randn(16, 4)
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return (time.perf_counter() - started) / steps


def measure(pieces_off: tuple[str, ...]) -> dict[str, float]:
    os.environ[PIECES_OFF_ENV] = ",".join(pieces_off)
    launches = []
    for _ in range(LAUNCHES):
        started = time.perf_counter()
        accelnb.launch(returns_at_once, num_processes=2, cpu=True, quiet=True)
        launches.append(time.perf_counter() - started)
    session = accelnb.Session.start(num_processes=2, cpu=True, quiet=True)
    try:
        session.run(returns_at_once)  # joined: the calls below are calls alone
        calls = []
        for _ in range(CALLS):
            started = time.perf_counter()
            session.run(returns_at_once)
            calls.append(time.perf_counter() - started)
    finally:
        session.stop()
    step = accelnb.launch(step_time, args=(STEPS, WARMUP), num_processes=2, cpu=True, quiet=True).values[0]
    return {"launch_ms": statistics.median(launches) * 1e3, "call_ms": statistics.median(calls) * 1e3,
            "step_us": step * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of RESULTS.md")
    options = parser.parse_args()
    load_before = os.getloadavg()
    began = time.monotonic()
    accelnb.launch(returns_at_once, num_processes=2, cpu=True, quiet=True)  # the template is warm
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in CONFIGS}
    for round_index in range(options.rounds):
        order = CONFIGS[round_index % len(CONFIGS):] + CONFIGS[:round_index % len(CONFIGS)]
        for name, pieces_off in order:
            results[name].append(measure(pieces_off))
            print(f"round {round_index + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    os.environ.pop(PIECES_OFF_ENV, None)
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
               for name, runs in results.items()}
    base = medians["everything on"]
    rows = ["| configuration | launch, ms | vs on | session call, ms | vs on | step, µs | vs on |",
            "| --- | --: | --: | --: | --: | --: | --: |"]
    for name, _ in CONFIGS:
        m = medians[name]
        rows.append(f"| {name} | {m['launch_ms']:.1f} | {m['launch_ms'] - base['launch_ms']:+.1f} "
                    f"| {m['call_ms']:.2f} | {m['call_ms'] - base['call_ms']:+.2f} "
                    f"| {m['step_us']:.0f} | {m['step_us'] - base['step_us']:+.0f} |")
    on = results["everything on"]
    spread = ", ".join(f"{label} {min(run[key] for run in on):{fmt}}–{max(run[key] for run in on):{fmt}}"
                       for label, key, fmt in (("launch", "launch_ms", ".1f"), ("session call", "call_ms", ".2f"),
                                               ("step", "step_us", ".0f")))
    text = "\n".join([
        *run_header(HEADING, "2 CPU ranks (gloo), from a script", load_before, time.monotonic() - began,
                    f"python benchmarks/bench_features.py --rounds {options.rounds}; medians"),
        "",
        "Each piece of the rank body turned off alone (`ACCELNB_BENCH_PIECES_OFF`), then all five; \"vs on\" is the "
        "difference from everything on (negative: what the piece costs). launch: a one-shot 2-rank launch of a "
        f"function that returns at once (median of {LAUNCHES}); session call: a session's `run` of it (median of "
        f"{CALLS}); step: rank 0's time per step of a small DDP loop ({STEPS} steps).",
        "",
        *rows, "",
        f"How much \"everything on\" alone varied from round to round (the noise a difference must exceed): "
        f"{spread}.", "",
    ])
    print(text)
    if options.write:
        replace_section(HEADING, text)


if __name__ == "__main__":
    main()
