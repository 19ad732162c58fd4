"""What runs inside each worker process, from the fork in the helper to ``os._exit``.

The helper (``worker/helper.py``) forks, points fds 1 and 2 at the kernel's pipes, makes the
worker a child subreaper (whatever the rank starts stays in its process tree, and the helper
ends it once the rank is gone), and calls :func:`worker_main`. The worker then:

1. takes its rank's environment (RANK, LOCAL_RANK, CUDA_VISIBLE_DEVICES, …), the kernel's cwd and
   ``sys.path``; arms faulthandler (segfault tracebacks, SIGUSR1 stack dumps for timeouts);
2. sets its CUDA device and joins the default process group, rendezvousing through a TCPStore
   whose listening socket the launcher already bound on 127.0.0.1 (rank 0 inherits it, so the
   port cannot be stolen and nothing listens beyond loopback), then waits until every rank has
   joined, so that no rank's code can tear the group down under a peer still connecting. If
   set-up fails, the rank reports the exception (a :class:`CallError` with no call) and exits;
3. runs calls from its inbox (one for ``notebook_launcher``, many in a persistent session),
   answering each with a value or the exception, both pickled so that the kernel can load them
   without touching CUDA (``wire/result_pickling.py``), the traceback without accelnb's frames;
4. leaves on the kernel's Shutdown (sent once every rank answered), with ``os._exit``: the OS
   closes the group's sockets. End of file on the inbox means the kernel is gone: exit now.
"""

from __future__ import annotations

import bdb
import ctypes
import faulthandler
import io
import linecache
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any

import cloudpickle

from accelnb.wire import buffers, channel
from accelnb.wire.events import CallError, CallResult, InputReply, Joined, RunCall, Shutdown
from accelnb.wire.result_pickling import dumps_exception_for_kernel, dumps_for_kernel
from accelnb.wire.spec import WorkerSpec
from accelnb.worker import rank_debugger, rank_input, report, restarts

# accelnb/ with a trailing separator: frames under it are ours, whichever subpackage.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# cloudpickle's frames show only when accelnb's own (un)pickling fails: machinery too.
_CLOUDPICKLE_ROOT = os.path.dirname(os.path.abspath(cloudpickle.__file__)) + os.sep
FLUSH_INTERVAL_S = 0.05
STREAM_BUFFER_BYTES = 1 << 16
SIGTERM_FLUSH_LIMIT_S = 1.0
# Rendezvous, and the default timeout of every collective: a rank waiting longer than this in a
# barrier or all_reduce raises instead of hanging.
PROCESS_GROUP_TIMEOUT_S = 300.0
# Keys of the join barrier in the launch's TCPStore (torch's own keys carry a "default_pg/" prefix).
_JOINED_KEY = "accelnb/joined"
_ALL_JOINED_KEY = "accelnb/all-joined"


def worker_main(spec: WorkerSpec, inbox_fd: int, events_fd: int, store_fd: int | None) -> int:
    """Run one worker to its end; returns the exit code. Inbox and events are stream sockets."""
    events = channel.MessageWriter(socket.socket(fileno=events_fd))
    try:
        return _serve(spec, inbox_fd, events, store_fd)
    except SystemExit as leaving:  # the function's own SIGTERM handler, run between calls
        _flush_streams_and_metrics()
        return leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)


def report_setup_failure(rank: int, events_fd: int, error: BaseException) -> None:
    """Tell the kernel that this rank failed before running any call (``call_id=None``)."""
    channel.MessageWriter(socket.socket(fileno=events_fd)).send(_describe_error(rank, None, error))


def _serve(spec: WorkerSpec, inbox_fd: int, events: channel.MessageWriter, store_fd: int | None) -> int:
    commands: queue.Queue[Any] = queue.Queue()
    try:
        terminating, flusher = _set_up(spec, inbox_fd, events, store_fd, commands)
    except BaseException as error:  # the kernel shows the cause, not a bare exit code
        _flush_streams_and_metrics()
        events.send(_describe_error(spec.rank, None, error))
        return 1
    events.send(Joined(spec.rank))

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
        command = None  # its arguments' shared pages go now, not when the next call comes
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


def _set_up(spec: WorkerSpec, inbox_fd: int, events: channel.MessageWriter, store_fd: int | None,
            commands: queue.Queue[Any]) -> tuple[threading.Event, threading.Event]:
    """Everything before the first call; returns (SIGTERM came, the flusher's stop)."""
    terminating = _flush_before_dying_of_sigterm(wake=lambda: commands.put(None))
    os.environ.update(spec.env)
    _chdir_quietly(spec.cwd)
    sys.path[:] = spec.sys_path
    _install_streams()
    # Straight to fd 2, which survives a user replacing sys.stderr.
    faulthandler.enable(file=2, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True, chain=False)
    report.attach(events, spec.rank)
    rank_input.attach(events, spec.rank, flush=_flush_streams_and_metrics)  # input() asks the notebook
    rank_debugger.attach()  # breakpoint() opens a (Pdb) prompt there
    restarts.attach(spec.restart_count)
    _start_inbox_reader(inbox_fd, commands)
    flusher = _start_flusher()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, spec.threads_per_rank))
    _compile_in_process()
    _join_process_group(spec, store_fd, torch, dist)
    return terminating, flusher


def _compile_in_process() -> None:
    """``torch.compile`` in a rank compiles in the rank, not in a pool of compile processes,
    unless the user set ``TORCHINDUCTOR_COMPILE_THREADS``.

    Inductor sizes its pool (up to 32 subprocesses) when ``torch._inductor.config`` is imported,
    which happens in the helper, before the fork, so the variable alone would come too late. A
    pool per rank is wrong here: N ranks times the pool compete for the cores the ranks share; it
    is shut down by an ``atexit`` hook, which a rank leaving with ``os._exit`` never runs, so its
    processes would be left to the subreaper's SIGKILL; and for a notebook's models starting it
    costs more than it saves (2 cores: first compiled call 2.5 s in-process against 3.5 s with
    the pool, a one-rank launch 5.5 s against 8.0 s).
    """
    threads = os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # and processes the rank starts
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None and threads.strip().isdigit():
        setattr(inductor_config, "compile_threads", max(1, int(threads)))  # noqa: B010  (mypy cannot see torch config attributes)


def _run_call(rank: int, call: RunCall, events: channel.MessageWriter) -> bool:
    """Run one call; True when it returned normally and its value (if wanted) went back."""
    value = None
    _register_sources(call.sources)
    try:
        # Big arguments are rebuilt over the shared pages the kernel wrote once for all ranks,
        # mapped copy-on-write: this rank may write into them without affecting anyone else.
        fn, args, kwargs = buffers.load(call.payload)
        try:
            value = fn(*args, **kwargs)
        finally:
            rank_debugger.leave_debugger()
    except BaseException as error:
        if not (isinstance(error, SystemExit) and error.code in (0, None)):
            _flush_streams_and_metrics()
            events.send(_describe_error(rank, call.call_id, error))
            return False
    try:
        data = dumps_for_kernel(value) if rank in call.value_ranks else None
    except BaseException as error:  # an interrupt while pickling is an interrupt of the call
        _flush_streams_and_metrics()
        events.send(_unsendable_value(rank, call.call_id, value, error) if isinstance(error, Exception)
                    else _describe_error(rank, call.call_id, error))
        return False
    _flush_streams_and_metrics()
    events.send(CallResult(rank, call.call_id, data))
    return True


def _register_sources(sources: tuple[tuple[str, str], ...]) -> None:
    """Notebook cells' text, so that the debugger and tracebacks show the lines of notebook code."""
    for filename, text in sources:
        if filename not in linecache.cache:
            lines = text.splitlines(keepends=True)
            linecache.cache[filename] = (len(text), None, lines, filename)


def _join_process_group(spec: WorkerSpec, store_fd: int | None, torch: Any, dist: Any) -> None:
    timeout = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
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
    _wait_until_every_rank_joined(store, spec.world_size)


def _wait_until_every_rank_joined(store: Any, world_size: int) -> None:
    """Return only once every rank's ``init_process_group`` has returned.

    ``init_process_group`` can return on one rank while a peer is still finishing its side of the
    connections (gloo's ``connectFullMesh``): this rank is connected, the peer still reads the
    handshake. A function that tears the group down at once (Accelerate's ``end_training()``
    calls ``destroy_process_group()``) then closes the socket under the peer, whose set-up fails
    with "Connection closed by peer" (seen in about 1 launch in 70 under CPU load). So no rank
    runs user code before all have joined. A store counter, not ``dist.barrier()``: no collective
    on the device (NCCL would allocate), and not torch's ``TORCH_DIST_INIT_BARRIER``, which polls.
    """
    if store.add(_JOINED_KEY, 1) == world_size:
        store.set(_ALL_JOINED_KEY, b"1")
    store.wait([_ALL_JOINED_KEY])


def _describe_error(rank: int, call_id: int | None, error: BaseException) -> CallError:
    if isinstance(error, bdb.BdbQuit):  # the user's own `q`: no traceback through pdb's frames
        return CallError(rank=rank, call_id=call_id, type_name="bdb.BdbQuit",
                         message=f"quit in the debugger on rank {rank}", traceback="",
                         exception=None, timestamp=time.time())
    return CallError(
        rank=rank,
        call_id=call_id,
        type_name=_type_name(type(error)),
        message=_text_of(error),
        traceback=_user_traceback(error),
        # Through the kernel-safe pickler, like return values: an argument could be a CUDA tensor.
        exception=dumps_exception_for_kernel(error),
        timestamp=time.time(),
    )


def _unsendable_value(rank: int, call_id: int, value: Any, error: Exception) -> CallError:
    """The function returned, but its value cannot be pickled: say so, without pickle's frames."""
    kind = _type_name(type(value))
    message = (
        f"the function returned a {kind} on rank {rank}, which cannot be sent back to the notebook "
        f"({type(error).__name__}: {_text_of(error)}). Return data that pickles instead: numbers, "
        "strings, tensors, lists and dicts of them, a model's state_dict(). Keep locks, sockets, "
        "open files and generators inside the function (a generator: return list(...)), or save "
        "the value to a file and return its path.")
    reason = TypeError(message)
    return CallError(rank=rank, call_id=call_id, type_name="TypeError", message=message,
                     traceback="", exception=dumps_exception_for_kernel(reason), timestamp=time.time())


def _type_name(kind: type) -> str:
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _text_of(error: BaseException) -> str:
    try:
        return str(error)
    except Exception as failure:  # a broken __str__ must not cost the report
        return f"<str() of the exception raised {type(failure).__name__}>"


def _user_traceback(error: BaseException) -> str:
    """The traceback as the user should see it: their frames only, not accelnb's (any
    subpackage) nor those of the cloudpickle calls accelnb makes; chained exceptions too."""
    try:
        shown = traceback.TracebackException(type(error), error, error.__traceback__, compact=True)
        _drop_machinery_frames(shown, set())
        return "".join(shown.format())
    except Exception:  # a pathological exception must not cost the report
        return f"{_type_name(type(error))}: {_text_of(error)}\n"


def _drop_machinery_frames(shown: traceback.TracebackException, seen: set[int]) -> None:
    if id(shown) in seen:
        return
    seen.add(id(shown))
    frames = list(shown.stack)
    while frames and frames[0].filename.startswith((_PACKAGE_ROOT, _CLOUDPICKLE_ROOT)):
        frames.pop(0)  # accelnb calling into cloudpickle, down to the user's first frame
    shown.stack = traceback.StackSummary.from_list(
        [frame for frame in frames if not frame.filename.startswith(_PACKAGE_ROOT)])
    nested = [shown.__cause__, shown.__context__, *(getattr(shown, "exceptions", None) or [])]
    for inner in nested:
        if inner is not None:
            _drop_machinery_frames(inner, seen)


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
    SIGTERM gets a handler of ours, and Python's wakeup fd tells a thread of ours the moment it
    arrives, even while the main thread is stuck in native code (a collective). That thread
    flushes (for at most a second: a stream could be wedged), then acts on the disposition the
    function left:

    - ours (the function set none): the process dies of SIGTERM, as it would have without us;
    - ignored: the signal never arrives, and the supervisor's SIGKILL ends the rank after its grace;
    - a handler of the function's own (a checkpoint on pre-emption): Python runs it in the main
      thread, then the worker leaves instead of waiting for more work. The handler is pending
      before the thread hears of the signal, so ``wake``, which unblocks a worker idle between
      calls, can never let the worker leave before the handler runs.

    SIGTERM is not blocked in any thread: a blocked signal stays blocked in every process the
    rank starts (the mask survives ``exec``), and ``proc.terminate()`` on one would wait forever.
    (Code that takes over the wakeup fd, as asyncio's ``add_signal_handler`` does, leaves our
    handler to act alone: it runs when the main thread next runs Python.)
    """
    received = threading.Event()
    acting = threading.Lock()  # the watcher and our handler may both hear it: one acts
    wakeup_read, wakeup_write = os.pipe()
    for fd in (wakeup_read, wakeup_write):
        os.set_blocking(fd, False)

    def act_on_sigterm() -> None:
        if not acting.acquire(blocking=False):
            return
        received.set()
        flushing = threading.Thread(target=_flush_streams_and_metrics, daemon=True)
        flushing.start()
        flushing.join(SIGTERM_FLUSH_LIMIT_S)
        if signal.getsignal(signal.SIGTERM) is die_after_flushing:
            _die_of_sigterm()
        wake()

    def die_after_flushing(signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread when it runs Python; the watcher may have acted already.
        act_on_sigterm()

    def watch_for_sigterm() -> None:
        while True:
            select.select([wakeup_read], [], [])
            try:
                heard = os.read(wakeup_read, 512)  # one byte per signal that has a Python handler
            except BlockingIOError:
                continue
            if signal.SIGTERM in heard:
                act_on_sigterm()

    def forget_in_forked_child() -> None:
        # A fork (a DataLoader worker) must die of SIGTERM plainly, not wake our watcher: it
        # shares the wakeup pipe. SIGTERM stays blocked from before the fork until this is done.
        signal.set_wakeup_fd(-1)
        if signal.getsignal(signal.SIGTERM) is die_after_flushing:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in (wakeup_read, wakeup_write):
            os.close(fd)

    signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, die_after_flushing)
    _hold_sigterm_across_fork(in_child=forget_in_forked_child)
    threading.Thread(target=watch_for_sigterm, name="accelnb-sigterm", daemon=True).start()
    return received


def _hold_sigterm_across_fork(in_child: Callable[[], None]) -> None:
    """Block SIGTERM in the forking thread around ``os.fork``, until ``in_child`` has run in the
    child: a SIGTERM sent the moment the child exists would otherwise find it still in our
    state. The parent gets any SIGTERM meanwhile in another thread, and the child once ready."""
    terminate = {signal.SIGTERM}
    held = threading.local()

    def before() -> None:
        held.mask = signal.pthread_sigmask(signal.SIG_BLOCK, terminate)

    def restore() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, held.mask)

    def in_child_then_restore() -> None:
        in_child()
        restore()

    os.register_at_fork(before=before, after_in_parent=restore, after_in_child=in_child_then_restore)


def _die_of_sigterm() -> None:
    """Die of SIGTERM from any thread: ``signal.signal`` is for the main thread only, so the
    default disposition is restored through libc, then the signal is sent to this thread."""
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGTERM, None)  # SIG_DFL is the null handler
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)


def _flush_streams_and_metrics() -> None:
    report.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a user may have replaced or closed the stream
            pass


def _start_inbox_reader(inbox_fd: int, commands: queue.Queue[Any]) -> None:
    """Commands arrive on a thread, so that end of file (the kernel died) ends us at once."""
    inbox = channel.MessageReceiver(socket.socket(fileno=inbox_fd))

    def read_forever() -> None:
        while True:
            try:
                message = inbox.receive()
            except OSError:
                message = None
            if message is None:
                # The kernel closes our inbox only after we exited, so end of file here means
                # the kernel died: nobody will read our result. End our whole process group.
                os.killpg(0, signal.SIGKILL)
            if isinstance(message, InputReply):
                rank_input.deliver(message)  # to the prompt waiting for it, never to the call loop
            else:
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
