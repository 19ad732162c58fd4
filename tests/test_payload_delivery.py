"""Big arguments of a launch reach every rank through shared memory, from the template (issue 33).

No launch forks the kernel any more, so a big argument is never inherited: the kernel copies its
tensors and arrays once into a memfd that every rank maps (``wire/shared_memory.py``), and what
must be pickled is pickled, said in the cell when it is over 100 MiB. Each test asks the ranks
where their argument's bytes live, from their own ``/proc/self/maps``. Leftovers are checked by
pid and by this process's open fds.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

import accelnb
from accelnb.errors import RankFailed
from accelnb.kernel.helper.payload import BIG_PICKLE_BYTES, pack_call
from accelnb.kernel.helper.template import running_helper_pid, sockets_held_ahead
from tests.conftest import InterruptWhenRunning, live_descendants, result_of, run_notebook, start_repo_kernel
from tests.zmq_contexts import collect_garbage

BIG = 256 << 20  # bytes
MIB = 1 << 20
MEMFD = "/memfd:accelnb (deleted)"


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
    collect_garbage()
    found = set()
    held_ahead = {str(held.fileno()) for held in sockets_held_ahead()}  # for the next launch, on purpose
    for fd in set(os.listdir("/proc/self/fd")) - held_ahead:
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


# ── tests ───────────────────────────────────────────────────────────────────────────────────
@pytest.mark.usefixtures("nothing_left")
def test_a_big_argument_is_mapped_by_every_rank_forked_from_the_template() -> None:
    x = torch.arange(BIG // 4, dtype=torch.float32)
    values = accelnb.launch(where_it_lives, (x,), num_processes=2, cpu=True, quiet=True).values

    assert [v[:2] for v in values.values()] == [(MEMFD, float(x[-1]))] * 2
    assert {v[2] for v in values.values()} == {running_helper_pid()}


@pytest.mark.usefixtures("nothing_left")
def test_a_rank_writing_into_its_argument_changes_nothing_for_the_others() -> None:
    x = torch.zeros(BIG // 4)
    values = accelnb.launch(write_on_rank_0_then_look, (x,), num_processes=2, cpu=True, quiet=True).values

    assert values == {0: (7.0, 7.0), 1: (0.0, 0.0)}
    assert float(x.abs().sum()) == 0.0  # nor for the kernel


@pytest.mark.usefixtures("nothing_left")
def test_nothing_is_left_after_a_failure_with_a_big_argument() -> None:
    with pytest.raises(RankFailed, match="boom with"):
        accelnb.launch(fail_on_rank_1, (torch.ones(BIG // 4),), num_processes=2, cpu=True, quiet=True)


@pytest.mark.usefixtures("nothing_left")
def test_nothing_is_left_after_an_interrupt_with_a_big_argument() -> None:
    remove_hook = accelnb.kernel.run.run_state.add_wait_hook(InterruptWhenRunning())
    try:
        with pytest.raises(KeyboardInterrupt):
            accelnb.launch(block_forever, (torch.ones(BIG // 4),), num_processes=2, cpu=True, quiet=True)
    finally:
        remove_hook()


def test_a_pickle_over_100_mib_is_said_with_its_size_and_the_way_around_it(capsys: pytest.CaptureFixture[str]) -> None:
    pack_call(len, (b"x" * (BIG_PICKLE_BYTES + MIB),), {})
    said = capsys.readouterr().err
    assert "pickle to 101 MiB" in said and "load it inside the function" in said and "Session" in said, said
    pack_call(len, (torch.ones(BIG // 4),), {})  # a tensor is not pickled: nothing to say
    assert capsys.readouterr().err == ""


def test_in_a_kernel_the_notebook_tensor_is_mapped_and_no_process_stays() -> None:
    cells = ["import os, psutil, torch, accelnb\n"
             f"from tests.test_payload_delivery import where_it_lives\nX = torch.arange({BIG // 4}, dtype=torch.int32)",
             "from accelnb.kernel.helper.template import running_helper_pid\n"
             "values = accelnb.launch(where_it_lives, (X,), num_processes=2, cpu=True, quiet=True).values\n"
             f"[v[:2] == ({MEMFD!r}, float(X[-1])) for v in values.values()], "
             "{v[2] for v in values.values()} == {running_helper_pid()}",
             "%load_ext accelnb",
             "%%distributed --procs 2 --cpu\nfrom tests.test_payload_delivery import where_it_lives\n"
             "where_it_lives(X)[:2]",
             "[c.cmdline() for c in psutil.Process().children() if c.pid != running_helper_pid()]"]
    outputs = run_notebook(cells, timeout=300)

    last = float(BIG // 4 - 1)
    assert result_of(outputs[1]) == "([True, True], True)", outputs[1]
    assert result_of(outputs[3]) == f"({MEMFD!r}, {last})", outputs[3]
    # The kernel's only child is its template.
    assert result_of(outputs[4]) == "[]", outputs[4]


def test_the_kernel_killed_mid_launch_takes_the_template_and_its_ranks_with_it(tmp_path: Path) -> None:
    manager, client = start_repo_kernel(ACCELNB_SYNTHETIC_GPUS=None)
    try:
        client.execute("import torch, accelnb\nfrom tests.test_payload_delivery import say_where_then_block\n"
                       f"accelnb.launch(say_where_then_block, (torch.ones({BIG // 4}), {str(tmp_path)!r}), "
                       "num_processes=2, cpu=True, quiet=True)")
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("[0-9]*"))) < 2:  # both ranks hold the tensor
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
