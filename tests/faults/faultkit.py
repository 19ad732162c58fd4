"""Fault injection for the fault matrix: what the workers run, and how a test watches them.

The worker side is :func:`fault_target`, launched on 2 CPU ranks. Every rank first writes a
report (pid, rendezvous port, the pid of a child process it started, as a DataLoader would) into a
private directory, then the rank under test injects its fault while the other rank carries on
into a collective and waits there for it:

    launch(fault_target, ("segfault", 1, "after", str(report_dir)), num_processes=2, cpu=True)

*Phase*: a worker joins the process group before it runs the function, so "before the group is
joined" here means the function faults before its first collective (``"before"``); ``"after"``
faults after one ``all_reduce`` went through. Failing in set-up itself is covered separately
(``backend="mpi"``, which this torch build lacks, fails inside ``init_process_group``).

The kernel side is :class:`RunWatcher`: a thread that, while a launch runs, collects every
process under the helper (recursively), every port they listen on, and the reports, and can
SIGKILL a worker from outside. :func:`wait_gone` then times how long until every process it saw
is gone. A process is its pid and when it started (:func:`started_at`): a pid the OS gave again
since is another process, not one that failed to go.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from accelnb.kernel.helper.template import wait_for_departed_ranks
from tests.conftest import is_standby

FAULTS = ("exception", "sys_exit", "os_exit", "sigkill", "segfault", "hang_python",
          "hang_collective", "ignore_sigterm")


# ── worker side ─────────────────────────────────────────────────────────────────────────────
def fault_target(fault: str, fault_rank: int, phase: str, report_dir: str,
                 healthy: str = "collective") -> Any:
    """Run on every rank; ``fault_rank`` injects ``fault``, the other rank waits in a collective.

    ``healthy="raise"``: the other rank raises once the faulty rank is armed (so that accelnb
    has to stop a rank that ignores SIGTERM).
    """
    import subprocess

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    child = subprocess.Popen(["sleep", "600"])  # a rank's own child process must go too
    report(report_dir, rank, pid=os.getpid(), pid_started=started_at(os.getpid()), child_pid=child.pid,
           child_pid_started=started_at(child.pid), port=int(os.environ["MASTER_PORT"]))
    wait_for_report(report_dir, 1 - rank, "pid")  # so that the test knows every pid before the fault
    tensor = torch.ones(1)
    if phase == "after":
        dist.all_reduce(tensor)  # the group is joined and has communicated
    if rank != fault_rank:
        if healthy == "raise":
            wait_for_report(report_dir, fault_rank, "armed_at")
            report(report_dir, rank, fault_at=time.time())
            raise RuntimeError(f"rank {rank} fails while rank {fault_rank} ignores SIGTERM")
        report(report_dir, rank, collective_at=time.time())  # the test knows we are about to wait
        dist.all_reduce(tensor)  # waits here for the faulty rank
        return tensor.item()
    if fault == "ignore_sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        report(report_dir, rank, armed_at=time.time())
        time.sleep(3600)
    if fault == "sigkill":
        report(report_dir, rank, armed_at=time.time())  # the test kills us from outside now
        time.sleep(3600)
    report(report_dir, rank, fault_at=time.time())
    if fault == "exception":
        raise ValueError(f"injected fault on rank {rank}")
    if fault == "sys_exit":
        sys.exit(3)
    if fault == "os_exit":
        os._exit(3)
    if fault == "segfault":
        import ctypes

        ctypes.string_at(0)
    if fault == "sigkill_self":  # for the soak, where no test thread watches
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang_python":
        time.sleep(3600)
    if fault == "hang_collective":
        dist.barrier()  # skipped the all_reduce the other rank waits in
    raise AssertionError(f"unknown fault {fault!r}")


def report(report_dir: str, rank: int, **facts: Any) -> None:
    """Add ``facts`` to ``rank``'s report file (atomically replaced)."""
    path = Path(report_dir) / f"rank{rank}.json"
    current = read_report(path)
    current.update(facts)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(current))
    os.replace(tmp, path)


def read_report(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_for_report(report_dir: str, rank: int, key: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    path = Path(report_dir) / f"rank{rank}.json"
    while time.monotonic() < deadline:
        value = read_report(path).get(key)
        if value is not None:
            return value
        time.sleep(0.01)
    raise TimeoutError(f"rank {rank} never reported {key!r} in {report_dir}")


def ok_target() -> float:
    """A healthy run: one collective, a value back."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()


# ── kernel side ─────────────────────────────────────────────────────────────────────────────
def descendants(pid: int) -> list[psutil.Process]:
    """What runs below ``pid``, once the ranks that departed were reaped (a launch need not wait
    for the OS to free them), but a template's children waiting for a rank to become: they are
    the template's own, and end with it (``worker/template/standby_ranks.py``)."""
    assert wait_for_departed_ranks(), "a departed rank was not reaped within 10 s"
    with contextlib.suppress(psutil.Error):
        return [p for p in psutil.Process(pid).children(recursive=True) if not is_standby(p)]
    return []


ALREADY_GONE = -1.0  # when a process started, where it had gone before it was seen: no process starts before boot


def started_at(pid: int) -> float | None:
    """When ``pid`` started (psutil's ``create_time``); None when no process has that pid. A pid
    is given again once its process is gone (sooner than a wrap around the pid space where someone
    rewinds ``ns_last_pid``): only the pid and this together name one process."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def is_gone(pid: int, started: float | None = None) -> bool:
    """No process ``pid`` runs (a zombie counts as gone: it holds nothing but its pid); with
    ``started`` (:func:`started_at` when it was seen), a process that got the pid since is not it."""
    try:
        process = psutil.Process(pid)
        return process.status() == psutil.STATUS_ZOMBIE or (started is not None and process.create_time() != started)
    except psutil.NoSuchProcess:
        return True


def identified(pids: Iterable[int] | Mapping[int, float | None]) -> dict[int, float | None]:
    """pid: when it started, for each of ``pids``; a mapping is taken as that already."""
    if isinstance(pids, Mapping):
        return dict(pids)
    return {pid: started_at(pid) for pid in pids}


def wait_gone(pids: Iterable[int] | Mapping[int, float | None], timeout: float) -> float | None:
    """``time.time()`` when every process had gone (zombies count as gone), None on timeout.
    ``pids`` maps each pid to when it started (:func:`started_at`, as a watcher saw it), or is
    plain pids, each the process that has it now."""
    pending = identified(pids)
    deadline = time.monotonic() + timeout
    while True:
        pending = {pid: started for pid, started in pending.items() if not is_gone(pid, started)}
        if not pending:
            return time.time()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


def still_running(pids: Mapping[int, float | None], roles: Mapping[int, str]) -> list[str]:
    """What each process of ``pids`` that has not gone is, for a failure's message: its role in
    the run (``roles``), name, state, parent and command line."""
    described = []
    for pid, started in sorted(pids.items()):
        if is_gone(pid, started):
            continue
        try:
            process = psutil.Process(pid)
            parent = process.parent()
            described.append(f"pid {pid} ({roles.get(pid, 'seen under the helper')}): {process.name()}, "
                             f"{process.status()}, parent {process.ppid()} "
                             f"({parent.name() if parent else '?'}): {' '.join(process.cmdline())[:200]}")
        except psutil.Error as error:
            described.append(f"pid {pid} ({roles.get(pid, 'seen under the helper')}): {error!r}")
    return described


def listening_on(port: int) -> list[Any]:
    """Every LISTEN socket on ``port``, whoever owns it."""
    return [c for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]


def ports_held_ahead() -> set[int]:
    """Run in the kernel: the ports of the sockets it holds for its next launch. A rank forked at
    launch holds the kernel's next socket for the moment between its fork and closing what is
    not its own, so a watcher may see it listen there: that port stays held after the run, on
    purpose (``wire/group_ahead.py``), and is never the run's rendezvous port (bound while that
    one was still open)."""
    from accelnb.kernel.helper.template import sockets_held_ahead

    return {held.getsockname()[1] for held in sockets_held_ahead()}


def ports_left_listening(watcher: RunWatcher, ours: set[int], held_ahead: set[int]) -> dict[int, list[Any]]:
    """The ports ``watcher`` saw that a process of ``ours`` still listens on, but those the
    kernel holds for its next launch (:func:`ports_held_ahead`)."""
    left = {}
    for port in watcher.ports - held_ahead:
        holders = [c for c in listening_on(port) if c.pid is None or c.pid in ours]
        if holders:
            left[port] = holders
    return left


def listens_of_its_own(helper_pid: int, kernel_pid: int) -> list[tuple[int, Any]]:
    """The template's LISTEN sockets but the one it holds for its kernel's next launch: the
    kernel bound that one, and holds it too (``wire/group_ahead.py``)."""
    kernels = {conn.laddr.port for _, conn in listen_sockets([kernel_pid])}
    return [(pid, conn) for pid, conn in listen_sockets([helper_pid]) if conn.laddr.port not in kernels]


def listen_sockets(pids: Iterable[int]) -> list[tuple[int, Any]]:
    """(pid, connection) for every LISTEN inet socket of ``pids`` still alive."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for conn in psutil.Process(pid).net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((pid, conn))
    return found


@dataclass
class RunWatcher:
    """Watches one launch from a thread of the kernel: processes, ports, reports.

    ``on_report(rank, report)`` is called on every poll; use it to act (kill) on a report.
    """

    helper_pid: int
    report_dir: Path
    on_report: Callable[[int, dict[str, Any]], None] | None = None
    interval: float = 0.03
    # Every process seen, pid: when it started (started_at when first seen, or as the rank
    # reported it; ALREADY_GONE when it had gone by then), and what each was, for a failure's message.
    seen: dict[int, float] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)
    ports: set[int] = field(default_factory=set)
    # Where each port was first seen, for a failure's message: a process's listening socket, or a
    # rank's report of its rendezvous port.
    seen_on: dict[int, str] = field(default_factory=dict)
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def pids(self) -> set[int]:
        return set(self.seen)

    def processes(self, *more: Iterable[int]) -> dict[int, float | None]:
        """Every process seen, and the ``more`` pids it did not see (each the process that has
        the pid now): what :func:`wait_gone` takes."""
        unseen = identified([pid for pids in more for pid in pids if pid not in self.seen])
        return {**unseen, **self.seen}

    def still_running(self, *more: Iterable[int]) -> list[str]:
        """What :func:`still_running` says of :meth:`processes`."""
        return still_running(self.processes(*more), self.roles)

    def __enter__(self) -> RunWatcher:
        self._thread = threading.Thread(target=self._watch, name="fault-watcher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self._poll()  # the last reports, for runs faster than one interval

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval)

    def _poll(self) -> None:
        for proc in descendants(self.helper_pid):
            if proc.pid not in self.seen:
                started = started_at(proc.pid)
                self.seen[proc.pid] = ALREADY_GONE if started is None else started
                self.roles.setdefault(proc.pid, f"under the helper from {time.strftime('%H:%M:%S')}")
            with contextlib.suppress(psutil.Error):
                for port in (c.laddr.port for c in proc.net_connections(kind="inet")
                             if c.status == psutil.CONN_LISTEN):
                    self.ports.add(port)
                    self.seen_on.setdefault(port, f"pid {proc.pid} ({proc.name()}) listening, "
                                                  f"{time.strftime('%H:%M:%S')}")
        for path in sorted(self.report_dir.glob("rank*.json")):
            rank = int(path.stem[4:])
            self.reports[rank] = read_report(path)
            for key, role in (("pid", f"rank {rank}"), ("child_pid", f"rank {rank}'s child")):
                pid, started = self.reports[rank].get(key), self.reports[rank].get(f"{key}_started")
                if pid:
                    if started is None:  # a report of another target's: when it started, as for the rest
                        started = self.seen[pid] if pid in self.seen else started_at(pid)
                    self.seen[pid] = ALREADY_GONE if started is None else started
                    self.roles[pid] = role
            if self.reports[rank].get("port"):
                self.ports.add(self.reports[rank]["port"])
                self.seen_on.setdefault(self.reports[rank]["port"], f"rank {rank}'s rendezvous port (its report)")
            if self.on_report is not None:
                self.on_report(rank, self.reports[rank])

    def fact(self, key: str) -> list[Any]:
        return [r[key] for _, r in sorted(self.reports.items()) if key in r]


class KillFromOutside:
    """An ``on_report`` that SIGKILLs the faulty rank from outside once it is armed, as the
    OOM killer would; ``killed_at`` is when."""

    def __init__(self, fault_rank: int) -> None:
        self.fault_rank = fault_rank
        self.killed_at: float | None = None

    def __call__(self, rank: int, facts: dict[str, Any]) -> None:
        if rank == self.fault_rank and "armed_at" in facts and self.killed_at is None:
            self.killed_at = time.time()
            os.kill(facts["pid"], signal.SIGKILL)
