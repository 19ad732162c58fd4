"""The ranks of one Ray launch or session: one actor per rank, in one placement group.

:class:`RayRankGroup` is a :class:`~accelnb.kernel.run.rank_group.RankGroup`: the engine drives it as
it drives forked workers. Its wait loop keeps one ``events`` poll in flight per actor and
multiplexes them, and each call's ``run``, with ``ray.wait``; output goes to the
:class:`~accelnb.kernel.display.output.OutputRouter` (so rank 0 streams into the launching cell, not into
whichever cell runs when Ray's log forwarding would print it), metrics to their sink, results and
errors into the :class:`~accelnb.kernel.run.call_outcome.CallOutcome`.

    >>> group = RayRankGroup(plan, actors, placed, placement_group, router)   # doctest: +SKIP
    >>> group.begin(specs)                                                    # doctest: +SKIP
    >>> outcome = group.call(payload, value_ranks={0}, timeout=None)          # doctest: +SKIP

Endings, which leave no actor behind and, once the group closes, no placement group:

- every rank answered: a one-shot launch's actors are killed by :meth:`shutdown`;
- a rank raised, or its actor died (killed, its node lost: the failure names the node): every
  other actor is killed, since Ray would leave them blocked in the collective. Where the only
  failure is a peer's echo ("Connection reset by peer"), the kill waits a little for the death that
  caused it, and an actor found dead by itself only after the kill is still that crash;
- ``timeout=``: every rank's stack is read (:meth:`RankActor.stacks`), then all are killed;
- an interrupt: a session first interrupts the call on every rank and keeps the actors if all
  answer within a grace period; otherwise, and always for a one-shot launch, all are killed.

A Stop (the stop button, a panel, ``timeout=``, SIGTERM) to code that checks
``accelnb.stop_requested()`` is first a request, as for local ranks: each actor gets a
``StopRequest`` through :meth:`RankActor.deliver`, which Ray runs beside the call, and the call
ends when the ranks answer. A rank's ``input()`` or ``(Pdb)`` prompt is answered the same way.

The payload goes into Ray's object store once (``ray.put``) and every actor reads it from there.

What does not depend on Ray is shared with the local group (``kernel/run/group/``): a call's
answers and the events both backends send (``call_answers``), the rank states displays follow
(``rank_phases``), waiting for a call and deciding what to stop at its end (``call_protocol``),
Stop presses and their announcement (``stop_presses``) and the ranks' prompts (``prompt_answers``).
This module keeps what is Ray's: the actors, their polls, how an actor is lost and how it is
killed, and stacks asked of the actors themselves.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

from accelnb.cluster.rank_layout import PlacedActor
from accelnb.kernel.display.output import OutputRouter, notebook_sink
from accelnb.kernel.planning.rank_plan import LaunchPlan
from accelnb.kernel.run import run_state
from accelnb.kernel.run.call_outcome import CallOutcome, Ending, StopSource
from accelnb.kernel.run.failure_report import actor_fault_failure, actor_lost_failure, is_peer_loss
from accelnb.kernel.run.group.call_answers import CallAnswers, MetricSink, record_event
from accelnb.kernel.run.group.call_protocol import CallProtocol, CallRanks, StopWhy
from accelnb.kernel.run.group.prompt_answers import PromptAnswers
from accelnb.kernel.run.group.rank_phases import RankPhases
from accelnb.kernel.run.group.stall_report import stall_report
from accelnb.kernel.run.group.stop_presses import announce_request
from accelnb.wire.buffers import Packed
from accelnb.wire.events import InputReply, InputRequest, OutputChunk, StopRequest
from accelnb.wire.held_interrupts import held_interrupts
from accelnb.wire.spec import WorkerSpec

POLL_WAIT_S = 0.2  # how long an actor holds an events poll open when it has nothing to send
WAIT_SLICE_S = 0.05
INTERRUPT_GRACE_S = 5.0  # sessions: how long the ranks get to stop the call (two Ray round trips under load)
LAST_WORDS_S = 0.2  # before killing: what the ranks printed last still reaches the cell
# Before killing, when every failure so far is a peer's echo ("Connection reset by peer"): how long
# to wait for the death that caused it. The driver learns of an actor's death later than its peers
# do (through the GCS), often after their exception.
PEER_DEATH_WAIT_S = 3.0
KILLED_BY_US = "killed by `ray.kill`"  # Ray's death cause for an actor that ray.kill ended
KILL_WAIT_S = 10.0  # after ray.kill: how long until every actor is known dead
STACKS_WAIT_S = 2.0
PLACEMENT_REMOVAL_WAIT_S = 5.0
_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the task's name in a task error's traceback


class RayRankGroup:
    """The actors of one plan, ``actors[i]`` running rank ``i`` on ``placed[i]``."""

    def __init__(self, plan: LaunchPlan, actors: list[Any], placed: list[PlacedActor], placement_group: Any,
                 output: OutputRouter, persistent: bool = False) -> None:
        import ray

        self._ray = ray
        self.plan = plan
        self.persistent = persistent
        self.output = output
        self.metric_sink: MetricSink | None = None
        self.closed = False
        self._actors = actors
        self._placed = placed
        self._placement_group = placement_group
        self._alive = [True] * len(actors)
        self._killed: set[int] = set()
        self._watched: dict[Any, tuple[int, str]] = {}  # ObjectRef -> (rank, "events" | "run" | "set_up")
        self._driving = threading.RLock()
        self._phases = RankPhases()
        self.run = self._phases.begin(
            [run_state.RankState(r.rank, r.device, "starting", p.pid) for r, p in zip(plan.ranks, placed, strict=True)],
            self.collect_stacks)
        self._calls = CallProtocol(CallRanks(
            persistent=persistent, interrupt_grace=INTERRUPT_GRACE_S, size=lambda: len(self._actors),
            live_ranks=lambda: [rank for rank, alive in enumerate(self._alive) if alive],
            usable=lambda: self.usable, helper_death=lambda: None, pump=self._pump,
            between_pumps=self._between_pumps, interrupt=lambda rank: self._actors[rank].interrupt.remote(),
            stop=self._stop_for, stacks_at_timeout=lambda: self.collect_stacks(STACKS_WAIT_S),
            progress_at=lambda: self.output.progress_at, show_stall=self._show_stall,
            request_stop=self._request_stop, show_request=lambda by: announce_request(self.output, self.run, by)))
        self._prompts = PromptAnswers(output, alive=lambda rank: self._alive[rank], reply=self._send_reply)

    @property
    def usable(self) -> bool:
        return not self.closed and all(self._alive)

    def begin(self, specs: list[WorkerSpec]) -> None:
        """Start every rank's set-up (joining the process group) and its event polls; a set-up
        that fails is reported by the first call, as the local engine reports it."""
        for spec, actor in zip(specs, self._actors, strict=True):
            self._watched[actor.set_up.remote(spec)] = (spec.rank, "set_up")
            self._poll(spec.rank)

    # ── a call ──────────────────────────────────────────────────────────────────────────────
    def call(self, payload: Packed, value_ranks: set[int], timeout: float | None,
             ranks: frozenset[int] | None = None, *, stall_timeout: float | None = None,
             stop_grace: float | None = None) -> CallOutcome:
        """Run one call on every rank (or only on ``ranks``, as the local engine does); waiting
        and ending it is the call protocol's (``kernel/run/group/call_protocol.py``)."""
        with self._driving:
            answers = self._calls.begin(ranks)
            self._prompts.refuse_all("it asked between two cells, when no cell waits for input")
            ending: Ending
            source: StopSource = "interrupt"
            try:
                payload_ref = self._ray.put(payload)  # once into the object store, read by every actor
                for rank, actor in enumerate(self._actors):
                    if self._alive[rank] and answers.runs_on(rank):
                        self._watched[actor.run.remote(answers.call_id, payload_ref, frozenset(value_ranks))] = \
                            (rank, "run")
                run = self.run
                waited = self._calls.wait(answers, timeout, run.take_stop_press, stall_timeout, stop_grace)
                if waited == "stop_requested":
                    ending, source = "interrupted", "stop_request"
                else:
                    ending = waited
            except KeyboardInterrupt:
                ending = "interrupted"
            outcome = self._calls.conclude(answers.outcome(ending, timeout, stop_source=source), answers)
            if outcome.workers_kept:
                self._prompts.refuse_all("the cell ended before it could be asked")
            return outcome

    # ── what the kernel sends a running call: a stop request, a line of input ──────────────
    def _request_stop(self, answers: CallAnswers) -> bool:
        """Ask the call's ranks to stop at their next check (each actor hears it beside the call)."""
        assert answers.call_id is not None
        for rank, actor in enumerate(self._actors):
            if self._alive[rank] and answers.runs_on(rank):
                actor.deliver.remote(StopRequest(answers.call_id))
        return True

    def _send_reply(self, rank: int, reply: InputReply) -> None:
        if self._alive[rank]:
            self._actors[rank].deliver.remote(reply)

    def _between_pumps(self, answers: CallAnswers) -> float:
        """The wait loop's idle work: a rank's prompt first (the seconds at it come back), else
        the display hooks. An actor sends a prompt after the output printed before it, so there
        is nothing more to read first."""
        if self._prompts:
            return self._prompts.answer_next(answers, pump=lambda timeout: self._pump(timeout, answers),
                                             drain=lambda rank: None)
        run_state.run_wait_hooks()
        return 0.0

    def _show_stall(self, quiet_for: float) -> None:
        stacks = self.collect_stacks(STACKS_WAIT_S)
        self.output.tick(force=True)  # what the ranks printed before comes first
        notebook_sink("stderr", stall_report(quiet_for, stacks))

    # ── the wait loop ───────────────────────────────────────────────────────────────────────
    def _poll(self, rank: int) -> None:
        self._watched[self._actors[rank].events.remote(POLL_WAIT_S)] = (rank, "events")

    def _pump(self, timeout: float, answers: CallAnswers) -> None:
        refs = list(self._watched)
        if refs:
            ready, _ = self._ray.wait(refs, num_returns=1, timeout=timeout)
            if ready:
                ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        else:
            time.sleep(timeout)
            ready = []
        # A ref taken is a ref handled, its rank polled again: lost to a Ctrl-C in between, the
        # rank's events were never read nor asked for again, and an interrupted session call
        # waited 25 s for its answer and ended the session. The refs are ready: no wait inside.
        with held_interrupts():
            for ref in ready:
                rank, kind = self._watched.pop(ref)
                try:
                    value = self._ray.get(ref)
                except self._ray.exceptions.RayActorError as error:
                    self._on_actor_lost(rank, error, answers)
                    continue
                except self._ray.exceptions.RayTaskError as error:
                    self._on_actor_fault(rank, error, answers)
                    continue  # not polled again: what it would send cannot be trusted
                if kind == "events":
                    for event in value:
                        self._on_event(rank, event, answers)
                    if self._alive[rank]:
                        self._poll(rank)
        self.output.tick()

    def _on_event(self, rank: int, event: Any, answers: CallAnswers) -> None:
        if isinstance(event, OutputChunk):
            self.output.feed(rank, "stderr" if event.stream == "stderr" else "stdout", event.data)
        elif not record_event(answers, rank, self._placed[rank].pid, event, self._phases, self.output,
                              self.metric_sink, persistent=self.persistent) and isinstance(event, InputRequest):
            self._prompts.add(rank, event)

    def _on_actor_lost(self, rank: int, error: BaseException, answers: CallAnswers) -> None:
        if not self._alive[rank]:
            return
        self._alive[rank] = False
        why = _why_actor_died(error)
        if answers.has_failed(rank) or (rank in self._killed and KILLED_BY_US in why):
            return  # it failed already, or our kill ended it; an actor dead before the kill still counts
        placed = self._placed[rank]
        failure = actor_lost_failure(rank, placed.pid, placed.address, why, self.output.tail(rank))
        answers.failures.append(failure)
        self._phases.set(rank, "failed", failure.summary)

    def _on_actor_fault(self, rank: int, error: Any, answers: CallAnswers) -> None:
        """A method of the actor raised (``error``: Ray's ``RayTaskError``). The user's code never
        raises there (``run_call`` answers with its exceptions), so this is accelnb's own code: the
        rank's failure, and the stop that follows kills the actor with the others."""
        if answers.has_failed(rank):
            return
        cause = getattr(error, "cause", None) or error
        traceback = _actor_traceback(error)
        placed = self._placed[rank]
        failure = actor_fault_failure(rank, placed.pid, placed.address, f"{type(cause).__name__}: {cause}",
                                      traceback, self.output.tail(rank))
        answers.failures.append(failure)
        self._phases.set(rank, "failed", failure.summary)

    # ── stopping ────────────────────────────────────────────────────────────────────────────
    def _stop_for(self, why: StopWhy, answers: CallAnswers) -> list[int]:
        """Kill every live actor, after reading what they printed last unless ``why`` is
        "at_once" (interrupted while stopping); the ranks stopped. Ray has no gentler stop, so
        every other reason is the same."""
        echoes_only = why == "failed" and bool(answers.failures) and all(map(is_peer_loss, answers.failures))
        return self._kill_all(answers, last_words_s=0.0 if why == "at_once" else LAST_WORDS_S,
                              wait_for_cause=echoes_only)

    def _kill_all(self, answers: CallAnswers, *, last_words_s: float, wait_for_cause: bool = False) -> list[int]:
        """Kill every live actor after ``last_words_s`` of reading what they send (and, with
        ``wait_for_cause``, until a failure that is no peer's echo arrives, up to
        :data:`PEER_DEATH_WAIT_S`); the ranks killed that had not failed.

        The failures seen meanwhile are kept: an actor that died by itself before the kill, even
        where the driver learns of it only after, is a crash, and may be the root cause."""
        seen = CallAnswers(None)
        started = time.monotonic()
        while any(self._alive):
            waited = time.monotonic() - started
            cause_pending = wait_for_cause and all(map(is_peer_loss, seen.failures))
            if waited >= max(last_words_s, PEER_DEATH_WAIT_S if cause_pending else 0.0):
                break
            self._pump(0.02, seen)
        killed = []
        for rank, actor in enumerate(self._actors):
            if self._alive[rank]:
                self._killed.add(rank)
                killed.append(rank)
                self._ray.kill(actor, no_restart=True)
                if self._phases.phase(rank) not in ("done", "failed"):
                    self._phases.set(rank, "stopped")
        # An actor is gone once a call pending on it fails.
        deadline = time.monotonic() + KILL_WAIT_S
        while any(self._alive) and time.monotonic() < deadline:
            self._watch_every_live_rank()
            self._pump(WAIT_SLICE_S, seen)
        answers.keep_failures(seen)  # every one: _on_actor_lost records no death of ours
        return [rank for rank in killed if not answers.has_failed(rank)]

    def _watch_every_live_rank(self) -> None:
        """A poll for each live rank that has no call pending: a Ctrl-C in :meth:`begin` can leave
        ranks unpolled, and a rank whose actor code failed is not polled again. Without one, the
        kill's wait learnt of no death and took all of ``KILL_WAIT_S``."""
        watched = {rank for rank, _ in self._watched.values()}
        for rank, alive in enumerate(self._alive):
            if alive and rank not in watched:
                self._poll(rank)

    # ── live stacks ─────────────────────────────────────────────────────────────────────────
    def collect_stacks(self, wait: float = STACKS_WAIT_S) -> dict[int, str]:
        """Every live rank's stack in its running call, without stopping anything (threads of
        the actors answer, so any thread of the kernel may ask)."""
        if self.closed:
            return {}
        asked = {rank: actor.stacks.remote() for rank, actor in enumerate(self._actors) if self._alive[rank]}
        self._ray.wait(list(asked.values()), num_returns=len(asked), timeout=wait)
        stacks: dict[int, str] = {}
        for rank, ref in asked.items():
            try:
                stacks[rank] = self._ray.get(ref, timeout=0)
            except Exception:  # no answer in time (native code holding the GIL), or the actor died
                stacks[rank] = ""
        return stacks

    # ── ending ──────────────────────────────────────────────────────────────────────────────
    def shutdown(self) -> None:
        """The ranks answered: kill the actors (nothing is left to flush) and free the group."""
        self.close()

    def close(self) -> None:
        with self._driving:
            if self.closed:
                return
            try:
                self._kill_all(CallAnswers(None), last_words_s=0.0)
            finally:
                self.closed = True
                self._remove_placement_group()
                self.output.finish()
                self._phases.finish()

    def _remove_placement_group(self) -> None:
        from ray.util.placement_group import placement_group_table, remove_placement_group

        try:
            remove_placement_group(self._placement_group)
            # Removal is asynchronous: return once the group's resources are free again.
            deadline = time.monotonic() + PLACEMENT_REMOVAL_WAIT_S
            while placement_group_table(self._placement_group).get("state") != "REMOVED":
                if time.monotonic() > deadline:
                    break
                time.sleep(WAIT_SLICE_S)  # the GCS offers nothing to wait on
        except Exception:  # the cluster is gone: nothing is left to free there
            pass

    def status(self) -> str:
        lines = [f"accelnb session on Ray: {len(self._actors)} rank(s), backend {self.plan.backend}, "
                 f"{'running' if self.usable else 'ended'}"]
        for spec, placed, alive in zip(self.plan.ranks, self._placed, self._alive, strict=True):
            lines.append(f"  node {placed.address}  rank {spec.rank}  local rank {spec.local_rank}  {spec.device}  "
                         f"pid {placed.pid}  {'alive' if alive else 'gone'}")
        return "\n".join(lines)


def _actor_traceback(error: BaseException) -> str:
    """The actor's traceback in a task error, as Python prints one: Ray's text of the error (what
    ``ray.get`` raises keeps no ``traceback_str``) is a line naming the task, with carets under it,
    then the frames."""
    lines = _ANSI_CODES.sub("", str(error)).strip().splitlines()
    if lines and lines[0].startswith("ray::"):
        lines = lines[1:]
    while lines and not lines[0].strip("^ "):
        lines = lines[1:]
    return "\n".join(["Traceback (most recent call last):", *lines]) if lines else ""


def _why_actor_died(error: BaseException) -> str:
    """Ray's reason, without the ids around it: "its worker process has died ..."."""
    text = " ".join(str(error).split())
    marker = "The actor is dead because"
    if marker in text:
        return text[text.index(marker) + len(marker):].strip().rstrip(".")[:400]
    return text[:400]
