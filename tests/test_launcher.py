"""The core engine with real worker processes and real torch.distributed (gloo, 2 CPU ranks)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from accelnb import (
    LaunchTimeout,
    PortInUseError,
    RankCrashed,
    RankFailed,
    UnpicklableError,
    last_result,
    launch,
    notebook_launcher,
    synthetic_inventory,
)
from accelnb.errors import LaunchConfigError
from accelnb.kernel.run import run_state
from accelnb.kernel.run.supervisor import FAILURE_GRACE_S
from tests.conftest import wait_until_no_workers, worker_processes
from tests.gpu.gpukit import needs_gpus

pytestmark = pytest.mark.usefixtures("no_leftovers")


def all_reduce_rank_plus_one() -> float:
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def test_all_reduce_and_every_ranks_return_value() -> None:
    result = launch(all_reduce_rank_plus_one, num_processes=2, cpu=True, quiet=True)
    assert result.values == {0: 3.0, 1: 3.0}
    assert notebook_launcher(all_reduce_rank_plus_one, num_processes=2, cpu=True, quiet=True) == 3.0


def test_workers_get_the_planned_environment_and_device_mapping() -> None:
    def environment() -> dict[str, str]:
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES")
        return {k: os.environ[k] for k in keys}

    result = launch(environment, gpus="3,5", inventory=synthetic_inventory(8), quiet=True)
    port = str(result.plan.master_port)
    for rank in (0, 1):
        assert result.values[rank] == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": "3,5"}


def test_closures_lambdas_and_local_classes_travel() -> None:
    offset = 10

    class Box:
        def __init__(self, value: int) -> None:
            self.value = value

    def make_box(scale: int) -> Box:
        import torch.distributed as dist

        return Box(dist.get_rank() * scale + offset)

    boxes = launch(make_box, args=(100,), num_processes=2, cpu=True, quiet=True).values
    assert (boxes[0].value, boxes[1].value) == (10, 110)
    assert notebook_launcher(lambda: "λ", num_processes=2, cpu=True, quiet=True) == "λ"


def test_a_rank_that_returns_first_stays_until_every_rank_answered() -> None:
    # init_process_group does not wait for the last rank to finish connecting; rank 0 serves the
    # store, so it must not leave while a peer still needs it (here, on purpose, after a delay).
    def handoff() -> str:
        import time

        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            store.set("greeting", "hi")
            return "set"
        time.sleep(0.5)
        return bytes(store.get("greeting")).decode()

    assert launch(handoff, num_processes=2, cpu=True, quiet=True).values == {0: "set", 1: "hi"}


def test_tensors_and_modules_come_back_on_the_cpu() -> None:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(3, 2)

    module = notebook_launcher(build, num_processes=2, cpu=True, quiet=True)
    assert isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu"
    assert isinstance(module.weight, torch.nn.Parameter)


def test_an_unpicklable_argument_is_named_before_anything_starts() -> None:
    helper_children_before = len(worker_processes())
    with pytest.raises(UnpicklableError, match=r"Argument 1 \(args\[1\]\) of type _thread.lock"):
        launch(print, args=(1, threading.Lock()), num_processes=2, cpu=True, quiet=True)
    with pytest.raises(UnpicklableError, match=r"Keyword argument 'lock'"):
        launch(print, kwargs={"lock": threading.Lock()}, num_processes=2, cpu=True, quiet=True)
    assert len(worker_processes()) == helper_children_before == 0


def test_a_global_the_function_uses_that_cannot_pickle_is_named() -> None:
    lock = threading.Lock()

    def uses_lock() -> bool:
        return lock.locked()

    with pytest.raises(UnpicklableError, match="The name 'lock', which uses_lock uses"):
        launch(uses_lock, num_processes=2, cpu=True, quiet=True)


def test_bad_input_is_refused_before_start() -> None:
    with pytest.raises(LaunchConfigError, match="must be callable"):
        launch(42, num_processes=2, cpu=True)  # type: ignore[arg-type]
    with pytest.raises(LaunchConfigError, match="timeout must be a positive"):
        launch(print, num_processes=2, cpu=True, timeout=0)
    with pytest.raises(LaunchConfigError, match="output='everything' must be"):
        launch(print, num_processes=2, cpu=True, output="everything")  # type: ignore[arg-type]


def test_a_taken_master_port_is_a_clear_error_not_a_hang() -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    try:
        with pytest.raises(PortInUseError, match=f"master_port={port} is already in use"):
            launch(print, num_processes=2, cpu=True, master_port=port, quiet=True)
    finally:
        squatter.close()
    assert launch(all_reduce_rank_plus_one, num_processes=2, cpu=True, master_port=port, quiet=True).values[0] == 3.0


def fail_on_rank_1() -> None:
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} was here")  # still in its buffer when the stop comes
    dist.barrier()
    if dist.get_rank() == 1:
        raise KeyError("missing-key-on-rank-1")
    dist.barrier()


def test_an_exception_on_rank_1_keeps_its_type_and_traceback_and_stops_everyone() -> None:
    failed_at: list[float] = []

    def watch(run: run_state.RunState | None) -> None:
        if not failed_at and run is not None and run.ranks[1].phase == "failed":
            failed_at.append(time.monotonic())

    unsubscribe = run_state.on_run_change(watch)
    try:
        with pytest.raises(KeyError) as info:
            launch(fail_on_rank_1, num_processes=2, cpu=True, quiet=True)
    finally:
        unsubscribe()
    # Rank 0, waiting in a barrier, left on accelnb's SIGTERM: no wait for the grace and SIGKILL.
    assert time.monotonic() - failed_at[0] < FAILURE_GRACE_S
    error = info.value
    assert isinstance(error, RankFailed)
    message = str(error)
    assert message.startswith("Rank 1 failed: KeyError: 'missing-key-on-rank-1'")
    assert 'raise KeyError("missing-key-on-rank-1")' in message
    assert "accelnb/worker/" not in message and "accelnb/kernel/" not in message
    assert error.root_cause is not None and error.root_cause.rank == 1
    after = last_result()
    assert after is not None and after.values == {}
    # Rank 0 was SIGTERMed in its barrier: it flushed its output before dying.
    assert after.output(0) == "rank 0 was here\n" and after.output(1).startswith("rank 1 was here\n")
    assert worker_processes() == []


@pytest.mark.parametrize("rank_0_still_busy", [True, False], ids=["rank0-busy", "rank0-returned"])
def test_a_functions_own_sigterm_handler_runs_when_accelnb_stops_its_rank(
        rank_0_still_busy: bool, tmp_path: Path) -> None:
    rank_0_answered = tmp_path / "rank-0-answered"

    def save_on_sigterm_then_fail_on_rank_1() -> None:  # defined here: shipped by value, no import
        import os
        import signal
        import sys
        import time

        import torch.distributed as dist

        def save_checkpoint(signum: int, frame: object) -> None:
            print(f"rank {dist.get_rank()} saved a checkpoint on signal {signum}")
            sys.exit(0)

        signal.signal(signal.SIGTERM, save_checkpoint)  # the usual pre-emption handler
        store = dist.distributed_c10d._get_default_store()
        dist.barrier()
        if dist.get_rank() == 1:
            if rank_0_still_busy:
                store.wait(["rank 0 is in its loop"])
            else:
                while not os.path.exists(rank_0_answered):  # the kernel marks it once rank 0 answered
                    time.sleep(0.005)
            raise KeyError("missing-key-on-rank-1")
        while rank_0_still_busy:  # a training loop: Python runs between steps
            store.set("rank 0 is in its loop", "yes")
            time.sleep(0.01)

    failed_at: list[float] = []

    def watch(run: run_state.RunState | None) -> None:
        phases = {state.rank: state.phase for state in run.ranks} if run is not None else {}
        if phases.get(0) == "done":
            rank_0_answered.touch()
        if phases.get(1) == "failed" and not failed_at:
            failed_at.append(time.monotonic())

    launch(lambda: None, num_processes=2, cpu=True, quiet=True)  # warm: what is timed below is this run
    unsubscribe = run_state.on_run_change(watch)
    try:
        with pytest.raises(KeyError, match="Rank 1 failed"):
            launch(save_on_sigterm_then_fail_on_rank_1, num_processes=2, cpu=True, quiet=True)
    finally:
        unsubscribe()
    raised_at = time.monotonic()
    after = last_result()
    assert after is not None
    assert after.output(0) == f"rank 0 saved a checkpoint on signal {int(signal.SIGTERM)}\n"
    # It left on its own after accelnb's SIGTERM, well before the grace ran out and SIGKILL came.
    assert raised_at - failed_at[0] < FAILURE_GRACE_S
    assert wait_until_no_workers(5.0) < 5.0


def test_a_sigterm_that_comes_in_the_middle_of_a_write_lets_the_write_finish_before_the_rank_dies() -> None:
    # Python runs a signal handler in the main thread, wherever it is: here inside a long write to
    # stdout, holding the lock that the flush on SIGTERM needs. A handler that waited there for
    # that flush waited for itself: the rank died a second later with the write cut short (the
    # same with a batch of report()s being sent: a failed attempt lost its last steps).
    def write_then_wait_for_the_end() -> None:
        import signal
        import sys
        import threading

        main = threading.main_thread()
        main_task = threading.get_native_id()  # (a forked rank's main_thread().native_id is the template's)
        block = "".join(f"line {i:06d} " + "x" * 80 + "\n" for i in range(30_000)) + "the last line\n"  # 2.7 MB

        def write_the_block() -> None:  # 40 pipe-fulls: the write blocks while the kernel reads
            sys.stdout.write(block)

        def sigterm_in_the_write() -> None:
            # Only once the main thread is blocked in write(1, ...) (Linux shows a thread's system
            # call and its arguments in /proc): its frame alone (once tried) also matched the
            # moments before the write began, where the SIGTERM came first and the rank rightly
            # died with the block unwritten (once in ~150 runs). A busy machine may not run this
            # thread while a block is being written (once in a fresh-clone run): the main thread
            # then writes the block again, and stops only once this thread is about to send.
            blocked_in_the_write = f"1 {hex(1)} "
            while True:
                with open(f"/proc/self/task/{main_task}/syscall") as syscall:
                    if syscall.read().startswith(blocked_in_the_write):
                        sending.set()  # first: no block may start after the signal
                        signal.pthread_kill(main.ident, signal.SIGTERM)  # type: ignore[arg-type]
                        return

        sending = threading.Event()
        threading.Thread(target=sigterm_in_the_write, daemon=True).start()
        while not sending.is_set():
            write_the_block()
        threading.Event().wait()  # the rank ends of the SIGTERM, after flushing

    with pytest.raises(RankCrashed, match="killed by SIGTERM"):
        # timeout=: were the rank ever left alive (once in a fresh-clone run, never since), the
        # test fails with the rank's stacks rather than hanging until pytest's timeout.
        launch(write_then_wait_for_the_end, num_processes=1, cpu=True, quiet=True, timeout=120)
    after = last_result()
    assert after is not None
    block = "".join(f"line {i:06d} " + "x" * 80 + "\n" for i in range(30_000)) + "the last line\n"
    assert after.output(0).endswith("the last line\n"), after.output(0)[-200:]
    assert after.output(0).endswith(block)  # the block the SIGTERM came in, whole (output keeps the last MBs)


def test_a_segfault_is_reported_with_the_signal_name() -> None:
    def crash() -> None:
        import ctypes

        import torch.distributed as dist

        if dist.get_rank() == 1:
            ctypes.string_at(0)
        dist.barrier()

    with pytest.raises(RankCrashed, match="Rank 1 failed: killed by SIGSEGV") as info:
        launch(crash, num_processes=2, cpu=True, quiet=True)
    assert "in crash" in str(info.value)  # faulthandler's Python stack of the crash


def test_os_exit_is_reported_with_its_code() -> None:
    def leave() -> None:
        os._exit(3)

    with pytest.raises(RankCrashed, match="exited with code 3"):
        launch(leave, num_processes=2, cpu=True, quiet=True)


def fails_while_rank_0_waits_in_a_collective() -> None:
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    # Rank 0 outlives the SIGTERM that ends rank 1 (its own is ignored: only the SIGKILL after the
    # grace ends it), so its barrier sees rank 1 go, and raises gloo's "Connection closed by peer".
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.barrier()


def test_a_rank_whose_collective_lost_a_peer_to_the_stop_was_stopped_and_did_not_fail() -> None:
    with pytest.raises(RankFailed) as info:
        launch(fails_while_rank_0_waits_in_a_collective, num_processes=2, cpu=True, quiet=True)
    message = str(info.value)
    assert message.startswith("Rank 1 failed: ValueError: rank 1 fails"), message
    assert "Stopped by accelnb after the failure: rank 0." in message, message
    assert "Also rank 0" not in message and "Connection closed by peer" not in message, message
    assert [failure.rank for failure in info.value.failures] == [1]  # rank 0's echo is no failure
    wait_until_no_workers(5.0)


def test_timeout_shows_every_ranks_stack_then_stops_all() -> None:
    def hang_in_collective() -> None:
        import time

        import torch.distributed as dist

        if dist.get_rank() == 0:
            time.sleep(60)
        dist.barrier()

    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(hang_in_collective, num_processes=2, cpu=True, timeout=2, quiet=True)
    message = str(info.value)
    assert "── rank 0 ──" in message and "── rank 1 ──" in message
    assert "in hang_in_collective" in message and "in barrier" in message
    assert "accelnb/worker/" not in message
    # accelnb's own threads (the watcher, the output flusher) are left out entirely.
    assert message.count("(most recent call first)") == 2, message  # each rank's main thread only
    # timeout=2, then the stacks and the stop ladder: well under the 60 s the rank sleeps, even on a loaded machine.
    assert time.monotonic() - started < 2 + 20
    wait_until_no_workers(5.0)


def test_interrupt_stops_every_worker_at_once() -> None:
    def sleep_long() -> None:
        time.sleep(60)

    launch(all_reduce_rank_plus_one, num_processes=2, cpu=True, quiet=True)  # helper already warm
    interrupted_at: list[float] = []

    def ctrl_c_once_every_rank_runs() -> None:  # a display's wait hook: runs inside the wait for answers
        run = run_state.current_run()
        if not interrupted_at and run is not None and all(r.phase == "running" for r in run.ranks):
            interrupted_at.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)  # what the kernel's stop button sends

    remove_hook = run_state.add_wait_hook(ctrl_c_once_every_rank_runs)
    try:
        with pytest.raises(KeyboardInterrupt, match="accelnb stopped the run: every worker was ended"):
            launch(sleep_long, num_processes=2, cpu=True, quiet=True)
    finally:
        remove_hook()
    # At once (benchmarks/bench_stop.py measures it); the bound tells it from the 60 s sleep and the
    # 120 s stop grace, and holds on a loaded machine.
    assert time.monotonic() - interrupted_at[0] < 20
    assert worker_processes() == []  # gone when the interrupt reached the caller
    assert launch(all_reduce_rank_plus_one, num_processes=2, cpu=True, quiet=True).values[0] == 3.0


def test_rank0_output_is_streamed_other_ranks_kept(capfd: pytest.CaptureFixture[str]) -> None:
    def talk() -> None:
        import torch.distributed as dist

        rank = dist.get_rank()
        print(f"python print from rank {rank}")
        os.write(1, f"fd-level write from rank {rank}\n".encode())
        os.system(f"echo child process output from rank {rank}")  # a C-level child writes to fd 1

    result = launch(talk, num_processes=2, cpu=True, quiet=True)
    shown = capfd.readouterr().out
    for line in ("python print from rank 0", "fd-level write from rank 0", "child process output from rank 0"):
        assert line in shown
    assert "rank 1" not in shown
    assert "child process output from rank 1" in result.output(1)


def test_output_all_prefixes_every_rank(capfd: pytest.CaptureFixture[str]) -> None:
    launch(lambda: print("hello"), num_processes=2, cpu=True, quiet=True, output="all")
    shown = capfd.readouterr().out
    assert "[rank 0] hello" in shown and "[rank 1] hello" in shown


def test_a_flood_is_thinned_in_the_cell_and_kept_whole_in_last_result(capfd: pytest.CaptureFixture[str]) -> None:
    def flood() -> str:
        for i in range(200_000):
            print(f"line {i}")
        return "done"

    assert notebook_launcher(flood, num_processes=2, cpu=True, quiet=True) == "done"
    shown = capfd.readouterr().out
    assert "accelnb.last_result().output(0) has every line]" in shown
    assert shown.count("\n") < 100_000 and shown.endswith("line 199999\n")
    result = last_result()
    assert result is not None and result.value == "done"
    assert result.output(0).count("\n") == 200_000 and result.output(0).startswith("line 0\n")


def test_tqdm_progress_collapses_to_its_latest_state(capfd: pytest.CaptureFixture[str]) -> None:
    def progress() -> None:
        import sys

        from tqdm import tqdm

        for _ in tqdm(range(2000), file=sys.stdout, mininterval=0, miniters=1):
            pass

    launch(progress, num_processes=2, cpu=True, quiet=True)
    shown = capfd.readouterr().out
    assert "2000/2000" in shown
    assert shown.count("\r") < 200  # 2000 updates arrive as a handful of redraws


def test_accelerator_inside_the_function_sees_the_distributed_setup() -> None:
    def accelerator_view() -> tuple[str, int, int, str]:
        from accelerate import Accelerator

        accelerator = Accelerator()
        return (str(accelerator.distributed_type), accelerator.num_processes,
                accelerator.process_index, accelerator.mixed_precision)

    values = launch(accelerator_view, num_processes=2, cpu=True, quiet=True, mixed_precision="bf16").values
    assert values == {0: ("DistributedType.MULTI_CPU", 2, 0, "bf16"),
                      1: ("DistributedType.MULTI_CPU", 2, 1, "bf16")}


def _listening_ports() -> set[int]:
    """Local ports in LISTEN state (``0A``) on IPv4, read from /proc/net/tcp."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return {int(row[1].split(":")[1], 16) for row in rows if row[3] == "0A"}


def test_the_rendezvous_port_is_released_and_a_fixed_port_can_be_reused_at_once() -> None:
    first = launch(all_reduce_rank_plus_one, num_processes=2, cpu=True, quiet=True)
    port = first.plan.master_port
    assert port not in _listening_ports()
    # Closed connections leave the port in TIME_WAIT for a minute; rerunning a cell with a fixed
    # master_port must still work straight away (the classic "Address already in use").
    again = launch(all_reduce_rank_plus_one, num_processes=2, cpu=True, quiet=True, master_port=port)
    assert again.values == first.values
    assert port not in _listening_ports()


@pytest.mark.gpu
@needs_gpus(1)
def test_cuda_initialised_in_the_kernel_does_not_break_launches() -> None:
    torch.zeros(1).cuda()  # what breaks every fork-the-kernel launcher

    def where() -> tuple[str, int]:
        return str(torch.zeros(1).cuda().device), torch.cuda.device_count()

    assert notebook_launcher(where, gpus="0", quiet=True) == ("cuda:0", 1)


def environment_variable(name: str) -> str | None:
    return os.environ.get(name)


def test_the_ranks_see_the_notebooks_environment_as_it_is_at_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cell sets os.environ["WANDB_MODE"] or NCCL_DEBUG, then launches: torchrun and mp.spawn pass
    # the environment as it is then, so must accelnb, whose helper started before the cell ran.
    launch(int, num_processes=2, cpu=True, quiet=True)  # the helper is up
    monkeypatch.setenv("ACCELNB_TEST_SET_LATER", "after-the-helper")
    assert launch(environment_variable, args=("ACCELNB_TEST_SET_LATER",), num_processes=2, cpu=True,
                  quiet=True).values == {0: "after-the-helper", 1: "after-the-helper"}
    monkeypatch.delenv("ACCELNB_TEST_SET_LATER")
    assert launch(environment_variable, args=("ACCELNB_TEST_SET_LATER",), num_processes=2, cpu=True,
                  quiet=True).values == {0: None, 1: None}
