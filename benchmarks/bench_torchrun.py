"""``%torchrun`` vs ``!torchrun`` in a real Jupyter kernel: first output, whole cell, and Stop.

    python benchmarks/bench_torchrun.py [--repeats 5] [--stop-repeats 5] [--write]

Two kernels (``jupyter_client``, ``PYTHONPATH`` = this working tree, the venv's ``bin`` first on
``PATH`` so that ``!torchrun`` is its torchrun), each in a folder holding two torchrun scripts
written as people write them (``init_process_group(backend="gloo")`` from the environment):

``train.py``
    DDP training: Linear(784,512)-ReLU-Linear(512,512)-ReLU-Linear(512,10), Adam, batch 64,
    300 steps over MNIST-shaped random data (16,384 × 784 float32, 48 MiB, built by every rank)
    with a ``DistributedSampler``. Rank 0 prints ``rank 0 started`` as its very first statement
    (before ``import torch``), a loss every 100 steps, and the time of its loop.
``ships_logs.py``
    Every rank first starts a child of its own in its own session (``start_new_session=True``,
    as log shippers and data servers are started), writes ``pids-RANK.txt`` (its pid and the
    child's), joins the group, and then runs until stopped.

One kernel runs ``%load_ext accelnb`` then ``%torchrun --nproc-per-node 2 SCRIPT``; the other
runs ``!torchrun --nproc-per-node 2 SCRIPT`` (IPython runs it through a shell on a pty). The
cases alternate between the kernels, so a burst of load hits both. Measured from this process,
which stands in for the notebook (times are when a message is read off the kernel's sockets):

1. from sending the cell to the first IOPub stream message holding rank 0's first line;
2. the whole training cell, from sending it until both its ``execute_reply`` and its IOPub
   ``idle`` arrived (the cell's ``[*]`` turning into a number); rank 0's own loop time alongside;
3. Stop: once rank 0 said every rank is running (so both ranks and both children are up and
   their pids are in the files), ``interrupt_kernel()`` (the notebook's Stop button: SIGINT to
   the kernel). Then the 4 recorded processes (ranks + their children) are watched every 20 ms
   for ``--watch-s`` seconds: how many are alive 3 s after Stop, and when the last one went (if
   it did). The other processes the cell started (the kernel's new descendants other than those
   4, e.g. the shell and torchrun for ``!``) are watched the same way; and when the cell answered.
   Whatever is left is then killed by this script, by pid (psutil, so a reused pid is never hit).

The first cell of each kind in each kernel is shown apart ("first in kernel"): it pays for cold
caches and, for ``%torchrun``, for starting accelnb's helper. A benchmark, not a test: nothing is
asserted about timings. With ``--write`` the tables replace this script's section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import queue
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil
from jupyter_client.manager import start_new_kernel
from results_file import replace_section  # benchmarks/ is on sys.path when run as a script
from run_all import fmt, machine, spread, table

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
VENV_BIN = Path(sys.executable).parent
SECTION_TITLE = "## `%torchrun` vs `!torchrun` in a Jupyter kernel"
FIRST_LINE = "rank 0 started"
DONE_LINE = "rank 0 done"
RUNNING_LINE = "every rank is running"
CELL_TIMEOUT_S = 600
STOP_AFTER_S = 3.0
STARTED: list[psutil.Process] = []  # every rank and child the scripts started: killed at the end if alive

TRAIN_SCRIPT = r'''
import os

if os.environ.get("RANK") == "0":
    print("rank 0 started", flush=True)  # a script's first log line, before anything slow

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16384, 784), torch.randint(0, 10, (16384,)))  # MNIST-shaped
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = DDP(nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    step, epoch, began = 0, 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1
    if rank == 0:
        print(f"rank 0 done: {step} steps in {time.perf_counter() - began:.3f} s, "
              f"{torch.get_num_threads()} threads", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

SHIPPER_SCRIPT = r'''
import os

rank = os.environ["RANK"]
if rank == "0":
    print("rank 0 started", flush=True)

import subprocess
import sys
import time

import torch.distributed as dist

# A helper of the rank's own, in its own session, as log shippers and data servers are started
# (it ends itself after 2 minutes, should everything else fail).
shipper = subprocess.Popen([sys.executable, "-c", "import time\nfor _ in range(1200): time.sleep(0.1)"],
                           start_new_session=True)
with open(f"pids-{rank}.tmp", "w") as out:
    out.write(f"{os.getpid()} {shipper.pid}\n")
os.replace(f"pids-{rank}.tmp", f"pids-{rank}.txt")
dist.init_process_group(backend="gloo")
dist.barrier()
if rank == "0":
    print("every rank is running", flush=True)
while True:
    time.sleep(0.1)
'''

MODES = {"%": "`%torchrun --nproc-per-node 2 {script}`", "!": "`!torchrun --nproc-per-node 2 {script}`"}


# ── a kernel, read message by message ───────────────────────────────────────────────────────
@dataclass
class Cell:
    """One executed cell: when it was sent, and when each thing about it arrived."""

    msg_id: str
    sent: float
    text: str = ""  # stdout and stderr, as they arrived
    first_line: float | None = None  # when the text first held FIRST_LINE
    done_line: float | None = None  # ... and DONE_LINE
    reply: dict[str, Any] | None = None
    replied: float | None = None
    idle: float | None = None

    @property
    def done(self) -> bool:
        return self.replied is not None and self.idle is not None


@dataclass
class Kernel:
    mode: str
    folder: Path
    manager: Any = None
    client: Any = None
    pid: int = 0
    seen: dict[tuple[int, float], psutil.Process] = field(default_factory=dict)  # every descendant met

    def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env["PATH"] = os.pathsep.join((str(VENV_BIN), env.get("PATH", "")))
        env.pop("OMP_NUM_THREADS", None)  # torchrun and accelnb each choose the ranks' threads
        self.manager, self.client = start_new_kernel(kernel_name="python3", env=env, cwd=str(self.folder))
        setup = "import os\n" + ("%load_ext accelnb\n" if self.mode == "%" else "") + "print(os.getpid())"
        cell = self.run(setup)
        if cell.reply is None or cell.reply["content"]["status"] != "ok":
            raise RuntimeError(f"kernel set-up failed: {cell.text}")
        self.pid = int(cell.text.split()[-1])

    def send(self, code: str) -> Cell:
        sent = time.monotonic()
        return Cell(self.client.execute(code), sent)

    def poll(self, cell: Cell, wait_s: float) -> None:
        """Read what arrived for ``cell`` (waiting up to ``wait_s`` for the first IOPub message)."""
        try:
            message = self.client.get_iopub_msg(timeout=wait_s)
        except queue.Empty:
            message = None
        while message is not None:
            now = time.monotonic()
            if message["parent_header"].get("msg_id") == cell.msg_id:
                kind = message["header"]["msg_type"]
                if kind == "stream":
                    cell.text += message["content"]["text"]
                    if cell.first_line is None and FIRST_LINE in cell.text:
                        cell.first_line = now
                    if cell.done_line is None and DONE_LINE in cell.text:
                        cell.done_line = now
                elif kind == "error":
                    cell.text += "\n".join(message["content"].get("traceback", [])) + "\n"
                elif kind == "status" and message["content"]["execution_state"] == "idle":
                    cell.idle = now
            try:
                message = self.client.get_iopub_msg(timeout=0)
            except queue.Empty:
                message = None
        while cell.replied is None:
            try:
                reply = self.client.get_shell_msg(timeout=0)
            except queue.Empty:
                break
            if reply["parent_header"].get("msg_id") == cell.msg_id:
                cell.reply, cell.replied = reply, time.monotonic()

    def wait(self, cell: Cell, until: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                return False
            self.poll(cell, 0.02)
        return True

    def run(self, code: str, timeout: float = CELL_TIMEOUT_S) -> Cell:
        cell = self.send(code)
        if not self.wait(cell, lambda: cell.done, timeout):
            raise RuntimeError(f"cell did not finish in {timeout} s: {code!r}; output so far:\n{cell.text[-2000:]}")
        return cell

    def descendants(self) -> dict[tuple[int, float], psutil.Process]:
        found = {}
        try:
            for p in psutil.Process(self.pid).children(recursive=True):
                try:
                    found[(p.pid, p.create_time())] = p
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass
        self.seen.update(found)
        return found

    def shut_down(self) -> None:
        self.descendants()
        if self.client is not None:
            self.client.stop_channels()
        if self.manager is not None:
            self.manager.shutdown_kernel(now=True)


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_leftovers(processes: Sequence[psutil.Process]) -> list[str]:
    """SIGKILL each process still alive (``is_running`` checks its start time: never a reused pid)."""
    killed = []
    for p in processes:
        if alive(p):
            try:
                name = " ".join(p.cmdline())[:80]
                p.kill()
                killed.append(f"{p.pid} ({name})")
            except psutil.NoSuchProcess:
                pass
    return killed


# ── the cases ───────────────────────────────────────────────────────────────────────────────
def command(mode: str, script: str) -> str:
    return f"{mode}torchrun --nproc-per-node 2 {script}"


def training(kernel: Kernel) -> dict[str, float]:
    cell = kernel.run(command(kernel.mode, "train.py"))
    status = cell.reply["content"]["status"] if cell.reply else "none"
    done = re.search(r"rank 0 done: \d+ steps in ([0-9.]+) s, (\d+) threads", cell.text)
    if status != "ok" or done is None or cell.first_line is None:
        raise RuntimeError(f"{command(kernel.mode, 'train.py')} failed ({status}); output:\n{cell.text[-3000:]}")
    assert cell.replied is not None and cell.idle is not None and cell.done_line is not None
    loop_s = float(done.group(1))
    ended = max(cell.replied, cell.idle)
    return {"first_line_s": cell.first_line - cell.sent, "wall_s": ended - cell.sent, "loop_s": loop_s,
            "threads": float(done.group(2)),
            # rank 0's loop began about loop_s before its last line arrived
            "to_loop_s": cell.done_line - loop_s - cell.first_line, "after_loop_s": ended - cell.done_line}


def stop(kernel: Kernel, watch_s: float) -> dict[str, Any]:
    for stale in kernel.folder.glob("pids-*"):
        stale.unlink()
    before = kernel.descendants()
    cell = kernel.send(command(kernel.mode, "ships_logs.py"))
    pid_files = [kernel.folder / f"pids-{rank}.txt" for rank in (0, 1)]
    if not kernel.wait(cell, lambda: RUNNING_LINE in cell.text and all(f.exists() for f in pid_files), 300):
        raise RuntimeError(f"the ranks never all ran; output:\n{cell.text[-3000:]}")
    script = []
    for path in pid_files:
        for pid in path.read_text().split():
            script.append(psutil.Process(int(pid)))  # alive now: the barrier was passed
    STARTED.extend(script)
    others = [p for key, p in kernel.descendants().items()
              if key not in before and p.pid not in {s.pid for s in script}]
    stopped = time.monotonic()
    kernel.manager.interrupt_kernel()  # the notebook's Stop button
    watched = script + others
    gone: dict[int, float] = {}
    while time.monotonic() - stopped < watch_s and not (len(gone) == len(watched) and cell.done):
        kernel.poll(cell, 0.02)
        for p in watched:
            if p.pid not in gone and not alive(p):
                gone[p.pid] = time.monotonic() - stopped
    answered_in_time = kernel.wait(cell, lambda: cell.done, 60)
    status = cell.reply["content"]["status"] if cell.reply else "no answer"

    def left_at(processes: Sequence[psutil.Process], after_s: float) -> int:
        return sum(1 for p in processes if gone.get(p.pid, float("inf")) > after_s)

    script_gone = [gone[p.pid] for p in script if p.pid in gone]
    names = {p.pid: _name(p) for p in others}
    result = {
        "processes": len(script),
        "alive_after_3s": left_at(script, STOP_AFTER_S),
        "ranks_alive_after_3s": left_at(script[0::2], STOP_AFTER_S),  # each file: the rank's pid, its child's
        "children_alive_after_3s": left_at(script[1::2], STOP_AFTER_S),
        "all_gone_s": max(script_gone) if len(script_gone) == len(script) else None,
        "alive_at_end": left_at(script, watch_s),
        "others": len(others),
        "others_names": sorted(names.values()),
        "others_alive_after_3s": left_at(others, STOP_AFTER_S),
        "others_left": sorted(names[p.pid] for p in others if gone.get(p.pid, float("inf")) > STOP_AFTER_S),
        "cell_answered_s": (cell.replied - stopped) if answered_in_time and cell.replied else None,
        "status": status,
    }
    if not answered_in_time:  # a second Stop, as an impatient user would, so that the next case can run
        kernel.manager.interrupt_kernel()
        kernel.wait(cell, lambda: cell.done, 60)
    result["killed"] = kill_leftovers(watched)
    return result


def _name(p: psutil.Process) -> str:
    try:
        words = p.cmdline()
    except psutil.NoSuchProcess:
        return "?"
    return " ".join(Path(w).name if i == 0 else w for i, w in enumerate(words))[:60]


# ── the report ──────────────────────────────────────────────────────────────────────────────
def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("torch", "ipykernel", "ipython", "jupyter_client", "psutil"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def timing_rows(runs: dict[str, list[dict[str, Any]]], key: str, script: str, loop: bool) -> list[list[str]]:
    rows = []
    for mode, label in MODES.items():
        values = [r[key] for r in runs[mode]]
        first, later = (values[0], values[1:]) if values else (None, [])
        row = [label.format(script=script), fmt(first, "s"), *spread(later, "s")]
        if loop:
            row.append(fmt(statistics.median([r["loop_s"] for r in runs[mode][1:]]) if len(values) > 1 else None, "s"))
        rows.append(row)
    return rows


def breakdown_rows(runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for mode, label in MODES.items():
        later = runs[mode][1:]
        rows.append([label.format(script="train.py"),
                     *(fmt(statistics.median([r[key] for r in later]) if later else None, "s")
                       for key in ("first_line_s", "to_loop_s", "loop_s", "after_loop_s", "wall_s"))])
    return rows


def median_range(values: Sequence[float]) -> str:
    return f"{fmt(statistics.median(values), 's')} ({fmt(min(values), 's')}–{fmt(max(values), 's')})"


def stop_rows(stops: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for mode, label in MODES.items():
        done = stops[mode]
        gone = [r["all_gone_s"] for r in done if r["all_gone_s"] is not None]
        answered = [r["cell_answered_s"] for r in done if r["cell_answered_s"] is not None]
        statuses = sorted({r["status"] for r in done})
        rows.append([
            label.format(script="ships_logs.py"),
            "/".join(str(n) for n in sorted({r["processes"] for r in done})),
            ", ".join(f"{r['alive_after_3s']} ({r['ranks_alive_after_3s']}+{r['children_alive_after_3s']})"
                      for r in done),
            f"{len(gone)} of {len(done)}" + (f": {median_range(gone)}" if gone else ""),
            (median_range(answered) if answered else "never") + f", `{'`/`'.join(statuses)}`",
            "/".join(str(n) for n in sorted({r["others"] for r in done})) + "; "
            + ", ".join(str(r["others_alive_after_3s"]) for r in done),
            str(len(done)),
        ])
    return rows


def report(runs: dict[str, list[dict[str, Any]]], stops: dict[str, list[dict[str, Any]]], watch_s: float,
           started: datetime.datetime, seconds: float, load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    m = machine()
    head = [
        SECTION_TITLE,
        "",
        f"- date: {started.strftime('%Y-%m-%d %H:%M %Z').strip()}",
        f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['os']}, no GPU used (2 CPU ranks, gloo)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()),
        f"- load average (1/5/15 min) at start {'/'.join(f'{x:.1f}' for x in load[0])}, "
        f"at end {'/'.join(f'{x:.1f}' for x in load[1])}",
        f"- whole run: {seconds:.0f} s (`python benchmarks/bench_torchrun.py`; two real kernels through "
        "jupyter_client, the cases alternating between them)",
    ]
    timing_header = ["cell", "first in kernel", "min", "median", "max", "later runs"]
    threads = sorted({int(r["threads"]) for mode in MODES for r in runs[mode]})
    first = ("### 1. Rank 0's first line on IOPub (s)\n\n"
             "From sending the cell to the first stream message holding rank 0's first line, which "
             "the script prints before `import torch`.\n\n"
             + table(timing_header, timing_rows(runs, "first_line_s", "train.py", loop=False)))
    wall = ("### 2. Whole cell: 300-step DDP training (s)\n\n"
            "From sending the cell until its `execute_reply` and its IOPub `idle` both arrived. Inner "
            "loop = rank 0's 300 steps alone, timed in the script (later runs). Threads per rank, as "
            f"each launcher set them: {'/'.join(map(str, threads))}.\n\n"
            + table([*timing_header, "inner loop, median"], timing_rows(runs, "wall_s", "train.py", loop=True))
            + "\n\nWhere the time goes (medians of the later runs): rank 0's loop began about its measured "
            "length before its last line arrived; \"first line → loop\" is the script's imports, the group, "
            "the data and DDP; \"loop → cell done\" is the ranks' and the launcher's exit (0.00 where rank "
            "0's last line reached IOPub with the cell's end).\n\n"
            + table(["cell", "send → first line", "first line → loop", "loop", "loop → cell done", "whole cell"],
                    breakdown_rows(runs)))
    stop_header = ["cell", "processes (ranks + children)", "alive 3 s after Stop (ranks+children), each run",
                   f"runs all gone within {watch_s:.0f} s: median (min–max) s", "cell answered after Stop (s), status",
                   "other processes the cell started; alive 3 s after, each run", "runs"]
    others_seen = sorted({name for mode in MODES for r in stops[mode] for name in r["others_left"]})
    others_started = {mode: sorted({name for r in stops[mode] for name in r["others_names"]}) for mode in MODES}
    killed = sum(len(r["killed"]) for mode in MODES for r in stops[mode])
    stop_text = ("### 3. Stop (kernel interrupt) once both ranks and both children are up\n\n"
                 "Every rank starts a child in its own session (as a log shipper is), then waits; Stop is "
                 "`interrupt_kernel()` once rank 0 printed that every rank runs. The 4 pids come from files "
                 f"the script writes; each is watched every 20 ms for {watch_s:.0f} s. \"Other processes\" are "
                 "the kernel's new descendants besides those: "
                 + "; ".join(f"{mode}torchrun: " + (", ".join(f"`{n}`" for n in names) or "none")
                             for mode, names in others_started.items()) + ".\n\n"
                 + table(stop_header, stop_rows(stops))
                 + ("\n\nStill alive 3 s after Stop among the other processes: " + "; ".join(
                     f"`{n}`" for n in others_seen) if others_seen else "")
                 + f"\n\nLeft alive at the end of the watch, and killed by the benchmark by pid: {killed} "
                 "process(es).")
    return "\n".join(head) + "\n\n" + "\n\n".join([first, wall, stop_text]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="training cells per kernel after the first (5)")
    parser.add_argument("--stop-repeats", type=int, default=5, help="Stop cases per kernel (5)")
    parser.add_argument("--watch-s", type=float, default=10.0, help="how long the processes are watched after Stop")
    parser.add_argument("--write", action="store_true", help="replace this section of benchmarks/RESULTS.md")
    opts = parser.parse_args(argv)

    started = datetime.datetime.now().astimezone()
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    stops: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    kernels: dict[str, Kernel] = {}
    every_script_process: list[psutil.Process] = []
    with tempfile.TemporaryDirectory(prefix="accelnb-bench-torchrun-") as workdir:
        try:
            for mode in MODES:
                folder = Path(workdir) / ("percent" if mode == "%" else "bang")
                folder.mkdir()
                (folder / "train.py").write_text(TRAIN_SCRIPT)
                (folder / "ships_logs.py").write_text(SHIPPER_SCRIPT)
                kernels[mode] = Kernel(mode, folder)
                kernels[mode].start()
            for i in range(opts.repeats + 1):
                for mode in (MODES if i % 2 == 0 else reversed(MODES)):  # alternate which goes first
                    runs[mode].append(training(kernels[mode]))
                    r = runs[mode][-1]
                    print(f"{command(mode, 'train.py')}: first line {r['first_line_s']:.2f} s, cell "
                          f"{r['wall_s']:.2f} s, loop {r['loop_s']:.2f} s (first line → loop {r['to_loop_s']:.2f} s, "
                          f"loop → cell done {r['after_loop_s']:.2f} s)", file=sys.stderr)
            for i in range(opts.stop_repeats):
                for mode in (MODES if i % 2 == 0 else reversed(MODES)):
                    stops[mode].append(stop(kernels[mode], opts.watch_s))
                    r = stops[mode][-1]
                    print(f"{command(mode, 'ships_logs.py')} + Stop: {r['alive_after_3s']}/{r['processes']} alive "
                          f"after 3 s, all gone {r['all_gone_s']}, cell answered {r['cell_answered_s']} "
                          f"({r['status']}), others {r['others_alive_after_3s']}/{r['others']} {r['others_names']}, "
                          f"killed {r['killed']}", file=sys.stderr)
        finally:
            for kernel in kernels.values():
                kernel.shut_down()
                every_script_process += list(kernel.seen.values())
            time.sleep(1)
            left = kill_leftovers(STARTED + every_script_process)
            if left:
                print(f"killed after the kernels shut down: {left}", file=sys.stderr)
    text = report(runs, stops, opts.watch_s, started, time.perf_counter() - t0, (load_start, os.getloadavg()))
    print(text)
    if opts.write:
        replace_section(SECTION_TITLE, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
