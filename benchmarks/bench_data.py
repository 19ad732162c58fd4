"""Data in and out of a launch: ``python benchmarks/bench_data.py [--sizes 256,1024] [--ranks 2,4]``.

Each case runs in a fresh process of this script (``--case``), so that one case's peak RSS and
mappings do not leak into the next; the parent prints one table and, with ``--write``, appends it
to ``benchmarks/RESULTS.md``. CPU, gloo, float32 tensors of ``--sizes`` MiB.

Cases (medians of ``--repeats`` runs, after one warm-up launch that starts accelnb's helper):

``memcpy``
    The floor: ``X.clone()`` of the same bytes (a fresh allocation, like a received copy).
``accelnb-in``
    ``notebook_launcher(first_element, args=(X,))``: the whole call, helper warm; every rank
    reads one element. Also the same call with no argument, for the launch's own share. The
    tensor is copied once into a memfd that every rank maps (since issue 33 no launch forks the
    kernel to hand it down).
``accelnb-in-memfd``
    The same call (it was the way with forks ruled out, before issue 33; kept so that the table's
    columns compare with earlier runs).
``accelerate-in``
    Accelerate's ``notebook_launcher`` with the same function as a closure argument: it forks
    this process, so the ranks see ``X`` for free. The function joins and leaves a gloo group, as
    accelnb's ranks do.
``accelnb-out``
    A persistent :class:`accelnb.Session`: one call makes the tensor on rank 0 (untimed), the
    next returns it (timed), so the time is the bring-back plus one session call (~2 ms). The
    kernel then reads every page of the result (``sum()``) and its RSS is taken.

On this project's machines (Firecracker VMs whose balloon reports freed pages to the host) the
first touch of memory the guest freed a while ago costs up to 10× more: a bare ``pwrite`` of
1 GiB into a memfd took 2.8 s, then 0.29 s on the next seven tries. Any case that needs fresh
memory (memcpy, the memfd copy, bring-back) is bimodal at 1 GiB; a fork needs none.

Peak RSS is this process's high-water mark (``ru_maxrss``) minus its RSS before the tensor
existed; "after" is the RSS with the brought-back tensor alive and fully read.

    python benchmarks/bench_data.py --sizes 256 --ranks 2 --save-json /tmp/before.json   # at main
    python benchmarks/bench_data.py --before /tmp/before.json --write                    # after
"""

from __future__ import annotations

import argparse
import builtins
import datetime
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # benchmark this working tree, not an installed copy

from results_file import replace_section  # noqa: E402 (benchmarks/ is on sys.path as the script's folder)

MIB = 1 << 20


# ── functions that run in the workers ───────────────────────────────────────────────────────
def first_element(x: Any = None) -> float:
    return 0.0 if x is None else float(x[0])


def first_element_env_group(x: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        float(x[0])
    finally:
        dist.destroy_process_group()


def make_on_rank0(numel: int) -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        builtins._bench_tensor = torch.ones(numel)  # type: ignore[attr-defined]


def give_back() -> Any:
    return getattr(builtins, "_bench_tensor", None)


def nothing() -> None:
    return None


# ── measuring, in the case's own process ────────────────────────────────────────────────────
def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(case: str, size_mib: int, ranks: int, repeats: int) -> dict[str, Any]:
    import torch

    numel = size_mib * MIB // 4
    base = rss_mib()
    out: dict[str, Any] = {}
    if case == "memcpy":
        x = torch.ones(numel)
        out["times"] = [timed(lambda: x.clone()) for _ in range(repeats)]
    elif case in ("accelnb-in", "accelnb-in-memfd"):
        import accelnb

        accelnb.notebook_launcher(first_element, num_processes=ranks, quiet=True)  # warm helper
        out["empty"] = [timed(lambda: accelnb.notebook_launcher(first_element, num_processes=ranks, quiet=True))
                        for _ in range(repeats)]
        x = torch.ones(numel)
        out["times"] = [timed(lambda: accelnb.notebook_launcher(first_element, (x,), num_processes=ranks,
                                                                quiet=True)) for _ in range(repeats)]
    elif case == "accelerate-in":
        from accelerate import notebook_launcher

        x = torch.ones(numel)
        out["times"] = [timed(lambda: notebook_launcher(first_element_env_group, (x,), num_processes=ranks,
                                                        use_port=str(free_port()))) for _ in range(repeats)]
    elif case == "accelnb-out":
        import accelnb

        with accelnb.Session.start(num_processes=ranks) as session:
            out["empty"] = [timed(lambda: session.run(nothing, collect="rank0", output="none"))
                            for _ in range(repeats)]
            session.run(make_on_rank0, (numel,), output="none")
            times, afters = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                value = session.run(give_back, collect="rank0", output="none").values[0]
                times.append(time.perf_counter() - started)
                assert value.numel() == numel and float(value.sum()) == numel  # reads every page
                afters.append(rss_mib() - base)
                del value
            out["times"], out["after_mib"] = times, max(afters)
    else:
        raise SystemExit(f"unknown case {case!r}")
    out["peak_mib"] = peak_mib() - base
    return out


# ── the parent: cases in fresh processes, one table ─────────────────────────────────────────
CASE_TIMEOUT_S = 300
CASES = ("memcpy", "accelerate-in", "accelnb-in", "accelnb-in-memfd", "accelnb-out")


def spawn_case(case: str, size: int, ranks: int, repeats: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    command = [sys.executable, __file__, "--case", case, "--sizes", str(size), "--ranks", str(ranks),
               "--repeats", str(repeats)]
    # A case that hangs (Accelerate's ranks once waited forever in their group's set-up) is
    # ended with everything it forked, and shows as failed in the table.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                               start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return {"error": f"hung: no result within {CASE_TIMEOUT_S} s"}
    try:
        return dict(json.loads(stdout.decode().strip().splitlines()[-1]))
    except (IndexError, json.JSONDecodeError):
        return {"error": f"exit {process.returncode}"}


def median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f}"


def table(rows: dict[tuple[int, int], dict[str, dict[str, Any]]],
          before: dict[str, Any] | None) -> str:
    lines = ["| MiB | ranks | memcpy | Accelerate in | accelnb in (empty launch) | in / Accelerate "
             "| accelnb in, memfd only | memfd / Accelerate "
             "| accelnb out (empty call) | out / memcpy | kernel peak RSS MiB | RSS after out / data |",
             "| --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |"]
    for (size, ranks), cases in sorted(rows.items()):
        memcpy = median(cases["memcpy"].get("times"))
        accel = median(cases["accelerate-in"].get("times"))
        ship, ship_empty = median(cases["accelnb-in"].get("times")), median(cases["accelnb-in"].get("empty"))
        memfd = median(cases["accelnb-in-memfd"].get("times"))
        back, back_empty = median(cases["accelnb-out"].get("times")), median(cases["accelnb-out"].get("empty"))
        peak = max(cases[c].get("peak_mib", 0.0) for c in ("accelnb-in", "accelnb-in-memfd", "accelnb-out"))
        after = cases["accelnb-out"].get("after_mib")
        if memcpy is None or accel is None or ship is None or memfd is None or back is None or after is None:
            lines.append(f"| {size} | {ranks} | failed: {json.dumps({c: v.get('error') for c, v in cases.items()})} |")
            continue
        lines.append(
            f"| {size} | {ranks} | {ms(memcpy)} | {ms(accel)} | {ms(ship)} ({ms(ship_empty)}) "
            f"| {ship / accel:.2f} | {ms(memfd)} | {memfd / accel:.2f} "
            f"| {ms(back)} ({ms(back_empty)}) | {back / memcpy:.2f} | {peak:,.0f} "
            f"| {after / size:.2f} |")
    if before:
        lines += ["", "Before (main, same script, same machine):", "",
                  "| MiB | ranks | accelnb in | accelnb out | kernel peak RSS MiB |", "| --: | --: | --: | --: | --: |"]
        for key, cases in sorted(before.items()):
            size, ranks = (int(v) for v in key.split("x"))
            peak = max(cases[c].get("peak_mib", 0.0) for c in ("accelnb-in", "accelnb-out"))
            lines.append(f"| {size} | {ranks} | {ms(median(cases['accelnb-in'].get('times')))} "
                         f"| {ms(median(cases['accelnb-out'].get('times')))} | {peak:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256,1024", help="MiB, comma-separated")
    parser.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", choices=CASES, help="(internal) run one case here, print JSON")
    parser.add_argument("--save-json", help="also write the raw numbers here")
    parser.add_argument("--before", help="raw numbers of an earlier run (--save-json) to show beside")
    parser.add_argument("--write", action="store_true",
                        help="put the table in benchmarks/RESULTS.md, in place of the last one")
    opts = parser.parse_args()
    sizes = [int(s) for s in opts.sizes.split(",")]
    rank_counts = [int(r) for r in opts.ranks.split(",")]
    if opts.case:
        sys.stdout.flush()
        result = run_case(opts.case, sizes[0], rank_counts[0], opts.repeats)
        print(json.dumps(result))
        return
    rows: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for size in sizes:
        for ranks in rank_counts:
            rows[(size, ranks)] = {}
            for case in CASES:
                print(f"  {size} MiB, {ranks} ranks, {case} …", file=sys.stderr, flush=True)
                rows[(size, ranks)][case] = spawn_case(case, size, ranks, opts.repeats)
    if opts.save_json:
        with open(opts.save_json, "w") as f:
            json.dump({f"{s}x{r}": v for (s, r), v in rows.items()}, f)
    before = None
    if opts.before:
        with open(opts.before) as f:
            before = json.load(f)
    text = table(rows, before)
    print(text)
    if opts.write:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        replace_section(
            "## Data in and out of a launch",
            f"## Data in and out of a launch (issue 12), {stamp}, {platform.node()}, "
            f"{os.cpu_count()} CPUs\n\n`python benchmarks/bench_data.py`: times in ms "
            f"(medians of {opts.repeats}), float32 CPU tensors, gloo. Targets: in ≤ 1.5× "
            "Accelerate, out ≤ 3× memcpy, RSS after out ≤ 1.1× the data. \"accelnb in\" is what a "
            "launch does: since issue 33 every launch writes a big payload once into a memfd that its ranks "
            "map (no rank is a fork of the kernel any more); \"memfd only\" forces that way, so the two "
            "columns measure the same path twice. Accelerate's ranks are forks of the launching process and "
            "inherit the payload without a copy. Fresh memory "
            "costs up to 10× more at random on these VMs (see the script's docstring), so the "
            "1 GiB memcpy, memfd and bring-back figures vary from run to run.\n\n"
            + text + "\n")


if __name__ == "__main__":
    main()
