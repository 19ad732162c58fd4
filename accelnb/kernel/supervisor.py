"""Owns the worker processes of one launch (or one persistent session), and nothing else.

:class:`WorkerGroup` asks the helper to fork one worker per rank, wires four pipes to each
(stdout, stderr, events, inbox), and then waits in the launching thread, multiplexing every pipe
and the helper's exit reports with one selector. While it waits it feeds output to the
:class:`~accelnb.kernel.output.OutputRouter`, metrics to their sink, and rank states to ``run_state``.

Endings, all of which leave no process and no bound port behind:

- every rank answered: the call's values come back;
- a rank raised or died: all others get SIGTERM, then SIGKILL after one shared grace deadline,
  and :func:`~accelnb.kernel.failure_report.build_exception` explains the root cause;
- ``timeout=`` expired: SIGUSR1 makes faulthandler print every rank's stack, then the same stop;
- the user interrupted (stop button, Ctrl-C, a panel's Stop): the same stop, faster, then
  ``KeyboardInterrupt``.

Process groups, not pids, are signalled, so a rank's own children (DataLoader workers) go too.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from accelnb.errors import RankFailure
from accelnb.kernel import run_state
from accelnb.kernel.failure_report import build_exception, signal_failure
from accelnb.kernel.helper_client import WorkerHelper
from accelnb.kernel.output import OutputRouter
from accelnb.kernel.planning import LaunchPlan
from accelnb.kernel.stacks import clean_stack_dump
from accelnb.wire.channel import MessageReader, encode
from accelnb.wire.events import CallError, CallResult, Joined, MetricBatch, RunCall, Shutdown
from accelnb.wire.spec import WorkerSpec

PIPE_SIZE = 1 << 20  # bigger pipes: fewer wake-ups for floods and large results
FAILURE_GRACE_S = 3.0
INTERRUPT_GRACE_S = 1.5
ANSWER_WAIT_S = 1.0  # persistent sessions: how long the other ranks get to answer after a failure
STACK_DUMP_WAIT_S = 1.0
F_SETPIPE_SZ = 1031

MetricSink = Callable[[MetricBatch], None]


@dataclass
class _Worker:
    spec: WorkerSpec
    pid: int = 0
    stdout_fd: int = -1
    stderr_fd: int = -1
    events_fd: int = -1
    inbox_fd: int = -1
    events: MessageReader = field(default_factory=MessageReader)
    exit_code: int | None = None
    joined: bool = False
    state: run_state.RankState | None = None
    signals_sent: set[int] = field(default_factory=set)  # an exit by one of these is ours, not a crash

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def alive(self) -> bool:
        return self.exit_code is None


class StopRequested(Exception):
    """A display asked the run to stop (``run_state.request_stop``)."""


class WorkerGroup:
    """The live workers of one plan."""

    def __init__(self, plan: LaunchPlan, helper: WorkerHelper, output: OutputRouter,
                 metric_sink: MetricSink | None = None, persistent: bool = False) -> None:
        self.plan = plan
        self.persistent = persistent
        self.helper = helper
        self.output = output
        self.metric_sink = metric_sink
        self.workers: list[_Worker] = []
        self._selector = selectors.DefaultSelector()
        self._fd_owner: dict[int, tuple[_Worker, str]] = {}
        self._call_ids = 0
        self.run: run_state.RunState | None = None
        self.closed = False

    # ── starting ────────────────────────────────────────────────────────────────────────────
    def start(self, specs: list[WorkerSpec], store_socket: socket.socket) -> None:
        """Fork the workers. The store's listening socket goes to rank 0 only."""
        fds_to_send: list[int] = []
        ours_to_close: list[int] = []
        for spec in specs:
            worker = _Worker(spec)
            for name in ("stdout", "stderr", "events"):
                read_end, write_end = os.pipe()
                _enlarge(read_end)
                os.set_blocking(read_end, False)
                setattr(worker, f"{name}_fd", read_end)
                fds_to_send.append(write_end)
                ours_to_close.append(write_end)
            inbox_read, inbox_write = os.pipe()
            _enlarge(inbox_write)
            worker.inbox_fd = inbox_write
            fds_to_send.append(inbox_read)
            ours_to_close.append(inbox_read)
            if spec.holds_store:
                fds_to_send.append(store_socket.fileno())
            self.workers.append(worker)
        try:
            pids = self.helper.spawn(specs, fds_to_send)
        finally:
            for fd in ours_to_close:
                os.close(fd)
            store_socket.close()  # rank 0 holds it now; when rank 0 ends, the port is free
        for worker, pid in zip(self.workers, pids, strict=True):
            worker.pid = pid
            for name in ("stdout", "stderr", "events"):
                fd = getattr(worker, f"{name}_fd")
                self._selector.register(fd, selectors.EVENT_READ)
                self._fd_owner[fd] = (worker, name)
        self._selector.register(self.helper.fileno(), selectors.EVENT_READ)
        self.run = run_state.RunState(
            run_id=run_state.next_run_id(),
            ranks=[run_state.RankState(w.rank, w.spec.device, "starting", w.pid) for w in self.workers])
        for worker, state in zip(self.workers, self.run.ranks, strict=True):
            worker.state = state
        run_state.begin_run(self.run)

    # ── running a call ──────────────────────────────────────────────────────────────────────
    def call(self, payload: bytes, value_ranks: set[int], timeout: float | None) -> dict[int, Any]:
        """Run one cloudpickled call on every rank; returns {rank: pickled value or None}.

        Raises the run's failure, or KeyboardInterrupt. Afterwards :attr:`usable` says whether
        the workers are still there for another call (persistent sessions): they are when every
        rank answered, even with an exception; otherwise every worker has been stopped.
        """
        self._call_ids += 1
        call_id = self._call_ids
        for worker in self.workers:
            message = encode(RunCall(call_id, payload, worker.rank in value_ranks))
            try:
                _write_blocking(worker.inbox_fd, message)
            except BrokenPipeError:
                pass  # it died already; its exit report explains why
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: list[RankFailure] = []
        try:
            while True:
                self._pump(0.05, results, failures, call_id)
                if failures:
                    if self.persistent and self._all_answer(results, failures, ANSWER_WAIT_S):
                        raise build_exception(failures, (), self.output.live_ranks)
                    stopped = [r for r in self.stop(FAILURE_GRACE_S, failures) if r not in results]
                    raise build_exception(failures, stopped, self.output.live_ranks,
                                          session_ended=self.persistent)
                if len(results) == len(self.workers):
                    return results
                if self.run is not None and self.run.stop_requested.is_set():
                    self.run.stop_requested.clear()
                    raise StopRequested()
                if deadline is not None and time.monotonic() > deadline:
                    stacks = self._dump_stacks()
                    self.stop(FAILURE_GRACE_S, failures)
                    raise build_exception(failures, (), self.output.live_ranks,
                                          timed_out_after=timeout, stacks=stacks)
                run_state.run_wait_hooks()
        except (KeyboardInterrupt, StopRequested):
            if self.persistent and self._interrupt_call(results, failures):
                raise KeyboardInterrupt(
                    "accelnb interrupted the cell on every rank; the session and its variables "
                    "are kept.") from None
            self._stop_after_interrupt()
            raise KeyboardInterrupt(
                "accelnb stopped the run: every worker was ended on the interrupt"
                + (" (a rank did not respond to the interrupt, so the session was closed)."
                   if self.persistent else ".")) from None

    def _stop_after_interrupt(self) -> None:
        grace = INTERRUPT_GRACE_S
        while True:
            try:
                self.stop(grace, [])
                return
            except KeyboardInterrupt:
                grace = 0.0  # interrupted again: no more patience, kill now

    @property
    def usable(self) -> bool:
        return not self.closed and all(w.alive for w in self.workers)

    def _all_answer(self, results: dict[int, Any], failures: list[RankFailure], wait: float) -> bool:
        """Wait up to ``wait`` s for every rank to answer the current call."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            answered = set(results) | {f.rank for f in failures}
            if len(answered) == len(self.workers):
                return all(w.alive for w in self.workers)
            self._pump(0.02, results, failures, self._call_ids)
        return False

    def _interrupt_call(self, results: dict[int, Any], failures: list[RankFailure]) -> bool:
        """SIGINT the ranks still working; True when all stopped their code and live on."""
        for worker in self.workers:
            if worker.alive and worker.rank not in results:
                _signal_pid(worker.pid, signal.SIGINT)
        try:
            return self._all_answer(results, failures, INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            return False

    # ── the selector loop ───────────────────────────────────────────────────────────────────
    def _pump(self, timeout: float, results: dict[int, Any], failures: list[RankFailure],
              call_id: int | None) -> None:
        for key, _ in self._selector.select(timeout):
            fd = int(key.fd)  # type: ignore[arg-type]
            if fd == self.helper.fileno():
                self.helper.collect()
                continue
            worker, name = self._fd_owner[fd]
            self._read(worker, name, fd, results, failures, call_id)
        for worker in self.workers:
            if worker.alive and worker.pid in self.helper.exit_codes:
                self._on_exit(worker, results, failures, call_id)
        self.output.tick()

    def _read(self, worker: _Worker, name: str, fd: int, results: dict[int, Any],
              failures: list[RankFailure], call_id: int | None) -> bool:
        """Read one chunk if there is one; True when data came (more may follow)."""
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return False
        if not chunk:
            self._selector.unregister(fd)
            return False
        if name == "events":
            for event in worker.events.feed(chunk):
                self._on_event(worker, event, results, failures, call_id)
        else:
            self.output.feed(worker.rank, name, chunk)  # type: ignore[arg-type]
        return True

    def _drain(self, worker: _Worker, results: dict[int, Any], failures: list[RankFailure],
               call_id: int | None) -> None:
        """Everything a dead worker wrote is already in its pipes; read it all now."""
        for name in ("stdout", "stderr", "events"):
            fd = getattr(worker, f"{name}_fd")
            while fd in self._selector.get_map() and self._read(worker, name, fd, results, failures, call_id):
                pass

    def _on_event(self, worker: _Worker, event: Any, results: dict[int, Any],
                  failures: list[RankFailure], call_id: int | None) -> None:
        if isinstance(event, Joined):
            worker.joined = True
            self._set_phase(worker, "running")
        elif isinstance(event, CallResult) and event.call_id == call_id:
            results[worker.rank] = event.value
            self._set_phase(worker, "done" if not worker.spec.persistent else "running")
        elif isinstance(event, CallError):
            failures.append(RankFailure(
                rank=worker.rank, pid=worker.pid, kind="exception",
                summary=f"{event.type_name}: {event.message}" if event.message else event.type_name,
                traceback=event.traceback, type_name=event.type_name, exception=event.exception,
                output_tail=self.output.tail(worker.rank), timestamp=event.timestamp))
            self._set_phase(worker, "failed", event.type_name)
        elif isinstance(event, MetricBatch) and self.metric_sink is not None:
            self.metric_sink(event)

    def _on_exit(self, worker: _Worker, results: dict[int, Any], failures: list[RankFailure],
                 call_id: int | None) -> None:
        self._drain(worker, results, failures, call_id)
        code = worker.exit_code = self.helper.exit_codes.pop(worker.pid)
        if any(f.rank == worker.rank for f in failures):
            return  # it reported its own exception before exiting
        if code != 0:
            failure = signal_failure(worker.rank, worker.pid, code, self.output.tail(worker.rank))
            failures.append(replace(failure, timestamp=self.helper.exit_times.pop(worker.pid, failure.timestamp)))
            self._set_phase(worker, "failed", failures[-1].summary)
        elif worker.rank not in results and call_id is not None:
            failures.append(RankFailure(
                worker.rank, worker.pid, "exit", "exited with code 0 before returning "
                "(sys.exit(0) or os._exit(0) inside the function?)", exit_code=0,
                output_tail=self.output.tail(worker.rank)))
            self._set_phase(worker, "failed", "exited early")

    # ── stopping ────────────────────────────────────────────────────────────────────────────
    def stop(self, grace: float, failures: list[RankFailure]) -> list[int]:
        """SIGTERM every live rank, SIGKILL what is left after ``grace``; returns stopped ranks."""
        live = [w for w in self.workers if w.alive]
        stopped = [w.rank for w in live]
        for worker in live:
            _signal_group(worker, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        self._wait_for_exits(time.monotonic() + grace, failures)
        for worker in self.workers:
            if worker.alive:
                _signal_group(worker, signal.SIGKILL)
        self._wait_for_exits(time.monotonic() + 5.0, failures)
        for worker in self.workers:
            if worker.alive:
                self._set_phase(worker, "stopped")
            _signal_group(worker, signal.SIGKILL)  # the rank's own children, if any survive
        stopped_ranks = [r for r in stopped if not any(f.rank == r for f in failures)]
        for worker in self.workers:
            finished = worker.state is not None and worker.state.phase == "done"
            if worker.rank in stopped_ranks and not finished:  # ended by us, not failed by itself
                self._set_phase(worker, "stopped")
        return stopped_ranks

    def _wait_for_exits(self, deadline: float, failures: list[RankFailure]) -> None:
        ignored: dict[int, Any] = {}
        scratch: list[RankFailure] = []
        while any(w.alive for w in self.workers) and time.monotonic() < deadline:
            self._pump(0.02, ignored, scratch, None)
        # Exits by a signal we sent are not failures; a real failure that raced our stop still
        # counts, a crash included (a SIGKILL from outside before ours is a crash).
        signals_sent = {w.rank: w.signals_sent for w in self.workers}
        failures.extend(f for f in scratch if f.rank not in {x.rank for x in failures}
                        and (f.kind == "exception" or (f.exit_code is not None
                                                       and -f.exit_code not in signals_sent[f.rank])))

    def _dump_stacks(self) -> dict[int, str]:
        """Have every live rank print its Python stacks (faulthandler on SIGUSR1)."""
        marks = {w.rank: self.output.position(w.rank) for w in self.workers}
        self.output.live_ranks.clear()  # the dump goes into the exception, not also the cell
        for worker in self.workers:
            if worker.alive:
                _signal_pid(worker.pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        ignored: dict[int, Any] = {}
        scratch: list[RankFailure] = []
        while time.monotonic() < deadline:
            self._pump(0.05, ignored, scratch, None)
        return {w.rank: clean_stack_dump(self.output.text_since(w.rank, marks[w.rank])) for w in self.workers}

    def shutdown(self) -> None:
        """End workers that finished their work: ask nicely, then make sure. Frees every fd."""
        if self.closed:
            return
        for worker in self.workers:
            if worker.alive:
                try:
                    _write_blocking(worker.inbox_fd, encode(Shutdown()))
                except OSError:
                    pass
        self._wait_for_exits(time.monotonic() + 10.0, [])
        self.stop(FAILURE_GRACE_S, [])
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.output.finish()
        for worker in self.workers:
            for fd in (worker.stdout_fd, worker.stderr_fd, worker.events_fd, worker.inbox_fd):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        self._selector.close()
        if self.run is not None:
            self.run.finished = True
            run_state.publish()

    def _set_phase(self, worker: _Worker, phase: run_state.RankPhase, detail: str = "") -> None:
        if worker.state is not None and (worker.state.phase != phase or detail):
            worker.state.phase = phase
            worker.state.detail = detail
            run_state.publish()


def _enlarge(fd: int) -> None:
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:  # capped by /proc/sys/fs/pipe-max-size; the default still works
        pass


def _write_blocking(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[: 1 << 20]):]


def _signal_group(worker: _Worker, sig: int) -> None:
    if worker.alive:
        worker.signals_sent.add(sig)
    try:
        os.killpg(worker.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
