"""What runs inside each worker process, from the fork in the helper to ``os._exit``.

The helper (``worker/helper.py``) forks, points fds 1 and 2 at the kernel's pipes, and calls
:func:`worker_main`. The worker then:

1. takes its rank's environment (RANK, LOCAL_RANK, CUDA_VISIBLE_DEVICES, …), the kernel's cwd and
   ``sys.path``; arms faulthandler (segfault tracebacks, SIGUSR1 stack dumps for timeouts);
2. sets its CUDA device and joins the default process group, rendezvousing through a TCPStore
   whose listening socket the launcher already bound on 127.0.0.1 (rank 0 inherits it, so the
   port cannot be stolen and nothing listens beyond loopback);
3. runs calls from its inbox (one for ``notebook_launcher``, many in a persistent session),
   answering each with a value or the remote traceback;
4. leaves on the kernel's Shutdown (sent once every rank answered), with ``os._exit``: the OS
   closes the group's sockets. End of file on the inbox means the kernel is gone: exit now.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import cloudpickle

from accelnb.wire import channel
from accelnb.wire.events import CallError, CallResult, Joined, RunCall, Shutdown
from accelnb.wire.result_pickling import dumps_for_kernel
from accelnb.wire.spec import WorkerSpec
from accelnb.worker import report

# accelnb/ with a trailing separator: frames under it are ours, whichever subpackage.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
FLUSH_INTERVAL_S = 0.05
STREAM_BUFFER_BYTES = 1 << 16
SIGTERM_FLUSH_LIMIT_S = 1.0


def worker_main(spec: WorkerSpec, inbox_fd: int, events_fd: int, store_fd: int | None) -> int:
    """Run one worker to its end; returns the exit code."""
    try:
        return _serve(spec, inbox_fd, events_fd, store_fd)
    except SystemExit as leaving:  # the function's own SIGTERM handler, run between calls
        _flush_streams_and_metrics()
        return leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)


def _serve(spec: WorkerSpec, inbox_fd: int, events_fd: int, store_fd: int | None) -> int:
    commands: queue.Queue[Any] = queue.Queue()
    # First: threads started from here on inherit its signal mask.
    terminating = _flush_before_dying_of_sigterm(wake=lambda: commands.put(None))
    os.environ.update(spec.env)
    _chdir_quietly(spec.cwd)
    sys.path[:] = spec.sys_path
    _install_streams()
    # Straight to fd 2, which survives a user replacing sys.stderr.
    faulthandler.enable(file=2, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True, chain=False)
    events = channel.MessageWriter(events_fd)
    report.attach(events, spec.rank)
    _start_inbox_reader(inbox_fd, commands)
    flusher = _start_flusher()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, spec.threads_per_rank))
    started = time.perf_counter()
    try:
        _join_process_group(spec, store_fd, torch, dist)
    except BaseException as error:
        events.send(_describe_error(spec.rank, None, error))
        _finish(flusher)
        return 1
    events.send(Joined(spec.rank, os.getpid(), time.perf_counter() - started))

    exit_code = 0
    while True:
        try:
            command = commands.get()
        except KeyboardInterrupt:
            continue  # an interrupt meant for a call that had already finished here
        if command is None or isinstance(command, Shutdown):
            break
        assert isinstance(command, RunCall)
        succeeded = _run_call(spec.rank, command, events)
        if not spec.persistent:
            exit_code = 0 if succeeded else 1
            if succeeded and not terminating.is_set():
                # init_process_group does not wait for the last rank to finish connecting (to
                # rank 0's store, to each gloo pair), so a function without collectives can
                # return here while a peer still needs us. Leave on the kernel's Shutdown, sent
                # once every rank has answered.
                continue
            break
        # A persistent session survives an exception in a cell; the kernel decides whether
        # the group is still usable (every rank answered) or must be torn down.
    # No destroy_process_group(): we leave with os._exit right after, and the OS closes the
    # sockets and frees device memory just the same. gloo's destroy alone spends ~20 ms waiting,
    # a third of a one-shot launch.
    _finish(flusher)
    return exit_code


def _run_call(rank: int, call: RunCall, events: channel.MessageWriter) -> bool:
    """Run one call; True when it returned normally."""
    started = time.perf_counter()
    try:
        fn, args, kwargs = cloudpickle.loads(call.payload)
        value = fn(*args, **kwargs)
        data = dumps_for_kernel(value) if call.want_value else None
    except BaseException as error:
        if isinstance(error, SystemExit) and error.code in (0, None):
            data = None
        else:
            _flush_streams_and_metrics()
            events.send(_describe_error(rank, call.call_id, error))
            return False
    _flush_streams_and_metrics()
    events.send(CallResult(rank, call.call_id, data, time.perf_counter() - started))
    return True


def _join_process_group(spec: WorkerSpec, store_fd: int | None, torch: Any, dist: Any) -> None:
    timeout = timedelta(seconds=spec.join_timeout_s)
    device_id = None
    if spec.device.startswith("cuda"):
        device_id = torch.device(spec.device)
        torch.cuda.set_device(device_id)
    store = dist.TCPStore(
        spec.master_addr,
        spec.master_port,
        spec.world_size,
        is_master=spec.rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=store_fd,
    )
    kwargs: dict[str, Any] = {"store": store, "rank": spec.rank, "world_size": spec.world_size,
                              "timeout": timeout}
    if device_id is not None and spec.backend == "nccl":
        kwargs["device_id"] = device_id
    dist.init_process_group(spec.backend, **kwargs)


def _describe_error(rank: int, call_id: int | None, error: BaseException) -> CallError:
    kind = type(error)
    type_name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    try:
        pickled: bytes | None = cloudpickle.dumps(error)
        cloudpickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        pickled = None
    return CallError(
        rank=rank,
        call_id=call_id,
        type_name=type_name,
        message=str(error),
        traceback=_user_traceback(error),
        exception=pickled,
        timestamp=time.time(),
        keyboard_interrupt=isinstance(error, KeyboardInterrupt),
    )


def _user_traceback(error: BaseException) -> str:
    """The traceback without this module's frames: the user should see only their code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_ROOT):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _install_streams() -> None:
    """Fresh, block-buffered text streams over fds 1 and 2; a thread flushes them.

    Line buffering would cost one pipe write per print; a 50 ms flusher keeps output live while
    a print loop runs at full speed.
    """
    sys.stdout = _block_buffered_text(1)
    sys.stderr = _block_buffered_text(2)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]


def _block_buffered_text(fd: int) -> io.TextIOWrapper:
    # 64 KB per pipe write rather than 8 KB: a print-heavy loop makes 8x fewer system calls and
    # wakes the kernel 8x less often, which is most of what relaying costs it.
    raw = io.BufferedWriter(io.FileIO(fd, "w", closefd=False), buffer_size=STREAM_BUFFER_BYTES)
    stream = io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=False)
    stream._CHUNK_SIZE = STREAM_BUFFER_BYTES  # type: ignore[attr-defined]  # text-side batching
    return stream


def _start_flusher() -> threading.Event:
    stop = threading.Event()

    def flush_forever() -> None:
        while not stop.wait(FLUSH_INTERVAL_S):
            _flush_streams_and_metrics()

    threading.Thread(target=flush_forever, name="accelnb-flush", daemon=True).start()
    return stop


def _flush_before_dying_of_sigterm(wake: Callable[[], None]) -> threading.Event:
    """Die of accelnb's SIGTERM only after flushing output and metrics; returns "SIGTERM came".

    The supervisor SIGTERMs the other ranks when one fails; dying at once would drop what they
    printed or reported in their last 50 ms, often the very lines that explain the failure. So
    SIGTERM is blocked in every thread but one, which waits for it, flushes (for at most a
    second: a stream could be wedged), then re-raises it for the disposition the function left:

    - the default: the process dies of SIGTERM, as it would have without us;
    - ignored: nothing happens, and the supervisor's SIGKILL ends the rank after its grace;
    - a handler of the function's own (a checkpoint on pre-emption): Python runs it in the main
      thread at its next Python instruction, then the worker leaves instead of waiting for more
      work. ``wake`` unblocks a worker idle between calls so that the handler gets to run.
    """
    terminate = {signal.SIGTERM}
    received = threading.Event()
    signal.pthread_sigmask(signal.SIG_BLOCK, terminate)
    # Forked children (DataLoader workers) must not inherit the block.
    os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, terminate))

    def wait_then_die() -> None:
        signal.sigwait(terminate)
        received.set()
        flushing = threading.Thread(target=_flush_streams_and_metrics, daemon=True)
        flushing.start()
        flushing.join(SIGTERM_FLUSH_LIMIT_S)
        if callable(signal.getsignal(signal.SIGTERM)):
            wake()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, terminate)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=wait_then_die, name="accelnb-sigterm", daemon=True).start()
    return received


def _flush_streams_and_metrics() -> None:
    report.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a user may have replaced or closed the stream
            pass


def _start_inbox_reader(inbox_fd: int, commands: queue.Queue[Any]) -> None:
    """Commands arrive on a thread, so that end of file (the kernel died) ends us at once."""

    def read_forever() -> None:
        while True:
            try:
                message = channel.read_message(inbox_fd)
            except OSError:
                message = None
            if message is None:
                # The kernel closes our inbox only after we exited, so end of file here means
                # the kernel died: nobody will read our result. End our whole process group.
                os.killpg(0, signal.SIGKILL)
            commands.put(message)

    threading.Thread(target=read_forever, name="accelnb-inbox", daemon=True).start()


def _chdir_quietly(path: str) -> None:
    try:
        os.chdir(path)
    except OSError:
        pass


def _finish(flusher: threading.Event) -> None:
    flusher.set()
    _flush_streams_and_metrics()
