"""The first launch in a notebook, against Accelerate's: ``python benchmarks/bench_first_launch.py [--write]``.

Issue 33's targets, in real kernels (jupyter_client), one fresh kernel per run, cells in the order
a notebook runs them: the first cell imports torch, transformers, tqdm.auto and accelnb (or
Accelerate's launcher), a second is the user's pause (5 s: a cell being read or written), and the
launch comes in the third, timed inside the cell, from the call to its result. The function is
the same for both: it builds a tiny GPT-2 with transformers, runs it, all-reduces the result and
leaves the group it joined (Accelerate's ranks make it from the environment, accelnb's adopt its).

``… template warm``: the template started after the first cell and imported what it imported.
``… template off``: ``ACCELNB_TEMPLATE=off``: the launch starts the template and waits for its
imports (the cost a script pays at its first launch).
``… 256 MiB``: the same launch with a 256 MiB tensor as its argument (accelnb copies it once into
shared memory; Accelerate's fork of the kernel hands its pages down).
``%load_ext → %distributed start``: from ``%load_ext accelnb`` to a ready session, no pause.

Also printed: the template's memory and what one rank shares with it (``/proc/PID/smaps_rollup``).
Medians of ``--repeats`` fresh kernels per case. A benchmark, not a test: nothing is asserted.
With ``--write`` the table replaces this script's section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
from collections.abc import Sequence

import psutil
from jupyter_client.manager import start_new_kernel
from results_file import replace_section  # benchmarks/ is on sys.path when run as a script

SECTION_TITLE = "## First launch in a notebook (issues 12 and 33)"
CELL_TIMEOUT_S = 90  # a launch past this hangs: it is shown as "hung"

IMPORTS = "import time, torch, transformers\nfrom tqdm.auto import tqdm\n"
FUNCTION = """
def f(x=None):
    import os, torch, torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    t = model(torch.arange(1, 9)[None]).logits.sum().detach().reshape(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    with open("/proc/self/smaps_rollup") as rollup:
        kept = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty")
        memory = {line.split()[0][:-1]: int(line.split()[1]) for line in rollup if line.split()[0][:-1] in kept}
    return (None if x is None else float(x[-1])), memory
"""
PAUSE = "time.sleep(5)  # the user reads the cell they wrote"
ARGUMENT = "X = torch.ones(64 << 20)  # 256 MiB"
MEMORY = """
import json
from accelnb.kernel.helper.template import running_helper_pid
with open(f"/proc/{running_helper_pid()}/smaps_rollup") as rollup:
    template = {line.split()[0][:-1]: int(line.split()[1]) for line in rollup if line.split()[0].endswith(":")}
print("MEMORY", json.dumps({"template_rss_kib": template["Rss"], "rank": value[1]}))
"""


def launch_cells(launcher: str, call: str, before: Sequence[str] = ()) -> list[str]:
    timed = f"t0 = time.perf_counter(); value = {call}\nprint('SECONDS', time.perf_counter() - t0)"
    return [IMPORTS + launcher + FUNCTION, *before, PAUSE, timed]


ACCELNB = "import accelnb\n"
ACCELERATE = "from accelerate import notebook_launcher\n"
LOAD_EXT_CELLS = [
    "import time, torch",
    "t0 = time.perf_counter()\n%load_ext accelnb",
    "%distributed start --procs 2 --cpu --quiet",
    "print('SECONDS', time.perf_counter() - t0)",
    "%distributed stop",
]
TEMPLATE_OFF = {"ACCELNB_TEMPLATE": "off"}
CASES: dict[str, tuple[list[str], dict[str, str]]] = {
    "accelnb first call, template warm": (
        [*launch_cells(ACCELNB, "accelnb.notebook_launcher(f, num_processes=2, cpu=True, quiet=True)"), MEMORY], {}),
    "accelnb first call, template off": (
        launch_cells(ACCELNB, "accelnb.notebook_launcher(f, num_processes=2, cpu=True, quiet=True)"), TEMPLATE_OFF),
    "Accelerate first call": (launch_cells(ACCELERATE, "notebook_launcher(f, num_processes=2)"), {}),
    "accelnb first call, 256 MiB": (
        launch_cells(ACCELNB, "accelnb.notebook_launcher(f, (X,), num_processes=2, cpu=True, quiet=True)",
                     [ARGUMENT]), {}),
    "Accelerate first call, 256 MiB": (
        launch_cells(ACCELERATE, "notebook_launcher(f, (X,), num_processes=2)", [ARGUMENT]), {}),
    "%load_ext → %distributed start": (LOAD_EXT_CELLS, {}),
}


def seconds_in_fresh_kernel(cells: Sequence[str], env: dict[str, str]) -> tuple[float, str | None]:
    """Run ``cells`` in a new kernel; return the number a cell printed after ``SECONDS``, and
    what one printed after ``MEMORY``."""
    manager, client = start_new_kernel(kernel_name="python3", env={**os.environ, **env})
    printed: list[str] = []
    try:
        for cell in cells:
            try:
                reply = client.execute_interactive(
                    cell, timeout=CELL_TIMEOUT_S,
                    output_hook=lambda msg: printed.append(msg["content"].get("text", "")))
            except TimeoutError:  # a launcher that hangs (Accelerate's fork after a parallel op in the kernel)
                for process in psutil.Process(manager.provisioner.pid).children(recursive=True):  # type: ignore[union-attr]
                    process.kill()
                return math.nan, None
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"cell failed: {cell!r}: {reply['content'].get('evalue')}")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    lines = "".join(printed).splitlines()
    memory = next((line.split(" ", 1)[1] for line in lines if line.startswith("MEMORY")), None)
    for line in lines:
        if line.startswith("SECONDS"):
            return float(line.split()[1]), memory
    raise RuntimeError(f"no timing printed; output was: {''.join(printed)!r}")


HUNG_WHY = (" (Accelerate hung: its ranks, forks of a kernel whose OpenMP pool had run, wait for threads "
            "that do not exist)")


def _seconds(value: float) -> str:
    return "hung" if math.isnan(value) else f"{value:.2f}"


def table(medians: dict[str, float], runs: dict[str, list[float]], memory: str | None) -> str:
    warm, cold = medians["accelnb first call, template warm"], medians["accelnb first call, template off"]
    accelerate = medians["Accelerate first call"]
    big, accelerate_big = medians["accelnb first call, 256 MiB"], medians["Accelerate first call, 256 MiB"]
    load_ext = medians["%load_ext → %distributed start"]
    rows = ["| case | median s | runs (s) |", "| --- | --: | --- |"]
    rows += [f"| {name} | {medians[name]:.2f} | {', '.join(_seconds(s) for s in runs[name])} |" for name in CASES]
    verdicts = [
        "| target | value | verdict |", "| --- | --: | --- |",
        f"| first launch, template warm ≤ 1.0× Accelerate's | {warm / accelerate:.2f}× | "
        f"{'meets' if warm <= accelerate else 'misses'} |",
        f"| 256 MiB into a launch ≤ 1.0× Accelerate's | {big / accelerate_big:.2f}× | "
        f"{'meets' if not big > accelerate_big else 'misses'}{HUNG_WHY if math.isnan(accelerate_big) else ''} |",
        f"| (for scale) first launch, template off | {cold / accelerate:.2f}× | – |",
        # Issue 35's "session start ≤ 1.5 s" is from a warm template (bench_session_cell.py); this
        # one includes the template's own start: python, torch, and the kernel's transformers.
        f"| (for scale) `%load_ext` → `%distributed start` ready, the template cold | {load_ext:.2f} s | – |",
    ]
    note = f"\nMemory (KiB, last warm run): {memory}\n" if memory else ""
    return "\n".join(rows) + "\n\n" + "\n".join(verdicts) + "\n" + note


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh kernels per case (default 3)")
    parser.add_argument("--write", action="store_true", help="replace this section of benchmarks/RESULTS.md")
    opts = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[float]] = {name: [] for name in CASES}
    memory = None
    for _ in range(opts.repeats):  # alternate the cases, so that a burst of load hits all of them
        for name, (cells, env) in CASES.items():
            seconds, printed = seconds_in_fresh_kernel(cells, env)
            runs[name].append(seconds)
            memory = printed or memory
            print(f"{name}: {seconds:.2f} s", file=sys.stderr)
    medians = {name: statistics.median(values) for name, values in runs.items()}  # nan where one hung
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = (f"{SECTION_TITLE}, {when}, {platform.node()}, {os.cpu_count()} CPUs\n\n"
            f"`python benchmarks/bench_first_launch.py`: fresh kernels, cells in a notebook's order, a "
            f"function using transformers, 2 CPU ranks, gloo; load average {load_before:.1f} at start, "
            f"{os.getloadavg()[0]:.1f} at end.\n\n" + table(medians, runs, memory))
    print(text)
    if opts.write:
        replace_section(SECTION_TITLE, text)


if __name__ == "__main__":
    main()
