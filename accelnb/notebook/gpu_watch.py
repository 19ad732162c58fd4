"""What the GPUs panel shows about each GPU beyond the inventory: a minute of utilisation, who else
holds it, and whether a selected GPU is busy.

The inventory (:mod:`accelnb.kernel.planning.inventory`) says what NVML says now. People who pick
GPUs want to see at a glance which are busy, as nvdashboard and nvitop show them: this module keeps
the last minute of utilisation readings (:class:`UtilizationHistory`), names the processes NVML
lists on each GPU (:func:`name_process`, from ``/proc``), and tells this kernel's own ranks from
other users' and other kernels' processes. :func:`gpu_rows` makes the panel's GPU rows of it.

    >>> from accelnb.kernel.planning.inventory import synthetic_inventory
    >>> history = UtilizationHistory()
    >>> history.add(synthetic_inventory(1), now=100.0)
    >>> history.series(0, now=102.0)
    [[2.0, 0]]
    >>> gpu_rows(synthetic_inventory(1), history, ours=set(), selected=[0], now=102.0)[0]["busy"]
    ''
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import threading
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelnb.kernel.planning.inventory import GpuInfo, GpuProcess, Inventory

HISTORY_S = 60.0  # how far back the panel's utilisation history goes
BUSY_UTILIZATION = 50  # percent: a GPU this busy with no process of ours on it is someone else's work


@dataclass(frozen=True)
class ProcessName:
    """Who a process on a GPU is, as far as this machine's ``/proc`` tells."""

    name: str  # "python3 train.py"; "" when the pid is not visible here (another container)
    user: str  # its owner's login name; "" when unknown


class UtilizationHistory:
    """Every GPU's utilisation readings of the last :data:`HISTORY_S` seconds.

    Readings closer than ``min_gap_s`` to the one before are dropped, so two panels (or a refresh
    between two timed reads) do not crowd the history. Safe from several threads.
    """

    def __init__(self, span_s: float = HISTORY_S, min_gap_s: float = 1.0) -> None:
        self._span_s = span_s
        self._min_gap_s = min_gap_s
        self._readings: dict[int, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()

    def add(self, inventory: Inventory, now: float) -> None:
        """Keep this inventory's readings (a GPU without a utilisation figure adds none)."""
        with self._lock:
            for gpu in inventory.gpus:
                self._add(self._readings.setdefault(gpu.index, deque()), gpu.utilization, now)

    def _add(self, readings: deque[tuple[float, int]], utilization: int | None, now: float) -> None:
        if utilization is not None and (not readings or now - readings[-1][0] >= self._min_gap_s):
            readings.append((now, utilization))
        while readings and now - readings[0][0] > self._span_s:
            readings.popleft()

    def series(self, index: int, now: float) -> list[list[float]]:
        """``[[seconds ago, percent], ...]``, oldest first, within the last minute."""
        with self._lock:
            return [[round(now - at, 1), value] for at, value in self._readings.get(index, ())
                    if now - at <= self._span_s]


def name_process(pid: int) -> ProcessName:
    """The command line (program and script, base names) and owner of ``pid``, from ``/proc``.

    NVML reports pids of the host's pid namespace; inside a container a pid of another container
    is not in ``/proc``, and its name is "" (the panel then shows the pid alone).
    """
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = [part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part]
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return ProcessName("", "")
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return ProcessName(_short_command(argv), user)


def _short_command(argv: Sequence[str]) -> str:
    """``/usr/bin/python3 /home/a/train.py --lr 3`` → ``python3 train.py``: enough to recognise it."""
    if not argv:
        return ""
    words = [os.path.basename(argv[0])]
    if words[0].startswith(("python", "pypy")):
        words.extend(_what_python_runs(argv[1:]))
    return " ".join(words)[:40]


def _what_python_runs(args: Sequence[str]) -> list[str]:
    """``train.py``, ``-m torch.distributed.run``, or nothing for ``-c`` code."""
    for n, arg in enumerate(args):
        if arg == "-c":
            return []
        if arg == "-m":
            return ["-m", *args[n + 1:n + 2]]
        if not arg.startswith("-"):
            return [os.path.basename(arg)]
    return []


def kernel_pids() -> set[int]:
    """This process and every process it started, however deep (the helper, the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as stat:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after it.
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(child for child in children.get(pid, ()) if child not in found)
    return found


def gpu_rows(inventory: Inventory, history: UtilizationHistory, ours: Collection[int],
             selected: Sequence[int] | None, now: float,
             known: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
    """The panel's GPU rows: the inventory's fields, ``history``, named ``processes`` and ``busy``.

    ``ours``: the pids of this kernel and its ranks; their processes are marked ``ours`` and make
    no GPU busy. ``known``: names for some pids ("rank 1"), before what ``/proc`` says. ``busy``
    is "" or why a *selected* GPU is taken by someone else (the panel marks it before the
    launch). Plain JSON types.
    """
    chosen = set(selected or ())
    rows = []
    for gpu in inventory.gpus:
        row = dataclasses.asdict(gpu)
        processes = [_process_row(process, ours, known or {}) for process in gpu.processes]
        row["processes"] = processes
        row["history"] = history.series(gpu.index, now)
        row["busy"] = _busy(gpu, processes) if gpu.index in chosen else ""
        rows.append(row)
    return rows


def _process_row(process: GpuProcess, ours: Collection[int], known: Mapping[int, str]) -> dict[str, Any]:
    named = name_process(process.pid)
    return {"pid": process.pid, "memory_used": process.memory_used, "name": known.get(process.pid) or named.name,
            "user": named.user, "ours": process.pid in ours}


def _busy(gpu: GpuInfo, processes: list[dict[str, Any]]) -> str:
    others = [p for p in processes if not p["ours"]]
    if others:
        first = others[0]
        who = f"{first['name']} (pid {first['pid']})" if first["name"] else f"pid {first['pid']}"
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        return f"busy: held by {who}{more}"
    if not processes and gpu.utilization is not None and gpu.utilization >= BUSY_UTILIZATION:
        # NVML lists no process (another container's, say) yet the GPU works: someone uses it.
        return f"busy: {gpu.utilization}% utilised by a process not visible here"
    return ""
