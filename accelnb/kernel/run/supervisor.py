"""Owns the worker processes of one launch (or one persistent session), and nothing else.

:class:`WorkerGroup` asks the helper to fork one worker per rank, wires four channels to each
(stdout and stderr pipes; events and inbox ``AF_UNIX`` stream sockets, which carry the memfds
of big buffers, see ``wire/channel.py``), and then waits in the launching thread, multiplexing
every channel and the helper's reports with one selector. While it waits it feeds output to the
:class:`~accelnb.kernel.display.output.OutputRouter`, metrics to their sink, and rank states to ``run_state``.

    >>> group = WorkerGroup(plan, shared_helper(), router)                  # doctest: +SKIP
    >>> group.start(specs, store_socket)                                     # doctest: +SKIP
    >>> outcome = group.call(payload, value_ranks={0}, timeout=None)         # doctest: +SKIP

:meth:`WorkerGroup.call` returns a :class:`~accelnb.kernel.run.call_outcome.CallOutcome` and raises
nothing for what happens to the ranks; :mod:`accelnb.kernel.run.engine` decides what the user sees.
Endings, all of which leave no process and no bound port behind:

- every rank answered: the call's values come back;
- a rank raised or died: all others get SIGTERM, then SIGKILL after one shared grace deadline;
- ``timeout=`` expired: SIGUSR1 makes faulthandler print every rank's stack, then the same stop;
- the user interrupted (Ctrl-C, a panel's Stop): the same stop, faster (a persistent session
  first tries to interrupt just the cell);
- accelnb's helper process died: its workers died with it (``PR_SET_PDEATHSIG``); their process
  groups are killed too, and the group waits until they are gone.

Live stacks (:meth:`WorkerGroup.collect_stacks`, from any thread) stop nothing: SIGUSR1 makes
faulthandler print each rank's stacks on its stderr. Whoever drives the group's pipes reads the
dumps: the launching thread during a call (it serves the request in its wait loop), or the asking
thread itself when no call runs (a session between cells). The pipes are never read by two
threads at once: a call, a shutdown and a self-served request each hold the group's drive lock.

An interrupt can land at any moment, start-up included: :meth:`WorkerGroup.start` undoes a start
it did not finish (kills what was forked, closes every fd), and a call interrupted while its
frames were being written leaves the group unusable, since a worker's inbox then holds half a
frame. Process groups, not pids, are signalled, so a rank's own children (DataLoader workers) go too.
"""

from __future__ import annotations

import fcntl
import os
import select
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from accelnb.errors import RankFailure
from accelnb.kernel.display.output import OutputRouter
from accelnb.kernel.helper.client import StepHook, WorkerExit, WorkerHelper
from accelnb.kernel.planning.rank_plan import LaunchPlan
from accelnb.kernel.run import run_state
from accelnb.kernel.run.call_outcome import CallOutcome, CallPhase, Ending, HelperExit, StopSource
from accelnb.kernel.run.cell_sources import in_memory_sources
from accelnb.kernel.run.failure_report import exception_failure, exit_failure
from accelnb.kernel.run.rank_prompts import PendingPrompts, ask_in_kernel
from accelnb.kernel.stacks.faulthandler_dumps import clean_stack_dump, split_stack_dump
from accelnb.wire.buffers import Packed
from accelnb.wire.channel import MessageReader, encode, receive_chunk, send_frame
from accelnb.wire.events import (
    CallError,
    CallResult,
    InputReply,
    InputRequest,
    Joined,
    MetricBatch,
    RunCall,
    Shutdown,
)
from accelnb.wire.held_interrupts import held_interrupts
from accelnb.wire.spec import WorkerSpec

PIPE_SIZE = 1 << 20  # bigger pipes: fewer wake-ups for floods and large results
F_SETPIPE_SZ = 1031
FAILURE_GRACE_S = 3.0
INTERRUPT_GRACE_S = 1.5
ANSWER_WAIT_S = 1.0  # persistent sessions: how long the other ranks get to answer after a failure
STACK_DUMP_WAIT_S = 1.0
STACK_DUMP_QUIET_S = 0.1  # a live dump is complete once every rank wrote one and this long passed silent
SHUTDOWN_WAIT_S = 10.0  # finished workers leave on Shutdown; past this they are stopped
KILL_WAIT_S = 5.0  # after SIGKILL: how long until the helper reports the exits
BURY_WAIT_S = 1.0  # the helper died: how long its workers may take to be gone
WAIT_SLICE_S = 0.05
# While the kernel waits at a prompt, its pumping thread wakes this often: the prompt returns only
# once the thread has stopped, so this bounds the delay each answer adds (50 ms made it 100 ms).
PROMPT_PUMP_SLICE_S = 0.01
HOOK_INTERVAL_S = 0.1  # display hooks (a Stop button's comm pump) run at most ten times a second

MetricSink = Callable[[MetricBatch], None]
_WaitEnding = Literal["answered", "failed", "timed_out", "stop_requested", "helper_died"]


@dataclass
class _Worker:
    spec: WorkerSpec
    pid: int = 0
    stdout_fd: int = -1
    stderr_fd: int = -1
    events: socket.socket | None = None  # non-blocking, read by the selector loop
    inbox: socket.socket | None = None  # blocking: a call's frame goes out whole
    event_reader: MessageReader = field(default_factory=MessageReader)
    exit_code: int | None = None
    joined: bool = False  # it joined the process group: an exit from now on is not a set-up failure
    state: run_state.RankState | None = None
    signals_sent: set[int] = field(default_factory=set)  # an exit by one of these is ours, not a crash

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    @property
    def events_fd(self) -> int:
        return self.events.fileno() if self.events is not None else -1

    def close_channels(self) -> None:
        for fd in (self.stdout_fd, self.stderr_fd):
            _close_quietly(fd)
        for sock in (self.events, self.inbox):
            if sock is not None:
                sock.close()
        self.event_reader.close()  # fds of a frame that never arrived whole


@dataclass
class _Answers:
    """What came back for one call (``call_id`` None: while stopping, between calls) from the
    ranks it runs on (``ranks``; None: every rank)."""

    call_id: int | None
    ranks: frozenset[int] | None = None
    values: dict[int, Packed | None] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)

    def has_failed(self, rank: int) -> bool:
        return any(f.rank == rank for f in self.failures)

    def answered(self) -> set[int]:
        return set(self.values) | {f.rank for f in self.failures}

    def runs_on(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


@dataclass
class _StackRequest:
    """A live stack dump asked for by some thread, served by whichever thread pumps the pipes."""

    wait: float
    done: threading.Event = field(default_factory=threading.Event)
    ranks: list[int] = field(default_factory=list)  # signalled; empty until the request is served
    deadline: float = 0.0
    last_held: int = -1  # bytes of held stderr last seen, to tell when the dumps went quiet
    quiet_since: float = 0.0
    stacks: dict[int, str] = field(default_factory=dict)


class WorkerGroup:
    """The live workers of one plan.

    ``on_step(name)`` is called at each step of starting and of sending a call (every pipe
    opened, the spawn request sent, each frame and each write of it): the moments an interrupt
    or a fault can land. Tests inject faults there; it is None in real launches.
    """

    def __init__(self, plan: LaunchPlan, helper: WorkerHelper, output: OutputRouter,
                 metric_sink: MetricSink | None = None, persistent: bool = False,
                 on_step: StepHook | None = None) -> None:
        self.plan = plan
        self.persistent = persistent
        self.helper = helper
        self.output = output
        self.metric_sink = metric_sink
        self.workers: list[_Worker] = []
        self._sources_sent: set[str] = set()  # notebook cell sources every rank has (cell_sources.py)
        self.run: run_state.RunState | None = None
        self.closed = False
        self._on_step = on_step
        self._selector: selectors.BaseSelector | None = None
        self._fd_owner: dict[int, tuple[_Worker, str]] = {}
        self._helper_fd = -1
        self._worker_ends: list[int] = []  # pipe ends for the workers, until the helper has them
        self._spawned_pids: list[int] = []
        self._call_ids = 0
        self._inbox_half_written = False  # an interrupted write left half a frame in an inbox
        self._call_phase: CallPhase = "unsent"
        self._helper_death: HelperExit | None = None
        self._hooks_ran_at = float("-inf")
        self._driving = threading.RLock()  # held by whoever reads the pipes: a call, a shutdown, a stack request
        self._stack_request: _StackRequest | None = None
        self._one_stack_request = threading.Lock()
        self._between_calls = _Answers(None)  # what a self-served stack request saw between calls
        self._prompts = PendingPrompts()  # ranks waiting in input() or their debugger

    @property
    def usable(self) -> bool:
        """Whether the workers can take another call (persistent sessions)."""
        return (not self.closed and not self._inbox_half_written and self._helper_death is None
                and all(w.alive for w in self.workers))

    @property
    def helper_death(self) -> HelperExit | None:
        """How accelnb's helper process ended, once this group saw it die."""
        return self._helper_death

    # ── starting ────────────────────────────────────────────────────────────────────────────
    def start(self, specs: list[WorkerSpec], store_socket: socket.socket) -> None:
        """Fork the workers. The store's listening socket goes to rank 0 only.

        Whatever stops it half-way (Ctrl-C, the helper's death) kills what was forked and closes
        every fd before it propagates.
        """
        try:
            self._selector = selectors.DefaultSelector()
            fds_to_send: list[int] = []
            for spec in specs:
                fds_to_send += self._open_pipes(spec)
                if spec.holds_store:
                    fds_to_send.append(store_socket.fileno())
            self._spawned_pids = self.helper.spawn(specs, fds_to_send, on_step=self._on_step)
            self._step("spawned")
            for worker, pid in zip(self.workers, self._spawned_pids, strict=True):
                worker.pid = pid
            self._close_worker_ends()  # the workers hold them now: end of file works both ways
            self._watch_pipes()
            self._publish_run()
        except BaseException:
            self._abort_start()
            raise
        finally:
            store_socket.close()  # rank 0 holds it now; when rank 0 ends, the port is free

    def _open_pipes(self, spec: WorkerSpec) -> list[int]:
        """The worker's four channels; returns the ends it gets (stdout, stderr, events, inbox)."""
        worker = _Worker(spec)
        self.workers.append(worker)
        theirs: list[int] = []
        for name in ("stdout", "stderr"):
            with held_interrupts():  # bare fds: owned before a Ctrl-C may surface
                read_end, write_end = os.pipe()
                setattr(worker, f"{name}_fd", read_end)
                self._worker_ends.append(write_end)
            theirs.append(write_end)
            self._step("pipe-opened")
            _enlarge(read_end)
            os.set_blocking(read_end, False)
        for name in ("events", "inbox"):
            ours, their_socket = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            setattr(worker, name, ours)
            their_end = their_socket.detach()  # a plain fd from now on: _worker_ends owns it
            self._worker_ends.append(their_end)
            theirs.append(their_end)
            self._step("pipe-opened")
        assert worker.events is not None
        worker.events.setblocking(False)
        return theirs

    def _close_worker_ends(self) -> None:
        while self._worker_ends:
            _close_quietly(self._worker_ends.pop())

    def _watch_pipes(self) -> None:
        assert self._selector is not None
        for worker in self.workers:
            for name in ("stdout", "stderr", "events"):
                fd = getattr(worker, f"{name}_fd")
                self._selector.register(fd, selectors.EVENT_READ)
                self._fd_owner[fd] = (worker, name)
        self._helper_fd = self.helper.fileno()
        self._selector.register(self._helper_fd, selectors.EVENT_READ)

    def _publish_run(self) -> None:
        self.run = run_state.RunState(
            run_id=run_state.next_run_id(),
            ranks=[run_state.RankState(w.rank, w.spec.device, "starting", w.pid) for w in self.workers],
            collect_stacks=self.collect_stacks)
        for worker, state in zip(self.workers, self.run.ranks, strict=True):
            worker.state = state
        run_state.begin_run(self.run)

    def _abort_start(self) -> None:
        """Undo a start that did not finish: kill what was forked, free every fd."""
        try:
            if self._spawned_pids and not self.helper.lost:
                self.helper.wait_for_exits(self._spawned_pids, time.monotonic() + KILL_WAIT_S)
        except KeyboardInterrupt:
            pass  # no more patience: with their inboxes closed below, the workers end themselves
        finally:
            for worker in self.workers:
                worker.exit_code = worker.exit_code if worker.exit_code is not None else -signal.SIGKILL
            self._close_worker_ends()
            self.close()

    # ── running a call ──────────────────────────────────────────────────────────────────────
    def call(self, payload: Packed, value_ranks: set[int], timeout: float | None,
             ranks: frozenset[int] | None = None) -> CallOutcome:
        """Run one packed call on every rank (or only on ``ranks``: the others stay idle, their
        state untouched) and report how it ended.

        Neither a failure of the ranks nor an interrupt raises here: both are in the outcome,
        after every worker that had to go is gone. Afterwards :attr:`usable` says whether the
        workers are still there for another call (persistent sessions): they are when every rank
        answered, even with an exception; otherwise every worker has been stopped.
        """
        with self._driving:
            return self._call(payload, value_ranks, timeout, ranks)

    def _call(self, payload: Packed, value_ranks: set[int], timeout: float | None,
              ranks: frozenset[int] | None) -> CallOutcome:
        self._call_ids += 1
        answers = _Answers(self._call_ids, ranks)
        # A rank that died while a stack request pumped between calls is this call's root cause.
        answers.failures.extend(self._between_calls.failures)
        self._between_calls.failures.clear()
        self._call_phase = "unsent"
        self.output.prompting_ranks.clear()
        self._refuse_prompts("it asked between two cells, when no cell waits for input")
        source: StopSource = "interrupt"
        ending: Ending
        try:
            self._pump(0, answers)  # the helper or a rank may have died since the last call
            if self._helper_death is None:
                self._send_call(answers, payload, value_ranks)
            self._call_phase = "running"
            waited = self._wait_for_answers(answers, timeout)
            if waited == "stop_requested":
                ending, source = "interrupted", "stop_request"
            else:
                ending = waited
        except KeyboardInterrupt:
            ending = "interrupted"
        return self._conclude(CallOutcome(ending, answers.values, answers.failures, timeout=timeout,
                                          phase=self._call_phase, stop_source=source,
                                          ranks=None if ranks is None else sorted(ranks)), answers)

    def _send_call(self, answers: _Answers, payload: Packed, value_ranks: set[int]) -> None:
        """One frame for all ranks: its big buffers are written once, each rank maps them."""
        assert answers.call_id is not None
        sources = in_memory_sources(already_sent=self._sources_sent)
        call = RunCall(answers.call_id, payload, frozenset(value_ranks), sources=sources)
        with encode(call) as frame:
            for worker in self.workers:
                if not worker.alive or worker.inbox is None or not answers.runs_on(worker.rank):
                    continue
                self._step("call-writing")
                self._call_phase = "sending"
                self._inbox_half_written = True  # until the whole frame is out
                try:
                    send_frame(worker.inbox, frame, self._after_inbox_write)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it died already; its exit report explains why
                self._inbox_half_written = False
        if answers.ranks is None:  # every rank has them now; a --ranks call gave them to some only
            self._sources_sent.update(filename for filename, _ in sources)
        self._step("call-sent")

    def _after_inbox_write(self, bytes_left: int) -> None:
        if bytes_left:
            self._step("call-part-written")

    def _wait_for_answers(self, answers: _Answers, timeout: float | None) -> _WaitEnding:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump(WAIT_SLICE_S, answers)
            if self._helper_death is not None:
                return "helper_died"
            if answers.failures:
                return "failed"
            if len(answers.values) == self._running(answers):
                return "answered"
            if self.run is not None and self.run.stop_requested.is_set():
                self.run.stop_requested.clear()
                return "stop_requested"
            if deadline is not None and time.monotonic() > deadline:
                return "timed_out"
            if self._prompts:
                at_prompt = self._answer_prompt(answers)
                if deadline is not None:
                    deadline += at_prompt  # time at a prompt is the user's, not the run's
                continue
            self._run_display_hooks()

    def _answer_prompt(self, answers: _Answers) -> float:
        """Ask the user for the oldest rank's line, send it; returns the seconds at the prompt."""
        request = self._prompts.next()
        worker = next((w for w in self.workers if w.rank == request.rank), None)
        if worker is None or not worker.alive:
            return 0.0
        # The rank flushed before asking: everything it printed is in its pipes, and goes first.
        self._drain(worker, answers, ("stdout", "stderr"))
        self.output.add_text(worker.rank, "stdout", request.shown_first)
        self.output.tick(force=True)
        told: list[RankFailure] = []

        def pump_and_tell() -> None:
            self._pump(PROMPT_PUMP_SLICE_S, answers)
            if answers.failures and not told:  # the run will stop once the prompt is answered
                told.append(failure := answers.failures[0])
                self.output.add_text(worker.rank, "stderr", (
                    f"accelnb: rank {failure.rank} failed ({failure.summary}) while this prompt "
                    "waits; answer it, or press Stop, to end the run.\n"))

        reply, seconds = ask_in_kernel(request, pump=pump_and_tell)
        if reply.line is None and reply.eof_reason:
            self.output.add_text(worker.rank, "stderr", f"accelnb: {reply.eof_reason}\n")
            self.output.tick(force=True)
        self._send_reply(worker, reply)
        return seconds

    def _send_reply(self, worker: _Worker, reply: InputReply) -> None:
        if worker.inbox is None or not worker.alive or self._inbox_half_written:
            return
        with encode(reply) as frame, held_interrupts():  # a reply goes out whole, or not at all
            try:
                send_frame(worker.inbox, frame)
            except OSError:
                pass  # it died meanwhile; its exit report explains why

    def _refuse_prompts(self, why: str) -> None:
        """End of input for every rank still waiting: nobody will ask the user for it."""
        for request in self._prompts.take_all():
            worker = next((w for w in self.workers if w.rank == request.rank), None)
            if worker is not None:
                self._send_reply(worker, InputReply(request.request_id, None, why))

    def _conclude(self, outcome: CallOutcome, answers: _Answers) -> CallOutcome:
        """Stop what has to stop for ``outcome``; never ends with a worker that should be gone."""
        try:
            if outcome.ending == "failed":
                if not (self.persistent and self._all_answer(answers, ANSWER_WAIT_S)):
                    outcome.stopped = [r for r in self._stop(FAILURE_GRACE_S, answers) if r not in answers.values]
            elif outcome.ending == "timed_out":
                outcome.stacks = self._dump_stacks()
                self._stop(FAILURE_GRACE_S, answers)
            elif outcome.ending == "interrupted":
                keep = self.persistent and (outcome.phase == "unsent" or (
                    outcome.phase == "running" and self._interrupt_call(answers)))
                if not keep:
                    self._stop(INTERRUPT_GRACE_S, answers)
        except KeyboardInterrupt:  # interrupted while stopping: no more patience
            self._stop(0.0, answers)
        if self._helper_death is not None:
            outcome.ending = "helper_died"
            outcome.helper_exit = self._helper_death
        outcome.workers_kept = self.usable
        if outcome.workers_kept:
            self._refuse_prompts("the cell ended before it could be asked")
        return outcome

    def _all_answer(self, answers: _Answers, wait: float) -> bool:
        """Wait up to ``wait`` s for every rank to answer the current call."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self._helper_death is None:
            if len(answers.answered()) == self._running(answers):
                return all(w.alive for w in self.workers)
            self._pump(0.02, answers)
        return False

    def _interrupt_call(self, answers: _Answers) -> bool:
        """SIGINT the ranks still working; True when all stopped their code and live on."""
        for worker in self.workers:
            if worker.alive and worker.rank not in answers.values and answers.runs_on(worker.rank):
                _signal_pid(worker.pid, signal.SIGINT)  # an idle rank would take it as a fatal interrupt
        try:
            return self._all_answer(answers, INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            return False

    def _running(self, answers: _Answers) -> int:
        """How many ranks the call runs on: how many answers end it."""
        return len(self.workers) if answers.ranks is None else len(answers.ranks)

    def _run_display_hooks(self) -> None:
        # Once per wake-up would be thousands a second under an output flood.
        now = time.monotonic()
        if now - self._hooks_ran_at >= HOOK_INTERVAL_S:
            self._hooks_ran_at = now
            run_state.run_wait_hooks()

    # ── the selector loop ───────────────────────────────────────────────────────────────────
    def _pump(self, timeout: float, answers: _Answers) -> None:
        assert self._selector is not None
        for key, _ in self._selector.select(timeout):
            fd = int(key.fd)  # type: ignore[arg-type]
            if fd == self._helper_fd:
                self.helper.collect()
                continue
            worker, name = self._fd_owner[fd]
            self._read(worker, name, fd, answers)
        if self.helper.lost and self._helper_death is None:  # seen here, or by another group's pump
            self._bury_workers_of_dead_helper(answers)
        for worker in self.workers:
            if worker.alive:
                ended = self.helper.take_exit(worker.pid)
                if ended is not None:
                    self._on_exit(worker, ended, answers)
        self._serve_stack_request()
        self.output.tick()

    def _read(self, worker: _Worker, name: str, fd: int, answers: _Answers) -> bool:
        """Read one chunk if there is one; True when data came (more may follow)."""
        fds: list[int] = []
        try:
            if name == "events":
                assert worker.events is not None
                with held_interrupts():  # received fds: queued before a Ctrl-C may surface
                    chunk, fds = receive_chunk(worker.events)
                    events = worker.event_reader.feed(chunk, fds) if chunk else []
            else:
                chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return False
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self._unwatch(fd)
            return False
        if name == "events":
            for event in events:
                self._on_event(worker, event, answers)
        else:
            self.output.feed(worker.rank, name, chunk)  # type: ignore[arg-type]
        return True

    def _unwatch(self, fd: int) -> None:
        assert self._selector is not None
        if fd in self._selector.get_map():
            self._selector.unregister(fd)

    def _drain(self, worker: _Worker, answers: _Answers,
               channels: tuple[str, ...] = ("stdout", "stderr", "events")) -> None:
        """Read everything ``worker`` wrote so far (a dead worker: all it ever wrote)."""
        assert self._selector is not None
        for name in channels:
            fd = getattr(worker, f"{name}_fd")
            while fd in self._selector.get_map() and self._read(worker, name, fd, answers):
                pass

    def _on_event(self, worker: _Worker, event: Any, answers: _Answers) -> None:
        if isinstance(event, Joined):
            worker.joined = True
            self._set_phase(worker, "running")
        elif isinstance(event, CallResult) and event.call_id == answers.call_id:
            answers.values[worker.rank] = event.value
            self._set_phase(worker, "done" if not worker.spec.persistent else "running")
        elif isinstance(event, CallError) and (answers.call_id is None or event.call_id in (None, answers.call_id)):
            answers.failures.append(exception_failure(worker.rank, worker.pid, event,
                                                      self.output.tail(worker.rank)))
            self._set_phase(worker, "failed", event.type_name)
        elif isinstance(event, MetricBatch) and self.metric_sink is not None:
            self.metric_sink(event)
        elif isinstance(event, InputRequest):
            self._prompts.add(event)
            self.output.show_rank(worker.rank)  # what it prints between prompts must be seen

    def _on_exit(self, worker: _Worker, ended: WorkerExit, answers: _Answers) -> None:
        self._drain(worker, answers)
        worker.exit_code = ended.code
        if answers.has_failed(worker.rank):
            return  # it reported its own exception before exiting
        if ended.code != 0 or (worker.rank not in answers.values and answers.call_id is not None):
            failure = exit_failure(worker.rank, worker.pid, ended.code, self.output.tail(worker.rank), ended.time,
                                   joined=worker.joined)
            answers.failures.append(failure)
            self._set_phase(worker, "failed", failure.summary if ended.code != 0 else "exited early")

    def _bury_workers_of_dead_helper(self, answers: _Answers) -> None:
        """The helper died: its workers die with it (PDEATHSIG). Make sure, and wait until they are gone."""
        self._helper_death = self.helper.death()
        self._unwatch(self._helper_fd)
        live = [w for w in self.workers if w.alive]
        for worker in live:
            _signal_group(worker, signal.SIGKILL)  # the rank's own children have no PDEATHSIG
        _wait_gone([w.pid for w in live], time.monotonic() + BURY_WAIT_S)
        for worker in live:
            self._drain(worker, answers)
            worker.exit_code = -signal.SIGKILL
            self._set_phase(worker, "failed", "accelnb's helper process died")

    # ── stopping ────────────────────────────────────────────────────────────────────────────
    def _stop(self, grace: float, answers: _Answers) -> list[int]:
        """SIGTERM every live rank, SIGKILL what is left after ``grace``; returns the ranks stopped.

        A second interrupt while it waits cuts the grace short: SIGKILL at once.
        """
        stopped = [w.rank for w in self.workers if w.alive]
        while True:
            try:
                self._stop_ladder(grace, answers)
                break
            except KeyboardInterrupt:
                grace = 0.0
        stopped_ranks = [r for r in stopped if not answers.has_failed(r)]
        for worker in self.workers:
            finished = worker.state is not None and worker.state.phase == "done"
            if worker.rank in stopped_ranks and not finished:  # ended by us, not failed by itself
                self._set_phase(worker, "stopped")
        return stopped_ranks

    def _stop_ladder(self, grace: float, answers: _Answers) -> None:
        for worker in self.workers:
            if worker.alive:
                _signal_group(worker, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        self._wait_for_exits(time.monotonic() + grace, answers)
        for worker in self.workers:
            if worker.alive:
                _signal_group(worker, signal.SIGKILL)
        self._wait_for_exits(time.monotonic() + KILL_WAIT_S, answers)
        # A reaped worker is not signalled again: its pid may already be reused, and the helper
        # reports an exit only after ending everything that rank left behind (worker/helper.py).
        for worker in self.workers:
            if worker.alive:
                self._set_phase(worker, "stopped")
                _signal_group(worker, signal.SIGKILL)

    def _wait_for_exits(self, deadline: float, answers: _Answers) -> None:
        scratch = _Answers(None)
        while any(w.alive for w in self.workers) and time.monotonic() < deadline:
            self._pump(0.02, scratch)
        # Exits by a signal we sent are not failures; a real failure that raced our stop still
        # counts, a crash included (a SIGKILL from outside before ours is a crash).
        signals_sent = {w.rank: w.signals_sent for w in self.workers}
        answers.failures.extend(
            f for f in scratch.failures if not answers.has_failed(f.rank)
            and (f.kind == "exception" or (f.exit_code is not None and -f.exit_code not in signals_sent[f.rank])))

    def _dump_stacks(self) -> dict[int, str]:
        """Have every live rank print its Python stacks (faulthandler on SIGUSR1)."""
        marks = {w.rank: self.output.position(w.rank) for w in self.workers}
        self.output.live_ranks.clear()  # the dump goes into the exception, not also the cell
        for worker in self.workers:
            if worker.alive:
                _signal_pid(worker.pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        scratch = _Answers(None)
        while time.monotonic() < deadline:
            self._pump(WAIT_SLICE_S, scratch)
        return {w.rank: clean_stack_dump(self.output.text_since(w.rank, marks[w.rank])) for w in self.workers}

    # ── live stacks ─────────────────────────────────────────────────────────────────────────
    def collect_stacks(self, wait: float = STACK_DUMP_WAIT_S) -> dict[int, str]:
        """Every live rank's current Python stacks, cleaned, without stopping anything.

        Safe from any thread. Returns within about ``wait`` s (sooner once every dump is in);
        a rank whose dump did not arrive in time (blocked in C code with the GIL held) maps to
        an empty string. A group that is closed returns ``{}``.
        """
        with self._one_stack_request:
            if self.closed:
                return {}
            request = _StackRequest(wait)
            self._stack_request = request
            try:
                # A call's wait loop serves it within one slice; with no call running, nobody
                # reads the pipes, so this thread does, once it may drive the group.
                while not request.done.wait(WAIT_SLICE_S):
                    if self._driving.acquire(blocking=False):
                        try:
                            self._serve_until_done(request)
                        finally:
                            self._driving.release()
            finally:
                self._stack_request = None
            return request.stacks

    def _serve_until_done(self, request: _StackRequest) -> None:
        while not request.done.is_set():
            if self.closed:
                self._finish_stack_request(request)
                return
            self._pump(WAIT_SLICE_S, self._between_calls)

    def _serve_stack_request(self) -> None:
        """Called on every pump: start the pending request, or finish it once its dumps are in."""
        request = self._stack_request
        if request is None or request.done.is_set():
            return
        now = time.monotonic()
        if not request.ranks:
            request.ranks = [w.rank for w in self.workers if w.alive]
            self.output.hold_stderr(request.ranks)
            for worker in self.workers:
                if worker.alive:
                    _signal_pid(worker.pid, signal.SIGUSR1)
            request.deadline = now + request.wait
            if not request.ranks:
                self._finish_stack_request(request)
            return
        held = [self.output.held_stderr(rank) for rank in request.ranks]
        size = sum(len(text) for text in held)
        if size != request.last_held:
            request.last_held, request.quiet_since = size, now
        every_rank_dumped = all("most recent call first" in text for text in held)
        if now >= request.deadline or (every_rank_dumped and now - request.quiet_since >= STACK_DUMP_QUIET_S):
            self._finish_stack_request(request)

    def _finish_stack_request(self, request: _StackRequest) -> None:
        for rank, text in self.output.release_stderr().items():
            dump, own_output = split_stack_dump(text)
            request.stacks[rank] = clean_stack_dump(dump)
            self.output.show(rank, "stderr", own_output)  # the rank's own stderr still reaches the cell
        request.done.set()

    # ── ending ──────────────────────────────────────────────────────────────────────────────
    def shutdown(self) -> None:
        """End workers that finished their work: ask nicely, then make sure. Frees every fd."""
        with self._driving:
            self._shutdown()

    def _shutdown(self) -> None:
        if self.closed:
            return
        try:
            if not self._inbox_half_written:
                shutdown = encode(Shutdown())
                for worker in self.workers:
                    if worker.alive and worker.inbox is not None:
                        try:
                            send_frame(worker.inbox, shutdown)
                        except OSError:
                            pass
                self._wait_for_exits(time.monotonic() + SHUTDOWN_WAIT_S, _Answers(None))
            self._stop(FAILURE_GRACE_S, _Answers(None))
        finally:
            self.close()

    def close(self) -> None:
        """Free every fd. A worker still running is killed first: nothing outlives its group."""
        with self._driving:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._kill_survivors()
        finally:
            for worker in self.workers:
                worker.close_channels()
            self._close_worker_ends()
            if self._selector is not None:
                self._selector.close()
            self.output.finish()
            if self.run is not None:
                self.run.finished = True
                run_state.publish()

    def _kill_survivors(self) -> None:
        survivors = [w for w in self.workers if w.alive and w.pid]
        if not survivors:
            return
        pids = [w.pid for w in survivors]
        if self.helper.lost:
            for worker in survivors:
                _signal_group(worker, signal.SIGKILL)
            _wait_gone(pids, time.monotonic() + BURY_WAIT_S)
        else:
            self.helper.wait_for_exits(pids, time.monotonic() + KILL_WAIT_S)
        for worker in survivors:
            worker.exit_code = -signal.SIGKILL
            self._set_phase(worker, "stopped")

    def _set_phase(self, worker: _Worker, phase: run_state.RankPhase, detail: str = "") -> None:
        if worker.state is not None and (worker.state.phase != phase or detail):
            worker.state.phase = phase
            worker.state.detail = detail
            run_state.publish()

    def _step(self, name: str) -> None:
        if self._on_step is not None:
            self._on_step(name)


def _enlarge(fd: int) -> None:
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:  # capped by /proc/sys/fs/pipe-max-size; the default still works
        pass


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _signal_group(worker: _Worker, sig: int) -> None:
    if worker.alive:
        worker.signals_sent.add(sig)
    try:
        # Just forked, a worker may not have called setsid() yet: then only its pid can be reached.
        # Never both: a function's own SIGTERM handler must run once.
        if os.getpgid(worker.pid) == worker.pid:
            os.killpg(worker.pid, sig)
        else:
            os.kill(worker.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(pids: list[int], deadline: float) -> None:
    """Wait until none of ``pids`` runs (gone, or a zombie nobody reaps yet), or ``deadline``.

    They are not our children (the dead helper's, re-parented), so nothing can be waited on but a
    pidfd, which becomes readable when its process exits; /proc is polled where there is none.
    """
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone already
        except (AttributeError, OSError):  # no pidfd_open (Linux < 5.3)
            while _runs(pid) and time.monotonic() < deadline:
                time.sleep(0.005)
            continue
        try:
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(pidfd)


def _runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return False
    state = fields[fields.rindex(b")") + 2:][:1]  # after "pid (comm) "; comm may hold spaces
    return state not in (b"Z", b"X")
