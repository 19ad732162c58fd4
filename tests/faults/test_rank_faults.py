"""The fault matrix, in process (this pytest process plays the kernel): faults 1–6 and 12.

Each fault on rank 0 and on rank 1, before the function's first collective and after one
(see faultkit for what "before the group is joined" means here). Every case must end with:

- the cause in what the user sees (exception and cell output): the rank, the exception or signal
  name, the traceback or stacks where there are any; the root cause first;
- every pid gone (the workers, their children, anything under the helper) within 5 s of the
  fault, or within timeout + 5 s of the launch for hangs;
- no socket listening on the rendezvous port or on any port the workers listened on;
- and the next launch in the same process succeeding.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from faultkit import (
    FAULTS,
    KillFromOutside,
    RunWatcher,
    fault_target,
    listens_of_its_own,
    ok_target,
    ports_held_ahead,
    ports_left_listening,
    wait_gone,
)

import accelnb
from accelnb import LaunchFailed, LaunchTimeout, RankCrashed, RankFailed

FAILURE_BOUND_S = 5.0
# A failure inside set-up has no moment the test can see, so its cleanup is timed from the launch:
# the bound adds the launch's own start (a rank forked and importing torch.distributed), which took
# 6.2 s on a GPU machine running 12 tests at once.
SETUP_FAILURE_BOUND_S = FAILURE_BOUND_S + 5.0
HANG_TIMEOUT_S = 1.5
HANG_BOUND_S = HANG_TIMEOUT_S + 5.0


@dataclass(frozen=True)
class Expected:
    error: type[LaunchFailed]
    first_line: str  # a pattern; {rank} is the faulty rank
    evidence: tuple[str, ...] = ()  # in the message or the cell output: traceback, stacks
    stacks: tuple[str, str] | None = None  # hangs: (faulty rank's frame, other rank's frame)
    root_is_faulty: bool = True


EXPECTED = {
    "exception": Expected(RankFailed, r"Rank {rank} failed: ValueError: injected fault on rank {rank}",
                          ("Traceback (most recent call last)", 'raise ValueError(f"injected fault')),
    "sys_exit": Expected(RankFailed, r"Rank {rank} failed: SystemExit: 3",
                         ("Traceback (most recent call last)", "sys.exit(3)")),
    "os_exit": Expected(RankCrashed, r"Rank {rank} failed: exited with code 3"),
    "sigkill": Expected(RankCrashed, r"Rank {rank} failed: killed by SIGKILL"),
    "segfault": Expected(RankCrashed, r"Rank {rank} failed: killed by SIGSEGV",
                         ("in string_at", "in fault_target")),
    "hang_python": Expected(LaunchTimeout, r"The run did not finish within timeout=1.5 s",
                            stacks=("in fault_target", "in all_reduce")),
    "hang_collective": Expected(LaunchTimeout, r"The run did not finish within timeout=1.5 s",
                                stacks=("in barrier", "in all_reduce")),
    "ignore_sigterm": Expected(RankFailed, r"Rank {other} failed: RuntimeError: rank {other} fails while "
                               r"rank {rank} ignores SIGTERM", ("Stopped by accelnb after the failure: "
                                                                "rank {rank}",), root_is_faulty=False),
}


@dataclass
class Outcome:
    error: BaseException | None
    seen: str  # what the user saw: the cell output, then the exception's message
    watcher: RunWatcher
    printed_pids: list[int]
    started: float
    returned: float
    gone: float | None
    waited: float  # how long after the launch returned the test waited for every process to go


def run_case(function: Any, args: tuple[Any, ...], report_dir: Path, helper_pid: int,
             capsys: pytest.CaptureFixture[str], on_report: Any = None, bound: float = 10.0,
             **launch_kwargs: Any) -> Outcome:
    """Launch, expecting a failure; watch every process and port; time the cleanup."""
    capsys.readouterr()
    error: BaseException | None = None
    started = time.time()
    with RunWatcher(helper_pid, report_dir, on_report=on_report) as watcher:
        try:
            accelnb.launch(function, args, num_processes=2, cpu=True, **launch_kwargs)
        except (LaunchFailed, KeyboardInterrupt) as raised:
            error = raised
    returned = time.time()
    captured = capsys.readouterr()
    printed = [int(p) for p in re.findall(r"\(pid (\d+)\)", captured.out)]
    gone = wait_gone(watcher.processes(printed), bound)
    seen = captured.out + captured.err + "\n" + (str(error) if error is not None else "")
    return Outcome(error, seen, watcher, printed, started, returned, gone, bound)


def user_facing_type(error: BaseException | None) -> str:
    if error is None:
        return "(nothing raised)"
    base = next(c for c in type(error).__mro__ if c.__module__ == "accelnb.errors")
    return base.__name__ if type(error) is base else f"{base.__name__} (also {type(error).__name__})"


def assert_nothing_left(outcome: Outcome, helper_pid: int) -> None:
    watcher = outcome.watcher
    assert outcome.gone is not None, f"still running {outcome.waited} s after the launch returned:\n" + \
        "\n".join(watcher.still_running(outcome.printed_pids))
    ours = watcher.pids | set(outcome.printed_pids) | {helper_pid}
    held_ahead = ports_held_ahead()
    left = ports_left_listening(watcher, ours, held_ahead)
    assert not left, (f"ports still listening after the run: {left}; first seen as "
                      f"{ {port: watcher.seen_on.get(port) for port in left} }; held for the next launch: {held_ahead}")
    assert not listens_of_its_own(helper_pid, os.getpid()), "the helper process listens on a port"


def assert_next_launch_works() -> None:
    result = accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)
    assert result.values == {0: 2.0, 1: 2.0}


CASES = [pytest.param(fault, rank, phase, id=f"{fault}-rank{rank}-{phase}")
         for fault in FAULTS for rank in (0, 1) for phase in ("before", "after")]


@pytest.mark.parametrize(("fault", "rank", "phase"), CASES)
def test_fault(fault: str, rank: int, phase: str, tmp_path: Path, helper_pid: int,
               capsys: pytest.CaptureFixture[str], fault_record: dict[str, Any]) -> None:
    expected = EXPECTED[fault]
    other = 1 - rank
    hang = expected.error is LaunchTimeout
    killer = KillFromOutside(rank) if fault == "sigkill" else None
    outcome = run_case(fault_target, (fault, rank, phase, str(tmp_path),
                                      "raise" if fault == "ignore_sigterm" else "collective"),
                       tmp_path, helper_pid, capsys, on_report=killer,
                       timeout=HANG_TIMEOUT_S if hang else None)
    error = outcome.error
    reports = outcome.watcher.reports
    if hang:
        reference, bound = outcome.started + HANG_TIMEOUT_S, HANG_BOUND_S - HANG_TIMEOUT_S
    elif killer is not None:
        reference, bound = killer.killed_at or outcome.started, FAILURE_BOUND_S
    else:
        root = rank if expected.root_is_faulty else other
        reference, bound = reports.get(root, {}).get("fault_at", outcome.started), FAILURE_BOUND_S
    cleanup = None if outcome.gone is None else outcome.gone - reference
    first_line = str(error).splitlines()[0] if error is not None and str(error) else ""
    fault_record.update(fault=fault, rank=rank, phase=phase, raised=user_facing_type(error),
                        first_line=first_line, cleanup_s=cleanup, bound_s=bound,
                        measured_from="timeout expiry" if hang else "fault")

    # Nothing left, in time, and the next launch works ...
    assert set(reports) == {0, 1}, f"ranks that reported: {sorted(reports)}"
    assert {reports[r]["pid"] for r in (0, 1)} == set(outcome.printed_pids)
    assert_nothing_left(outcome, helper_pid)
    assert cleanup is not None and cleanup <= bound, f"cleanup took {cleanup} s (bound {bound} s)"
    if fault == "ignore_sigterm":  # the ladder's SIGKILL did it, after the grace
        assert outcome.returned - reference >= 2.5
    assert_next_launch_works()

    # ... and the user was told the cause.
    assert isinstance(error, expected.error), \
        f"expected {expected.error.__name__}, got {type(error).__name__}: {first_line[:160]}"
    assert re.match(expected.first_line.format(rank=rank, other=other), first_line), first_line
    for evidence in expected.evidence:
        assert evidence.format(rank=rank) in outcome.seen, f"{evidence!r} not shown:\n{outcome.seen}"
    if not hang:
        assert error.root_cause is not None
        assert error.root_cause.rank == (rank if expected.root_is_faulty else other), str(error)
    else:
        assert expected.stacks is not None
        faulty_frame, other_frame = expected.stacks
        assert f"── rank {rank} ──" in str(error) and f"── rank {other} ──" in str(error)
        lines = str(error).splitlines()
        for who, frame in ((rank, faulty_frame), (other, other_frame)):
            assert any(line.startswith(f"[rank {who}]") and frame in line for line in lines), \
                f"rank {who}'s stack does not show {frame!r}:\n{error}"


def test_setup_failure(tmp_path: Path, helper_pid: int, capsys: pytest.CaptureFixture[str],
                       fault_record: dict[str, Any]) -> None:
    """Set-up itself fails on every rank: this torch has no MPI, so init_process_group raises."""
    outcome = run_case(ok_target, (), tmp_path, helper_pid, capsys, backend="mpi")
    error = outcome.error
    cleanup = None if outcome.gone is None else outcome.gone - outcome.started
    first_line = str(error).splitlines()[0] if error is not None and str(error) else ""
    fault_record.update(fault="setup_backend", rank="both", phase="set-up", raised=user_facing_type(error),
                        first_line=first_line, cleanup_s=cleanup, bound_s=SETUP_FAILURE_BOUND_S,
                        measured_from="launch")

    assert isinstance(error, RankFailed) and isinstance(error, RuntimeError), repr(error)
    assert re.match(r"Rank [01] failed: RuntimeError: Distributed package doesn't have MPI", first_line)
    assert "init_process_group" in outcome.seen
    assert len(outcome.printed_pids) == 2
    assert_nothing_left(outcome, helper_pid)
    assert cleanup is not None and cleanup <= SETUP_FAILURE_BOUND_S
    assert_next_launch_works()


def test_root_cause_is_the_crash_not_its_echo(tmp_path: Path, helper_pid: int,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A rank that dies makes its peer's collective fail a moment later ("Connection closed by
    peer"); the death is the root cause, every time, and the message names it."""
    wrong = []
    for attempt in range(10):
        fault, rank = ("os_exit", "segfault")[attempt % 2], attempt // 2 % 2
        report_dir = tmp_path / str(attempt)
        report_dir.mkdir()
        outcome = run_case(fault_target, (fault, rank, "after", str(report_dir)), report_dir, helper_pid,
                           capsys)
        error = outcome.error
        assert isinstance(error, LaunchFailed)
        named = "exited with code 3" if fault == "os_exit" else "killed by SIGSEGV"
        first_line = str(error).splitlines()[0]
        if not (error.root_cause is not None and error.root_cause.rank == rank and named in first_line):
            wrong.append(f"{fault} on rank {rank} -> {first_line[:90]!r}"
                         + ("" if named in str(error) else f" (and {named!r} is nowhere in the message)"))
    assert not wrong, f"{len(wrong)}/10 crashes reported with the wrong root cause:\n" + "\n".join(wrong)


FUNCTION_HANDLER_VS_WAKE = """
import os, signal, threading, time
from accelnb.worker.signal_watcher import watch_signals

handled = threading.Event()
woken = []
# The worker, idle between calls, is woken to leave; the function's handler must run first.
watch_signals(wake=lambda: woken.append(handled.wait(5)))
signal.signal(signal.SIGTERM, lambda *_: handled.set())  # the function's own handler
os.kill(os.getpid(), signal.SIGTERM)
deadline = time.monotonic() + 15
while not woken and time.monotonic() < deadline:
    time.sleep(0.01)  # the main thread runs Python, where a pending handler runs
print("handler ran before the wake-up:", woken)
"""


def test_a_functions_sigterm_handler_is_pending_before_the_worker_is_woken() -> None:
    """The worker's SIGTERM thread wakes an idle worker so that it leaves; were the wake-up sent
    before the signal, the worker could reach os._exit before the handler ever ran. Here the
    wake-up waits (5 s at most) for the handler: it can only see it run if the signal came first."""
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", FUNCTION_HANDLER_VS_WAKE], capture_output=True, text=True,
                          timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    assert "handler ran before the wake-up: [True]" in done.stdout, done.stdout + done.stderr
