"""Faults in accelnb's own machinery, as a user meets them (rows 13–15 of docs/faults.md).

13. accelnb's helper process is SIGKILLed (the OOM killer picks it, or a user's ``kill``) while
    the ranks run: the launch raises within 2 s, naming the helper and the signal; every worker
    is gone; the next launch starts a fresh helper and works.
14. Ctrl-C lands at one of many moments of start-up and of sending the call: KeyboardInterrupt
    (or, when it lands after the run ended, a normal return), never a worker left, no fd or
    ``/dev/shm`` growth in this process, and the next launch works at once. Also, exactly, after
    each call into C that accelnb's side of a launch makes (every ninth; ``make soak``: every
    one), and at each read of a template's report (a lost worker's exit once left a departed
    rank waited for forever). A session's call survives a Ctrl-C after any of its calls into C:
    the session, its ranks and their variables are kept. With ``max_restarts``, no attempt starts
    after a Ctrl-C, even one that only hurried the end of a failed attempt's ranks. A Ctrl-C as
    the template's answer to a spawn is read leaves no exit noted for the pids it named: a rank
    the OS later gives one of them is not taken for dead. A Ctrl-C the moment a call's SIGINT or
    SIGTERM handler goes in or out is raised once, never lost, and leaves no handler behind.
15. A rank starts a process in its own session (``start_new_session=True``, as logging daemons
    do) and returns, or raises: that process is gone when the launch is.

This pytest process plays the kernel, as in ``test_rank_faults.py``.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from faultkit import ok_target, read_report, report, wait_for_report, wait_gone
from interrupt_points import InterruptAfterCall, ProfileHook, from_accelnb, sweep

import accelnb
from accelnb.kernel.helper import client
from accelnb.kernel.helper.template import shared_helper, sockets_held_ahead, unclaimed_exits
from accelnb.kernel.run.group import rank_processes
from accelnb.kernel.run.sigterm import sigterm_as_stop
from accelnb.wire.held_interrupts import held_interrupts, routed_interrupts
from tests.conftest import wait_until_no_workers, worker_processes

# Set where the pid-reuse test runs again in a pid namespace of its own: the namespace it came from.
OUTER_PID_NAMESPACE_ENV = "ACCELNB_TEST_OUTER_PID_NAMESPACE"
HELPER_DEATH_BOUND_S = 2.0
GONE_BOUND_S = 5.0
# Offsets (ms) at which Ctrl-C lands after the call starts: dense over the first 100 ms, where
# start-up (binding the port, forking, sending the call) happens on a warm helper.
INTERRUPT_OFFSETS_MS = (0, 1, 2, 3, 5, 7, 10, 13, 16, 20, 25, 30, 40, 50, 65, 80, 100, 150, 250, 400)
# A launch makes ~770 calls into C on accelnb's side (the kernel's): every 9th in `make test`
# (~12 s alone; odd, so that it meets both calls of a pair), every one in `make soak` (~3 min).
EVERY_NINTH, EVERY_ONE = 9, 1
# A launch that works after every 4th point of a sweep: the sweep's own launches test the rest.
CHECK_LAUNCH_EVERY = 4


def sleeping_target(report_dir: str) -> None:
    """Report this rank's pid, then wait (in Python) until accelnb ends the run."""
    import torch.distributed as dist

    report(report_dir, dist.get_rank(), pid=os.getpid())
    time.sleep(3600)


def detached_child_target(report_dir: str, then: str) -> int:
    """Start a process in its own session (as a logging daemon does), then return or raise."""
    import torch.distributed as dist

    rank = dist.get_rank()
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    report(report_dir, rank, pid=os.getpid(), child_pid=child.pid)
    if then == "raise" and rank == 1:
        wait_for_report(report_dir, 0, "child_pid")  # so that the test knows both pids
        raise RuntimeError("rank 1 fails after starting a detached process")
    return rank


def open_fds() -> set[str]:
    """This process's fds but the socket it holds for its template's next launch (``wire/group_ahead.py``)."""
    return set(os.listdir("/proc/self/fd")) - {str(held.fileno()) for held in sockets_held_ahead()}


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_helper_killed_mid_run(tmp_path: Path, fault_record: dict[str, Any]) -> None:
    helper = shared_helper().pid
    killed_at: list[float] = []

    def kill_helper_once_both_ranks_run() -> None:
        for rank in (0, 1):
            wait_for_report(str(tmp_path), rank, "pid")
        killed_at.append(time.monotonic())
        os.kill(helper, signal.SIGKILL)

    killer = threading.Thread(target=kill_helper_once_both_ranks_run)
    killer.start()
    with pytest.raises(accelnb.AccelnbError) as raised:
        accelnb.launch(sleeping_target, (str(tmp_path),), num_processes=2, cpu=True, quiet=True, timeout=60)
    seconds_to_raise = time.monotonic() - killed_at[0]
    killer.join()
    message = str(raised.value)
    pids = [read_report(tmp_path / f"rank{rank}.json")["pid"] for rank in (0, 1)]
    gone = wait_gone(pids, GONE_BOUND_S)
    fault_record.update(fault="helper_killed", rank="–", phase="-", raised=type(raised.value).__name__,
                        first_line=message.splitlines()[0], cleanup_s=seconds_to_raise,
                        bound_s=HELPER_DEATH_BOUND_S, measured_from="the kill, until the launch raised")

    assert seconds_to_raise < HELPER_DEATH_BOUND_S, f"the launch raised {seconds_to_raise:.2f} s after the kill"
    assert "helper" in message and "SIGKILL" in message, message
    assert gone is not None, f"workers outlived their helper: {pids}"
    assert accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}
    assert shared_helper().pid != helper


def test_interrupt_at_many_moments_of_start_up(fault_record: dict[str, Any]) -> None:
    accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)  # warm: the helper is running
    fds_before, shm_before = open_fds(), shm_names()
    main = threading.get_ident()
    interrupted = returned = 0
    started = time.monotonic()
    for offset_ms in INTERRUPT_OFFSETS_MS:
        fired = threading.Event()

        def interrupt(at: float = offset_ms / 1000, fired: threading.Event = fired) -> None:
            time.sleep(at)  # this *is* the moment under test, not a wait for something
            signal.pthread_kill(main, signal.SIGINT)
            fired.set()

        sender = threading.Thread(target=interrupt)
        completed = False
        try:
            sender.start()
            accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)
            completed = True
            fired.wait()  # a Ctrl-C after the run is still delivered inside this try
            time.sleep(0)  # lets the interpreter run the pending handler here
        except KeyboardInterrupt:
            pass
        sender.join()
        interrupted, returned = interrupted + (not completed), returned + completed
        assert worker_processes() == [] or wait_until_no_workers(GONE_BOUND_S) < GONE_BOUND_S
        assert accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}
    leaked_fds = open_fds() - fds_before
    fault_record.update(fault="interrupt_start", rank="–", phase="-",
                        raised=f"RunInterrupted at {interrupted} of {len(INTERRUPT_OFFSETS_MS)} moments "
                               f"(at {returned} the run had already returned)",
                        first_line="", cleanup_s=time.monotonic() - started, bound_s=GONE_BOUND_S,
                        label=f"{len(INTERRUPT_OFFSETS_MS)} moments, 0–400 ms after the call",
                        measured_from="the first interrupt, for all moments together")

    assert interrupted >= 5, f"only {interrupted} interrupts landed inside a launch: the sweep misses start-up"
    assert not leaked_fds, f"fds left open in the kernel: {sorted(leaked_fds)}"
    assert shm_names() == shm_before


class NothingLeft:
    """What a sweep of launches checks after each Ctrl-C: no worker left, no fd or ``/dev/shm``
    entry of this process's left, no worker's exit noted that no group took; and after every
    ``launch_every``-th, that the next launch works at once (between those, the sweep's next
    launch is the next launch: one that fails for what the last Ctrl-C left is a problem at the
    next point)."""

    def __init__(self, launch_every: int = 1) -> None:
        self.fds, self.shm = open_fds(), shm_names()
        self.launch_every, self.seen = launch_every, 0

    def __call__(self, point: InterruptAfterCall) -> str | None:
        self.seen += 1
        values: Any = {0: 2.0, 1: 2.0}
        try:
            wait_until_no_workers(GONE_BOUND_S)
            if self.seen % self.launch_every == 0:
                values = accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values
                wait_until_no_workers(GONE_BOUND_S)
        except (AssertionError, accelnb.AccelnbError) as error:
            return f"then: {type(error).__name__}: {error}"
        left = [f"fds {sorted(open_fds() - self.fds)}" if open_fds() - self.fds else "",
                f"exits nobody took {unclaimed_exits()}" if unclaimed_exits() else "",
                "/dev/shm entries" if shm_names() != self.shm else "",
                f"the next launch gave {values}" if values != {0: 2.0, 1: 2.0} else ""]
        self.fds, self.shm = open_fds(), shm_names()  # one leak is reported once
        return "; ".join(what for what in left if what) or None


def launch_ok() -> None:
    accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True)


def launch_then_collect_its_exits() -> None:
    launch_ok()
    wait_until_no_workers(GONE_BOUND_S)
    launch_ok()  # reads the reports of the last launch's exits


def reading_a_report(frame: FrameType, function: Any) -> bool:
    """The kernel decoding a report of its template, the moment before it notes it."""
    return function is pickle.loads and frame.f_code.co_filename == client.__file__


def test_interrupt_at_each_report_of_the_template() -> None:
    launch_then_collect_its_exits()  # warm: the helper is running
    swept = sweep(launch_then_collect_its_exits, NothingLeft(), counted=reading_a_report)

    assert swept.points >= 2, f"{swept.points} reports read in two launches: the hook no longer sees them"
    assert not swept.problems, "\n".join(swept.problems)
    assert swept.interrupted == swept.points


def rank_pid() -> int:
    return os.getpid()


class InterruptAfterSpawnAnswer(ProfileHook):
    """Within the block: SIGINT as the kernel's read of its template's answer to a spawn returns,
    the answer noted but not yet in the hands of the spawn that waits for it. ``pids``: the
    workers that answer named."""

    def __init__(self) -> None:
        self.pids: list[int] = []

    def _on_event(self, frame: FrameType, event: str, arg: Any) -> None:
        if (event == "return" and not self.pids and frame.f_code.co_filename == client.__file__
                and frame.f_code.co_name == "_receive" and isinstance(arg, tuple) and arg[0] == "spawned"):
            self.pids = list(arg[2])
            signal.raise_signal(signal.SIGINT)


def next_pid_is(pid: int) -> None:
    """Have the OS give ``pid`` to the next process forked in this pid namespace (root only)."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))


def rerun_in_own_pid_namespace(request: pytest.FixtureRequest) -> None:
    """Run this test again, alone, in a pid namespace of its own (and a mount namespace, for a
    ``/proc`` that shows its pids): the pids it has the OS give again are given there only."""
    completed = subprocess.run(
        # sh, not Python, is the namespace's pid 1 (which gets only the signals it has handlers for)
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", '"$@"; exit $?', "sh",
         sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", request.node.nodeid],
        env={**os.environ, OUTER_PID_NAMESPACE_ENV: os.readlink("/proc/self/ns/pid")},
        cwd=request.config.rootpath, capture_output=True, text=True, timeout=240)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0 and re.search(r"^1 passed", completed.stdout, re.MULTILINE), output


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a pid namespace where the next pid can be chosen (ns_last_pid) needs root and unshare")
def test_a_rank_given_the_pid_of_an_interrupted_launchs_worker_is_not_taken_for_it(
        request: pytest.FixtureRequest) -> None:
    """A Ctrl-C right after the kernel read the template's answer to a spawn lost the answer: the
    workers it named were not killed at once, and their exits, reported later, stayed noted for
    nobody. Once pids wrapped around (32768 by default), a new rank given one of those pids took
    that exit at its first look: "Rank 3 failed: killed by SIGKILL" (``make soak``, 3 of 150
    launches). Here the OS is asked for those pids again, until a rank gets one: in a pid
    namespace of the test's own. The counter is the machine's otherwise, and rewinding it gave
    the pids of processes other tests had just seen end to new ones (a fault test running beside
    this one found the ranks it had seen die still running: 1 run of the suite in 6)."""
    outer_namespace = os.environ.get(OUTER_PID_NAMESPACE_ENV)
    if outer_namespace is None:
        rerun_in_own_pid_namespace(request)
        return
    assert os.readlink("/proc/self/ns/pid") != outer_namespace
    launch_ok()  # warm: the helper is running
    interrupt = InterruptAfterSpawnAnswer()
    with pytest.raises(KeyboardInterrupt), interrupt:
        launch_ok()
    assert interrupt.pids, "the kernel read no answer to a spawn: the test no longer reaches its point"
    wait_until_no_workers(GONE_BOUND_S)
    assert unclaimed_exits() == {}

    given_again = None
    for _ in range(10):  # another process on the machine may fork first and take the pid
        next_pid_is(interrupt.pids[0])
        pids = accelnb.launch(rank_pid, num_processes=2, cpu=True, quiet=True).values  # raised "killed by SIGKILL"
        given_again = given_again or set(pids.values()) & set(interrupt.pids)
        if given_again:
            break
    assert given_again, f"no rank got {interrupt.pids} again in 10 launches: nothing was checked"
    wait_until_no_workers(GONE_BOUND_S)


@pytest.mark.parametrize("stride", [EVERY_NINTH, pytest.param(EVERY_ONE, marks=pytest.mark.slow)])
def test_interrupt_after_calls_into_c_of_a_launch(stride: int) -> None:
    launch_then_collect_its_exits()
    swept = sweep(launch_ok, NothingLeft(CHECK_LAUNCH_EVERY), stride=stride)

    assert swept.points >= 20, f"only {swept.points} points: the hook no longer sees accelnb's calls"
    assert not swept.problems, "\n".join(swept.problems)
    # A Ctrl-C once every rank answered only hurries their ending (RankProcesses.stop), and the
    # launch returns its values: 3-10 of ~800 points. Before, it interrupts the launch.
    assert swept.interrupted >= 0.95 * swept.points, f"returned despite the Ctrl-C: {swept.returned}"


def fails_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")


def ending_ranks(frame: FrameType, function: Any) -> bool:
    """A call into C made while accelnb ends a group's ranks (``RankProcesses.stop``, from which a
    Ctrl-C is not raised: it cuts the grace short). Not the handler changes of the holds there:
    their moments have a test of their own (below), and they made this sweep a third longer."""
    if changes_a_handler(frame, function):
        return False
    caller: FrameType | None = frame
    for _ in range(12):
        if caller is None:
            return False
        if caller.f_code.co_name == "stop" and caller.f_code.co_filename == rank_processes.__file__:
            return from_accelnb(frame, function)
        caller = caller.f_back
    return False


@pytest.mark.parametrize("stride", [3, pytest.param(EVERY_ONE, marks=pytest.mark.slow)])
def test_an_interrupt_is_never_followed_by_a_restart(stride: int) -> None:
    """A Ctrl-C while a failed attempt's ranks are ended (up to FAILURE_GRACE_S) hurries their end;
    the failure is still what the launch raises, but no attempt may start after the Ctrl-C.
    A Ctrl-C at every third point of ending the ranks, of either attempt (~65 points, ~10 s alone);
    ``make soak``: at every one."""
    def launch_with_a_restart() -> None:
        try:
            accelnb.launch(fails_on_rank_1, num_processes=2, cpu=True, quiet=True, max_restarts=1)
        except accelnb.RankFailed:
            pass

    launch_with_a_restart()  # warm: the helper is running
    nothing_left = NothingLeft(CHECK_LAUNCH_EVERY)

    def no_attempt_after_it(point: InterruptAfterCall) -> str | None:
        result = accelnb.last_result()
        started = result.attempts[-1].started if result is not None and result.attempts else 0.0
        assert point.raised_at is not None
        if started > point.raised_at:
            return f"attempt {len(result.attempts) if result else '?'} started after the Ctrl-C"
        return nothing_left(point)

    swept = sweep(launch_with_a_restart, no_attempt_after_it, stride=stride, counted=ending_ranks)

    assert swept.points >= 10, f"only {swept.points} points: the hook no longer sees accelnb's calls"
    assert not swept.problems, "\n".join(swept.problems)
    assert swept.returned, "no Ctrl-C landed while ranks were ended: the sweep misses what it tests"


def add_one(x: int) -> int:
    return x + 1


def test_interrupt_after_each_call_into_c_of_a_session_call() -> None:
    """A session survives a Ctrl-C anywhere in a call: the cell is interrupted, its ranks and
    their variables are kept, and the next call works."""
    with accelnb.Session.start(num_processes=2, cpu=True, quiet=True) as session:
        session.run(add_one, (1,))
        fds = open_fds()

        def session_kept(point: InterruptAfterCall) -> str | None:
            if not session.alive:
                return "the session ended"
            values = session.run(add_one, (1,)).values
            leaked = open_fds() - fds
            return (f"the next call gave {values}" if values != {0: 2, 1: 2}
                    else f"fds {sorted(leaked)}" if leaked else None)

        swept = sweep(lambda: session.run(add_one, (1,)), session_kept)

    assert swept.points >= 50, f"only {swept.points} points: the hook no longer sees accelnb's calls"
    assert not swept.problems, "\n".join(swept.problems)
    assert swept.interrupted >= swept.points - 2, f"returned despite the Ctrl-C: {swept.returned}"


@pytest.mark.parametrize("then", ["return", "raise"])
def test_detached_grandchild_is_gone_with_its_rank(then: str, tmp_path: Path,
                                                    fault_record: dict[str, Any]) -> None:
    error: BaseException | None = None
    try:
        accelnb.launch(detached_child_target, (str(tmp_path), then), num_processes=2, cpu=True, quiet=True)
    except accelnb.RankFailed as failed:
        error = failed
    ended = time.time()
    children = [read_report(tmp_path / f"rank{rank}.json")["child_pid"] for rank in (0, 1)]
    gone = wait_gone(children, GONE_BOUND_S)
    fault_record.update(fault="detached_child", rank=1 if then == "raise" else "both",
                        phase="-", raised="RankFailed" if error else "(the value)",
                        first_line=str(error).splitlines()[0] if error else "",
                        cleanup_s=None if gone is None else max(0.0, gone - ended), bound_s=GONE_BOUND_S,
                        label="then returns" if then == "return" else "then rank 1 raises",
                        measured_from="the launch's end")

    assert (error is None) == (then == "return")
    assert gone is not None, f"a process the rank started in its own session outlived the launch: {children}"


def changes_a_handler(frame: FrameType, function: Any) -> bool:
    """A call into C that reads or changes a signal's handler (``wire/signal_handlers.py``)."""
    return frame.f_code.co_filename.endswith(os.path.join("wire", "signal_handlers.py"))


@contextmanager
def hold_inside_a_route() -> Iterator[None]:
    with routed_interrupts(), held_interrupts():
        yield


def _sigterm_handler(signum: int, frame: FrameType | None) -> None:
    pass


BLOCKS: dict[str, Callable[[], AbstractContextManager[None]]] = {
    "a hold": held_interrupts, "a route": routed_interrupts, "a hold inside a route": hold_inside_a_route,
    "SIGTERM as a Stop press": sigterm_as_stop}


@pytest.mark.parametrize("block", BLOCKS)
def test_a_ctrl_c_as_a_handler_changes_is_neither_lost_nor_leaves_a_handler_behind(block: str) -> None:
    """Each moment a block reads or changes a handler, one after another: the Ctrl-C that lands
    there is raised once (never lost to a route that did not know its target yet), and SIGINT and
    SIGTERM mean after the block what they meant before it; the next route works. (A launch's
    sweep above lands on these moments too, among all its others.)"""
    previous_sigterm = signal.signal(signal.SIGTERM, _sigterm_handler)
    try:
        with InterruptAfterCall(0, changes_a_handler) as counting, BLOCKS[block]():
            pass
        assert counting.calls >= 2, f"{counting.calls} handler calls in {block}: the test no longer reaches its point"
        for at in range(1, counting.calls + 1):
            raised = 0
            try:
                with InterruptAfterCall(at, changes_a_handler), BLOCKS[block]():
                    pass
            except KeyboardInterrupt:
                raised += 1
            assert raised == 1, f"{block}, moment {at}: the Ctrl-C was lost"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, f"{block}, moment {at}"
            assert signal.getsignal(signal.SIGTERM) is _sigterm_handler, f"{block}, moment {at}"
            with pytest.raises(KeyboardInterrupt), routed_interrupts(), held_interrupts():
                signal.raise_signal(signal.SIGINT)  # the next route holds, then raises
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
