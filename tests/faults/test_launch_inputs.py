"""Faults 9–11: what a launch carries in and out.

9. A 200 MB return value, and 100,000 lines of output with no newline at the end, from rank 0 and
   from rank 1: the value arrives whole, every line is kept, the last unterminated line too.
10. The port: accelnb binds the rendezvous port itself and hands the bound socket to rank 0, so
    there is no window between choosing a port and using it. An explicit ``master_port=`` that
    another process holds raises PortInUseError before any process starts; an automatic port
    cannot be taken by anyone else while the run needs it.
11. An unpicklable argument, keyword or referenced notebook name: UnpicklableError naming it,
    before any process starts.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from faultkit import RunWatcher, descendants, listening_on, ok_target, report, wait_for_report, wait_gone

import accelnb
from accelnb import PortInUseError, UnpicklableError

BIG_BYTES = 200 * 2**20
FLOOD_LINES = 100_000


def big_return(rank_with_value: int) -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_rank() != rank_with_value:
        return None
    return torch.arange(BIG_BYTES // 4, dtype=torch.int32)  # 200 MB


def flood(rank_flooding: int) -> str:
    import torch.distributed as dist

    if dist.get_rank() == rank_flooding:
        for i in range(FLOOD_LINES - 1):
            print(f"line {i}")
        print(f"line {FLOOD_LINES - 1} (no newline)", end="")
    return "done"


def record_plain(fault_record: dict[str, Any], fault: str, rank: Any, error: BaseException | None,
                 cleanup: float | None = None, bound: float | None = None, label: str = "",
                 seconds: float | None = None) -> None:
    fault_record.update(fault=fault, label=label, rank=rank, phase="-",
                        raised=type(error).__name__ if error is not None else "(nothing: the run succeeds)",
                        first_line=str(error).splitlines()[0] if error is not None else "",
                        cleanup_s=cleanup, bound_s=bound, seconds=seconds,
                        measured_from="launch return" if cleanup is not None else "")


@pytest.mark.parametrize("rank", [0, 1])
def test_big_return_value(rank: int, helper_pid: int, tmp_path: Path, fault_record: dict[str, Any]) -> None:
    started = time.perf_counter()
    with RunWatcher(helper_pid, tmp_path) as watcher:
        result = accelnb.launch(big_return, (rank,), num_processes=2, cpu=True, quiet=True)
    seconds = time.perf_counter() - started
    returned = time.time()
    gone = wait_gone(watcher.processes(), 5.0)
    record_plain(fault_record, "big_return", rank, None, None if gone is None else gone - returned, 5.0,
                 label="200 MB tensor", seconds=seconds)

    value = result.values[rank]
    assert value.numel() * value.element_size() == BIG_BYTES
    assert int(value[0]) == 0 and int(value[-1]) == BIG_BYTES // 4 - 1 and int(value[12345]) == 12345
    assert result.values[1 - rank] is None
    assert gone is not None
    assert_next_launch_works()


@pytest.mark.parametrize("rank", [0, 1])
def test_flood_without_final_newline(rank: int, helper_pid: int, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str],
                                     fault_record: dict[str, Any]) -> None:
    capsys.readouterr()
    started = time.perf_counter()
    with RunWatcher(helper_pid, tmp_path) as watcher:
        result = accelnb.launch(flood, (rank,), num_processes=2, cpu=True, quiet=True)
    seconds = time.perf_counter() - started
    returned = time.time()
    gone = wait_gone(watcher.processes(), 5.0)
    shown = capsys.readouterr().out
    record_plain(fault_record, "flood", rank, None, None if gone is None else gone - returned, 5.0,
                 label="100,000 lines, no final newline", seconds=seconds)

    kept = result.output(rank)
    last = f"line {FLOOD_LINES - 1} (no newline)"
    assert kept.endswith(last), kept[-200:]
    assert kept.count("\n") == FLOOD_LINES - 1 and kept.startswith("line 0\n")
    if rank == 0:  # streamed live: throttled, but the end (with its unterminated line) is shown
        assert shown.endswith(last), shown[-300:]
    else:
        assert "line" not in shown  # output="rank0": rank 1 is kept, not shown
    assert result.values == {0: "done", 1: "done"}
    assert gone is not None
    assert_next_launch_works()


HOLDER = """
import socket, sys, time
address, listen = sys.argv[1], sys.argv[2] == "listen"
s = socket.socket()
s.bind((address, 0))
if listen:
    s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("address", "mode"), [("127.0.0.1", "listen"), ("0.0.0.0", "bind")])
def test_explicit_port_taken(address: str, mode: str, helper_pid: int, tmp_path: Path,
                             fault_record: dict[str, Any]) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, address, mode], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        before = {p.pid for p in descendants(helper_pid)}
        error: BaseException | None = None
        try:
            accelnb.launch(report_pid, (str(tmp_path),), num_processes=2, cpu=True, master_port=port, quiet=True)
        except PortInUseError as raised:
            error = raised
        record_plain(fault_record, "port_taken", "-", error, label=f"port held on {address} ({mode})")

        assert isinstance(error, PortInUseError) and error.port == port
        assert f"master_port={port} is already in use" in str(error)
        assert {p.pid for p in descendants(helper_pid)} == before == set(), "a process started"
        assert not list(tmp_path.iterdir()), "the function ran"
    finally:
        holder.kill()
        holder.wait()
    assert_next_launch_works()


def report_pid(report_dir: str) -> int:
    import os

    import torch.distributed as dist

    report(report_dir, dist.get_rank(), pid=os.getpid(), port=int(os.environ["MASTER_PORT"]))
    wait_for_report(report_dir, dist.get_rank(), "released")
    return int(os.environ["MASTER_PORT"])


def test_auto_port_cannot_be_taken(helper_pid: int, tmp_path: Path, fault_record: dict[str, Any]) -> None:
    """While the run needs its port, nobody can bind it: not on loopback, not on any address."""
    attempts: dict[str, int] = {}

    def steal() -> None:
        port = wait_for_report(str(tmp_path), 0, "port")
        for address in ("127.0.0.1", "0.0.0.0"):
            thief = socket.socket()
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                thief.bind((address, port))
                attempts[address] = 0
            except OSError as error:
                attempts[address] = error.errno or -1
            finally:
                thief.close()
        for rank in (0, 1):
            report(str(tmp_path), rank, released=True)

    thread = threading.Thread(target=steal)
    thread.start()
    with RunWatcher(helper_pid, tmp_path) as watcher:
        result = accelnb.launch(report_pid, (str(tmp_path),), num_processes=2, cpu=True, quiet=True)
    thread.join()
    record_plain(fault_record, "port_auto", "-", None,
                 label="binds on 127.0.0.1 and 0.0.0.0 get EADDRINUSE")

    assert result.value == result.plan.master_port == result.values[1]
    assert attempts == {"127.0.0.1": errno.EADDRINUSE, "0.0.0.0": errno.EADDRINUSE}
    assert wait_gone(watcher.processes(), 5.0) is not None
    assert not [c for c in listening_on(result.plan.master_port) if c.pid is None or c.pid in watcher.pids]


LOCK = threading.Lock()


def _notebook_function() -> Any:
    """A function as a notebook cell defines it (module ``__main__``: travels by value)."""
    namespace: dict[str, Any] = {"__name__": "__main__", "LOCK": LOCK}
    exec("def train():\n    with LOCK:\n        return 1\n", namespace)
    return namespace["train"]


@pytest.mark.parametrize("where", ["argument", "keyword", "notebook name"])
def test_unpicklable(where: str, helper_pid: int, tmp_path: Path, fault_record: dict[str, Any]) -> None:
    call: dict[str, Any] = {
        "argument": {"function": ok_target, "args": (LOCK,)},
        "keyword": {"function": ok_target, "kwargs": {"lock": LOCK}},
        "notebook name": {"function": _notebook_function()},
    }[where]
    before = {p.pid for p in descendants(helper_pid)}
    error: BaseException | None = None
    try:
        accelnb.launch(num_processes=2, cpu=True, quiet=True, **call)
    except UnpicklableError as raised:
        error = raised
    record_plain(fault_record, "unpicklable", "-", error, label=where)

    assert isinstance(error, UnpicklableError), repr(error)
    expected = {"argument": "Argument 0 (args[0])", "keyword": "Keyword argument 'lock'",
                "notebook name": "The name 'LOCK', which train uses,"}[where]
    assert str(error).startswith(expected) and "_thread.lock" in str(error), str(error)
    assert {p.pid for p in descendants(helper_pid)} == before == set(), "a process started"
    assert_next_launch_works()


def assert_next_launch_works() -> None:
    assert accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}
