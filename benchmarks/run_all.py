"""accelnb vs Accelerate's ``notebook_launcher`` vs Lightning Fabric's ``ddp_notebook``: one command.

    make bench                         # installs the ``bench`` extra (accelerate, lightning), runs this
    python benchmarks/run_all.py       # the same, with what is installed
    python benchmarks/run_all.py --quick --no-write    # a smoke run: few repeats, RESULTS.md untouched

Every tool is measured in its own fresh process (``benchmarks/bench_launch.py --tool T --json``,
whose docstring says exactly how each tool is called), one after the other, so that no tool's
imports, threads or child processes disturb another's numbers. This script collects their JSON,
prints one table per scenario of issue 6 with min/median/max and the ratios against the issue's
targets, and writes the same tables to ``benchmarks/RESULTS.md`` with the date and the machine.
2 ranks, gloo, CPU.

This is a benchmark, not a test: it asserts nothing about timings, and a tool that cannot run a
scenario gets "n/a" and the reason. Numbers from a shared or busy machine are noisy; the load
average at start and end is printed with them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from results_file import RESULTS_PATH, replace_section  # benchmarks/ is on sys.path as the script's folder

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
TOOLS = ("accelnb", "accelerate", "fabric", "plain", "throughput")
NAMES = {"accelnb": "accelnb", "accelerate": "Accelerate", "fabric": "Fabric", "plain": "plain fork"}
QUICK = ["--repeats", "3", "--calls", "10", "--train-repeats", "1", "--throughput-pairs", "2",
         "--output-pairs", "2", "--memory-launches", "5"]
TOOL_TIMEOUT_S = 1800


# ── running the tools ───────────────────────────────────────────────────────────────────────
def run_tool(tool: str, extra: Sequence[str], log_dir: str) -> dict[str, Any]:
    """One fresh process for ``tool``; its JSON, or {"error": why} when it produced none."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.pop("OMP_NUM_THREADS", None)  # each launcher chooses its workers' threads itself
    log_path = os.path.join(log_dir, f"{tool}.log")
    command = [sys.executable, os.path.join(HERE, "bench_launch.py"), "--tool", tool, "--json", *extra]
    print(f"  {tool:<11} ", end="", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO_ROOT,
                                  timeout=TOOL_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            print(f"timed out after {TOOL_TIMEOUT_S} s (log: {log_path})")
            return {"error": f"did not finish in {TOOL_TIMEOUT_S} s"}
    seconds = time.perf_counter() - started
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        data: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        print(f"failed (exit {done.returncode}; log: {log_path})")
        return {"error": f"its process exited with {done.returncode} and no result (log: {log_path})"}
    failed = [name for name, value in data.items() if isinstance(value, dict) and "error" in value]
    print(f"{seconds:6.1f} s" + (f"  (failed: {', '.join(failed)}; log: {log_path})" if failed else ""))
    return data


# ── formatting ──────────────────────────────────────────────────────────────────────────────
def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "ms":
        value *= 1000
    if unit == "%":
        return f"{value * 100:+.1f} %"
    if unit == "ratio":
        return f"{value:.3f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if unit != "ms" else f"{value:.1f}"


def spread(values: Sequence[float], unit: str) -> list[str]:
    """min, median, max, n."""
    if not values:
        return ["–", "–", "–", "0"]
    return [fmt(min(values), unit), fmt(statistics.median(values), unit), fmt(max(values), unit),
            str(len(values))]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; rows made by :func:`na_row` end with a note below the table."""
    notes = [f"- {r[0]}: n/a, {r[-1][len(NA):]}" for r in rows if r and r[-1].startswith(NA)]
    rows = [[r[0]] + ["n/a"] * (len(header) - 1) if r and r[-1].startswith(NA) else r for r in rows]
    cells = [list(header)] + [list(r) + [""] * (len(header) - len(r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(row, widths, strict=True))) + " |"

    rule = "| " + " | ".join("-" * w if i == 0 else "-" * (w - 1) + ":" for i, w in enumerate(widths)) + " |"
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]] + (["", *notes] if notes else []))


NA = "\0n/a:"


def na_row(label: str, reason: str, width: int) -> list[str]:
    """A row the tool could not fill; :func:`table` shows "n/a" and the reason under the table."""
    return [label, NA + reason]


def verdict(value: float | None, target: float, below: bool = True) -> str:
    if value is None:
        return "n/a"
    ok = value <= target if below else value >= target
    return "meets" if ok else "misses"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def median_of(results: dict[str, Any], tool: str, scen: str, key: str) -> float | None:
    values = results.get(tool, {}).get(scen, {}).get(key)
    return statistics.median(values) if values else None


def error_of(results: dict[str, Any], tool: str, scen: str) -> str | None:
    tool_data = results.get(tool, {})
    if "error" in tool_data and scen not in tool_data:
        return str(tool_data["error"])
    value = tool_data.get(scen)
    if value is None:
        return "not measured"
    return str(value["error"]) if "error" in value else None


def ratio_table(rows: Sequence[tuple[str, float | str | None, str, str]]) -> str:
    """Rows of (what, value, target, verdict); a float value is shown with 3 decimals."""
    return table(["ratio", "value", "target", "verdict"],
                 [[name, "–" if value is None else (f"{value:.3f}" if isinstance(value, float) else value),
                   target, result] for name, value, target, result in rows])


# ── the scenarios ───────────────────────────────────────────────────────────────────────────
def launch_section(r: dict[str, Any]) -> str:
    spacing = next((r[t]["launch"]["spacing_s"] for t in NAMES if "spacing_s" in r.get(t, {}).get("launch", {})), 0.5)
    header = ["tool", "first launch", "back to back: min", "median", "max",
              f"{spacing:g} s apart: min", "median", "max", "runs"]
    rows = []
    for tool in ("accelnb", "accelerate", "fabric", "plain"):
        label = NAMES[tool] + (" (floor)" if tool == "plain" else "")
        problem = error_of(r, tool, "launch")
        if problem:
            rows.append(na_row(label, problem, len(header)))
            continue
        data = r[tool]["launch"]
        spaced = spread(data["spaced_s"], "ms")[:3] if data.get("spaced_s") else ["–"] * 3
        rows.append([label, fmt(data["first_s"], "ms"), *spread(data["later_s"], "ms")[:3], *spaced,
                     str(len(data["later_s"]))])
        long_notebook = r[tool].get("long_notebook", {})
        if long_notebook.get("later_s"):  # accelnb's launches after a long notebook's cells
            rows.append([f"{label}, after {long_notebook['cells']:,} notebook cells", "–",
                         *spread(long_notebook["later_s"], "ms")[:3], "–", "–", "–",
                         str(len(long_notebook["later_s"]))])
    ratio_rows = []
    for key, how in (("later_s", "back to back"), ("spaced_s", f"{spacing:g} s apart")):
        ours = median_of(r, "accelnb", "launch", key)
        acc = median_of(r, "accelerate", "launch", key)
        fab = median_of(r, "fabric", "launch", key)
        floor = median_of(r, "plain", "launch", key)
        ratio_rows += [
            (f"accelnb / Accelerate, {how}", ratio(ours, acc), "≤ 0.2", verdict(ratio(ours, acc), 0.2)),
            (f"accelnb / Fabric, {how}", ratio(ours, fab), "≤ 0.6", verdict(ratio(ours, fab), 0.6)),
            (f"accelnb / plain fork floor, {how}", ratio(ours, floor), "(≤ 1: at or below the floor)",
             verdict(ratio(ours, floor), 1.0)),
        ]
    return ("### 1. One-shot launch of a trivial function (ms)\n\n"
            "Group set up by the launcher (for Accelerate by the function, from its environment), one "
            "`all_reduce`, return. *First launch* is the process's first; then launches "
            f"{spacing:g} s apart (the pause untimed), as cells a person runs, then launches back to back: "
            "accelnb's template forks the next launch's ranks while idle (`worker/template/standby_ranks.py`) "
            "and they join the next launch's group while they wait (`wire/group_ahead.py`), "
            "which only launches apart show, and once nothing came for 0.1 s moves its memory onto 2 MiB pages "
            "(`worker/template/huge_pages.py`, in the first pauses), which makes every later fork and rank "
            "exit cheaper. accelnb's first launch starts its helper process (a fresh interpreter importing "
            "torch). *After 3,000 notebook cells*: accelnb's launches back to back, last, with that many "
            "distinct cells in `linecache` as IPython registers them and one more before each launch "
            "(their text goes to the template once, and a call carries the ranks only what they "
            "lack: `kernel/helper/cell_sources.py`).\n\n" + table(header, rows) + "\n\n" + ratio_table(ratio_rows))


def session_section(r: dict[str, Any]) -> str:
    header = ["tool", "session start", "min", "median", "max", "calls"]
    rows = []
    problem = error_of(r, "accelnb", "session")
    if problem:
        rows.append(na_row("accelnb", problem, len(header)))
    else:
        data = r["accelnb"]["session"]
        rows.append(["accelnb", fmt(data["start_s"], "ms"), *spread(data["call_s"], "ms")])
    for tool in ("accelerate", "fabric"):
        rows.append(na_row(NAMES[tool], "no persistent workers; every call is a new launch", len(header)))
    call = median_of(r, "accelnb", "session", "call_s")
    peers = {t: median_of(r, t, "launch", "later_s") for t in ("accelerate", "fabric")}
    known = {t: v for t, v in peers.items() if v is not None}
    faster = min(known, key=lambda t: known[t]) if known else None
    value = ratio(call, known[faster]) if faster else None
    name = f"session call / {NAMES[faster]} one-shot launch" if faster else "session call / faster peer"
    return ("### 2. Persistent session round trip (ms)\n\n"
            "The same trivial function (one `all_reduce`) run in already-running workers, process group "
            "kept; 3 warm-up calls not counted.\n\n" + table(header, rows) + "\n\n"
            + ratio_table([(name, value, "≤ 0.05", verdict(value, 0.05))]))


def training_section(r: dict[str, Any]) -> str:
    header = ["tool", "min", "median", "max", "runs", "inner loop, median"]
    variants = [("accelnb", "training", "accelnb"),
                ("accelerate", "training", "Accelerate (threads set as the others do)"),
                ("accelerate", "training_default_threads", "Accelerate (as is: torch's default threads)"),
                ("fabric", "training", "Fabric"),
                ("plain", "training", "plain fork (reference)")]
    rows = []
    for tool, scen, label in variants:
        problem = error_of(r, tool, scen)
        if problem:
            rows.append(na_row(label, problem, len(header)))
            continue
        data = r[tool][scen]
        inner = statistics.median(data["loop_s"]) if data.get("loop_s") else None
        rows.append([label, *spread(data["total_s"], "s"), fmt(inner, "s")])
    ours = median_of(r, "accelnb", "training", "total_s")
    acc = median_of(r, "accelerate", "training", "total_s")
    acc_default = median_of(r, "accelerate", "training_default_threads", "total_s")
    fab = median_of(r, "fabric", "training", "total_s")
    ratios = ratio_table([
        ("accelnb / Accelerate (threads set)", ratio(ours, acc), "≤ 0.5", verdict(ratio(ours, acc), 0.5)),
        ("accelnb / Accelerate (as is)", ratio(ours, acc_default), "≤ 0.5",
         verdict(ratio(ours, acc_default), 0.5)),
        ("accelnb / Fabric", ratio(ours, fab), "(no target)", "–"),
    ])
    return ("### 3. 200-step MLP training, whole launch (s)\n\n"
            "Linear(64,256)-ReLU-Linear(256,10), batch 64, Adam, DDP; wall time of the launcher call, "
            "including each fresh worker building its first optimizer (lazy `torch._dynamo` import "
            "unless the worker already has it). accelnb, Fabric and the plain baseline run "
            "`cpu_count // 2` intra-op threads per rank; Accelerate leaves torch's default (every "
            "core in every rank), shown as is and with the function setting the same thread count "
            "(the target is judged against the latter, which isolates the launcher). Inner loop = "
            "the 200 steps alone, timed in rank 0.\n\n" + table(header, rows) + "\n\n" + ratios)


def throughput_section(r: dict[str, Any]) -> str:
    header = ["launcher", "min", "median", "max", "runs"]
    rows = []
    problem = error_of(r, "throughput", "throughput")
    ours = plain = paired = None
    if problem:
        rows.append(na_row("accelnb and plain fork", problem, len(header)))
    else:
        data = r["throughput"]["throughput"]["steps_per_s"]
        rows.append(["accelnb", *spread(data["accelnb"], "steps/s")])
        rows.append(["plain torch.multiprocessing fork", *spread(data["plain"], "steps/s")])
        pairs = [a / b for a, b in zip(data["accelnb"], data["plain"], strict=True)]
        rows.append(["ratio of each pair (accelnb / plain)", *spread(pairs, "ratio")])
        ours, plain = statistics.median(data["accelnb"]), statistics.median(data["plain"])
        paired = statistics.median(pairs)
    for tool in ("accelerate", "fabric"):
        rows.append(na_row(NAMES[tool], "the target compares accelnb with plain torch.multiprocessing",
                           len(header)))
    return ("### 4. Training throughput inside the function (steps/s)\n\n"
            "The same DDP loop; 20 warm-up steps, then 200 timed in rank 0. accelnb and plain fork "
            "(same gloo group set-up through a TCPStore, same threads) launched alternately, so each "
            "pair ran under about the same machine load; the spread of the pair ratios shows how "
            "far this machine's noise is from the 2 % being asked about.\n\n"
            + table(header, rows) + "\n\n"
            + ratio_table([
                ("accelnb / plain (medians)", ratio(ours, plain), "≥ 0.98", verdict(ratio(ours, plain), 0.98,
                                                                                      below=False)),
                ("accelnb / plain (median of pairs)", paired, "≥ 0.98", verdict(paired, 0.98, below=False)),
            ]))


def output_section(r: dict[str, Any]) -> str:
    header = ["rank 0 prints to", "min", "median", "max", "runs"]
    rows = []
    problem = error_of(r, "accelnb", "output")
    slowdown = note = None
    if problem:
        rows.append(na_row("accelnb", problem, len(header)))
    else:
        data = r["accelnb"]["output"]
        rows.append(["sys.stdout, relayed by accelnb", *spread(data["stdout_s"], "ms")])
        rows.append(["/dev/null (same loop, same worker)", *spread(data["devnull_s"], "ms")])
        slowdown = statistics.median(data["stdout_s"]) / statistics.median(data["devnull_s"]) - 1
        note = (f"Per launch of {data['lines']:,} lines the cell was shown a median "
                f"{statistics.median(data['shown_lines']):,.0f} lines and a marker for "
                f"{statistics.median(data['skipped_lines']):,.0f} skipped ones (accelnb's flood "
                f"protection keeps the notebook under Jupyter's IOPub rate limit); the launch result "
                f"retained {statistics.median(data['retained_lines']):,.0f} lines. Whole launch, "
                f"median: {fmt(statistics.median(data['launch_s']), 'ms')} ms.")
    for tool in ("accelerate", "fabric"):
        rows.append(na_row(NAMES[tool], "forked workers write to the kernel's own file descriptors; "
                                        "the launcher relays nothing", len(header)))
    return ("### 5. Rank-0 output: 100,000 short lines (ms for the print loop, timed inside rank 0)\n\n"
            + table(header, rows) + "\n\n"
            + ratio_table([("slowdown (medians)", None if slowdown is None else fmt(slowdown, "%"),
                            "≤ +5 %", verdict(slowdown, 0.05))])
            + ("\n\n" + note if note else ""))


def memory_section(r: dict[str, Any]) -> str:
    launches = next((r[t]["memory"]["launches"] for t in ("accelnb", "accelerate", "fabric")
                     if "launches" in r.get(t, {}).get("memory", {})), 20)
    header = ["tool", "RSS before first launch", "after first", f"after {launches} more", "growth",
              "CUDA initialised in launcher"]
    rows = []
    growth = None
    cuda_ok = None
    for tool in ("accelnb", "accelerate", "fabric"):
        problem = error_of(r, tool, "memory")
        if problem:
            rows.append(na_row(NAMES[tool], problem, len(header)))
            continue
        data = r[tool]["memory"]
        cuda = data.get("cuda_initialized") or data.get("cuda_initialized_at_end")
        rows.append([NAMES[tool], fmt(data.get("rss_before_first_mb"), "MB"),
                     fmt(data["rss_after_first_mb"], "MB"), fmt(data["rss_after_mb"], "MB"),
                     f"{data['growth_mb']:+.1f}", str(bool(cuda))])
        if tool == "accelnb":
            growth, cuda_ok = data["growth_mb"], not cuda
    return ("### 6. Launching process memory (MiB RSS, after `gc.collect()`)\n\n"
            + table(header, rows) + "\n\n"
            + ratio_table([(f"accelnb growth over {launches} launches (MiB)",
                            None if growth is None else f"{growth:+.1f}", "≤ 30", verdict(growth, 30)),
                           ("accelnb: CUDA never initialised in the launcher",
                            None if cuda_ok is None else str(cuda_ok), "True",
                            "n/a" if cuda_ok is None else ("meets" if cuda_ok else "misses"))])
            + "\n\n(torch here is a CPU build, so no launcher could initialise CUDA; on a GPU machine "
              "this row is the meaningful one.)")


# ── the report ──────────────────────────────────────────────────────────────────────────────
def machine() -> dict[str, str]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model, "nproc": str(os.cpu_count()), "os": f"{platform.system()} {platform.release()}"}


def report(results: dict[str, Any], started: datetime.datetime, seconds: float,
           load: tuple[tuple[float, ...], tuple[float, ...]], quick: bool) -> str:
    versions: dict[str, str] = {}
    for data in results.values():
        versions.update(data.get("meta", {}).get("versions", {}))
    m = machine()
    head = [
        "## accelnb launch benchmark" + (" (quick run: few repeats)" if quick else ""),
        "",
        f"- date: {started.strftime('%Y-%m-%d %H:%M %Z').strip()}",
        f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['os']}, no GPU used (2 CPU ranks, gloo)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load[0])}, "
        f"at end {'/'.join(f'{x:.1f}' for x in load[1])}",
        f"- whole run: {seconds:.0f} s (`python benchmarks/run_all.py`; each tool in a fresh process)",
    ]
    sections = [launch_section(results), session_section(results), training_section(results),
                throughput_section(results), output_section(results), memory_section(results)]
    return "\n".join(head) + "\n\n" + "\n\n".join(sections) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run")
    parser.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS_PATH}")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help="comma-separated subset of " + ",".join(TOOLS))
    parser.add_argument("--keep-logs", action="store_true", help="keep each tool's stderr log")
    opts = parser.parse_args(argv)

    started = datetime.datetime.now().astimezone()
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    log_dir = tempfile.mkdtemp(prefix="accelnb-bench-")
    print(f"Measuring, each tool in a fresh process (logs in {log_dir}):")
    results = {tool: run_tool(tool, QUICK if opts.quick else [], log_dir)
               for tool in opts.tools.split(",") if tool}
    text = report(results, started, time.perf_counter() - t0, (load_start, os.getloadavg()), opts.quick)
    print()
    print(text)
    if not opts.no_write:
        replace_section("## accelnb launch benchmark", text)  # other scripts' sections stay
        print(f"(written to {os.path.relpath(RESULTS_PATH)})")
    if not opts.keep_logs and not any("error" in str(v) for v in results.values()):
        for name in os.listdir(log_dir):
            os.remove(os.path.join(log_dir, name))
        os.rmdir(log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
