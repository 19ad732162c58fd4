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
  other actor is killed, since Ray would leave them blocked in the collective;
- ``timeout=``: every rank's stack is read (:meth:`RankActor.stacks`), then all are killed;
- an interrupt: a session first interrupts the call on every rank and keeps the actors if all
  answer within a grace period; otherwise, and always for a one-shot launch, all are killed.

The payload goes into Ray's object store once (``ray.put``) and every actor reads it from there.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from accelnb.cluster.rank_layout import PlacedActor
from accelnb.errors import RankFailure
from accelnb.kernel.display.output import OutputRouter
from accelnb.kernel.planning.rank_plan import LaunchPlan
from accelnb.kernel.run import run_state
from accelnb.kernel.run.call_outcome import CallOutcome, Ending
from accelnb.kernel.run.failure_report import actor_lost_failure, exception_failure
from accelnb.wire.buffers import Packed
from accelnb.wire.events import CallError, CallResult, Joined, MetricBatch, OutputChunk
from accelnb.wire.spec import WorkerSpec

POLL_WAIT_S = 0.2  # how long an actor holds an events poll open when it has nothing to send
WAIT_SLICE_S = 0.05
ANSWER_WAIT_S = 1.0  # sessions: how long the other ranks get to answer after a failure
INTERRUPT_GRACE_S = 5.0  # sessions: how long the ranks get to stop the call (two Ray round trips under load)
LAST_WORDS_S = 0.2  # before killing: what the ranks printed last still reaches the cell
KILL_WAIT_S = 10.0  # after ray.kill: how long until every actor is known dead
STACKS_WAIT_S = 2.0
PLACEMENT_REMOVAL_WAIT_S = 5.0


@dataclass
class _Answers:
    call_id: int | None
    values: dict[int, Packed | None] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    ranks: frozenset[int] | None = None  # the ranks this call runs on; None: every rank

    def runs_on(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def has_failed(self, rank: int) -> bool:
        return any(f.rank == rank for f in self.failures)

    def answered(self) -> set[int]:
        return set(self.values) | {f.rank for f in self.failures}


class RayRankGroup:
    """The actors of one plan, ``actors[i]`` running rank ``i`` on ``placed[i]``."""

    def __init__(self, plan: LaunchPlan, actors: list[Any], placed: list[PlacedActor], placement_group: Any,
                 output: OutputRouter, persistent: bool = False) -> None:
        import ray

        self._ray = ray
        self.plan = plan
        self.persistent = persistent
        self.output = output
        self.metric_sink: Any = None
        self.closed = False
        self._actors = actors
        self._placed = placed
        self._placement_group = placement_group
        self._alive = [True] * len(actors)
        self._killed: set[int] = set()
        self._watched: dict[Any, tuple[int, str]] = {}  # ObjectRef -> (rank, "events" | "run" | "set_up")
        self._call_ids = 0
        self._driving = threading.RLock()
        self._between_calls = _Answers(None)
        self.run = run_state.RunState(
            run_id=run_state.next_run_id(),
            ranks=[run_state.RankState(r.rank, r.device, "starting", p.pid) for r, p in zip(plan.ranks, placed,
                                                                                            strict=True)],
            collect_stacks=self.collect_stacks)
        run_state.begin_run(self.run)

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
             ranks: frozenset[int] | None = None) -> CallOutcome:
        """Run one call on every rank (or only on ``ranks``, as the local engine does)."""
        with self._driving:
            self._call_ids += 1
            answers = _Answers(self._call_ids, ranks=ranks)
            answers.failures.extend(self._between_calls.failures)
            self._between_calls.failures.clear()
            ending: Ending
            try:
                payload_ref = self._ray.put(payload)  # once into the object store, read by every actor
                for rank, actor in enumerate(self._actors):
                    if self._alive[rank] and answers.runs_on(rank):
                        self._watched[actor.run.remote(answers.call_id, payload_ref, frozenset(value_ranks))] = \
                            (rank, "run")
                ending = self._wait_for_answers(answers, timeout)
            except KeyboardInterrupt:
                ending = "interrupted"
            return self._conclude(CallOutcome(ending, answers.values, answers.failures, timeout=timeout,
                                              ranks=None if ranks is None else sorted(ranks)), answers)

    def _wait_for_answers(self, answers: _Answers, timeout: float | None) -> Ending:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump(WAIT_SLICE_S, answers)
            if answers.failures:
                return "failed"
            if len(answers.values) == self._expected(answers):
                return "answered"
            if self.run.stop_requested.is_set():
                self.run.stop_requested.clear()
                return "interrupted"
            if deadline is not None and time.monotonic() > deadline:
                return "timed_out"
            run_state.run_wait_hooks()

    def _conclude(self, outcome: CallOutcome, answers: _Answers) -> CallOutcome:
        try:
            if outcome.ending == "failed":
                if not (self.persistent and self._all_answer(answers, ANSWER_WAIT_S)):
                    outcome.stopped = [r for r in self._stop(answers) if r not in answers.values]
            elif outcome.ending == "timed_out":
                outcome.stacks = self.collect_stacks(STACKS_WAIT_S)
                self._stop(answers)
            elif outcome.ending == "interrupted" and not (self.persistent and self._interrupt_call(answers)):
                self._stop(answers)
        except KeyboardInterrupt:  # interrupted while stopping: kill without waiting for last words
            self._kill_all(answers, last_words=False)
        outcome.workers_kept = self.usable
        return outcome

    def _all_answer(self, answers: _Answers, wait: float) -> bool:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if len(answers.answered()) == self._expected(answers):
                return all(self._alive)
            self._pump(0.02, answers)
        return False

    def _expected(self, answers: _Answers) -> int:
        return len(self._actors) if answers.ranks is None else len(answers.ranks)

    def _interrupt_call(self, answers: _Answers) -> bool:
        for rank, actor in enumerate(self._actors):
            if self._alive[rank] and answers.runs_on(rank) and rank not in answers.values:
                actor.interrupt.remote()
        try:
            return self._all_answer(answers, INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            return False

    # ── the wait loop ───────────────────────────────────────────────────────────────────────
    def _poll(self, rank: int) -> None:
        self._watched[self._actors[rank].events.remote(POLL_WAIT_S)] = (rank, "events")

    def _pump(self, timeout: float, answers: _Answers) -> None:
        refs = list(self._watched)
        if refs:
            ready, _ = self._ray.wait(refs, num_returns=1, timeout=timeout)
            if ready:
                ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        else:
            time.sleep(timeout)
            ready = []
        for ref in ready:
            rank, kind = self._watched.pop(ref)
            try:
                value = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as error:
                self._on_actor_lost(rank, error, answers)
                continue
            if kind == "events":
                for event in value:
                    self._on_event(rank, event, answers)
                if self._alive[rank]:
                    self._poll(rank)
        self.output.tick()

    def _on_event(self, rank: int, event: Any, answers: _Answers) -> None:
        pid = self._placed[rank].pid
        if isinstance(event, OutputChunk):
            self.output.feed(rank, "stderr" if event.stream == "stderr" else "stdout", event.data)
        elif isinstance(event, Joined):
            self._set_phase(rank, "running")
        elif isinstance(event, CallResult) and event.call_id == answers.call_id:
            answers.values[rank] = event.value
            self._set_phase(rank, "running" if self.persistent else "done")
        elif isinstance(event, CallError) and (answers.call_id is None or event.call_id in (None, answers.call_id)):
            answers.failures.append(exception_failure(rank, pid, event, self.output.tail(rank)))
            self._set_phase(rank, "failed", event.type_name)
        elif isinstance(event, MetricBatch) and self.metric_sink is not None:
            self.metric_sink(event)

    def _on_actor_lost(self, rank: int, error: BaseException, answers: _Answers) -> None:
        if not self._alive[rank]:
            return
        self._alive[rank] = False
        if rank in self._killed or answers.has_failed(rank):
            return
        placed = self._placed[rank]
        failure = actor_lost_failure(rank, placed.pid, placed.address, _why_actor_died(error), self.output.tail(rank))
        answers.failures.append(failure)
        self._set_phase(rank, "failed", failure.summary)

    # ── stopping ────────────────────────────────────────────────────────────────────────────
    def _stop(self, answers: _Answers) -> list[int]:
        """Kill every live actor (after reading what they printed last); the ranks stopped."""
        stopped = [rank for rank, alive in enumerate(self._alive) if alive and not answers.has_failed(rank)]
        self._kill_all(answers, last_words=True)
        return stopped

    def _kill_all(self, answers: _Answers, *, last_words: bool) -> None:
        scratch = _Answers(None)
        if last_words:
            deadline = time.monotonic() + LAST_WORDS_S
            while time.monotonic() < deadline and any(self._alive):
                self._pump(0.02, scratch)
        for rank, actor in enumerate(self._actors):
            if self._alive[rank]:
                self._killed.add(rank)
                self._ray.kill(actor, no_restart=True)
                if self.run.ranks[rank].phase not in ("done", "failed"):
                    self._set_phase(rank, "stopped")
        # An actor is gone once its pending calls fail; every live one has an events poll pending.
        deadline = time.monotonic() + KILL_WAIT_S
        while any(self._alive) and time.monotonic() < deadline:
            self._pump(WAIT_SLICE_S, scratch)
        answers.failures.extend(f for f in scratch.failures if f.kind == "exception" and not answers.has_failed(f.rank))

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
                self._kill_all(_Answers(None), last_words=False)
            finally:
                self.closed = True
                self._remove_placement_group()
                self.output.finish()
                self.run.finished = True
                run_state.publish()

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

    def _set_phase(self, rank: int, phase: run_state.RankPhase, detail: str = "") -> None:
        state = self.run.ranks[rank]
        if state.phase != phase or detail:
            state.phase, state.detail = phase, detail
            run_state.publish()


def _why_actor_died(error: BaseException) -> str:
    """Ray's reason, without the ids around it: "its worker process has died ..."."""
    text = " ".join(str(error).split())
    marker = "The actor is dead because"
    if marker in text:
        return text[text.index(marker) + len(marker):].strip().rstrip(".")[:400]
    return text[:400]
