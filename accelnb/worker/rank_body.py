"""What every rank does around the user's code, whatever started it: the rank's body.

A local worker (``worker/main.py``, forked by the helper, talking over pipes) and a Ray actor
(``worker/ray_rank.py``, one per rank on a cluster's nodes, talking through Ray) differ in how
they receive calls and send events; everything else they do alike, with the functions here:

- the streams: fresh block-buffered ``sys.stdout``/``sys.stderr`` over fds 1 and 2
  (:func:`install_streams`), flushed with the metrics every 50 ms by a thread
  (:func:`start_flusher`) and at every end of a call (:func:`flush_streams_and_metrics`);
- what the code reaches the notebook through (:func:`attach_to_kernel`: ``report()``, ``input()``,
  ``breakpoint()``, ``restart_count()``, ``stop_requested()``), so a Ray rank can do all that a
  local one can;
- the rank's place: the kernel's working directory (:func:`chdir_quietly`), then
  :func:`join_the_run`: torch's threads, ``torch.compile`` in the rank (:func:`compile_in_process`),
  the default process group (``worker/other_launchers/process_group.py``) and what watches the code;
- a call: the function run on the unpickled arguments, its value or its exception sent back
  as an event, the exception's traceback cut to the user's frames (:func:`run_call`,
  :func:`describe_error`).

    >>> events = channel.MessageWriter(sock)                    # doctest: +SKIP
    >>> install_streams(); attach_to_kernel(events, spec.rank, spec.restart_count)   # doctest: +SKIP
    >>> start_flusher(); join_the_run(spec, store_fd)           # doctest: +SKIP
    >>> run_call(spec.rank, call, events, interrupts)           # doctest: +SKIP

Module-level state: ``_stop_agreement``, whether this rank's calls agree on a stop (a benchmark's
rank may leave it out, :data:`PIECES_OFF_ENV`); a process is one rank, which joins one run.
"""

from __future__ import annotations

import bdb
import io
import os
import runpy
import sys
import threading
import time
import traceback
from typing import Any

import cloudpickle

from accelnb.wire import buffers, channel
from accelnb.wire.events import CallError, CallResult, RunCall
from accelnb.wire.result_pickling import dumps_exception_for_kernel, dumps_for_kernel
from accelnb.wire.spec import WorkerSpec
from accelnb.worker import library_progress, report, restarts, step_timing
from accelnb.worker.cell_sources import register_cell_sources
from accelnb.worker.interactive import rank_debugger, rank_input
from accelnb.worker.interactive.rank_interrupts import CallInterrupts
from accelnb.worker.other_launchers import launches_inside, process_group
from accelnb.worker.stopping import accelerate_trigger, rank_stop

# accelnb/ with a trailing separator: frames under it are ours, whichever subpackage.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# cloudpickle's frames show only when accelnb's own (un)pickling fails: machinery too.
_CLOUDPICKLE_ROOT = os.path.dirname(os.path.abspath(cloudpickle.__file__)) + os.sep
# runpy's frames, above a script run as __main__ (%torchrun): `python train.py` shows none.
_RUNPY_FILES = ("<frozen runpy>", os.path.abspath(runpy.__file__))
FLUSH_INTERVAL_S = 0.05
STREAM_BUFFER_BYTES = 1 << 16
# For benchmarks/bench_features.py only: the pieces of the rank body left out, by name (a comma
# list of PIECES), so that what each costs a launch, a call and a step is measured, not guessed.
# Not a user setting: each piece is a feature, and a rank without it lacks that feature.
PIECES_OFF_ENV = "ACCELNB_BENCH_PIECES_OFF"
PIECES = ("launches_inside", "step_timing", "library_progress", "accelerate_trigger", "stop_agreement")
# Whether this rank's calls agree on a stop (every one but a benchmark's): decided once, as the
# rank joins its run, not read from the environment again at each call.
_stop_agreement = True


def attach_to_kernel(events: channel.MessageWriter, rank: int, restart_count: int) -> None:
    """What the rank's code reaches the notebook through, whatever started the rank: ``report()``,
    ``input()`` and ``breakpoint()`` prompts, ``restart_count()`` and ``stop_requested()``. What
    the kernel sends back (a prompt's answer, a stop request) is handed to ``rank_input.deliver``
    and ``rank_stop.deliver`` by the rank's own receiver: the control reader of a local rank,
    ``RankActor.deliver`` of a Ray one."""
    report.attach(events, rank)
    rank_input.attach(events, rank, flush=flush_streams_and_metrics)
    rank_debugger.attach()
    restarts.attach(restart_count)
    rank_stop.attach(events, rank)


def join_the_run(spec: WorkerSpec, store_fd: int | None) -> None:
    """The rank's place in the run, once it is attached to the kernel: torch's threads, the default
    process group, and what watches the code: launches inside the rank (``mp.spawn`` & co. run in
    place, or refuse), step timing (for the per-rank view and the straggler watch), rank 0's
    library progress bars, and Accelerate's ``check_trigger()`` answering a Stop press."""
    global _stop_agreement
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, spec.threads_per_rank))
    compile_in_process()
    process_group.join_default_group(spec, store_fd, torch, dist)
    off = pieces_off()
    _stop_agreement = "stop_agreement" not in off
    if "launches_inside" not in off:
        launches_inside.place(spec)
    if "step_timing" not in off:
        step_timing.install()
    if "library_progress" not in off:
        library_progress.install()
    if "accelerate_trigger" not in off:
        accelerate_trigger.install()


def pieces_off() -> frozenset[str]:
    """The pieces a benchmark asked this rank to leave out (:data:`PIECES_OFF_ENV`); none for users."""
    named = os.environ.get(PIECES_OFF_ENV, "")
    return frozenset(piece.strip() for piece in named.split(",") if piece.strip() in PIECES)


def compile_in_process() -> None:
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


def run_call(rank: int, call: RunCall, events: channel.MessageWriter, interrupts: CallInterrupts) -> bool:
    """Run one call; True when it returned normally and its value (if wanted) went back.

    A Ctrl-C (a local rank's SIGINT, ``worker/interactive/rank_interrupts.py``) interrupts the code, or the
    pickling of its value; accelnb's own work before and after the code holds it until the code
    or the pickling runs, and once the answer starts out it is too late."""
    value = None
    try:
        interrupts.hold()
        register_cell_sources(call.sources)
        process_group.ensure_default_group()  # a session's earlier call may have destroyed it
        agreeing = _stop_agreement
        if agreeing:
            rank_stop.begin_call(call.call_id)
        # Big arguments are rebuilt over the shared pages the kernel wrote once for all ranks,
        # mapped copy-on-write: this rank may write into them without affecting anyone else.
        fn, args, kwargs = buffers.load(call.payload)
        interrupts.allow()
        returned = False
        try:
            value = fn(*args, **kwargs)
            returned = True
        finally:
            interrupts.hold()
            rank_debugger.leave_debugger()
            if agreeing:
                rank_stop.end_call(returned)
        interrupts.allow()
    except BaseException as error:
        if not (isinstance(error, SystemExit) and error.code in (0, None)):
            _answer(events, describe_error(rank, call.call_id, error), interrupts)
            return False
    try:
        data = dumps_for_kernel(value) if rank in call.value_ranks else None
    except BaseException as error:  # an interrupt while pickling is an interrupt of the call
        _answer(events, _unsendable_value(rank, call.call_id, value, error) if isinstance(error, Exception)
                else describe_error(rank, call.call_id, error), interrupts)
        return False
    _answer(events, CallResult(rank, call.call_id, data), interrupts)
    return True


def _answer(events: channel.MessageWriter, answer: CallResult | CallError, interrupts: CallInterrupts) -> None:
    """What the code printed and reported first, then the call's answer; a Ctrl-C is too late now."""
    interrupts.drop()
    flush_streams_and_metrics()
    events.send(answer)


def describe_error(rank: int, call_id: int | None, error: BaseException) -> CallError:
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
    while frames and frames[0].filename.startswith((_PACKAGE_ROOT, _CLOUDPICKLE_ROOT, *_RUNPY_FILES)):
        frames.pop(0)  # accelnb calling into cloudpickle or runpy, down to the user's first frame
    shown.stack = traceback.StackSummary.from_list(
        [frame for frame in frames if not frame.filename.startswith(_PACKAGE_ROOT)])
    nested = [shown.__cause__, shown.__context__, *(getattr(shown, "exceptions", None) or [])]
    for inner in nested:
        if inner is not None:
            _drop_machinery_frames(inner, seen)


def install_streams() -> None:
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


def start_flusher(begin: threading.Event | None = None, stop: threading.Event | None = None) -> threading.Event:
    """Start the thread that flushes the rank's streams and reports every ``FLUSH_INTERVAL_S``, from
    the moment ``begin`` is set (None: now), until ``stop`` is (None: a new event); returns ``stop``."""
    stop = stop if stop is not None else threading.Event()

    def flush_forever() -> None:
        if begin is not None:
            begin.wait()
        while not stop.wait(FLUSH_INTERVAL_S):
            flush_streams_and_metrics(periodic=True)

    threading.Thread(target=flush_forever, name="accelnb-flush", daemon=True).start()
    return stop


def flush_streams_and_metrics(periodic: bool = False) -> None:
    report.flush(periodic)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a user may have replaced or closed the stream
            pass


def chdir_quietly(path: str) -> None:
    try:
        os.chdir(path)
    except OSError:
        pass
