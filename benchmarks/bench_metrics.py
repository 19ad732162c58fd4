"""What reporting every step costs: a worker loop at ~20,000 steps/s, with and without
``accelnb.report(step=i, loss=…)`` on rank 0, run from a real Jupyter kernel.

    .venv/bin/python benchmarks/bench_metrics.py               # ~1 minute on 2 cores
    .venv/bin/python benchmarks/bench_metrics.py --steps 200000 --repeats 5

Each step does a fixed amount of trivial Python work calibrated to ~50 µs, so that reporting
once per step is 20,000 reports a second. Runs alternate (without, with, without, …) so that
load from other processes hits both alike; the table shows medians. It also counts the display
messages the kernel sent to the notebook for each launch (``display_data`` plus
``update_display_data``) and the kernel's CPU time spent while the launch ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbclient
import nbformat

REPO = Path(__file__).resolve().parents[1]
STEP_SECONDS = 50e-6  # 20,000 steps a second

WORKER_CODE = '''
import resource, time
import accelnb

def loop(steps, unit, with_report):
    import torch.distributed as dist
    if dist.get_rank() != 0:
        return None
    x = 0.0
    started, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        for _ in range(unit):          # the "training step": trivial work, ~50 µs
            x += 1.0
        if with_report:
            accelnb.report(step=i, loss=x)
    # process time counts every thread: the flusher's pickling and sending is part of the cost
    return time.perf_counter() - started, time.process_time() - cpu

def run(steps, unit, with_report):
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter()
    result = accelnb.launch(loop, args=(steps, unit, with_report), num_processes=2, quiet=True)
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_SELF)
    kernel_cpu = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
    print(repr((result.value, kernel_cpu, wall, len(result.metrics))))
'''


def calibrate_unit() -> int:
    """Iterations of the inner work loop that take STEP_SECONDS here."""
    unit = 2000
    best = float("inf")
    for _ in range(5):
        x = 0.0
        started = time.process_time()  # CPU time: other processes' load does not skew it
        for _ in range(200):
            for _ in range(unit):
                x += 1.0
        best = min(best, (time.process_time() - started) / 200)
    return max(1, round(unit * STEP_SECONDS / best))


def report_cost_cell() -> str:
    return '''
def tight():
    import time, torch.distributed as dist, accelnb
    if dist.get_rank() != 0:
        return None
    n = 200_000
    started = time.thread_time()
    for i in range(n):
        accelnb.report(step=i, loss=0.5)
    return (time.thread_time() - started) / n
print(repr(accelnb.launch(tight, num_processes=2, quiet=True).value))
'''


class CountingClient(nbclient.NotebookClient):
    display_messages: dict[int, int]

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        if msg["msg_type"] in ("display_data", "update_display_data"):
            self.display_messages[cell_index] = self.display_messages.get(cell_index, 0) + 1
        return super().process_message(msg, cell, cell_index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40_000, help="steps per run (default 40,000: ~2 s)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each kind (default 5)")
    options = parser.parse_args()

    unit = calibrate_unit()
    cells = [WORKER_CODE, "run(100, 1, True)"]  # the second cell warms the helper process up
    kinds: list[bool] = []
    for _ in range(options.repeats):
        for with_report in (False, True):
            cells.append(f"run({options.steps}, {unit}, {with_report})")
            kinds.append(with_report)
    cells.append(report_cost_cell())

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    with tempfile.TemporaryDirectory() as tmp:
        client = CountingClient(nb, kernel_name="python3", timeout=600,
                                resources={"metadata": {"path": tmp}})
        client.display_messages = {}
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        client.execute(env={**os.environ, "PYTHONPATH": path})

    def printed(index: int) -> Any:
        outputs = nb.cells[index].outputs
        errors = [o for o in outputs if o["output_type"] == "error"]
        if errors:
            sys.exit("\n".join(errors[0]["traceback"]))
        text = "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == "stdout")
        return eval(text.strip().splitlines()[-1])  # our own repr() of numbers

    # per run: worker wall s, worker CPU s, kernel CPU s, launch wall s, records, display messages
    rows: dict[bool, list[tuple[float, float, float, float, int, int]]] = {False: [], True: []}
    for offset, with_report in enumerate(kinds):
        index = offset + 2
        (wall, cpu), kernel_cpu, launch_wall, records = printed(index)
        rows[with_report].append((wall, cpu, kernel_cpu, launch_wall, records,
                                  client.display_messages.get(index, 0)))
    per_report = printed(len(cells) - 1)

    def median(kind: bool, column: int) -> float:
        return statistics.median(row[column] for row in rows[kind])

    steps = options.steps
    print(f"\naccelnb.report benchmark: {steps:,} steps per run, {options.repeats} runs of each kind "
          f"(medians), {os.cpu_count()} CPUs, ~{STEP_SECONDS * 1e6:.0f} µs of work per step\n")
    print("| rank 0 loop | steps/s (wall) | steps/s (worker CPU) | reports/s | kernel CPU | "
          "display messages | history records |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in (False, True):
        wall_rate, cpu_rate = steps / median(kind, 0), steps / median(kind, 1)
        print(f"| {'with report every step' if kind else 'without report'} | {wall_rate:,.0f} | "
              f"{cpu_rate:,.0f} | {wall_rate if kind else 0:,.0f} | "
              f"{median(kind, 2) / median(kind, 3) * 100:.0f}% | {median(kind, 5):.0f} | "
              f"{median(kind, 4):,.0f} |")
    for column, label in ((0, "wall"), (1, "worker CPU")):
        base, loaded = median(False, column), median(True, column)
        print(f"\nslowdown ({label} time): {(loaded - base) / base * 100:+.1f}%  "
              f"(per run, steps/s without: {', '.join(f'{steps / r[column]:,.0f}' for r in rows[False])}; "
              f"with: {', '.join(f'{steps / r[column]:,.0f}' for r in rows[True])})", end="")
    print(f"\nreport() alone, tight loop: {per_report * 1e6:.2f} µs of CPU per call")


if __name__ == "__main__":
    main()
