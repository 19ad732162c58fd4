"""Faults in accelnb's own machinery, injected at exact moments: the helper's death, and Ctrl-C.

Moments are chosen deterministically, never with a timer: the engine calls an injected
``on_step(name)`` at each step of starting and of sending a call (every pipe opened, the spawn
request sent, every frame and every write of it), and displays' wait hooks run inside the wait
for answers. A fault raised or fired from there lands exactly at that step.

The helper is killed with SIGKILL, as the OOM killer does. To see every process it leaves (its
workers are re-parented when it dies), this test process becomes a child subreaper: orphans of
its descendants become its children, so none can hide under init.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil
import pytest

import accelnb
from accelnb.errors import HelperDied, RankFailed, RunInterrupted
from accelnb.kernel.helper.payload import pack_call
from accelnb.kernel.helper.template import running_helper_pid, shared_helper, shutdown_helper, sockets_held_ahead
from accelnb.kernel.planning import rank_plan
from accelnb.kernel.planning.inventory import Inventory
from accelnb.kernel.run import run_state
from accelnb.kernel.run.call_settings import CallSettings
from accelnb.kernel.run.engine import run_on_group, start_workers
from accelnb.kernel.run.failure_report import build_exception, exit_failure
from accelnb.wire.buffers import Packed
from tests.conftest import wait_until_no_workers, worker_processes
from tests.zmq_contexts import collect_garbage

pytestmark = pytest.mark.usefixtures("no_leftovers")

HELPER_DEATH_BOUND_S = 2.0
PR_SET_CHILD_SUBREAPER = 36
BIG_ARGUMENT = b"x" * (3 << 20)  # a 3 MiB payload: each rank's frame goes out in several writes


def ok() -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()


def ok_with_payload(data: bytes) -> int:
    return len(data)


def sleep_long() -> None:
    time.sleep(600)


def wait_for_the_end(data: bytes) -> int:
    """Never answers: the rank ends with its helper (PDEATHSIG), however long the helper takes to die
    (a template that imported much takes longer to tear down than a rank takes to answer)."""
    signal.pause()
    return len(data)


# ── what the kernel process holds ───────────────────────────────────────────────────────────
def open_fds() -> set[str]:
    # Garbage first: a kernel client an earlier test stopped closes its zmq sockets only when it is
    # collected, which would change this process's fds in the middle of a test. One whose channels
    # still ran (an earlier file's, in this test worker) closed them in the middle of a test once
    # (fresh-clone run, "Could not destroy zmq context"): its channels are stopped first.
    from jupyter_client.client import KernelClient

    for found in gc.get_objects():
        if isinstance(found, KernelClient) and found.channels_running:
            found.stop_channels()
    collect_garbage()
    return set(os.listdir("/proc/self/fd")) - {str(held.fileno()) for held in sockets_held_ahead()}


def shared_memory_in_use() -> set[str]:
    """Shared-memory files this process maps or holds open (others' /dev/shm entries are theirs)."""
    with open("/proc/self/maps") as maps:
        mapped = {line.split(maxsplit=5)[-1].strip() for line in maps if "/dev/shm/" in line}
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            held.add(target)
    return mapped | held


@dataclass
class Orphans:
    """Processes re-parented to this test process (a subreaper) when their parent died."""

    helpers: set[int] = field(default_factory=set)  # helper pids: subprocess.Popen reaps those
    # Children this process already had (a browser test's Playwright driver lives for the whole
    # session): not orphans of ours.
    before: set[int] = field(default_factory=lambda: {p.pid for p in psutil.Process().children()})

    def running(self) -> list[psutil.Process]:
        found = []
        for child in psutil.Process().children():
            if child.pid in self.helpers or child.pid in self.before or child.pid == running_helper_pid():
                continue
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found

    def reap(self) -> None:
        for child in psutil.Process().children():
            if child.pid in self.helpers or child.pid in self.before or child.pid == running_helper_pid():
                continue
            try:
                os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                pass


@pytest.fixture
def orphans() -> Iterator[Orphans]:
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    adopted = Orphans()
    try:
        yield adopted
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        adopted.reap()


def cpu_plan() -> rank_plan.LaunchPlan:
    return rank_plan.plan(None, 2, inventory=Inventory(source="none"), cpu=True)


def run_like_launch(payload: Packed, *, on_step: Callable[[str], None] | None = None,
                    persistent: bool = False, timeout: float | None = None) -> accelnb.LaunchResult:
    """What ``accelnb.launch`` does with a packed call, with the engine's step hook injected."""
    group = start_workers(cpu_plan(), None, persistent=persistent, quiet=True, on_step=on_step)
    try:
        return run_on_group(group, payload, CallSettings(timeout=timeout, output="none"))
    finally:
        group.close()


def wait_until(condition: Callable[[], bool], bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ── the helper dies ─────────────────────────────────────────────────────────────────────────
@dataclass
class KillHelperAt:
    """An ``on_step`` that SIGKILLs the running helper at the first step called ``step``."""

    step: str
    killed_pid: int | None = None
    killed_at: float = 0.0

    def __call__(self, name: str) -> None:
        if name == self.step and self.killed_pid is None:
            self.killed_pid = running_helper_pid()
            assert self.killed_pid is not None
            self.killed_at = time.monotonic()
            os.kill(self.killed_pid, signal.SIGKILL)


def assert_helper_death_reported(error: HelperDied, killed_pid: int, seconds: float) -> None:
    message = str(error)
    assert seconds < HELPER_DEATH_BOUND_S, f"raised {seconds:.2f} s after the kill"
    assert message.startswith(f"accelnb's helper process (pid {killed_pid}"), message
    assert "killed by SIGKILL" in message, message
    assert error.exit_code == -signal.SIGKILL and error.helper_pid == killed_pid
    assert isinstance(error, accelnb.WorkerStartError) and isinstance(error, accelnb.LaunchFailed)


@pytest.mark.parametrize("step", ["helper-starting", "pipe-opened", "spawn-requested", "spawned",
                                  "call-part-written", "call-sent"])
def test_the_helper_killed_at_a_step_of_the_launch(step: str, orphans: Orphans) -> None:
    if step == "helper-starting":
        shutdown_helper()  # the next launch starts one, and it dies before it is ready
    else:
        run_like_launch(pack_call(ok, (), {}))  # a warm helper, whose death is under test
    fds_before, shm_before = open_fds(), shared_memory_in_use()
    kill = KillHelperAt(step)

    with pytest.raises(HelperDied) as raised:
        run_like_launch(pack_call(wait_for_the_end, (BIG_ARGUMENT,), {}), on_step=kill)
    seconds = time.monotonic() - kill.killed_at

    assert kill.killed_pid is not None
    orphans.helpers.add(kill.killed_pid)
    assert_helper_death_reported(raised.value, kill.killed_pid, seconds)
    # A worker forked just before the death dies of PDEATHSIG; one the group knew was waited for.
    assert wait_until(lambda: not orphans.running(), 1.0), orphans.running()
    assert running_helper_pid() is None
    # The dead helper was closed, not just dropped: the next launch's fresh helper is all that is new.
    assert run_like_launch(pack_call(ok, (), {})).values == {0: 2.0, 1: 2.0}
    assert running_helper_pid() not in (None, kill.killed_pid)
    helper_socket = 1 if step == "helper-starting" else 0  # none ran before: the new one's socket
    assert len(open_fds() - fds_before) == helper_socket and not fds_before - open_fds()
    assert shared_memory_in_use() == shm_before


def test_the_helper_killed_mid_run_raises_within_2_seconds(orphans: Orphans) -> None:
    accelnb.launch(ok, num_processes=2, cpu=True, quiet=True)
    helper_pid = running_helper_pid()
    assert helper_pid is not None
    orphans.helpers.add(helper_pid)
    killed_at: list[float] = []
    worker_pids: list[int] = []

    def kill_once_every_rank_runs() -> None:  # a display's wait hook: runs inside the wait for answers
        run = run_state.current_run()
        if not killed_at and run is not None and all(r.phase == "running" for r in run.ranks):
            worker_pids.extend(r.pid for r in run.ranks if r.pid is not None)
            killed_at.append(time.monotonic())
            os.kill(helper_pid, signal.SIGKILL)

    remove_hook = run_state.add_wait_hook(kill_once_every_rank_runs)
    try:
        with pytest.raises(HelperDied) as raised:
            accelnb.launch(sleep_long, num_processes=2, cpu=True, quiet=True)
    finally:
        remove_hook()
    seconds = time.monotonic() - killed_at[0]

    assert_helper_death_reported(raised.value, helper_pid, seconds)
    assert "died during the run" in str(raised.value)
    assert len(worker_pids) == 2 and not any(_runs(pid) for pid in worker_pids)  # gone when it raised
    assert orphans.running() == []
    assert [state.phase for state in run_state.current_run().ranks] == ["failed", "failed"]  # type: ignore[union-attr]
    assert accelnb.launch(ok, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}


def _runs(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ── Ctrl-C ──────────────────────────────────────────────────────────────────────────────────
@dataclass
class StepRecorder:
    steps: list[str] = field(default_factory=list)

    def __call__(self, name: str) -> None:
        self.steps.append(name)


@dataclass
class InterruptAt:
    """An ``on_step`` that raises KeyboardInterrupt at the ``index``-th step, as Ctrl-C would."""

    index: int
    seen: int = 0
    fired_at: str = ""

    def __call__(self, name: str) -> None:
        if self.seen == self.index:
            self.fired_at = name
            self.seen += 1
            raise KeyboardInterrupt
        self.seen += 1


def recorded_steps(persistent: bool) -> list[str]:
    """The steps of one launch with a warm helper (one is started first if need be)."""
    shared_helper()
    recorder = StepRecorder()
    assert run_like_launch(pack_call(ok_with_payload, (BIG_ARGUMENT,), {}), on_step=recorder,
                           persistent=persistent).values == {0: len(BIG_ARGUMENT), 1: len(BIG_ARGUMENT)}
    return recorder.steps


def test_an_interrupt_at_every_step_of_start_up_and_sending_leaves_nothing() -> None:
    steps = recorded_steps(persistent=False)
    for expected in ("helper-ready", "pipe-opened", "spawn-requested", "spawned", "started",
                     "call-writing", "call-part-written", "call-sent"):
        assert expected in steps, steps
    assert steps.count("pipe-opened") == 10 and steps.count("call-writing") == 2  # 5 channels a rank
    fds_before, shm_before = open_fds(), shared_memory_in_use()
    payload = pack_call(ok_with_payload, (BIG_ARGUMENT,), {})

    for index, step in enumerate(steps):
        interrupt = InterruptAt(index)
        with pytest.raises(RunInterrupted) as raised:
            run_like_launch(payload, on_step=interrupt)
        assert interrupt.fired_at == step, (index, interrupt.fired_at, step)
        assert str(raised.value).startswith("accelnb stopped the")
        # Gone when the interrupt reaches the caller, not "soon": every worker was waited for.
        assert worker_processes() == [], (index, step, worker_processes())
        assert open_fds() == fds_before, (index, step, open_fds() - fds_before)
        assert shared_memory_in_use() == shm_before, (index, step)

    # The next launch works at once, with the same helper.
    helper_pid = running_helper_pid()
    assert run_like_launch(pack_call(ok, (), {})).values == {0: 2.0, 1: 2.0}
    assert running_helper_pid() == helper_pid


def test_a_session_interrupted_while_its_call_is_sent_is_closed_not_desynchronised() -> None:
    steps = recorded_steps(persistent=True)
    sending = [i for i, step in enumerate(steps) if step in ("call-writing", "call-part-written")]
    assert len(sending) >= 4, steps
    payload = pack_call(ok_with_payload, (BIG_ARGUMENT,), {})
    fds_before = open_fds()

    for index in sending[1:]:  # a byte of the call went out: half a frame may sit in an inbox
        interrupt = InterruptAt(index)
        group = start_workers(cpu_plan(), None, persistent=True, quiet=True, on_step=interrupt)
        try:
            with pytest.raises(RunInterrupted, match="while sending it to the workers") as raised:
                run_on_group(group, payload, CallSettings(output="none"))
            assert "the session was closed" in str(raised.value)
            assert not group.usable  # what Session.alive reports
            assert worker_processes() == []
        finally:
            group.close()
        assert open_fds() == fds_before, (index, steps[index])


def test_a_session_interrupted_before_its_call_went_out_goes_on() -> None:
    steps = recorded_steps(persistent=True)
    group = start_workers(cpu_plan(), None, persistent=True, quiet=True,
                          on_step=InterruptAt(steps.index("call-writing")))
    try:
        with pytest.raises(RunInterrupted, match="before it reached the workers; the session and its "
                                                 "variables are kept"):
            run_on_group(group, pack_call(ok, (), {}), CallSettings(output="none"))
        assert group.usable
        assert run_on_group(group, pack_call(ok, (), {}), CallSettings(output="none")).values == {0: 2.0, 1: 2.0}
    finally:
        group.shutdown()


def test_an_interrupt_while_the_helper_starts_leaves_it_starting_for_the_next_launch() -> None:
    shutdown_helper()
    fds_before = open_fds()
    with pytest.raises(RunInterrupted, match="while starting its workers; no worker is left"):
        run_like_launch(pack_call(ok, (), {}), on_step=InterruptAt(0))
    starting = running_helper_pid()
    assert starting is not None  # kept: it is this kernel's helper, and the next launch needs it
    assert run_like_launch(pack_call(ok, (), {})).values == {0: 2.0, 1: 2.0}
    assert running_helper_pid() == starting
    assert len(open_fds() - fds_before) == 1  # the helper's socket, and nothing else


def test_a_stopped_cell_shows_one_short_line_in_ipython(capsys: pytest.CaptureFixture[str]) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shared_helper()  # warm and in step: the step numbers below are a launch's, not a template's start
    shell.user_ns["run_like_launch"] = run_like_launch
    shell.user_ns["payload"] = pack_call(ok, (), {})
    shell.user_ns["interrupt"] = InterruptAt(14)  # the first call-writing: 10 pipes opened, spawned, started
    capsys.readouterr()
    shell.run_cell("run_like_launch(payload, on_step=interrupt)")
    shown = capsys.readouterr()
    lines = [line for line in (shown.out + shown.err).splitlines() if line.strip()]
    assert lines == ["KeyboardInterrupt: accelnb stopped the run: every worker was ended on the interrupt."]
    wait_until_no_workers(0.5)


# ── remote exceptions ───────────────────────────────────────────────────────────────────────
def test_a_remote_exception_class_is_made_once_per_type_and_pickles() -> None:
    import pickle

    def fail() -> None:
        raise ValueError("bad value")

    errors = []
    for _ in range(2):
        with pytest.raises(ValueError) as raised:
            accelnb.launch(fail, num_processes=2, cpu=True, quiet=True)
        errors.append(raised.value)
    first, second = errors
    assert type(first) is type(second) and isinstance(first, RankFailed)
    copy = pickle.loads(pickle.dumps(first))
    assert type(copy) is type(first) and isinstance(copy, ValueError)
    assert str(copy) == str(first) and copy.failures == first.failures
    assert first.metrics is not None and copy.metrics is not None


# ── a start that fails ──────────────────────────────────────────────────────────────────────
def test_a_set_up_failure_says_it_happened_before_the_function_ran() -> None:
    with pytest.raises(RankFailed) as raised:  # this torch has no MPI: init_process_group raises
        accelnb.launch(ok, num_processes=2, cpu=True, quiet=True, backend="mpi")
    first, second = str(raised.value).splitlines()[:2]
    assert first.startswith("Rank ") and "RuntimeError: Distributed package doesn't have MPI" in first
    assert second == ("This happened while accelnb set the worker up (its environment, the process group), "
                      "before your function ran.")


def test_a_bare_exit_70_before_joining_is_a_set_up_failure_not_a_native_crash() -> None:
    before_joining = exit_failure(1, 4242, 70, "Traceback …\nOSError: no such thing", time.time(), joined=False)
    error = build_exception([before_joining], [0], show_output_of={0})
    message = str(error)
    assert message.startswith("Rank 1 failed: accelnb's worker set-up failed (exit code 70) before it could "
                              "report why\nThis happened while accelnb set the worker up")
    assert "native code" not in message and "[rank 1] OSError: no such thing" in message
    # Once the worker joined, an exit code of 70 is the function's own business.
    assert "native code" in exit_failure(1, 4242, 70, "", time.time(), joined=True).summary
