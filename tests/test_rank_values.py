"""What a rank sends back to the kernel: return values, exceptions, and a failed start.

- Exceptions travel like return values, through the kernel-safe pickler: a tensor on another
  device comes back on the CPU (a lazy tensor here, a real non-CPU device that needs no GPU;
  CUDA itself in the ``gpu`` test, where the kernel must not initialise CUDA).
- A value or an exception that cannot be pickled gives a clear error that names the rank, the
  type and the fix, never pickle's frames; an unpicklable exception keeps its type.
- The traceback the user sees holds their frames only, none of accelnb's.
- A worker whose set-up fails says why, instead of exiting with a bare code.

Real launches: 2 CPU ranks, gloo, accelnb's helper process and its workers.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import accelnb
from accelnb.kernel.helper.template import shared_helper
from accelnb.wire.channel import MessageReader
from accelnb.wire.events import CallError
from accelnb.wire.result_pickling import loads_in_kernel
from accelnb.wire.spec import RankFds, WorkerSpec, split_fds
from tests.gpu.gpukit import needs_gpus

pytestmark = pytest.mark.usefixtures("no_leftovers")

PACKAGE_DIR = os.path.dirname(os.path.abspath(accelnb.__file__)) + os.sep
PIPE_WAIT_S = 60.0


def lazy_ones() -> Any:
    """A tensor on the "lazy" device: not the CPU, and no GPU needed."""
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    return torch.ones(2, device="lazy")


# ── non-CPU tensors ─────────────────────────────────────────────────────────────────────────────
def rank_1_raises_with_a_lazy_tensor() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad batch", lazy_ones())


def test_an_exception_holding_a_non_cpu_tensor_comes_back_with_it_on_the_cpu() -> None:
    with pytest.raises(ValueError, match="Rank 1 failed: ValueError") as raised:
        accelnb.launch(rank_1_raises_with_a_lazy_tensor, num_processes=2, cpu=True, quiet=True)
    failure = raised.value.root_cause  # type: ignore[attr-defined]
    original = loads_in_kernel(failure.exception)
    assert type(original) is ValueError and original.args[0] == "bad batch"
    assert original.args[1].device.type == "cpu" and original.args[1].tolist() == [1.0, 1.0]


def test_a_non_cpu_tensor_returned_comes_back_on_the_cpu() -> None:
    values = accelnb.launch(lazy_ones, num_processes=2, cpu=True, quiet=True).values
    assert [values[rank].device.type for rank in (0, 1)] == ["cpu", "cpu"]


KERNEL_STAYS_CUDA_FREE = textwrap.dedent("""
    import torch, accelnb

    def raise_with_a_cuda_tensor():
        raise ValueError("bad batch", torch.ones(1, device="cuda"))

    try:
        accelnb.launch(raise_with_a_cuda_tensor, quiet=True)
    except ValueError as error:  # the kernel rebuilt the ValueError: it unpickled it
        assert "Rank 0 failed: ValueError" in str(error), error
    else:
        raise AssertionError("the launch did not raise")
    print("cuda initialised in the kernel:", torch.cuda.is_initialized())
""")


@pytest.mark.gpu
@needs_gpus(1)
def test_an_exception_holding_a_cuda_tensor_does_not_initialise_cuda_in_the_kernel() -> None:
    # A fresh process plays the kernel: this one may have initialised CUDA in another test.
    done = subprocess.run([sys.executable, "-c", KERNEL_STAYS_CUDA_FREE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cuda initialised in the kernel: False" in done.stdout, done.stdout + done.stderr


# ── what cannot be pickled ──────────────────────────────────────────────────────────────────────
def a_lambda_over_a_lock() -> Any:
    lock = threading.Lock()
    return lambda: lock


def a_generator() -> Any:
    return (step for step in range(3))


def an_open_socket() -> Any:
    return socket.socket()


def a_lock() -> Any:
    return threading.Lock()


UNPICKLABLE = {"function": a_lambda_over_a_lock, "generator": a_generator, "socket.socket": an_open_socket,
               "_thread.lock": a_lock}


def rank_1_returns(make: Callable[[], Any]) -> Any:
    import torch.distributed as dist

    return make() if dist.get_rank() == 1 else 0


def assert_no_machinery_frames(message: str) -> None:
    assert PACKAGE_DIR not in message, f"accelnb's frames in what the user sees:\n{message}"
    assert "cloudpickle" not in message and "pickle.py" not in message, f"pickle's frames:\n{message}"


@pytest.mark.parametrize("type_name", list(UNPICKLABLE))
def test_an_unpicklable_return_value_names_the_rank_its_type_and_the_fix(type_name: str) -> None:
    with pytest.raises(TypeError) as raised:
        accelnb.launch(rank_1_returns, (UNPICKLABLE[type_name],), num_processes=2, cpu=True, quiet=True)
    message = str(raised.value)
    assert isinstance(raised.value, accelnb.RankFailed)
    assert message.startswith(f"Rank 1 failed: TypeError: the function returned a {type_name} on rank 1"), message
    assert "Return data that pickles instead" in message, message
    assert_no_machinery_frames(message)


class NeedsTwoArguments(Exception):
    """Pickles, but cannot be rebuilt: unpickling calls ``NeedsTwoArguments(message)``."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__(f"{first} and {second}")


class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def raise_on_rank_1(kind: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() != 1:
        return
    if kind == "lock_argument":
        raise ValueError("bad input", threading.Lock())
    if kind == "needs_two":
        raise NeedsTwoArguments("this", "that")
    raise BrokenStr()


@pytest.mark.parametrize(("kind", "expected", "first_line"), [
    pytest.param("lock_argument", ValueError,
                 "Rank 1 failed: ValueError: ('bad input', <unlocked _thread.lock object", id="lock-argument"),
    pytest.param("needs_two", NeedsTwoArguments,
                 "Rank 1 failed: test_rank_values.NeedsTwoArguments: this and that", id="cannot-be-rebuilt"),
    pytest.param("broken_str", BrokenStr,
                 "Rank 1 failed: test_rank_values.BrokenStr: <str() of the exception raised", id="broken-str"),
])
def test_an_exception_that_cannot_travel_keeps_its_type_message_and_traceback(
        kind: str, expected: type[Exception], first_line: str) -> None:
    with pytest.raises(expected) as raised:
        accelnb.launch(raise_on_rank_1, (kind,), num_processes=2, cpu=True, quiet=True)
    message = str(raised.value)
    assert message.startswith(first_line), message
    assert "in raise_on_rank_1" in message, message  # the user's own frame
    assert_no_machinery_frames(message)


# ── frames ──────────────────────────────────────────────────────────────────────────────────────
def report_a_bad_metric_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        try:
            accelnb.report(loss="not a number")  # raises inside accelnb.worker.report
        except TypeError as error:
            raise RuntimeError("logging failed") from error


def test_the_traceback_shows_the_users_frames_and_none_of_accelnbs() -> None:
    with pytest.raises(RuntimeError, match="Rank 1 failed: RuntimeError: logging failed") as raised:
        accelnb.launch(report_a_bad_metric_on_rank_1, num_processes=2, cpu=True, quiet=True)
    message = str(raised.value)
    assert "accelnb.report: metric 'loss' must be a number" in message  # the cause, chained
    assert message.count("in report_a_bad_metric_on_rank_1") == 2, message  # once per exception
    assert_no_machinery_frames(message)


# ── a failed start ─────────────────────────────────────────────────────────────────────────────
def test_a_worker_whose_set_up_fails_reports_the_cause() -> None:
    """An environment the OS refuses (a NUL byte) makes the worker's set-up fail before it joins
    the group: the kernel gets the exception, not a bare exit code."""
    spec = WorkerSpec(rank=0, local_rank=0, world_size=1, device="cpu", backend="gloo",
                      env={"ACCELNB_TEST_BROKEN": "nul\0byte"}, master_addr="127.0.0.1", master_port=1,
                      cwd=os.getcwd(), sys_path=list(sys.path))
    # stdout, stderr (pipes), events, inbox, control (stream sockets, as the supervisor wires them)
    pipes = [os.pipe(), os.pipe(), *(tuple(s.detach() for s in socket.socketpair()) for _ in range(3))]
    ours = [pipes[0][0], pipes[1][0], pipes[2][0], pipes[3][1], pipes[4][1]]
    theirs = [pipes[0][1], pipes[1][1], pipes[2][1], pipes[3][0], pipes[4][0]]
    try:
        try:
            shared_helper().spawn([spec], [RankFds(*theirs)])
        finally:
            for fd in theirs:  # the worker holds its own copies now
                os.close(fd)
        events = MessageReader().feed(read_to_end(pipes[2][0]))
    finally:
        for fd in ours:
            os.close(fd)

    assert len(events) == 1 and isinstance(events[0], CallError), events
    error = events[0]
    assert (error.rank, error.call_id, error.type_name) == (0, None, "ValueError"), error
    assert "embedded null byte" in error.message
    assert_no_machinery_frames(error.traceback)


def test_the_fds_of_a_spawn_come_back_by_name_from_the_flat_list_that_crosses_the_socket() -> None:
    def spec(rank: int, holds_store: bool) -> WorkerSpec:
        return WorkerSpec(rank=rank, local_rank=rank, world_size=2, device="cpu", backend="gloo", env={},
                          master_addr="127.0.0.1", master_port=1, cwd="/", sys_path=[], holds_store=holds_store)

    specs = [spec(0, True), spec(1, False)]
    sent = [RankFds(10, 11, 12, 13, 14, store=15), RankFds(20, 21, 22, 23, 24)]
    assert split_fds([fd for each in sent for fd in each.flat()], specs) == sent
    with pytest.raises(ValueError, match="10 fds for 2 ranks, which take 11"):
        split_fds([10, 11, 12, 13, 14, 20, 21, 22, 23, 24], specs)  # rank 0's store missing


def read_to_end(fd: int) -> bytes:
    """Everything written to the pipe until its last writer (the worker) is gone."""
    chunks = []
    deadline = time.monotonic() + PIPE_WAIT_S
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0 and select.select([fd], [], [], remaining)[0], "the worker never ended"
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def open_a_missing_file() -> None:
    open("/nonexistent/accelnb/checkpoint-7/trainer_state.json")  # noqa: SIM115 - it raises


@pytest.mark.usefixtures("no_leftovers")
def test_an_oserror_in_a_rank_is_a_rank_failed_naming_it() -> None:
    # OSError's family combines with RankFailed but cannot be made through it: the launch once
    # raised a TypeError from accelnb's errors module instead of the rank's FileNotFoundError.
    with pytest.raises(accelnb.RankFailed) as failed:
        accelnb.launch(open_a_missing_file, num_processes=2, cpu=True, quiet=True)
    assert "FileNotFoundError" in str(failed.value) and "checkpoint-7" in str(failed.value)
    assert failed.value.root_cause is not None and failed.value.root_cause.rank in (0, 1)
