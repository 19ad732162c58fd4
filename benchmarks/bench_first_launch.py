"""The first launch in a fresh Jupyter kernel: ``python benchmarks/bench_first_launch.py [--write]``.

Issue 12's two start-up targets, measured in real kernels (jupyter_client), each run in a kernel
of its own that has already imported torch, as a notebook's first cell does:

``accelnb first call``
    ``accelnb.notebook_launcher(f, num_processes=2)``: from the call to its result, timed inside
    the cell. ``accelnb`` was imported in an earlier cell (without ``%load_ext``, so no head
    start): the call starts the helper process. ``f`` does one ``all_reduce`` in the group accelnb
    set up and returns.
``Accelerate first call``
    Accelerate's ``notebook_launcher(f, num_processes=2)`` in the same kind of kernel, imported in
    an earlier cell; its ``f`` sets up the gloo group from the environment Accelerate gives it,
    does the same ``all_reduce``, and leaves the group.
``…, spawned helper``
    The same with ``ACCELNB_HELPER_START=spawn``: the helper is a fresh interpreter that imports
    torch, as before it was forked from the kernel (``accelnb/kernel/helper/fork_or_spawn.py``).
``%load_ext → %distributed start``
    One cell takes the time and runs ``%load_ext accelnb`` (which gives the helper a head start);
    the very next cell runs ``%distributed start --procs 2``; a third reads the clock: the time
    from ``%load_ext`` until the session is ready, with no pause a user would make in between.

Medians of ``--repeats`` fresh kernels per case. A benchmark, not a test: nothing is asserted.
With ``--write`` the table replaces this script's section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from collections.abc import Sequence

from jupyter_client.manager import start_new_kernel
from results_file import replace_section  # benchmarks/ is on sys.path when run as a script

SECTION_TITLE = "## First launch in a fresh kernel (issue 12)"
CELL_TIMEOUT_S = 120

ACCELNB_CELLS = [
    "import time, torch",
    "import accelnb\n"
    "def f():\n"
    "    import torch.distributed as dist\n"
    "    t = torch.ones(1); dist.all_reduce(t); return t.item()",
    "t0 = time.perf_counter(); value = accelnb.notebook_launcher(f, num_processes=2)\n"
    "print('SECONDS', time.perf_counter() - t0, value)",
]

ACCELERATE_CELLS = [
    "import time, torch",
    "from accelerate import notebook_launcher\n"
    "def f():\n"
    "    import torch.distributed as dist\n"
    "    dist.init_process_group('gloo')\n"
    "    t = torch.ones(1); dist.all_reduce(t)\n"
    "    dist.destroy_process_group()",
    "t0 = time.perf_counter(); notebook_launcher(f, num_processes=2)\n"
    "print('SECONDS', time.perf_counter() - t0)",
]

LOAD_EXT_CELLS = [
    "import time, torch",
    "t0 = time.perf_counter()\n%load_ext accelnb",
    "%distributed start --procs 2 --quiet",
    "print('SECONDS', time.perf_counter() - t0)",
    "%distributed stop",
]

SPAWNED = {"ACCELNB_HELPER_START": "spawn"}  # what every launch did before the helper was forked
CASES: dict[str, tuple[list[str], dict[str, str]]] = {
    "accelnb first call": (ACCELNB_CELLS, {}),
    "accelnb first call, spawned helper": (ACCELNB_CELLS, SPAWNED),
    "Accelerate first call": (ACCELERATE_CELLS, {}),
    "%load_ext → %distributed start": (LOAD_EXT_CELLS, {}),
    "%load_ext → %distributed start, spawned helper": (LOAD_EXT_CELLS, SPAWNED),
}


def seconds_in_fresh_kernel(cells: Sequence[str], env: dict[str, str]) -> float:
    """Run ``cells`` in a new kernel; return the number a cell printed after ``SECONDS``."""
    manager, client = start_new_kernel(kernel_name="python3", env={**os.environ, **env})
    printed: list[str] = []
    try:
        for cell in cells:
            reply = client.execute_interactive(
                cell, timeout=CELL_TIMEOUT_S,
                output_hook=lambda msg: printed.append(msg["content"].get("text", "")))
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"cell failed: {cell!r}: {reply['content'].get('evalue')}")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    for line in "".join(printed).splitlines():
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    raise RuntimeError(f"no timing printed; output was: {''.join(printed)!r}")


def table(medians: dict[str, float], runs: dict[str, list[float]]) -> str:
    accelerate = medians["Accelerate first call"]
    accelnb = medians["accelnb first call"]
    load_ext = medians["%load_ext → %distributed start"]
    rows = ["| case | median s | runs (s) |", "| --- | --: | --- |"]
    rows += [f"| {name} | {medians[name]:.2f} | {', '.join(f'{s:.2f}' for s in runs[name])} |"
             for name in CASES]
    verdicts = [
        "| target | value | verdict |", "| --- | --: | --- |",
        f"| accelnb first call ≤ 1.5× Accelerate's | {accelnb / accelerate:.2f}× | "
        f"{'meets' if accelnb <= 1.5 * accelerate else 'misses'} |",
        f"| `%distributed start` ready ≤ 1.5 s after `%load_ext` | {load_ext:.2f} s | "
        f"{'meets' if load_ext <= 1.5 else 'misses'} |",
    ]
    return "\n".join(rows) + "\n\n" + "\n".join(verdicts) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh kernels per case (default 3)")
    parser.add_argument("--write", action="store_true", help="replace this section of benchmarks/RESULTS.md")
    opts = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(opts.repeats):  # alternate the cases, so that a burst of load hits all of them
        for name, (cells, env) in CASES.items():
            runs[name].append(seconds_in_fresh_kernel(cells, env))
            print(f"{name}: {runs[name][-1]:.2f} s", file=sys.stderr)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = (f"{SECTION_TITLE}, {when}, {platform.node()}, {os.cpu_count()} CPUs\n\n"
            f"`python benchmarks/bench_first_launch.py`: fresh kernels that imported torch, 2 CPU ranks, "
            f"gloo; load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end.\n\n"
            + table(medians, runs))
    print(text)
    if opts.write:
        replace_section(SECTION_TITLE, text)


if __name__ == "__main__":
    main()
