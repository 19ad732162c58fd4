"""A session's cell against a plain cell and ipyparallel's ``%%px``, in real kernels (issue 35).

    python benchmarks/bench_session_cell.py              # prints the tables, rewrites its RESULTS.md section
    python benchmarks/bench_session_cell.py --quick --no-write

What a user sees is the time from pressing Shift-Enter to the cell's end, so each figure is a
Jupyter client's round trip: ``execute_interactive`` (the execute request, every IOPub message up
to "idle", the reply), the way JupyterLab waits for a cell. Kernels started alike
(``jupyter_client``, the ``python3`` kernel of this environment), two of each kind (``--kernels``),
each measured in rounds that alternate between them, so that the load of a shared machine hits all
alike; each kind's figures pool its kernels, as two kernels running the same code differ by up to
~10 % (Python's memory layout and hash seeds differ between processes):

- ``plain``: ``x = 1`` in a kernel that imported torch and accelnb and loaded its magic (what
  Jupyter makes every cell cost); ``plain_line``: the same cell printing one line, as long as the
  line a ``%%distributed`` cell prints when it brings back a new name (one stream message, which
  costs Jupyter's kernel ~0.7 ms of CPU: the scale for the "new name" row);
- ``accelnb``: ``%%distributed`` + ``x = 1`` in a session of 2 CPU ranks (``%distributed start
  --procs 2 --cpu``), which runs the line on both ranks and returns when both answered;
- ``plain_after_many`` and ``accelnb_after_many``: the same cells in kernels that first ran
  :data:`MANY_CELLS` distinct cells, as a notebook does over a day's work (each is an entry in
  ``linecache``, a name in the namespace): what grows with the notebook shows here (each
  ``%%distributed`` cell looked through every cell's source until 5dc5619: 2 ms more after 3,000);
- ``plain_real`` and ``accelnb_real``: a cell as notebooks have them (:data:`REAL_CELL`: imports, a
  small model class, a helper, a config, a loop, a value at the end) as a plain cell and on 2 ranks,
  which bring back the names it binds: what a cell's size costs each (a rank compiling it, the
  names and the value coming back) shows here, where ``x = 1`` hides it;
- ``ipyparallel``: ``%%px`` + ``x = 1`` on a cluster of 2 engines (``ipp.Cluster(n=2)``), the
  tool people use for persistent engines in a notebook; blocking, as ``%%px`` is by default;
- ``floor``: ``%%floor`` + ``x = 1``, a cell magic written here that does the least any tool could:
  it writes the cell's source down a pipe to each of 2 bare Python processes, which ``exec`` it and
  answer one byte, and returns once both answered. No rank, no process group, no value back, no
  error handling: what a round trip to two other processes costs a cell on this machine, so that
  accelnb's own share of its cell is told apart from what the machine makes any such cell cost.

Beside each cell's wall time, the CPU it cost the machine (:class:`CpuSpent`): the kernel, the
processes under it, and this client. On a 2-core machine the wall time swings with whatever else
runs; the CPU shows what each tool itself spends, so a change that adds work is seen at once.

Session start is timed too, each from a kernel that has everything imported and (for accelnb)
a warm template (waited for, as it is a few seconds after ``import accelnb``, when a notebook's
next cells come): ``%distributed start --procs 2 --cpu`` against
``ipp.Cluster(n=2).start_and_connect_sync()``; each is stopped before the next.

Targets (issue 35): a session cell ≤ 1.2× a plain cell of the same kernel and ≤ 0.4× ``%%px``;
session start ≤ 1.5 s. A benchmark, not a test: it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from results_file import replace_section  # benchmarks/ is on sys.path as the script's folder

HEADING = "## A session's cell against a plain cell and ipyparallel (issue 35)"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_CELL = "import torch, accelnb\n%load_ext accelnb"
SESSION_START = "%distributed start --procs 2 --cpu"
PX_START = ("import ipyparallel as ipp\ncluster = ipp.Cluster(n=2, log_level=40)\n"
            "rc = cluster.start_and_connect_sync()\nrc[:].activate()")
PX_STOP = "rc.close(); cluster.stop_cluster_sync()"
# "{n}": the cell's number. accelnb names what a cell brought back only when that changed, so the
# same cell run again prints nothing; "accelnb_new_name" brings back a new name every time, and
# pays for the line that says so (one more IOPub message).
# A cell as notebooks have them: a small model, a helper, a config, a loop, a value at the end (the
# same text in a plain cell, which gets ``rank`` and ``world_size`` from REAL_CELL_NAMES first).
REAL_CELL = """import torch.nn as nn
import torch.nn.functional as F

class Net(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 4)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)

def describe(model):
    sizes = [p.numel() for p in model.parameters()]
    return {{"tensors": len(sizes), "numbers": sum(sizes)}}

config = {{"hidden": 32, "lr": 3e-4, "epochs": 2}}
history = []
for epoch in range(config["epochs"]):
    history.append(epoch)
steps_per_epoch = 10 * world_size
summary = f"rank {{rank}}: {{steps_per_epoch}} steps"
len(history) == config["epochs"] and steps_per_epoch > 0"""
REAL_CELL_NAMES = "rank, world_size = 0, 1"
CELLS = {"plain": "x = 1", "plain_line": "x = 1\nprint('accelnb: brought back from rank 0: x')",
         "accelnb": "%%distributed\nx = 1", "accelnb_new_name": "%%distributed\nx{n} = 1",
         "ipyparallel": "%%px\nx = 1", "floor": "%%floor\nx = 1",
         "plain_after_many": "x = 1", "accelnb_after_many": "%%distributed\nx = 1",
         "plain_real": REAL_CELL, "accelnb_real": "%%distributed\n" + REAL_CELL}
REAL_LINES = len(REAL_CELL.splitlines())
MANY_CELLS = 1000  # distinct cells the *_after_many kernels run first
# The floor's two processes: read a length-prefixed source from stdin, exec it, answer one byte.
FLOOR_PROCESS = ("import os, struct\nnamespace = {}\nwhile True:\n    head = os.read(0, 4)\n    if not head: break\n"
                 "    size, = struct.unpack('<I', head)\n    source = b''\n"
                 "    while len(source) < size: source += os.read(0, size - len(source))\n"
                 "    exec(source.decode(), namespace)\n    os.write(1, b'k')\n")
FLOOR_START = f"""import struct as _struct, subprocess as _subprocess, sys as _sys
from IPython.core.magic import register_cell_magic as _register_cell_magic
_floor = [_subprocess.Popen([_sys.executable, "-c", {FLOOR_PROCESS!r}], stdin=_subprocess.PIPE,
                            stdout=_subprocess.PIPE, bufsize=0) for _ in range(2)]

@_register_cell_magic
def floor(line, cell):
    data = cell.encode()
    for process in _floor:
        process.stdin.write(_struct.pack("<I", len(data)) + data)
    for process in _floor:
        process.stdout.read(1)
"""
FLOOR_STOP = "for _process in _floor: _process.stdin.close(); _process.wait()"


def start_kernel() -> tuple[Any, Any]:
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("ACCELNB_TEMPLATE", None)  # templates as users have them
    return start_new_kernel(kernel_name="python3", env=env, cwd=REPO_ROOT)


def run(client: Any, code: str, timeout: float = 300) -> float:
    """Seconds from the request to the reply, after every IOPub message of the cell; raises on an error."""
    errors: list[str] = []

    def keep_errors(message: dict[str, Any]) -> None:
        if message["msg_type"] == "error":
            errors.append("\n".join(message["content"]["traceback"]))
        elif message["msg_type"] == "stream" and message["content"]["name"] == "stderr":
            errors.append(message["content"]["text"])

    started = time.perf_counter()
    reply = client.execute_interactive(code, timeout=timeout, output_hook=keep_errors)
    took = time.perf_counter() - started
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{code!r} failed:\n" + "\n".join(errors))
    return took


def session_starts(kind: str, count: int) -> list[float]:
    """``count`` starts of a session of 2 (accelnb) or a cluster of 2 engines (ipyparallel), each from
    a kernel with everything imported, stopped before the next."""
    manager, client = start_kernel()
    try:
        run(client, FIRST_CELL + ("\nimport ipyparallel" if kind == "ipyparallel" else ""))
        if kind == "accelnb":  # a few seconds after the imports, as a notebook's next cells come: warm
            run(client, "accelnb.prewarm(wait=True)")
        times = []
        for _ in range(count):
            if kind == "accelnb":
                times.append(run(client, SESSION_START))
                run(client, "%distributed stop")
            else:
                times.append(run(client, PX_START))
                run(client, PX_STOP)
        return times
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


class CpuSpent:
    """Seconds on a CPU (every thread) spent by a kernel, by the processes under it (a session's
    ranks and helper, ipyparallel's controller and engines) and by this client, over some cells."""

    PARTS = ("kernel", "its processes", "client")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.cells = 0

    def add(self, before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], cells: int) -> None:
        """What ``cells`` cells spent, from two readings of :func:`cpu_now` taken around them."""
        for part in self.PARTS:
            # A process that ended meanwhile is missing from "after": only those in both count.
            self.seconds[part] += sum(after[part][pid] - spent for pid, spent in before[part].items()
                                      if pid in after[part])
        self.cells += cells

    def per_cell_ms(self, part: str) -> float:
        return self.seconds[part] / self.cells * 1000 if self.cells else float("nan")


SCHEDSTAT = os.path.exists("/proc/self/schedstat")  # Linux, unless built without CONFIG_SCHED_INFO


def cpu_now(kernel_pid: int) -> dict[str, dict[int, float]]:
    import psutil

    kernel = psutil.Process(kernel_pid)
    under: dict[int, float] = {}
    for child in kernel.children(recursive=True):
        seconds = _on_cpu(child.pid)
        if seconds is not None:
            under[child.pid] = seconds
    return {"kernel": {kernel_pid: _on_cpu(kernel_pid) or 0.0}, "its processes": under,
            "client": {os.getpid(): _on_cpu(os.getpid()) or 0.0}}


def _on_cpu(pid: int) -> float | None:
    """Seconds ``pid``'s live threads have run, to the nanosecond (``/proc/<pid>/task/*/schedstat``;
    ``cpu_times`` counts in 10 ms ticks); None once the process is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as schedstat:
                total += int(schedstat.read().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended while we looked
            pass
    return total / 1e9


def cell_round_trips(kinds: list[str], rounds: int, per_round: int, cpu: dict[str, CpuSpent] | None = None,
                     copies: int = 1, per_kernel: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """``copies`` kernels of each kind, set up once; then ``rounds`` rounds of ``per_round`` cells
    on each, the kernels taking turns round by round. A kind's times pool its kernels. ``cpu``: where
    each kind's CPU per cell is added up; ``per_kernel``: each kernel's median, kind by kind."""
    kernels: dict[tuple[str, int], tuple[Any, Any]] = {}
    numbers = itertools.count()
    times: dict[tuple[str, int], list[float]] = {(kind, copy): [] for copy in range(copies) for kind in kinds}
    spent = cpu if cpu is not None else {}
    try:
        for kind, copy in times:
            manager, client = kernels[kind, copy] = start_kernel()
            run(client, FIRST_CELL)
            if kind.startswith("accelnb"):
                run(client, SESSION_START)
            elif kind == "ipyparallel":
                run(client, PX_START)
            elif kind == "floor":
                run(client, FLOOR_START)
            elif kind == "plain_real":
                run(client, REAL_CELL_NAMES)
            if kind.endswith("_after_many"):
                for number in range(MANY_CELLS):
                    run(client, f"y{number} = {number}  # a distinct cell, as a notebook's are")
            for _ in range(5):  # warm-up, not counted
                run(client, CELLS[kind].format(n=next(numbers)))
        for _ in range(rounds):
            for kind, copy in times:
                manager, client = kernels[kind, copy]
                kernel_pid = manager.provisioner.process.pid
                before = cpu_now(kernel_pid) if SCHEDSTAT else None  # without it the CPU rows say n/a
                times[kind, copy] += [run(client, CELLS[kind].format(n=next(numbers))) for _ in range(per_round)]
                if before is not None:
                    spent.setdefault(kind, CpuSpent()).add(before, cpu_now(kernel_pid), per_round)
        if per_kernel is not None:
            for (kind, _copy), values in times.items():
                per_kernel.setdefault(kind, []).append(statistics.median(values))
        return {kind: [t for (of, _copy), values in times.items() if of == kind for t in values] for kind in kinds}
    finally:
        for (kind, _copy), (manager, client) in kernels.items():
            try:
                stop = ("%distributed stop" if kind.startswith("accelnb")
                        else PX_STOP if kind == "ipyparallel" else FLOOR_STOP if kind == "floor" else "pass")
                run(client, stop)
            except RuntimeError:
                pass  # the kernel is shut down next in any case
            finally:
                client.stop_channels()
                manager.shutdown_kernel(now=True)


def table(rows: list[tuple[str, list[float]]], scale: float, unit: str) -> list[str]:
    lines = [f"| tool | min ({unit}) | median ({unit}) | max ({unit}) | n |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, values in rows:
        if values:
            lines.append(f"| {name} | {min(values) * scale:.2f} | {statistics.median(values) * scale:.2f} | "
                         f"{max(values) * scale:.2f} | {len(values)} |")
        else:
            lines.append(f"| {name} | n/a | n/a | n/a | 0 |")
    return lines


def cpu_table(rows: list[tuple[str, CpuSpent | None]]) -> list[str]:
    parts = CpuSpent.PARTS
    lines = ["| tool | " + " | ".join(parts) + " | all |", "| --- |" + " ---: |" * (len(parts) + 1)]
    for name, spent in rows:
        if spent is None or not spent.cells:
            lines.append(f"| {name} |" + " n/a |" * (len(parts) + 1))
            continue
        values = [spent.per_cell_ms(part) for part in parts]
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {sum(values):.2f} |")
    return lines


def ratio_row(label: str, value: float | None, target: str, meets: Callable[[float], bool]) -> str:
    if value is None:
        return f"| {label} | n/a | {target} | n/a |"
    return f"| {label} | {value:.2f} | {target} | {'meets' if meets(value) else 'MISSES'} |"


def _ratio(top: float | None, bottom: float | None) -> str:
    return f"{top / bottom:.2f}" if top and bottom else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="leave benchmarks/RESULTS.md as it is")
    parser.add_argument("--kernels", type=int, default=None, help="kernels of each kind (default 2; 1 with --quick)")
    options = parser.parse_args()
    rounds, per_round, starts = (2, 5, 1) if options.quick else (10, 10, 3)
    copies = options.kernels or (1 if options.quick else 2)
    try:
        import ipyparallel  # noqa: F401
        kinds = ["plain", "plain_line", "floor", "accelnb", "accelnb_new_name", "plain_after_many",
                 "accelnb_after_many", "plain_real", "accelnb_real", "ipyparallel"]
        missing = ""
    except ImportError:
        kinds = ["plain", "plain_line", "floor", "accelnb", "accelnb_new_name", "plain_after_many",
                 "accelnb_after_many", "plain_real", "accelnb_real"]
        missing = "ipyparallel is not installed (`pip install ipyparallel`): its rows are n/a"
    load_before = os.getloadavg()
    began = time.monotonic()
    cpu: dict[str, CpuSpent] = {}
    per_kernel: dict[str, list[float]] = {}
    cells = cell_round_trips(kinds, rounds, per_round, cpu, copies, per_kernel)
    start_times = {kind: session_starts(kind, starts) for kind in ("accelnb", "ipyparallel") if kind in kinds}
    load_after = os.getloadavg()

    def median(values: list[float] | None) -> float | None:
        return statistics.median(values) if values else None

    plain, ours, px = median(cells.get("plain")), median(cells.get("accelnb")), median(cells.get("ipyparallel"))
    ours_new, floor = median(cells.get("accelnb_new_name")), median(cells.get("floor"))
    plain_line = median(cells.get("plain_line"))
    plain_many, ours_many = median(cells.get("plain_after_many")), median(cells.get("accelnb_after_many"))
    plain_real, ours_real = median(cells.get("plain_real")), median(cells.get("accelnb_real"))
    lines = [
        HEADING, "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}",
        f"- load average (1 min) {load_before[0]:.1f} at start, {load_after[0]:.1f} at end; "
        f"{time.monotonic() - began:.0f} s in all (`python benchmarks/bench_session_cell.py`)",
        *([f"- {missing}"] if missing else []), "",
        "### 1. A cell's round trip, Shift-Enter to the cell's end (ms)", "",
        f"`x = 1` as a plain cell, a `%%distributed` cell in a session of 2 CPU ranks, a `%%px` cell on 2 "
        f"engines; {copies} kernel{'s' if copies > 1 else ''} of each kind, {rounds} rounds of {per_round} "
        "cells on each, the kernels taking turns; a kind's figures pool its kernels. The `%%distributed` "
        "cell brings `x` back from rank 0 and names it the first time only (the same names again: nothing "
        "new to say); `x<n> = 1` brings back a new name each time, and its cell says so, one line more.", "",
        *table([("plain cell", cells.get("plain", [])),
                ("plain cell printing one line", cells.get("plain_line", [])),
                ("%%floor: a bare round trip to 2 processes", cells.get("floor", [])),
                ("accelnb %%distributed", cells.get("accelnb", [])),
                ("accelnb %%distributed, a new name each cell", cells.get("accelnb_new_name", [])),
                (f"plain cell, after {MANY_CELLS:,} distinct cells", cells.get("plain_after_many", [])),
                (f"accelnb %%distributed, after {MANY_CELLS:,} distinct cells", cells.get("accelnb_after_many", [])),
                (f"plain cell of {REAL_LINES} lines (a model, a helper, a loop)", cells.get("plain_real", [])),
                (f"accelnb %%distributed, the same {REAL_LINES} lines", cells.get("accelnb_real", [])),
                ("ipyparallel %%px", cells.get("ipyparallel", []))], 1000, "ms"), "",
        "Each kernel's median (ms): " + "; ".join(
            f"{kind} " + " / ".join(f"{value * 1000:.2f}" for value in values) for kind, values in per_kernel.items())
        + ".", "",
        "| ratio (medians) | value | target | verdict |", "| --- | ---: | ---: | ---: |",
        ratio_row("accelnb cell / plain cell", ours / plain if ours and plain else None, "≤ 1.2", lambda v: v <= 1.2),
        ratio_row("accelnb cell, a new name each cell / plain cell", ours_new / plain if ours_new and plain else None,
                  "≤ 1.2", lambda v: v <= 1.2),
        ratio_row("accelnb cell / %%px cell", ours / px if ours and px else None, "≤ 0.4", lambda v: v <= 0.4),
        f"| (for scale) accelnb cell, a new name each cell / plain cell printing one line | "
        f"{_ratio(ours_new, plain_line)} | – | – |",
        f"| (for scale) accelnb cell / plain cell, both after {MANY_CELLS:,} distinct cells | "
        f"{_ratio(ours_many, plain_many)} | – | – |",
        f"| (for scale) accelnb cell / plain cell, both of {REAL_LINES} lines | {_ratio(ours_real, plain_real)} "
        "| – | – |",
        f"| (for scale) %%floor cell / plain cell | {_ratio(floor, plain)} | – | – |",
        f"| (for scale) %%floor cell / %%px cell | {_ratio(floor, px)} | – | – |",
        f"| (for scale) accelnb cell / %%floor cell | {_ratio(ours, floor)} | – | – |", "",
        "`%%floor` is this benchmark's own magic (see the module docstring): the cell's source down a pipe "
        "to 2 bare processes that `exec` it and answer one byte. What any tool that runs a cell on 2 other "
        "processes pays here, before doing any of its own work; a target below it cannot be met on this "
        "machine by any design.", "",
        "CPU per cell (ms, every thread's time on a CPU, from `/proc/<pid>/task/*/schedstat`), over the "
        "same cells: what each tool costs the machine, steadier than wall time on a shared machine. "
        "\"Its processes\": a session's ranks and helper, ipyparallel's controller and engines, the floor's 2. The "
        "plain cell's row is Jupyter's own cost, which every cell pays.", "",
        *cpu_table([("plain cell", cpu.get("plain")), ("plain cell printing one line", cpu.get("plain_line")),
                    ("%%floor", cpu.get("floor")),
                    ("accelnb %%distributed", cpu.get("accelnb")),
                    ("accelnb %%distributed, a new name each cell", cpu.get("accelnb_new_name")),
                    (f"plain cell, after {MANY_CELLS:,} distinct cells", cpu.get("plain_after_many")),
                    (f"accelnb %%distributed, after {MANY_CELLS:,} distinct cells", cpu.get("accelnb_after_many")),
                    (f"plain cell of {REAL_LINES} lines", cpu.get("plain_real")),
                    (f"accelnb %%distributed, the same {REAL_LINES} lines", cpu.get("accelnb_real")),
                    ("ipyparallel %%px", cpu.get("ipyparallel"))]), "",
        "### 2. Session start, from a kernel with everything imported (s)", "",
        *table([("accelnb `%distributed start --procs 2 --cpu`", start_times.get("accelnb", [])),
                ("ipyparallel `Cluster(n=2).start_and_connect_sync()`", start_times.get("ipyparallel", []))],
               1, "s"), "",
        "| ratio | value | target | verdict |", "| --- | ---: | ---: | ---: |",
        ratio_row("accelnb session start (s)", median(start_times.get("accelnb")), "≤ 1.5 s", lambda v: v <= 1.5),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not options.no_write:
        replace_section(HEADING, text)


if __name__ == "__main__":
    main()
