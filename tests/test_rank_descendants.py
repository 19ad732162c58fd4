"""Everything a rank starts is gone when the rank ends, however it ends and however it detached.

A rank starts ``sleep 300`` in its own session (``start_new_session=True``, as logging services
do), or as a double-forked daemon, and then returns, raises, is SIGTERMed by accelnb's stop
ladder, or is SIGKILLed from outside. Each test asserts, by pid and start time (psutil), that
the detached process is gone within :data:`GONE_BOUND_S` of the launch's end, and that accelnb's
helper process is left with no child it did not fork as a worker (no zombie, no adoptee).

Real launches: 2 CPU ranks, gloo, accelnb's helper process and its workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import accelnb
from accelnb.kernel.helper import template as helper_template
from accelnb.wire.buffers import dump
from accelnb.wire.channel import MessageReader, encode, send_frame
from accelnb.wire.events import CallError, CallResult, MetricBatch, RunCall, Shutdown
from accelnb.wire.result_pickling import loads_in_kernel
from accelnb.wire.spec import WorkerSpec
from tests.conftest import is_standby, wait_until_no_workers

sys.path.insert(0, str(Path(__file__).parent / "faults"))
from faultkit import is_gone

pytestmark = pytest.mark.usefixtures("no_leftovers")

GONE_BOUND_S = 3.0
REPORT_WAIT_S = 60.0


# ── what the ranks run ─────────────────────────────────────────────────────────────────────────
def detach_sleep() -> int:
    """``sleep 300`` in a session of its own: the rank's process group no longer holds it."""
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return sleeper.pid


def double_fork_sleep() -> int:
    """A classic daemon: fork, setsid, fork again, the middle process exits at once."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.setsid()
            daemon = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.write(write_end, str(daemon.pid).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(middle, 0)
    with os.fdopen(read_end) as pipe:
        return int(pipe.read())


def start_then_end(report_dir: str, how: str, start: str) -> int:
    """Every rank starts a detached ``sleep``, reports it, then ends as ``how`` says."""
    import torch.distributed as dist

    rank = dist.get_rank()
    detached = double_fork_sleep() if start == "double_fork" else detach_sleep()
    write_report(report_dir, rank, detached)
    if how == "raise" and rank == 1:
        wait_for_report(report_dir, 0)  # so that accelnb stops rank 0 only after it started one
        raise RuntimeError("rank 1 fails after starting a detached process")
    if how == "sigterm":
        # rank 0 fails once rank 1 has its detached process; the stop ladder SIGTERMs rank 1
        if rank == 0:
            wait_for_report(report_dir, 1)
            raise RuntimeError("rank 0 fails, so accelnb stops rank 1")
        time.sleep(3600)
    if how == "sigkill":
        time.sleep(3600)  # the test SIGKILLs rank 1 from outside; accelnb stops rank 0
    return rank


def write_report(report_dir: str, rank: int, detached: int) -> None:
    facts = {"pid": os.getpid(), "detached": detached,
             "detached_started": psutil.Process(detached).create_time()}
    path = Path(report_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(facts))
    os.replace(tmp, path)


def wait_for_report(report_dir: str, rank: int) -> dict[str, Any]:
    path = Path(report_dir) / f"rank{rank}.json"
    deadline = time.monotonic() + REPORT_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} never reported in {report_dir}")
        time.sleep(0.01)
    report: dict[str, Any] = json.loads(path.read_text())
    return report


# ── what the test checks ────────────────────────────────────────────────────────────────────────
def seconds_until_gone(processes: list[tuple[int, float]], bound: float) -> float | None:
    began = time.monotonic()
    while not all(is_gone(pid, started) for pid, started in processes):
        if time.monotonic() - began > bound:
            return None
        time.sleep(0.01)
    return time.monotonic() - began


def end_leftovers(processes: list[tuple[int, float]]) -> None:
    for pid, started in processes:
        if not is_gone(pid, started):
            os.kill(pid, signal.SIGKILL)


def helper_children_not_workers(helper_pid: int) -> list[psutil.Process]:
    """Children of the helper once no worker runs: anything here is a leak (a zombie or an
    adoptee), but the children it forks ahead of the next launch."""
    try:
        return [p for p in psutil.Process(helper_pid).children() if not is_standby(p)]
    except psutil.NoSuchProcess:
        return []


def kill_rank_1_once_it_reported(report_dir: str) -> threading.Thread:
    def kill() -> None:
        wait_for_report(report_dir, 0)  # both detached processes exist before the kill
        os.kill(wait_for_report(report_dir, 1)["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill, name="kill-rank-1", daemon=True)
    killer.start()
    return killer


ENDINGS = {
    "return": None,
    "raise": accelnb.RankFailed,
    "sigterm": accelnb.RankFailed,  # rank 0's exception; rank 1 was stopped
    "sigkill": accelnb.RankCrashed,
}


STARTS = ("new_session", "double_fork")
# `make test` runs each ending once and each way of detaching twice (a diagonal of the matrix);
# `make soak` runs the other half too. Every pair went through the same code when this was split.
DETACH_CASES = [
    pytest.param(how, start, id=f"{how}-{start}",
                 marks=() if (i + STARTS.index(start)) % 2 == 0 else pytest.mark.slow)
    for i, how in enumerate(ENDINGS) for start in STARTS
]


@pytest.mark.parametrize(("how", "start"), DETACH_CASES)
def test_a_detached_process_is_gone_when_its_rank_ends(how: str, start: str, tmp_path: Path) -> None:
    helper_pid = helper_template.shared_helper().pid
    killer = kill_rank_1_once_it_reported(str(tmp_path)) if how == "sigkill" else None
    error: BaseException | None = None
    try:
        accelnb.launch(start_then_end, (str(tmp_path), how, start), num_processes=2, cpu=True, quiet=True)
    except accelnb.LaunchFailed as failed:
        error = failed
    if killer is not None:
        killer.join()
    reports = [wait_for_report(str(tmp_path), rank) for rank in (0, 1)]
    detached = [(r["detached"], r["detached_started"]) for r in reports]
    seconds = seconds_until_gone(detached, GONE_BOUND_S)
    end_leftovers(detached)  # a failing run must not leave them to the next test

    expected = ENDINGS[how]
    assert (error is None) if expected is None else isinstance(error, expected), repr(error)
    assert seconds is not None, \
        f"processes the ranks started ({start}) outlived the launch by {GONE_BOUND_S} s: {detached}"
    wait_until_no_workers(GONE_BOUND_S)
    assert helper_children_not_workers(helper_pid) == []


def start_then_terminate(how: str) -> int:
    """Start a child, SIGTERM it as ``proc.terminate()`` does, and wait: the rank must survive
    and the child must die of it (SIGTERM must not stay blocked in what a rank starts)."""
    if how == "subprocess":
        child = subprocess.Popen(["sleep", "300"])
        child.terminate()
        return child.wait(timeout=10)
    pid = os.fork()  # as a DataLoader worker is made
    if pid == 0:
        try:
            time.sleep(300)
        finally:
            os._exit(0)
    os.kill(pid, signal.SIGTERM)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.parametrize("how", ["subprocess", "fork"])
def test_a_process_the_rank_starts_dies_of_sigterm_and_the_rank_does_not(how: str) -> None:
    values = accelnb.launch(start_then_terminate, (how,), num_processes=2, cpu=True, quiet=True).values
    assert values == {0: -signal.SIGTERM, 1: -signal.SIGTERM}


# ── the helper's side of it, over its own protocol ────────────────────────────────────────────
class PrivateHelper:
    """accelnb's helper process, started for one test and spoken to directly (see its docstring):
    this test needs every message it sends, in order."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "accelnb.worker.template.helper", str(theirs.fileno()), "torch.distributed",
             "accelnb.worker.main"],
            pass_fds=(theirs.fileno(),), start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        theirs.close()
        self.sock = ours
        assert self.receive(120.0)[0] == "ready"

    def receive(self, timeout: float) -> Any:
        readable, _, _ = select.select([self.sock], [], [], timeout)
        assert readable, f"the helper sent nothing within {timeout} s"
        data = self.sock.recv(1 << 20)
        assert data, "the helper closed its socket"
        return pickle.loads(data)

    def close(self) -> None:
        self.sock.close()
        self.process.wait(timeout=30)


def one_rank_spec(port: int) -> WorkerSpec:
    return WorkerSpec(rank=0, local_rank=0, world_size=1, device="cpu", backend="gloo",
                      env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}, master_addr="127.0.0.1",
                      master_port=port, cwd=os.getcwd(), sys_path=list(sys.path), persistent=True,
                      holds_store=True)


def test_the_helper_reports_a_rank_ended_only_once_what_it_started_is_gone() -> None:
    """The order is the guarantee: when accelnb hears that a rank exited, the processes it
    started are already gone. And the helper reports its workers' exits, not the orphans it reaps."""
    helper = PrivateHelper()
    store = socket.create_server(("127.0.0.1", 0))
    # stdout, stderr (pipes), events, inbox, control (stream sockets, as the supervisor wires them)
    pipes = [os.pipe(), os.pipe(), *(tuple(s.detach() for s in socket.socketpair()) for _ in range(3))]
    theirs = [pipes[0][1], pipes[1][1], pipes[2][1], pipes[3][0], pipes[4][0], store.fileno()]
    try:
        socket.send_fds(helper.sock, [pickle.dumps(("spawn", 1, [one_rank_spec(store.getsockname()[1])], None, None))],
                        theirs)
        kind, _, pids, sources_held = helper.receive(60.0)
        assert (kind, sources_held) == ("spawned", 0)
        for fd in theirs[:-1]:
            os.close(fd)
        store.close()  # the worker holds the store's socket now
        events, inbox = pipes[2][0], socket.socket(fileno=os.dup(pipes[3][1]))
        for target in (detach_sleep, double_fork_sleep):
            send_frame(inbox, encode(RunCall(len(pids), dump((target, (), {})), frozenset({0}))))
        results = read_events(events, count=2 + 1)  # Joined, then one result per call
        detached = [loads_in_kernel(r.value) for r in results if isinstance(r, CallResult)]
        started = [(pid, psutil.Process(pid).create_time()) for pid in detached]
        send_frame(inbox, encode(Shutdown()))
        inbox.close()
        message = helper.receive(60.0)
        still_running = [pid for pid, at in started if not is_gone(pid, at)]
        end_leftovers(started)

        assert message[:2] == ("exited", pids[0]), message
        assert not still_running, f"reported before the rank's processes were gone: {still_running}"
        assert not select.select([helper.sock], [], [], 0.5)[0], "the helper reported a pid it did not fork"
    finally:
        for read_end, write_end in pipes:
            for fd in (read_end, write_end):
                with contextlib.suppress(OSError):
                    os.close(fd)
        helper.close()


def read_events(fd: int, count: int) -> list[Any]:
    reader = MessageReader()
    events: list[Any] = []
    deadline = time.monotonic() + REPORT_WAIT_S
    while len(events) < count:
        assert select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0], events
        chunk = os.read(fd, 1 << 16)  # small events: no fd comes with them
        assert chunk, f"the worker closed its events socket after {events}"
        events.extend(e for e in reader.feed(chunk) if not isinstance(e, MetricBatch))
    assert not any(isinstance(e, CallError) for e in events), events
    return events
