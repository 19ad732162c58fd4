"""Owns the worker processes of one launch (or one persistent session): :class:`WorkerGroup`.

The group asks the helper to fork one worker per rank, wires four channels to each (stdout and
stderr pipes; events, inbox and control ``AF_UNIX`` stream sockets, which carry the memfds of big
buffers, see ``wire/channel.py``), and then waits in the launching thread, multiplexing every channel and
the helper's reports with one selector. While it waits it feeds output to the
:class:`~accelnb.kernel.display.output.OutputRouter`, metrics to their sink, and rank states to ``run_state``.

    >>> group = WorkerGroup(plan, shared_helper(), router)                  # doctest: +SKIP
    >>> group.start(specs, store_socket)                                     # doctest: +SKIP
    >>> outcome = group.call(payload, value_ranks={0}, timeout=None)         # doctest: +SKIP

The group composes pieces with one job each (``kernel/run/group/``), and holds what ties them
together: the drive lock, the pump that routes what the channels bring (output, events, exits) to
the piece it concerns, and what a stop means for local processes (the graces below):

- ``rank_processes``: fork, the stop ladder, kill, bury; it reports what happened, and the group
  decides which exit is a failure;
- ``channel_pump``: the channels and the selector; ``rank_inboxes``: what is written to the ranks;
- ``call_protocol`` (shared with the Ray group): waiting for a call and ending it;
- ``prompt_answers``: the ranks' ``input()``/pdb prompts; ``live_stack_requests``: the ranks'
  stacks, asked for by signal.

:meth:`WorkerGroup.call` returns a :class:`~accelnb.kernel.run.call_outcome.CallOutcome` and raises
nothing for what happens to the ranks; :mod:`accelnb.kernel.run.engine` decides what the user sees.
Endings, all of which leave no process and no bound port behind:

- every rank answered: the call's values come back, and a one-shot launch's ranks are told to
  leave. A rank that leaves nothing behind (``Departing``: no process it started is left, no CUDA
  context, the store's port no longer listening, its channels closed) counts as gone once its
  channels reach end of file: the launch does not wait the ~20 ms the OS takes to free a
  torch-sized process, nearly half of a short launch, and the helper reaps it after (meanwhile
  the process only exits, at the lowest priority; gloo's own listener, on a port the OS picked,
  goes with it). A session's stop waits for every exit (``await_exits``): it is no fast path;
- a rank raised or died: all others get SIGTERM, then SIGKILL after one shared grace deadline;
- ``timeout=`` expired: every rank prints its stacks (``wire/stack_signals.py``), then the same stop;
- the user interrupted (Ctrl-C, a panel's Stop): the same stop, faster (a persistent session
  first tries to interrupt just the cell); but when the call's code checks ``stop_requested()``,
  the first press asks the ranks to stop at their next check, and they end as they choose;
- accelnb's helper process died: its workers died with it (``PR_SET_PDEATHSIG``); their process
  groups are killed too, and the group waits until they are gone.

Live stacks (:meth:`WorkerGroup.collect_stacks`, from any thread) stop nothing. The pipes are never
read by two threads at once: a call, a shutdown and a self-served stack request each hold the
group's drive lock.

An interrupt can land at any moment, start-up included: :meth:`WorkerGroup.start` undoes a start
it did not finish (kills what was forked, closes every fd), and a call interrupted while its
frames were being written leaves the group unusable, since a worker's inbox then holds half a
frame.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import replace
from typing import Any

from accelnb.errors import RankFailure
from accelnb.kernel.display.output import OutputRouter, notebook_sink
from accelnb.kernel.helper.client import StepHook, WorkerExit, WorkerHelper
from accelnb.kernel.planning.rank_plan import LaunchPlan
from accelnb.kernel.run import run_state
from accelnb.kernel.run.call_outcome import CallOutcome, Ending, HelperExit, StopSource
from accelnb.kernel.run.failure_report import exit_failure, is_peer_loss
from accelnb.kernel.run.group.call_answers import CallAnswers, MetricSink, record_event
from accelnb.kernel.run.group.call_protocol import CallProtocol, CallRanks, StopWhy
from accelnb.kernel.run.group.channel_pump import EVERY_CHANNEL, Channel, ChannelPump, RankChannels
from accelnb.kernel.run.group.live_stack_requests import STACK_DUMP_WAIT_S, LiveStackRequests
from accelnb.kernel.run.group.prompt_answers import PromptAnswers
from accelnb.kernel.run.group.rank_inboxes import RankInboxes
from accelnb.kernel.run.group.rank_phases import RankPhases
from accelnb.kernel.run.group.rank_processes import RankProcess, RankProcesses
from accelnb.kernel.run.group.stall_report import stall_report
from accelnb.kernel.run.group.stop_presses import announce_request
from accelnb.wire.buffers import Packed
from accelnb.wire.events import Departing, InputReply, InputRequest, Joined
from accelnb.wire.group_ahead import GroupAhead
from accelnb.wire.held_interrupts import held_interrupts, routed_interrupts
from accelnb.wire.spec import WorkerSpec

FAILURE_GRACE_S = 3.0  # between SIGTERM and SIGKILL when a rank failed, or the call timed out
INTERRUPT_GRACE_S = 1.5  # the same on an interrupt; and how long a session's ranks get to stop the call
SHUTDOWN_WAIT_S = 10.0  # finished workers leave on Shutdown; past this they are stopped
STOP_PUMP_SLICE_S = 0.02
# A rank whose channels all closed has exited; the helper reports it once it has reaped it.
EXIT_REPORT_WAIT_S = 2.0
HOOK_INTERVAL_S = 0.1  # display hooks (a Stop button's comm pump) run at most ten times a second
GRACE_S: dict[StopWhy, float] = {"failed": FAILURE_GRACE_S, "timed_out": FAILURE_GRACE_S,
                                 "interrupted": INTERRUPT_GRACE_S, "at_once": 0.0}


class WorkerGroup:
    """The live workers of one plan.

    ``on_step(name)`` is called at each step of starting and of sending a call (every pipe
    opened, the spawn request sent, each frame and each write of it): the moments an interrupt
    or a fault can land. Tests inject faults there; it is None in real launches.
    """

    def __init__(self, plan: LaunchPlan, helper: WorkerHelper, output: OutputRouter,
                 metric_sink: MetricSink | None = None, persistent: bool = False,
                 on_step: StepHook | None = None, await_exits: bool = True) -> None:
        self.plan = plan
        self.persistent = persistent
        self.await_exits = await_exits  # False: a rank that departs counts as gone (see the module docstring)
        self._departing: set[int] = set()  # said they depart; gone once their channels are at end of file
        self.helper = helper
        self.output = output
        self.metric_sink = metric_sink
        self.closed = False
        self._processes = RankProcesses(helper, on_step)
        self._channels = ChannelPump(output, on_step)
        self._inboxes = RankInboxes(on_step)
        self._phases = RankPhases()
        self._joined: set[int] = set()  # ranks in the process group: an exit now is not a set-up failure
        self._helper_death: HelperExit | None = None
        self._hooks_ran_at = float("-inf")
        self._stop_hurried = False  # a Ctrl-C cut a stop's grace short during the current call
        self._driving = threading.RLock()  # held by whoever reads the pipes: a call, a shutdown, a stack request
        self._calls = CallProtocol(CallRanks(
            persistent=persistent, interrupt_grace=INTERRUPT_GRACE_S, size=lambda: len(self._processes.ranks),
            live_ranks=self._processes.live_ranks, usable=lambda: self.usable,
            helper_death=lambda: self._helper_death, pump=self._pump, between_pumps=self._between_pumps,
            interrupt=lambda rank: self._processes.signal(rank, signal.SIGINT), stop=self._stop,
            stacks_at_timeout=self._stacks_at_timeout, progress_at=lambda: self.output.progress_at,
            show_stall=self._show_stall, request_stop=self._request_stop, show_request=self._show_request))
        self._prompts = PromptAnswers(output, alive=self._processes.is_alive, reply=self._send_reply)
        self._stack_requests = LiveStackRequests(output, self._processes, self._driving, closed=lambda: self.closed,
                                                 pump=lambda timeout: self._pump(timeout, self._calls.between_calls))

    @property
    def workers(self) -> list[RankProcess]:
        """Each rank's process (its pid, whether it runs), in rank order."""
        return self._processes.ranks

    @property
    def run(self) -> run_state.RunState | None:
        """The run as displays see it, once the workers started."""
        return self._phases.run

    @property
    def usable(self) -> bool:
        """Whether the workers can take another call (persistent sessions)."""
        return (not self.closed and not self._inboxes.half_written and self._helper_death is None
                and all(process.alive for process in self.workers))

    @property
    def helper_death(self) -> HelperExit | None:
        """How accelnb's helper process ended, once this group saw it die."""
        return self._helper_death

    # ── starting ────────────────────────────────────────────────────────────────────────────
    def start(self, specs: list[WorkerSpec], store_socket: socket.socket, *,
              next_group: GroupAhead | None = None) -> None:
        """Fork the workers. The store's listening socket goes to rank 0 only. ``next_group``:
        see :meth:`~accelnb.kernel.helper.client.WorkerHelper.spawn`.

        Whatever stops it half-way (Ctrl-C, the helper's death) kills what was forked and closes
        every fd before it propagates.
        """
        try:
            fds = []
            for spec in specs:
                theirs = self._channels.open(spec.rank)
                fds.append(replace(theirs, store=store_socket.fileno()) if spec.holds_store else theirs)
            self._inboxes.ranks_have_sources_to(self._processes.spawn(specs, fds, next_group=next_group))
            self._channels.close_their_ends()  # the workers hold them now: end of file works both ways
            self._channels.watch(self.helper.fileno(), self.helper.collect)
            self._phases.begin([run_state.RankState(spec.rank, spec.device, "starting", process.pid)
                                for spec, process in zip(specs, self.workers, strict=True)], self.collect_stacks)
        except BaseException:
            try:
                self._processes.abort_start()
            finally:
                self._channels.close_their_ends()
                self.close()
            raise
        finally:
            store_socket.close()  # rank 0 holds it now; when rank 0 ends, the port is free

    # ── running a call ──────────────────────────────────────────────────────────────────────
    def call(self, payload: Packed, value_ranks: set[int], timeout: float | None,
             ranks: frozenset[int] | None = None, *, stall_timeout: float | None = None,
             stop_grace: float | None = None) -> CallOutcome:
        """Run one packed call on every rank (or only on ``ranks``: the others stay idle, their
        state untouched) and report how it ended.

        Neither a failure of the ranks nor an interrupt raises here: both are in the outcome,
        after every worker that had to go is gone. Afterwards :attr:`usable` says whether the
        workers are still there for another call (persistent sessions): they are when every rank
        answered, even with an exception; otherwise every worker has been stopped.
        """
        with self._driving:
            return self._call(payload, value_ranks, timeout, ranks, stall_timeout, stop_grace)

    def _call(self, payload: Packed, value_ranks: set[int], timeout: float | None,
              ranks: frozenset[int] | None, stall_timeout: float | None, stop_grace: float | None) -> CallOutcome:
        answers = self._calls.begin(ranks)
        self._stop_hurried = False
        self._inboxes.phase = "unsent"
        self.output.prompting_ranks.clear()
        self._prompts.refuse_all("it asked between two cells, when no cell waits for input")
        source: StopSource = "interrupt"
        ending: Ending
        try:
            # One SIGINT handler for the call: its holds (writing the call, each read) and the
            # Stop press's meaning cost no system call (wire/held_interrupts.py).
            with routed_interrupts():
                self._pump(0, answers)  # the helper or a rank may have died since the last call
                self._await_exit_reports(answers)
                if self._helper_death is None:
                    self._send_call(answers, payload, value_ranks)
                self._inboxes.phase = "running"
                run = self.run
                waited = self._calls.wait(answers, timeout, run.take_stop_press if run is not None else None,
                                          stall_timeout, stop_grace)
            if waited == "stop_requested":
                ending, source = "interrupted", "stop_request"
            else:
                ending = waited
        except KeyboardInterrupt:
            ending = "interrupted"
        outcome = self._calls.conclude(answers.outcome(ending, timeout, self._inboxes.phase, source), answers)
        outcome.interrupted_while_stopping |= self._stop_hurried
        if outcome.workers_kept:
            self._prompts.refuse_all("the cell ended before it could be asked")
        return outcome

    def _await_exit_reports(self, answers: CallAnswers) -> None:
        """Before a call: wait (at most ``EXIT_REPORT_WAIT_S``) for the helper's report of each rank
        whose channels all reached end of file, a rank that died since the last call. Its death is
        then known before the call is written, and it, not a survivor's failure in the call, is
        the root cause: the helper reaps and reports a moment after the channels close, and on a
        loaded machine that moment once came after a survivor had failed."""
        deadline = time.monotonic() + EXIT_REPORT_WAIT_S
        while self._helper_death is None and self._ranks_gone_unreported():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._pump(min(left, STOP_PUMP_SLICE_S), answers)

    def _ranks_gone_unreported(self) -> bool:
        return any(self._processes.is_alive(channels.rank) and channels.rank not in self._departing
                   and self._channels.all_closed(channels.rank) for channels in self._channels.ranks)

    def _send_call(self, answers: CallAnswers, payload: Packed, value_ranks: set[int]) -> None:
        assert answers.call_id is not None
        inboxes = [channels.inbox for channels in self._call_channels(answers) if channels.inbox is not None]
        self._inboxes.send_call(answers.call_id, payload, value_ranks, inboxes, every_rank=answers.ranks is None)

    def _call_channels(self, answers: CallAnswers) -> list[RankChannels]:
        """The channels of the live ranks the call runs on."""
        return [channels for channels in self._channels.ranks
                if self._processes.is_alive(channels.rank) and answers.runs_on(channels.rank)]

    def _request_stop(self, answers: CallAnswers) -> bool:
        assert answers.call_id is not None
        controls = [channels.control for channels in self._call_channels(answers) if channels.control is not None]
        return self._inboxes.send_stop_request(answers.call_id, controls)

    def _show_request(self, by: str) -> None:
        announce_request(self.output, self.run, by)

    def _between_pumps(self, answers: CallAnswers) -> float:
        """The wait loop's idle work: a rank's prompt first (the seconds at it come back), else
        the display hooks."""
        if self._prompts:
            return self._prompts.answer_next(answers, pump=lambda timeout: self._pump(timeout, answers),
                                             drain=lambda rank: self._drain(rank, answers, ("stdout", "stderr")))
        # Once per wake-up would be thousands a second under an output flood.
        now = time.monotonic()
        if now - self._hooks_ran_at >= HOOK_INTERVAL_S:
            self._hooks_ran_at = now
            run_state.run_wait_hooks()
        return 0.0

    def _send_reply(self, rank: int, reply: InputReply) -> None:
        channels = self._channels.get(rank)
        if channels is not None and self._processes.is_alive(rank):
            self._inboxes.send_reply(channels.control, reply)

    # ── the pump: what the channels bring, to the piece it concerns ─────────────────────────
    def _pump(self, timeout: float, answers: CallAnswers) -> None:
        self._channels.pump(timeout, lambda rank, event: self._on_event(rank, event, answers))
        if self.helper.lost and self._helper_death is None:  # seen here, or by another group's pump
            self._bury_workers_of_dead_helper(answers)
        # An exit taken is an exit noted: lost to a Ctrl-C in between, its rank would be waited
        # for until the stop's last deadline (10 s), and then signalled again; a departure told
        # the helper but not noted left its rank to be killed by the stop. One hold a pump:
        # 2 µs inside a call's route of SIGINT, 12 outside (the shutdown's pumps).
        with held_interrupts():
            if self._departing:
                self._let_departed_go()
            for process, ended in self._processes.take_exits():
                self._on_exit(process, ended, answers)
        self._stack_requests.serve()
        self.output.tick()

    def _drain(self, rank: int, answers: CallAnswers, channels: tuple[Channel, ...] = EVERY_CHANNEL) -> None:
        self._channels.drain(rank, lambda sender, event: self._on_event(sender, event, answers), channels)

    def _on_event(self, rank: int, event: Any, answers: CallAnswers) -> None:
        if isinstance(event, Joined):
            self._joined.add(rank)
        elif isinstance(event, Departing) and not self.await_exits:
            self._departing.add(rank)
        process = self._processes.get(rank)
        pid = process.pid if process is not None else 0
        if not record_event(answers, rank, pid, event, self._phases, self.output, self.metric_sink,
                            persistent=self.persistent) and isinstance(event, InputRequest):
            self._prompts.add(rank, event)

    def _on_exit(self, process: RankProcess, ended: WorkerExit, answers: CallAnswers) -> None:
        rank = process.rank
        self._drain(rank, answers)
        process.exit_code = ended.code
        if rank in self._departing:  # it said it leaves nothing behind, and its exit came before the
            self._departing.discard(rank)  # end of its channels was read (a loaded machine): it departed
            self._processes.note_departure(rank)
        if answers.has_failed(rank):
            return  # it reported its own exception before exiting
        if ended.code != 0 or (rank not in answers.values and answers.call_id is not None):
            failure = exit_failure(rank, process.pid, ended.code, self.output.tail(rank), ended.time,
                                   joined=rank in self._joined)
            answers.failures.append(failure)
            self._phases.set(rank, "failed", failure.summary if ended.code != 0 else "exited early")

    def _let_departed_go(self) -> None:
        """A departing rank whose channels all reached end of file has said and written everything:
        it is done, and its exit is the helper's to reap."""
        for rank in [rank for rank in self._departing if self._channels.all_closed(rank)]:
            self._departing.discard(rank)
            self._processes.depart(rank)

    def _bury_workers_of_dead_helper(self, answers: CallAnswers) -> None:
        self._helper_death = self.helper.death()
        self._channels.unwatch_helper()
        for rank in self._processes.bury():
            self._drain(rank, answers)  # what it wrote last goes into its failure and the cell
            self._processes.note_exit(rank, -signal.SIGKILL)
            self._phases.set(rank, "failed", "accelnb's helper process died")

    # ── stopping ────────────────────────────────────────────────────────────────────────────
    def _stop(self, why: StopWhy, answers: CallAnswers) -> list[int]:
        return self._stop_with_grace(GRACE_S[why], answers)

    def _stop_with_grace(self, grace: float, answers: CallAnswers) -> list[int]:
        """SIGTERM every live rank, SIGKILL what is left after ``grace``; returns the ranks
        stopped that had not failed by themselves."""
        report = self._processes.stop(grace, lambda deadline: self._wait_for_exits(deadline, answers))
        self._stop_hurried |= report.hurried
        for rank in report.unreaped:
            self._phases.set(rank, "stopped")
        stopped = [rank for rank in report.stopped if not answers.has_failed(rank)]
        for rank in stopped:
            if self._phases.phase(rank) != "done":  # ended by us, not failed by itself
                self._phases.set(rank, "stopped")
        return stopped

    def _wait_for_exits(self, deadline: float, answers: CallAnswers) -> None:
        scratch = CallAnswers(None)
        while self._processes.any_alive() and time.monotonic() < deadline:
            self._pump(STOP_PUMP_SLICE_S, scratch)
        answers.keep_failures(scratch, self._is_real_failure)

    def _is_real_failure(self, failure: RankFailure) -> bool:
        """Exits by a signal we sent are not failures, nor a collective that lost a peer while we
        stopped the ranks: the peer died of our SIGTERM first (it had failed already, or waited
        for the kernel), and gloo then raises "Connection closed by peer" in a rank that was
        still flushing before dying of its own. A real failure that raced our stop still counts,
        a crash included (a SIGKILL from outside before ours is a crash)."""
        process = self._processes.get(failure.rank)
        if failure.kind == "exception":
            return not is_peer_loss(failure)
        return (
            failure.exit_code is not None and (process is None or not process.ended_by_us(failure.exit_code)))

    def _show_stall(self, quiet_for: float) -> None:
        stacks = self._stacks_at_timeout()
        self.output.tick(force=True)  # what the ranks printed before comes first
        notebook_sink("stderr", stall_report(quiet_for, stacks))

    def _stacks_at_timeout(self) -> dict[int, str]:
        scratch = CallAnswers(None)
        return self._stack_requests.dump_all(lambda timeout: self._pump(timeout, scratch))

    # ── live stacks ─────────────────────────────────────────────────────────────────────────
    def collect_stacks(self, wait: float = STACK_DUMP_WAIT_S) -> dict[int, str]:
        """Every live rank's current Python stacks, cleaned, without stopping anything.

        Safe from any thread; see :mod:`~accelnb.kernel.run.group.live_stack_requests`. A group
        that is closed returns ``{}``.
        """
        return self._stack_requests.collect(wait)

    # ── ending ──────────────────────────────────────────────────────────────────────────────
    def shutdown(self) -> None:
        """End workers that finished their work: ask nicely, then make sure. Frees every fd."""
        with self._driving:
            self._shutdown()

    def _shutdown(self) -> None:
        if self.closed:
            return
        try:
            inboxes = [channels.inbox for channels in self._channels.ranks
                       if channels.inbox is not None and self._processes.is_alive(channels.rank)]
            if self._inboxes.send_shutdown(inboxes):
                self._wait_for_exits(time.monotonic() + SHUTDOWN_WAIT_S, CallAnswers(None))
            self._stop_with_grace(FAILURE_GRACE_S, CallAnswers(None))
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
            for rank in self._processes.kill_survivors():
                self._phases.set(rank, "stopped")
        finally:
            # Each report dropped or taken and every fd closed, whatever cuts the close short: a
            # Ctrl-C landing as the hold ends is delivered after all of it.
            with held_interrupts():
                self._processes.release()
                self._channels.close()
                self.output.finish()
                self._phases.finish()
