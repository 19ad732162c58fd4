"""What a persistent session does when a call goes wrong, with real workers and real gloo.

- an exception on every rank: the cell fails, the session (and what the ranks hold) goes on;
- a rank dies: the session is closed and no process is left;
- an interrupt: the cell stops on every rank, the session and its variables are kept;
- ``timeout=``: every rank's stack is shown, and the session is closed;
- ``collect="all"``: every rank's value comes back through the session too;
- accelnb's helper process dies, between calls or within one: the call raises ``HelperDied``
  within 2 s, no worker is left, and the session reports itself closed;
- between calls a rank waits as a batch thread, and runs the code under the normal policy.

Ranks keep state between calls in a module attribute (``sys._accelnb_test_state``), as a model
built in one ``%%distributed`` cell is kept for the next.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import psutil
import pytest

from accelnb import LaunchTimeout, RankCrashed, RankFailed
from accelnb.errors import HelperDied, RunInterrupted
from accelnb.kernel.helper.template import running_helper_pid
from accelnb.kernel.run import run_state
from accelnb.session import Session

pytestmark = pytest.mark.usefixtures("no_leftovers")

HELPER_DEATH_BOUND_S = 2.0


def remember(value: int) -> int:
    import sys

    import torch.distributed as dist

    sys._accelnb_test_state = value * 10 + dist.get_rank()  # type: ignore[attr-defined]
    return os.getpid()


def recall() -> int:
    import sys

    return int(sys._accelnb_test_state)  # type: ignore[attr-defined]


def fail_everywhere() -> None:
    import torch.distributed as dist

    raise ValueError(f"bad input on rank {dist.get_rank()}")


def rank_1_exits() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def hang_in_collective() -> None:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(600)
    dist.barrier()


def say_inside_then_sleep(fifo: str) -> None:
    import time

    with open(fifo, "wb") as inside:  # the test reads one byte per rank: every rank runs the cell
        inside.write(b"!")
    time.sleep(600)


def sleep_long() -> None:
    import time

    time.sleep(600)


@pytest.fixture
def session() -> Iterator[Session]:
    started = Session.start(num_processes=2, cpu=True, quiet=True)
    try:
        yield started
    finally:
        started.stop()


def gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def worker_pids(session: Session) -> list[int]:
    pids = session.run(remember, (1,)).values
    return [pids[0], pids[1]]


def test_an_exception_on_every_rank_keeps_the_session_and_its_state(session: Session) -> None:
    pids = worker_pids(session)
    with pytest.raises(ValueError, match="bad input on rank") as raised:
        session.run(fail_everywhere)
    assert isinstance(raised.value, RankFailed)
    assert "The persistent session was closed" not in str(raised.value)
    assert session.alive
    assert session.run(recall).values == {0: 10, 1: 11}
    assert session.run(os.getpid).values == {0: pids[0], 1: pids[1]}  # the same processes


def test_a_rank_that_dies_closes_the_session_and_leaves_no_process(session: Session) -> None:
    pids = worker_pids(session)
    with pytest.raises(RankCrashed, match="Rank 1 failed: exited with code 3") as raised:
        session.run(rank_1_exits)
    assert "The persistent session was closed" in str(raised.value)
    assert not session.alive
    assert gone(pids)
    with pytest.raises(Exception, match="This session has ended"):
        session.run(recall)


def test_an_interrupt_stops_the_cell_on_every_rank_and_keeps_the_variables(session: Session,
                                                                            tmp_path: Path) -> None:
    pids = worker_pids(session)
    fifo = tmp_path / "inside"
    os.mkfifo(fifo)
    every_rank_inside = threading.Event()

    def read_both_ranks() -> None:
        with open(fifo, "rb") as inside:
            received = b""
            while len(received) < 2:
                received += inside.read(2 - len(received)) or b""
        every_rank_inside.set()

    reader = threading.Thread(target=read_both_ranks, daemon=True)
    reader.start()
    interrupted: list[float] = []

    def ctrl_c_once_every_rank_runs_the_cell() -> None:  # runs inside the session's wait for answers
        if every_rank_inside.is_set() and not interrupted:
            interrupted.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

    remove_hook = run_state.add_wait_hook(ctrl_c_once_every_rank_runs_the_cell)
    try:
        with pytest.raises(RunInterrupted, match="interrupted the cell on every rank; the session and its "
                                                 "variables are kept"):
            session.run(say_inside_then_sleep, (str(fifo),))
    finally:
        remove_hook()
    reader.join()
    assert time.monotonic() - interrupted[0] < 20  # at once: not the cell's sleep, nor the 120 s stop grace
    assert session.alive
    assert session.run(recall).values == {0: 10, 1: 11}
    assert session.run(os.getpid).values == {0: pids[0], 1: pids[1]}


def save_on_sigterm(path: str) -> int:
    """A cell that sets the usual pre-emption handler, which saves, then leaves it to the rank."""
    import signal

    import torch.distributed as dist

    def save(signum: int, frame: object) -> None:
        with open(f"{path}.{dist.get_rank()}", "w") as saved:
            saved.write("saved")

    signal.signal(signal.SIGTERM, save)
    return os.getpid()


def signal_handled(pid: int, signum: int) -> bool:
    """Whether ``signum`` sent to ``pid`` has been delivered: neither the thread's nor the
    process's pending set holds it any more."""
    bit = 1 << (signum - 1)
    with open(f"/proc/{pid}/status") as status:
        pending = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return not any(mask & bit for mask in pending)


def test_a_ctrl_c_that_reaches_a_rank_between_calls_is_dropped_and_the_next_call_runs_whole(
        session: Session) -> None:
    """A rank waits for its next call in its main thread (worker/kernel_sockets.py). A SIGINT that
    lands there, whichever thread the OS gives it to, was meant for a call that has ended: the
    next call must neither lose its message nor be interrupted by it."""
    pids = worker_pids(session)
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + 10
    while not all(signal_handled(pid, signal.SIGINT) for pid in pids):
        assert time.monotonic() < deadline, "the ranks did not take the SIGINT within 10 s"
        time.sleep(0.01)
    assert session.run(recall).values == {0: 10, 1: 11}
    assert session.run(os.getpid).values == {0: pids[0], 1: pids[1]}  # the same processes, still serving
    assert session.alive


def test_a_rank_that_died_between_calls_is_the_root_cause_though_its_exit_is_reported_late(
        session: Session) -> None:
    """A rank killed between calls closes its channels at once, but the helper reports its exit
    only once it has reaped it. Here the helper is held (SIGSTOP) until after the next call began:
    the call waits for that report, so the failure named first is the dead rank's, not a
    survivor's exception in the call (on a loaded machine, a late report once let it come first)."""
    pids = session.run(os.getpid, collect="all").values
    helper = psutil.Process(pids[1]).ppid()
    os.kill(helper, signal.SIGSTOP)
    resume = threading.Timer(0.5, os.kill, (helper, signal.SIGCONT))
    try:
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        # Exited, every thread: the last one out closed its fds (the leader is a zombie earlier).
        while psutil.Process(pids[1]).status() != psutil.STATUS_ZOMBIE or len(os.listdir(f"/proc/{pids[1]}/task")) > 1:
            assert time.monotonic() < deadline, "rank 1 did not exit within 10 s of SIGKILL"
            time.sleep(0.01)
        resume.start()
        with pytest.raises(RankCrashed, match="Rank 1 failed: killed by SIGKILL"):
            session.run(fail_everywhere)
    finally:
        resume.cancel()
        os.kill(helper, signal.SIGCONT)
    assert not session.alive


def test_sigterm_to_a_rank_between_calls_runs_the_codes_handler_then_the_rank_leaves(
        session: Session, tmp_path: Path) -> None:
    """A rank idle between calls waits in a read of its inbox; SIGTERM with a handler of the
    code's own (a pre-emption save) must run that handler, then end the wait, so the rank
    leaves instead of waiting for a call that will never come."""
    saved = tmp_path / "saved"
    pids = session.run(save_on_sigterm, (str(saved),), collect="all").values
    os.kill(pids[1], signal.SIGTERM)
    try:
        psutil.Process(pids[1]).wait(20)
    except psutil.TimeoutExpired:
        pytest.fail("rank 1 kept waiting for its next call after SIGTERM")
    assert (tmp_path / "saved.1").read_text() == "saved"
    assert not (tmp_path / "saved.0").exists()  # rank 0 got nothing
    with pytest.raises(RankCrashed, match="Rank 1"):
        session.run(recall)
    assert not session.alive
    assert gone([pids[0], pids[1]])


def count_a_cell(step: int) -> int:
    import sys

    sys._accelnb_test_count = getattr(sys, "_accelnb_test_count", 0) + 1  # type: ignore[attr-defined]
    return step


def every_rank_in_the_group() -> int:
    import torch
    import torch.distributed as dist

    ones = torch.ones(1)
    dist.all_reduce(ones)
    return int(ones.item())


def test_ctrl_c_at_random_moments_of_cells_never_loses_the_session(session: Session) -> None:
    """60 cells, each with a Ctrl-C at a random moment of its few milliseconds: while it is sent,
    while the ranks set it up, run it, answer, or after. Each cell ends or is interrupted, and the
    session always goes on with the same ranks, which agree on how many cells they ran. Before,
    such a Ctrl-C closed the session (cut between two ranks' frames, or an answer read and then
    dropped), killed a rank (landing after its answer), or left a lock of a rank's taken, and
    the next cell waited forever."""
    pids = worker_pids(session)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    chosen = random.Random(35)
    interrupted = 0

    def unless_interrupted(step: Callable[[], object]) -> object:
        while True:  # a Ctrl-C that comes after the cell ended lands here
            try:
                return step()
            except KeyboardInterrupt:
                continue

    try:
        for cell in range(60):
            ctrl_c = threading.Timer(chosen.uniform(0, 0.004), os.kill, (os.getpid(), signal.SIGINT))
            try:
                ctrl_c.start()
                got = session.run(count_a_cell, (cell,)).values
                assert got == {0: cell, 1: cell}, got
            except RunInterrupted as stopped:
                assert "the session and its variables are kept" in str(stopped), str(stopped)
                interrupted += 1
            except KeyboardInterrupt:
                pass  # it landed in the test, around the cell
            unless_interrupted(ctrl_c.cancel)
            unless_interrupted(ctrl_c.join)
            assert unless_interrupted(lambda: session.run(every_rank_in_the_group).values) == {0: 2, 1: 2}
    finally:
        signal.signal(signal.SIGINT, previous)
    assert session.alive
    assert session.run(os.getpid).values == {0: pids[0], 1: pids[1]}
    assert interrupted > 0, "no Ctrl-C landed in a cell: the test checked nothing"


def test_a_ctrl_c_while_the_kernel_decodes_an_answer_keeps_the_session(session: Session) -> None:
    """The moment the test above hit on faster machines (once in CI, then every run on an EPYC):
    the Ctrl-C lands while the kernel decodes a rank's answer. Its handler was given the decoding
    frame and kept it until delivery, and the frame's view of the channel's buffer made the buffer
    impossible to resize: the answer was lost, the interrupted call waited for it, and the
    session was closed. Here a profiler sends the Ctrl-C as the first decode returns."""
    pids = worker_pids(session)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    pressed: list[bool] = []

    def ctrl_c_as_a_decode_returns(frame: FrameType, event: str, arg: object) -> None:
        if event == "c_return" and arg is pickle.loads and not pressed:
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # handled at the decoding frame's next step

    message = ""
    try:
        sys.setprofile(ctrl_c_as_a_decode_returns)
        try:
            session.run(count_a_cell, (0,))
        except RunInterrupted as stopped:
            message = str(stopped)
        finally:
            sys.setprofile(None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert pressed, "no answer was decoded: the test checked nothing"
    assert "the session and its variables are kept" in message, message
    assert session.run(every_rank_in_the_group).values == {0: 2, 1: 2}
    assert session.run(os.getpid).values == {0: pids[0], 1: pids[1]}


def test_a_timeout_shows_the_stacks_and_closes_the_session(session: Session) -> None:
    pids = worker_pids(session)
    with pytest.raises(LaunchTimeout) as raised:
        session.run(hang_in_collective, timeout=2)
    message = str(raised.value)
    assert "── rank 0 ──" in message and "── rank 1 ──" in message
    assert "in hang_in_collective" in message
    assert not session.alive
    assert gone(pids)


def test_collect_all_and_collect_rank0_through_a_session(session: Session) -> None:
    def rank_squared() -> int:
        import torch.distributed as dist

        return dist.get_rank() ** 2 + 1

    assert session.run(rank_squared, collect="all").values == {0: 1, 1: 2}
    assert session.run(rank_squared, collect="rank0").values == {0: 1}


def _kill_helper_and_time_the_raise(session: Session, trigger: Callable[[Callable[[], None]], None],
                                    function: Callable[[], object]) -> tuple[HelperDied, float, int]:
    helper_pid = running_helper_pid()
    assert helper_pid is not None
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(helper_pid, signal.SIGKILL)

    trigger(kill)
    with pytest.raises(HelperDied) as raised:
        session.run(function)
    return raised.value, time.monotonic() - killed_at[0], helper_pid


def test_the_helper_killed_between_calls_closes_the_session(session: Session) -> None:
    pids = worker_pids(session)

    def now_and_until_it_is_dead(kill: Callable[[], None]) -> None:
        helper_pid = running_helper_pid()
        assert helper_pid is not None
        kill()
        os.waitid(os.P_PID, helper_pid, os.WEXITED | os.WNOWAIT)  # dead, and left for its owner to reap

    error, seconds, helper_pid = _kill_helper_and_time_the_raise(session, now_and_until_it_is_dead, recall)
    assert seconds < HELPER_DEATH_BOUND_S
    assert f"accelnb's helper process (pid {helper_pid}" in str(error) and "SIGKILL" in str(error)
    assert "The persistent session was closed" in str(error)
    assert not session.alive
    assert gone(pids)


def test_the_helper_killed_within_a_call_closes_the_session(session: Session) -> None:
    pids = worker_pids(session)

    def once_the_call_waits(kill: Callable[[], None]) -> None:
        def hook() -> None:
            remove()
            kill()

        remove = run_state.add_wait_hook(hook)

    error, seconds, helper_pid = _kill_helper_and_time_the_raise(session, once_the_call_waits, sleep_long)
    assert seconds < HELPER_DEATH_BOUND_S
    assert f"accelnb's helper process (pid {helper_pid}" in str(error) and "SIGKILL" in str(error)
    assert not session.alive
    assert gone(pids)
    fresh = Session.start(num_processes=2, cpu=True, quiet=True)
    try:
        assert fresh.run(remember, (2,)).values.keys() == {0, 1}
        assert running_helper_pid() not in (None, helper_pid)
    finally:
        fresh.stop()


def test_an_interrupt_that_found_some_ranks_done_says_their_variables_may_differ() -> None:
    from accelnb import RankFailure
    from accelnb.kernel.run.call_outcome import CallOutcome
    from accelnb.kernel.run.failure_report import run_interrupted

    interrupted = [RankFailure(1, 4321, "exception", "KeyboardInterrupt"), RankFailure(2, 4322, "exception", "")]
    apart = CallOutcome("interrupted", values={0: None}, failures=interrupted, workers_kept=True)
    assert str(run_interrupted(apart, persistent=True)) == (
        "accelnb interrupted the cell on every rank; the session and its variables are kept. rank 0 had "
        "finished the cell when the interrupt came, and ranks 1, 2 were interrupted in it: the ranks' "
        "variables may differ.")
    together = CallOutcome("interrupted", values={}, failures=interrupted, workers_kept=True)
    assert str(run_interrupted(together, persistent=True)).endswith("the session and its variables are kept.")


def pid_and_scheduling_policy() -> tuple[int, int]:
    return os.getpid(), os.sched_getscheduler(0)


def become_an_idle_priority_thread() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def test_a_rank_waits_for_its_call_as_a_batch_thread_and_runs_the_code_as_a_normal_one(session: Session) -> None:
    """Between calls a rank's main thread waits as a SCHED_BATCH thread, whose wake-up preempts
    nobody (the kernel, still writing the call to the next rank); the code runs under the normal
    policy, or under the one a cell chose."""
    ranks = session.run(pid_and_scheduling_policy, collect="all").values
    assert [policy for _, policy in ranks.values()] == [os.SCHED_OTHER, os.SCHED_OTHER]
    for pid, _ in ranks.values():  # the main thread's id is the pid
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(pid) != os.SCHED_BATCH:  # it gets there once its answer is out
            assert time.monotonic() < deadline, f"rank {pid} waits as policy {os.sched_getscheduler(pid)}"
            time.sleep(0.01)

    session.run(become_an_idle_priority_thread, ranks=[1])
    ranks = session.run(pid_and_scheduling_policy, collect="all").values
    assert [policy for _, policy in ranks.values()] == [os.SCHED_OTHER, os.SCHED_IDLE]  # the code's choice stays
