"""What the template's 2 MiB pages (``worker/template/huge_pages.py``) save a fork and a launch (issue 35).

    python benchmarks/bench_huge_pages.py [--rounds 2] [--write]

1. **Fork and exit** of a process shaped like the template: a fresh interpreter that imported
   torch (and, in a second row, transformers' Trainer too, as a notebook's template does), its
   objects frozen for the collector; ``fork``, the child leaves at once with ``os._exit`` (or first
   touches some objects, as a rank does), ``wait4``. Wall time and the child's CPU time, medians
   of 20; on 4 KiB pages, then once the same process collapsed its memory with
   :class:`~accelnb.worker.template.huge_pages.HugePages`.
2. **Launches** (2 CPU ranks, gloo, a function that does one ``all_reduce``), from a fresh script
   per configuration, the template on huge pages or not (``ACCELNB_BENCH_HUGE_PAGES_OFF``, a
   benchmark's switch); configurations alternate, ``--rounds`` times each: 20 launches back to
   back (and the whole machine's CPU time they used, per launch), 10 launches 0.5 s apart, and
   the template's memory once idle.

A benchmark, not a test: nothing is asserted. ``--write`` replaces this script's section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from typing import Any

from child_runs import child_result, parse_rounds  # benchmarks/ is on sys.path as the script's folder
from results_file import publish, run_header

HEADING = "## The template on 2 MiB pages: a fork, an exit, a launch (issue 35)"
FORKS = 20
BACK_TO_BACK, APART, SPACING_S = 20, 10, 0.5
STANDBY_WAIT_S = 30.0


# ── 1. fork and exit, in a child process per template shape ────────────────────────────────
def fork_and_exit(child_touches: bool) -> tuple[float, float]:
    """Median wall ms of fork → reaped, and median CPU ms of the child."""
    walls, cpus = [], []
    for _ in range(FORKS):
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            if child_touches:  # a rank's first steps write to objects all over the heap
                for module in list(sys.modules.values())[:400]:
                    list(getattr(module, "__dict__", {}).values())
            os._exit(0)
        _, _, usage = os.wait4(pid, 0)
        walls.append((time.perf_counter() - started) * 1e3)
        cpus.append((usage.ru_utime + usage.ru_stime) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def measure_forks(with_transformers: bool) -> dict[str, Any]:
    import torch  # noqa: F401

    if with_transformers:
        import transformers.trainer  # noqa: F401
    from accelnb.worker.template.huge_pages import HugePages

    gc.collect()
    gc.freeze()
    out: dict[str, Any] = {"anonymous_mib": anonymous_mib(os.getpid())[0]}
    out["small"] = {"exit": fork_and_exit(False), "touch": fork_and_exit(True)}
    started = time.perf_counter()
    pages = HugePages()
    while pages.due():
        pages.step()
    out["collapse_s"] = time.perf_counter() - started
    out["huge_mib"] = anonymous_mib(os.getpid())[1]
    out["huge"] = {"exit": fork_and_exit(False), "touch": fork_and_exit(True)}
    return out


# ── 2. launches, in a child process per configuration ──────────────────────────────────────
def measure_launches() -> dict[str, Any]:
    import psutil
    from bench_launch import allreduce_once  # the launch benchmark's trivial function

    import accelnb
    from accelnb.kernel.helper import template
    from accelnb.worker.template.standby_ranks import STANDBY_NAME

    def launch() -> float:
        started = time.perf_counter()
        accelnb.notebook_launcher(allreduce_once, num_processes=2, quiet=True)
        return (time.perf_counter() - started) * 1e3

    def settled(pid: int) -> None:
        """Polled: the template forks its waiting children, and collapses its memory, once idle."""
        deadline = time.monotonic() + STANDBY_WAIT_S
        while (sum(child.name() == STANDBY_NAME for child in psutil.Process(pid).children()) < 2
               or (huge and anonymous_mib(pid)[1] < anonymous_mib(pid)[0] / 2)):
            assert time.monotonic() < deadline, "the template did not settle"
            time.sleep(0.05)

    huge = os.environ.get("ACCELNB_BENCH_HUGE_PAGES_OFF") != "1"
    template.prewarm(wait=True)
    launch()
    pid = template.running_helper_pid()
    assert pid is not None
    settled(pid)
    launch()  # the children waiting before the collapse go; the next ones are forks of it
    settled(pid)
    memory = anonymous_mib(pid)
    cpu_before = psutil.cpu_times()
    back_to_back = [launch() for _ in range(BACK_TO_BACK)]
    cpu_after = psutil.cpu_times()
    apart = []
    for _ in range(APART):
        time.sleep(SPACING_S)  # the pause between two cells, not timed
        apart.append(launch())
    busy_ms = sum(getattr(cpu_after, f) - getattr(cpu_before, f) for f in ("user", "system", "nice", "irq", "softirq"))
    return {"back_to_back": back_to_back, "apart": apart, "cpu_per_launch_ms": busy_ms * 1e3 / BACK_TO_BACK,
            "template_anonymous_mib": memory[0], "template_huge_mib": memory[1]}


def anonymous_mib(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        found = {line.split(":")[0]: int(line.split()[1]) for line in rollup if "kB" in line}
    return found["Anonymous"] / 1024, found["AnonHugePages"] / 1024


# ── the tables ──────────────────────────────────────────────────────────────────────────────
def main() -> None:
    opts = parse_rounds(__doc__)
    if opts.child:
        result = (measure_launches() if opts.child == "launches"
                  else measure_forks(with_transformers=opts.child == "forks-transformers"))
        print(json.dumps(result))
        return
    load, started = os.getloadavg(), time.monotonic()
    forks = {"torch": child_result(__file__, "forks-torch"),
             "torch and transformers": child_result(__file__, "forks-transformers")}
    runs: dict[str, list[dict[str, Any]]] = {"4 KiB pages": [], "2 MiB pages": []}
    for _ in range(opts.rounds):
        for name in runs:
            switch = "1" if name.startswith("4") else "0"
            runs[name].append(child_result(__file__, "launches", {"ACCELNB_BENCH_HUGE_PAGES_OFF": switch}))
    lines = run_header(HEADING, "2 CPU ranks, gloo", load, time.monotonic() - started,
                       f"python benchmarks/bench_huge_pages.py --rounds {opts.rounds}")
    lines += ["", "### 1. Fork, then the child's exit (ms, medians of 20)", "",
              "| template | anonymous MiB (on 2 MiB pages) | collapse s | exit at once: 4 KiB | 2 MiB "
              "| after touching objects: 4 KiB | 2 MiB |",
              "| --- | --: | --: | --: | --: | --: | --: |"]
    for shape, found in forks.items():
        cells = [f"{found[pages][kind][0]:.1f} wall, {found[pages][kind][1]:.1f} CPU"
                 for kind in ("exit", "touch") for pages in ("small", "huge")]
        memory = f"{found['anonymous_mib']:.0f} ({found['huge_mib']:.0f})"
        lines.append(f"| {shape} | {memory} | {found['collapse_s']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", f"### 2. A 2-rank launch (ms; {opts.rounds} fresh scripts per configuration, alternating)", "",
              "| template | back to back: median | min | 0.5 s apart: median | min | machine CPU per launch "
              "back to back | template anonymous MiB (on 2 MiB pages) |",
              "| --- | --: | --: | --: | --: | --: | --: |"]
    for name, found_runs in runs.items():
        b2b = [t for run in found_runs for t in run["back_to_back"]]
        apart = [t for run in found_runs for t in run["apart"]]
        cpu = statistics.median(run["cpu_per_launch_ms"] for run in found_runs)
        anon = statistics.median(run["template_anonymous_mib"] for run in found_runs)
        huge = statistics.median(run["template_huge_mib"] for run in found_runs)
        lines.append(f"| {name} | {statistics.median(b2b):.1f} | {min(b2b):.1f} | {statistics.median(apart):.1f} | "
                     f"{min(apart):.1f} | {cpu:.0f} | {anon:.0f} ({huge:.0f}) |")
    publish(HEADING, lines, opts.write)


if __name__ == "__main__":
    main()
