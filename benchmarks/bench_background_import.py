"""Launches that come while the template imports what training touches (issue 35).

    python benchmarks/bench_background_import.py [--rounds 2] [--write]

After the first launch the template imports, while idle, what an optimizer's first step or a DDP
model imports (``TRAINING_PREIMPORTS``: ``torch._dynamo`` and Accelerate), one module per turn of
its loop. A launch that comes during a turn waits for that import to end: an import cannot be
interrupted. Before, ``torch._dynamo`` was one turn of 1-3 s; now its biggest dependencies from
outside its package come first, a turn each (``TORCH_DYNAMO_IN_TURNS``), so the longest turn is
``torch._dynamo``'s own modules.

Each configuration runs in a fresh script: the first launch (which starts the template), then
launches with 0.1 s pauses for 8 s, as a loop of short cells or a script would; ``one turn`` sets
the old list in the kernel before the first launch (the benchmark's only reach into accelnb).
Configurations alternate, ``--rounds`` times each. The last launch reports whether its rank found
``torch._dynamo`` in the template.

A benchmark, not a test: nothing is asserted. ``--write`` replaces this script's section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from child_runs import child_result, parse_rounds  # benchmarks/ is on sys.path as the script's folder
from results_file import publish, run_header

HEADING = "## Launches while the template imports what training touches (issue 35)"
WINDOW_S, PAUSE_S = 8.0, 0.1
WAITED_MS = 100.0  # a launch this long waited for an import (the others take 25-60 ms here)


def rank_found_dynamo() -> bool:
    """In a rank: whether the template had torch._dynamo (this function imports nothing)."""
    return "torch._dynamo" in sys.modules


def measure(one_turn: bool) -> dict[str, Any]:
    from bench_launch import allreduce_once  # the launch benchmark's trivial function

    import accelnb
    from accelnb.kernel.helper import template

    if one_turn:
        template.TRAINING_PREIMPORTS = ("torch._dynamo", "accelerate")  # the list before the turns

    def launch() -> float:
        started = time.perf_counter()
        accelnb.notebook_launcher(allreduce_once, num_processes=2, cpu=True, quiet=True)
        return (time.perf_counter() - started) * 1e3

    first = launch()
    launches = []
    window_start = time.monotonic()
    while time.monotonic() - window_start < WINDOW_S:
        time.sleep(PAUSE_S)
        launches.append(launch())
    found = accelnb.notebook_launcher(rank_found_dynamo, num_processes=2, cpu=True, quiet=True)
    return {"first_ms": first, "launches_ms": launches, "dynamo_in_template": bool(found)}


def main() -> None:
    opts = parse_rounds(__doc__)
    if opts.child:
        print(json.dumps(measure(one_turn=opts.child == "one-turn")))
        return
    load, started = os.getloadavg(), time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {"one turn (before)": [], "in turns (now)": []}
    for _ in range(opts.rounds):
        for name in runs:
            runs[name].append(child_result(__file__, "one-turn" if name.startswith("one") else "turns"))
    lines = run_header(HEADING, "2 CPU ranks, gloo", load, time.monotonic() - started,
                       f"python benchmarks/bench_background_import.py --rounds {opts.rounds}")
    lines += ["", f"Launches with {PAUSE_S:g} s pauses for {WINDOW_S:g} s after the first launch; "
              f"{opts.rounds} fresh scripts per configuration, alternating (ms). When the import meets "
              "the first launch (its template still busy with it when the launch comes), the first "
              "launch waits instead of a later one.", "",
              "| torch._dynamo imported | first launch, each script | longest later launch, each script | "
              f"later: median | launches over {WAITED_MS:g} ms | all launches in all, each script | "
              "the template had it at the end |",
              "| --- | --: | --: | --: | --: | --: | --: |"]
    for name, found in runs.items():
        later = [t for run in found for t in run["launches_ms"]]
        waited = [t for t in later if t > WAITED_MS]

        def each(value: Any, found: list[dict[str, Any]] = found) -> str:
            return ", ".join(f"{value(run):,.0f}" for run in found)

        had = sum(run["dynamo_in_template"] for run in found)
        lines.append(f"| {name} | {each(lambda run: run['first_ms'])} | {each(lambda run: max(run['launches_ms']))} | "
                     f"{statistics.median(later):.1f} | {len(waited)} of {len(later)} | "
                     f"{each(lambda run: run['first_ms'] + sum(run['launches_ms']))} | {had} of {len(found)} |")
    publish(HEADING, lines, opts.write)


if __name__ == "__main__":
    main()
