"""What runs inside each worker process, from the fork in the helper to ``os._exit``.

The helper (``worker/template/helper.py``, the template: a clean interpreter that never was the kernel)
forks, points fds 1 and 2 at the kernel's pipes, makes the
worker a child subreaper (whatever the rank starts stays in its process tree, and the helper
ends it once the rank is gone), and calls :func:`worker_main`. The worker then:

0. starts its watcher thread (``worker/signal_watcher.py``: the signals, and the control socket
   below), which starts the flusher once the rank has lived ``FLUSH_INTERVAL_S``: a call that ends
   sooner needs no other thread. A child that the template forked ahead of a launch does this
   while it waits for its spec (:func:`start_while_waiting`, module state ``_started_while_waiting``);
1. takes its rank's environment (RANK, LOCAL_RANK, CUDA_VISIBLE_DEVICES, …), the kernel's cwd and
   ``sys.path``; arms its stack dumps (a crash's traceback; the stacks the kernel asks for at a
   ``timeout=``, which the signal watcher writes: ``worker/interactive/stack_dump.py``);
2. sets its CUDA device and joins the default process group, rendezvousing through a TCPStore
   whose listening socket the launcher already bound on 127.0.0.1 (rank 0 inherits it, so the
   port cannot be stolen and nothing listens beyond loopback), then waits until every rank has
   joined, so that no rank's code can tear the group down under a peer still connecting. If
   set-up fails, the rank reports the exception (a :class:`CallError` with no call) and exits;
3. runs calls from its inbox, which its main thread reads itself between calls (one for
   ``notebook_launcher``, many in a persistent session), while what comes beside a running call
   (a stop request, the reply to a prompt) comes on its control socket, read by the watcher. It
   answers each call with a value or the exception, both pickled so that the kernel can load them
   without touching CUDA (``wire/result_pickling.py``), the traceback without accelnb's frames;
   how a call runs, like the streams, what the code reaches the notebook through
   (``attach_to_kernel``) and the group's join (``join_the_run``), is ``worker/rank_body.py``,
   which the Ray actor (``worker/ray_rank.py``) shares: this module keeps what is a local rank's
   own (its inbox and control reader, its signal watcher, whose SIGTERM flushes first). A SIGINT that comes
   after a call answered was meant for that call, and is dropped; one during accelnb's own work around the
   code waits for the code (``worker/interactive/rank_interrupts.py``);
4. leaves on the kernel's Shutdown (sent once every rank answered), with ``os._exit``: the OS
   closes the group's sockets. A rank that leaves nothing behind (no process it started is left,
   no CUDA context; rank 0 stops listening on the store's port) says so first and closes its
   channels (:func:`_depart`), so that a launch can end without waiting the ~20 ms the OS takes to
   free a torch-sized process. End of file from the kernel (on the inbox, on the control socket)
   means the kernel is gone (unless we are departing): exit now.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from accelnb.wire import channel
from accelnb.wire.events import CallError, CallResult, Departing, InputReply, Joined, RunCall, Shutdown, StopRequest
from accelnb.wire.spec import RankFds, WorkerSpec
from accelnb.worker.interactive import rank_input, stack_dump
from accelnb.worker.interactive.rank_interrupts import RankInterrupts
from accelnb.worker.other_launchers import process_group
from accelnb.worker.process_children import has_children
from accelnb.worker.rank_body import (
    FLUSH_INTERVAL_S,
    attach_to_kernel,
    chdir_quietly,
    describe_error,
    flush_streams_and_metrics,
    install_streams,
    join_the_run,
    run_call,
    start_flusher,
)
from accelnb.worker.signal_watcher import Watcher, watch_signals
from accelnb.worker.stopping import rank_stop

LEAVING_NICENESS = 19  # the lowest priority, for a rank that departed (see _depart)


def worker_main(spec: WorkerSpec, fds: RankFds) -> int:
    """Run one worker to its end; returns the exit code."""
    events = _EventsToKernel(socket.socket(fileno=fds.events))
    try:
        return _serve(spec, fds, events)
    except SystemExit as leaving:  # the function's own SIGTERM handler, run between calls
        flush_streams_and_metrics()
        return leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)


class _EventsToKernel(channel.MessageWriter):
    """The rank's events socket, which counts the calls' answers (their values or errors)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.answers_sent = 0

    def send(self, message: Any) -> None:
        super().send(message)
        if isinstance(message, (CallResult, CallError)):
            self.answers_sent += 1


def _run_call_and_answer(rank: int, call: RunCall, events: _EventsToKernel, interrupts: RankInterrupts) -> bool:
    """``run_call``, with an answer whenever the kernel's Ctrl-C lands. ``run_call`` answers one
    that interrupts the code or the pickling of its value, holds those that come during its own
    work and drops those that come once its answer starts out; one that still escapes it (a
    second, while an interrupted pickling is reported) is the call's answer."""
    answers_before = events.answers_sent
    try:
        return run_call(rank, call, events, interrupts)
    except KeyboardInterrupt as interrupt:
        interrupts.drop()
        if events.answers_sent == answers_before:
            events.send(describe_error(rank, call.call_id, interrupt))
        return False


def report_setup_failure(rank: int, events_fd: int, error: BaseException) -> None:
    """Tell the kernel that this rank failed before running any call (``call_id=None``)."""
    channel.MessageWriter(socket.socket(fileno=events_fd)).send(describe_error(rank, None, error))


class _Inbox:
    """The kernel's calls and its Shutdown, which the main thread reads itself between calls.

    A call then wakes one thread of the rank. (When a reader thread took every message and handed
    calls to the main thread through a queue, each call woke two: 70-110 µs more before the code
    ran, on 2 cores, and the kernel's writes to the other ranks waited behind them.) What the
    kernel sends while a call runs comes on the rank's other socket, the control socket, which
    the watcher thread reads (:class:`_Control`).
    """

    def __init__(self) -> None:
        self._receiver: channel.MessageReceiver | None = None

    def open(self, fd: int) -> None:
        self._receiver = channel.MessageReceiver(socket.socket(fileno=fd))

    def wake(self) -> None:
        """SIGTERM's wake of a main thread waiting here (from the signal watcher, once
        ``terminating`` is set): end of file on our reading side, at once or at the next read."""
        receiver = self._receiver
        if receiver is not None:
            try:
                receiver.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    def next_command(self, terminating: threading.Event) -> RunCall | Shutdown | None:
        """The kernel's next call or Shutdown; None once SIGTERM came."""
        assert self._receiver is not None
        if terminating.is_set():
            return None
        batch = _wait_as_batch()
        try:
            message = self._receiver.receive()
        except OSError:
            message = None
        finally:
            if batch:
                _run_as_normal()
        if message is None and not terminating.is_set():
            # The kernel closes our inbox only after we exited, so end of file here means the
            # kernel died: nobody will read our result. End our whole process group.
            os.killpg(0, signal.SIGKILL)
        if message is not None and not isinstance(message, (RunCall, Shutdown)):
            raise channel.ProtocolError(f"a {type(message).__name__} came on the rank's inbox, which takes calls")
        return message


def _wait_as_batch() -> bool:
    """Make the waiting main thread a batch thread (``SCHED_BATCH``), if it is a normal one;
    True when it was made one.

    The kernel writes a call to its ranks one after the other. A normal thread woken by the first
    write may preempt the kernel on its core before the second write goes out, and the second rank
    starts that much later (on 2 cores, with IPython's history writes deferred, the two writes took
    223 µs with the ranks normal, 35 with them batch: ``benchmarks/RESULTS.md``). A batch thread's
    wake-up preempts nobody: it runs on a free core, or once the kernel waits for the answers.
    The thread is normal again as soon as it has its call (:func:`_run_as_normal`): the code runs
    as it would without us. A policy of the code's own (a real-time one, say) is left as it is."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return False
        os.sched_setscheduler(0, os.SCHED_BATCH, _PRIORITY_ZERO)
    except OSError:  # a sandbox that refuses: the wait works as before
        return False
    return True


def _run_as_normal() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, _PRIORITY_ZERO)
    except OSError:
        pass


_PRIORITY_ZERO = os.sched_param(0)  # what SCHED_OTHER and SCHED_BATCH take


@dataclass
class _RankThreads:
    """What every rank starts, whichever rank it becomes: its watcher thread (the signals, the
    control socket once the rank has one, the flusher's start a while later) and what it shares
    with the main loop. Python's ``Thread.start`` returns once the thread ran: SIGTERM's set-up
    took 1.0-1.3 ms on 2 cores, on every launch's path when a rank started it after its spec came.
    A waiting child starts it while it waits (:func:`start_while_waiting`); the watcher is handed
    the control socket, and the flusher starts flushing, once the rank is known."""

    inbox: _Inbox  # read by the main loop; SIGTERM's wake ends its wait
    # Set once this rank said it departs: the kernel closing our control socket from then on is
    # expected, not the kernel's death (which ends the rank's whole process group).
    departing: threading.Event
    watcher: Watcher  # its ``terminating``: SIGTERM came
    flushing: threading.Event  # the flusher flushes from then on: the rank's streams are installed
    flusher_stop: threading.Event
    interrupts: RankInterrupts  # what a SIGINT does at each point of a call

    @classmethod
    def start(cls, control_fd: int | None = None) -> _RankThreads:
        """``control_fd``: the control socket, where the rank has one already (forked at launch)."""
        inbox = _Inbox()
        departing, flushing, flusher_stop = threading.Event(), threading.Event(), threading.Event()
        watcher = watch_signals(wake=inbox.wake, start=False)
        interrupts = RankInterrupts()  # this is the main thread: the only one that may set a handler
        # Its first periodic flush would come no sooner: a call that ends before never starts it.
        watcher.start_in_a_while(FLUSH_INTERVAL_S, lambda: start_flusher(begin=flushing, stop=flusher_stop))
        threads = cls(inbox, departing, watcher, flushing, flusher_stop, interrupts)
        if control_fd is not None:
            threads.read_control(control_fd)
        watcher.start()
        return threads

    def read_control(self, fd: int) -> None:
        """The watcher reads the control socket from now on."""
        self.watcher.read_too(fd, _Control(fd, self.departing).read)


_started_while_waiting: _RankThreads | None = None  # in a waiting child, the threads it started


def start_while_waiting() -> None:
    """In a child that waits for its spec (``worker/template/standby_ranks.py``), once it has left
    the template: start what any rank starts, off the launch's path."""
    global _started_while_waiting
    _started_while_waiting = _RankThreads.start()


def _serve(spec: WorkerSpec, fds: RankFds, events: _EventsToKernel) -> int:
    threads = _started_while_waiting
    if threads is None:
        threads = _RankThreads.start(control_fd=fds.control)
    else:
        threads.read_control(fds.control)
    try:
        _set_up(spec, fds, events, threads)
    except BaseException as error:  # the kernel shows the cause, not a bare exit code
        flush_streams_and_metrics()
        events.send(describe_error(spec.rank, None, error))
        return 1
    events.send(Joined(spec.rank))
    threads.interrupts.drop()  # until the first call: the launch's interrupt came too late

    exit_code = 0
    while True:
        command = threads.inbox.next_command(threads.watcher.terminating)
        if command is None or isinstance(command, Shutdown):
            break
        succeeded = _run_call_and_answer(spec.rank, command, events, threads.interrupts)
        command = None  # its arguments' shared pages go now, not when the next call comes
        if not spec.persistent:
            exit_code = 0 if succeeded else 1
            if succeeded and not threads.watcher.terminating.is_set():
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
    _finish(threads.flusher_stop)
    if isinstance(command, Shutdown) and exit_code == 0:
        _depart(spec.rank, events, threads.departing)
    return exit_code


def _set_up(spec: WorkerSpec, fds: RankFds, events: channel.MessageWriter, threads: _RankThreads) -> None:
    """Everything before the first call, once the rank's threads run."""
    # The notebook's variables as they are now (not as the helper found them), then the rank's.
    _take_environment({**(spec.kernel_env if spec.kernel_env is not None else os.environ), **spec.env})
    chdir_quietly(spec.cwd)
    sys.path[:] = spec.sys_path
    install_streams()
    stack_dump.arm()  # straight to fd 2, which survives a user replacing sys.stderr
    attach_to_kernel(events, spec.rank, spec.restart_count)
    threads.inbox.open(fds.inbox)
    threads.flushing.set()
    join_the_run(spec, fds.store)


def _take_environment(wanted: Mapping[str, str]) -> None:
    """Make ``os.environ`` what ``wanted`` says, changing only what differs: the template's
    environment is mostly the kernel's, and each change is a ``putenv`` (clearing and setting ~100
    variables took 0.34 ms of a rank's start here, the difference 0.07)."""
    for name in [name for name in os.environ if name not in wanted]:
        del os.environ[name]
    for name, value in wanted.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


class _Control:
    """What the kernel sends beside a running call (a stop request, the reply to a prompt), read
    by the watcher thread (the main thread runs the code), so that end of file (the kernel died)
    ends us at once, unless we are ``departing``."""

    def __init__(self, fd: int, departing: threading.Event) -> None:
        self._sock = socket.socket(fileno=fd)
        self._sock.setblocking(False)  # the watcher reads what came, and never waits for the rest
        self._reader = channel.MessageReader()
        self._departing = departing

    def read(self) -> bool:
        """Read what came and deliver it; False once the kernel closed its end (we departed)."""
        try:
            messages = self._reader.receive_from(self._sock)
        except BlockingIOError:  # a wake-up with nothing to read
            return True
        except OSError:
            messages = None
        if messages is None:
            if self._departing.is_set():
                return False  # the kernel let us go before we exited
            os.killpg(0, signal.SIGKILL)  # the kernel died (see _Inbox.next_command)
        for message in messages or ():
            if isinstance(message, InputReply):
                rank_input.deliver(message)  # to the prompt waiting for it
            elif isinstance(message, StopRequest):
                rank_stop.deliver(message)  # read by the code's next stop_requested(), on every rank alike
        return True


def _finish(flusher: threading.Event) -> None:
    flusher.set()
    flush_streams_and_metrics()


def _depart(rank: int, events: channel.MessageWriter, departing: threading.Event) -> None:
    """Tell the kernel that this rank leaves nothing behind, then close its channels, if so.

    Nothing is left when we have no child, running or not (we are a subreaper: whatever the rank
    started, and whatever those started, would be our child now), CUDA was never initialised
    (device memory is freed only when the process is gone, and the cell must not end before), and
    rank 0 could stop listening on the store's port (a user may choose that port for the next launch). gloo's
    own listener, on a port the OS picked, goes as the process ends: shutting it down aborts gloo.
    Output goes to /dev/null from here: a line printed now would be lost anyway.
    """
    if has_children() or _used_cuda() or not process_group.release_store_port():
        return  # a process of ours is left, GPU memory, or the port: the kernel waits until the helper reaps us
    departing.set()
    try:
        events.send(Departing(rank))
    except OSError:
        return  # the kernel is gone
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)  # end of file on the kernel's side of both pipes
    os.close(devnull)
    try:
        events.sock.shutdown(socket.SHUT_RDWR)  # and on the events socket, whatever thread holds it
    except OSError:
        pass
    # What is left is the OS freeing this process: ~20 ms of CPU that the kernel, which waits for
    # the end of file we just sent, and the notebook's next cell should not wait behind. Every
    # thread of ours (the whole process group: ours alone) runs from here at the lowest priority.
    # On 2 cores this took the kernel's wait for that end of file from 2.5 ms to 0.9.
    try:
        os.setpriority(os.PRIO_PGRP, 0, LEAVING_NICENESS)
    except OSError:  # lowering one's own priority is always allowed; a sandbox may still refuse
        pass


def _used_cuda() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())
