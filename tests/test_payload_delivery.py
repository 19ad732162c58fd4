"""Big arguments of a one-shot launch handed to the ranks by fork, not copied (issue 12).

Where forking the kernel is safe (torch imported, CUDA not initialised) and the arguments are
big, a launch forks a helper of its own from the kernel after packing them, and its ranks see
the kernel's pages copy-on-write (``kernel/helper/payload_delivery.py``). Each test asks the ranks where
their argument's bytes live, from their own ``/proc/self/maps``: anonymous memory they inherited,
or accelnb's memfd. Leftovers are checked by pid (the launch's helper and everything below it)
and by this process's open fds.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

import accelnb
from accelnb.errors import RankFailed
from accelnb.kernel.helper import payload_delivery
from accelnb.kernel.helper.client import running_helper_pid
from accelnb.kernel.helper.payload_delivery import inherit_worth_it
from accelnb.wire.buffers import dump
from accelnb.wire.inherited_payload import inherited
from tests.conftest import InterruptWhenRunning, live_descendants, result_of, run_notebook, start_repo_kernel

BIG = 256 << 20  # bytes
MIB = 1 << 20


# ── functions that run on the ranks ─────────────────────────────────────────────────────────
def where_it_lives(x: torch.Tensor) -> tuple[str, float, int]:
    """The mapping that holds ``x``'s bytes ("anonymous" or a file), its last element, the helper's pid."""
    address = x.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            if low <= address < high:
                return (fields[5].strip() if len(fields) > 5 else "anonymous"), float(x[-1]), os.getppid()
    raise AssertionError(f"no mapping holds {address:#x}")


def write_on_rank_0_then_look(x: torch.Tensor) -> tuple[float, float]:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        x.fill_(7)
    dist.barrier()  # rank 1 looks only once rank 0 has written
    return float(x[0]), float(x[-1])


def kill_the_helper_on_attempt_0(x: torch.Tensor) -> tuple[str, float, int]:
    if accelnb.restart_count() == 0:
        os.kill(os.getppid(), signal.SIGKILL)  # the launch's helper; this worker dies with it
        signal.pause()
    return where_it_lives(x)


def fail_on_rank_1(x: torch.Tensor) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"boom with {x.numel()} elements")


def block_forever(x: torch.Tensor) -> None:
    float(x[0])
    signal.pause()


def say_where_then_block(x: torch.Tensor, folder: str) -> None:
    """Write "pid helper-pid" to ``folder/<pid>`` (whole, by rename), then wait to be killed."""
    float(x[0])
    path = os.path.join(folder, str(os.getpid()))
    with open(path + ".part", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.rename(path + ".part", path)
    signal.pause()


# ── checks ──────────────────────────────────────────────────────────────────────────────────
def children_but_the_shared_helper() -> list[psutil.Process]:
    """This process's live descendants outside the shared helper's tree (a launch's own helper)."""
    shared = running_helper_pid()
    below_shared = {p.pid for p in live_descendants(shared)} if shared is not None else set()
    return [p for p in live_descendants(os.getpid()) if p.pid != shared and p.pid not in below_shared]


def running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def open_fds() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # listdir's own fd, closed meanwhile
            pass
    return found


@pytest.fixture
def nothing_left() -> object:
    """No process of a launch's own helper and no new fd once the test is done. (Compared with
    before the test: a session-wide fixture, such as the browser tests' JupyterLab server, may
    have children of this process running.)"""
    accelnb.notebook_launcher(float, (0,), num_processes=1, quiet=True)  # the shared helper's fds exist
    processes, fds = {p.pid for p in children_but_the_shared_helper()}, open_fds()
    yield None
    assert [p for p in children_but_the_shared_helper() if p.pid not in processes] == []
    # New fds of the kinds a launch opens; others come and go with this process's other work
    # (an IPython shell of an earlier test closing its history database).
    assert [fd for fd in open_fds() - fds if re.search(r"-> (socket|pipe|anon_inode|/memfd):", fd)] == []


@pytest.fixture
def small_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost model sees this test process as a 300 MiB kernel, so a 256 MiB argument is handed
    down by fork however much memory earlier tests left here (the rule has tests of its own; the
    real-kernel tests below use the real size)."""
    monkeypatch.setattr(payload_delivery, "kernel_resident_bytes", lambda: 300 * MIB)


# ── tests ───────────────────────────────────────────────────────────────────────────────────
def test_the_rule_forks_for_payloads_big_in_themselves_and_against_the_kernel() -> None:
    kernel = 300 * MIB  # torch imported, little else
    assert not inherit_worth_it(16 * MIB, kernel, ranks=2)
    assert inherit_worth_it(64 * MIB, kernel, ranks=2)
    # (measured: 64 MiB into a 2-rank launch from a kernel of 2.3 GiB, fork 193 ms, memfd 54 ms)
    assert not inherit_worth_it(64 * MIB, 2300 * MIB, ranks=2)
    assert inherit_worth_it(1 << 30, 4 << 30, ranks=2)
    assert not inherit_worth_it(1 << 30, 4 << 30, ranks=8)  # eight more copies of the page tables


def test_a_stand_in_resolves_only_while_its_launch_holds_the_payload() -> None:
    packed = dump(torch.arange(4.0))
    with inherited(packed) as stand_in:
        message = pickle.dumps(stand_in, protocol=5)
        assert len(message) < 100 and pickle.loads(message) is packed  # a token, not the bytes
    with pytest.raises(RuntimeError, match="was not forked from the kernel while the launch ran"):
        pickle.loads(message)


@pytest.mark.usefixtures("nothing_left", "small_kernel")
def test_a_big_argument_is_inherited_by_every_rank_and_the_launch_helper_ends_with_the_launch() -> None:
    x = torch.arange(BIG // 4, dtype=torch.float32)
    values = accelnb.launch(where_it_lives, (x,), num_processes=2, quiet=True).values

    assert [v[:2] for v in values.values()] == [("anonymous", float(x[-1]))] * 2  # not a memfd: inherited
    helper = values[0][2]
    assert values[1][2] == helper and helper != running_helper_pid()  # a helper of the launch's own
    assert not psutil.pid_exists(helper)  # ended and reaped with the launch


@pytest.mark.usefixtures("nothing_left")
@pytest.mark.parametrize("why", ["small", "spawn asked for", "CUDA initialised"])
def test_shared_memory_where_a_fork_does_not_pay_or_is_not_safe(why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 16 * MIB if why == "small" else BIG
    if why == "spawn asked for":
        monkeypatch.setenv("ACCELNB_HELPER_START", "spawn")
    if why == "CUDA initialised":
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    x = torch.ones(size // 4)
    values = accelnb.launch(where_it_lives, (x,), num_processes=2, quiet=True).values

    assert [v[:2] for v in values.values()] == [("/memfd:accelnb (deleted)", 1.0)] * 2
    assert {v[2] for v in values.values()} == {running_helper_pid()}


def matmul_with_two_threads(x: torch.Tensor) -> tuple[float, int]:
    torch.set_num_threads(2)
    b = torch.ones(1000, 1000)
    return (b @ b)[0, 0].item() + float(x[0]), torch.get_num_threads()


@pytest.mark.usefixtures("nothing_left", "small_kernel")
def test_ranks_forked_after_the_kernel_ran_a_parallel_op_can_use_threads() -> None:
    """The kernel's OpenMP pool is ended before the fork (``kernel/helper/openmp_pool.py``); without that
    this rank's matmul waited forever for threads its fork did not copy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(1000, 1000)
        assert (a @ a).abs().sum().item() > 0  # this thread now has a pool of OpenMP threads
        values = accelnb.launch(matmul_with_two_threads, (torch.zeros(BIG // 4),), num_processes=1,
                                quiet=True, timeout=60).values
        assert values == {0: (1000.0, 2)}
        assert (a @ a).abs().sum().item() > 0  # and the kernel starts a new pool for its next op
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("nothing_left", "small_kernel")
def test_a_rank_writing_into_an_inherited_argument_changes_nothing_for_the_others() -> None:
    x = torch.zeros(BIG // 4)
    values = accelnb.launch(write_on_rank_0_then_look, (x,), num_processes=2, quiet=True).values

    assert values == {0: (7.0, 7.0), 1: (0.0, 0.0)}
    assert float(x.abs().sum()) == 0.0  # nor for the kernel


@pytest.mark.usefixtures("nothing_left", "small_kernel")
def test_a_launch_helper_killed_mid_run_is_forked_again_for_the_next_attempt() -> None:
    x = torch.full((BIG // 4,), 3.0)
    result = accelnb.launch(kill_the_helper_on_attempt_0, (x,), num_processes=2, quiet=True, max_restarts=1)

    assert [a.ending for a in result.attempts] == ["failed", "succeeded"]  # the helper died: no rank failed
    assert [v[:2] for v in result.values.values()] == [("anonymous", 3.0)] * 2  # still inherited


@pytest.mark.usefixtures("nothing_left", "small_kernel")
def test_nothing_is_left_after_a_failure_with_an_inherited_argument() -> None:
    with pytest.raises(RankFailed, match="boom with"):
        accelnb.launch(fail_on_rank_1, (torch.ones(BIG // 4),), num_processes=2, quiet=True)


@pytest.mark.usefixtures("nothing_left", "small_kernel")
def test_nothing_is_left_after_an_interrupt_with_an_inherited_argument() -> None:
    remove_hook = accelnb.kernel.run.run_state.add_wait_hook(InterruptWhenRunning())
    try:
        with pytest.raises(KeyboardInterrupt):
            accelnb.launch(block_forever, (torch.ones(BIG // 4),), num_processes=2, quiet=True)
    finally:
        remove_hook()


def test_in_a_kernel_the_notebook_tensor_is_inherited_and_no_process_stays() -> None:
    cells = ["import os, psutil, torch, accelnb\n"
             f"from tests.test_payload_delivery import where_it_lives\nX = torch.arange({BIG // 4}, dtype=torch.int32)",
             "values = accelnb.launch(where_it_lives, (X,), num_processes=2, quiet=True).values\n"
             "[v[:2] for v in values.values()], psutil.pid_exists(values[0][2])",
             "%load_ext accelnb",
             "%%distributed --procs 2\nfrom tests.test_payload_delivery import where_it_lives\n"
             "where_it_lives(X)[:2]",
             "from accelnb.kernel.helper.client import running_helper_pid\n"
             "[c.cmdline() for c in psutil.Process().children() if c.pid != running_helper_pid()]"]
    outputs = run_notebook(cells, timeout=300)

    last = float(BIG // 4 - 1)
    assert result_of(outputs[1]) == f"([('anonymous', {last}), ('anonymous', {last})], False)", outputs[1]
    assert result_of(outputs[3]) == f"('anonymous', {last})", outputs[3]
    # No launch's helper is left: the kernel's only child is its shared helper (%load_ext starts it).
    assert result_of(outputs[4]) == "[]", outputs[4]


def test_the_kernel_killed_mid_launch_takes_the_launch_helper_and_its_ranks_with_it(tmp_path: Path) -> None:
    manager, client = start_repo_kernel(ACCELNB_SYNTHETIC_GPUS=None)
    try:
        client.execute("import torch, accelnb\nfrom tests.test_payload_delivery import say_where_then_block\n"
                       f"accelnb.launch(say_where_then_block, (torch.ones({BIG // 4}), {str(tmp_path)!r}), "
                       "num_processes=2, quiet=True)")
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("[0-9]*"))) < 2:  # both ranks hold the inherited tensor
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        pids = {int(n) for path in tmp_path.glob("[0-9]*") for n in path.read_text().split()}
        helper = psutil.Process(next(iter(pids - {int(p.name) for p in tmp_path.glob("[0-9]*")})))
        kernel = psutil.Process(helper.ppid())
        processes = [psutil.Process(pid) for pid in pids]
        kernel.kill()
        deadline = time.monotonic() + 10
        while alive := [p for p in processes if running(p)]:  # zombies count as gone
            assert time.monotonic() < deadline, f"still running 10 s after the kernel was killed: {alive}"
            time.sleep(0.01)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
