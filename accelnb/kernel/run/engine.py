"""The launch engine: bind the rendezvous port, fork workers, run a call on them, gather the result.

The public API (:mod:`accelnb.launcher`) and persistent sessions (:mod:`accelnb.session`) both
drive workers through these functions. Displays come in from outside: the caller passes the
metric view to draw on, so nothing here imports the notebook UI.

    >>> group = start_workers(plan, master_port=None, persistent=False, quiet=True)   # doctest: +SKIP
    >>> result = run_on_group(group, pack_call(fn, (), {}), CallSettings(timeout=60.0))  # doctest: +SKIP

A run's ``report()`` batches go through one :class:`MetricRoute` (history, live chart, the
caller's sinks such as a TensorBoard log). The caller makes it, so a launch with restarts
(:mod:`accelnb.kernel.run.attempts`) keeps one across its attempts: one history, one chart.

Module-level state: ``_last_result``, the latest launch's result (``accelnb.last_result()``); a
kernel has one latest launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from accelnb.errors import LaunchFailed
from accelnb.kernel.display.metrics_history import MetricHistory
from accelnb.kernel.display.output import OutputRouter, notebook_sink
from accelnb.kernel.display.rank_activity import RankActivity
from accelnb.kernel.display.start_table import show_start
from accelnb.kernel.helper.client import HelperSource, StepHook
from accelnb.kernel.helper.template import shared_helper
from accelnb.kernel.planning import rank_plan
from accelnb.kernel.planning.ports import bind_rendezvous_socket
from accelnb.kernel.planning.worker_specs import worker_specs
from accelnb.kernel.run import run_state
from accelnb.kernel.run.call_settings import CallSettings
from accelnb.kernel.run.failure_report import exception_for, interrupted_outside_call, start_interrupted
from accelnb.kernel.run.launch_result import Attempt, LaunchResult
from accelnb.kernel.run.rank_group import RankGroup
from accelnb.kernel.run.supervisor import WorkerGroup
from accelnb.wire.buffers import Packed
from accelnb.wire.events import MetricBatch, StepWindow
from accelnb.wire.group_ahead import GroupAhead, group_ahead
from accelnb.wire.result_pickling import loads_in_kernel


class MetricsView(Protocol):
    """A live display of a run's metrics and its ranks' progress (the notebook's view, or nothing)."""

    def add(self, batch: MetricBatch) -> None: ...

    def follow(self, activity: RankActivity) -> None: ...

    def activity_changed(self) -> None: ...

    def close(self) -> None: ...


PROGRESS_PUBLISH_INTERVAL_S = 1.0  # ranks' progress lines to the run's state (the side panel)
AttemptSink = Callable[[MetricBatch, int], None]  # (batch, attempt): a TensorBoard log, the caller's sink


class MetricRoute:
    """Where a run's metric batches and step windows go: its :class:`MetricHistory` and
    :class:`RankActivity` (the ranks' progress), a live view, and sinks (metrics only).

    ``attempt`` is the attempt now running; each record is kept with it. :meth:`close` closes
    the view (sinks belong to whoever passed them).
    """

    def __init__(self, view: MetricsView | None = None, sinks: Sequence[AttemptSink] = ()) -> None:
        self.history = MetricHistory()
        self.activity = RankActivity()
        self._published = -float("inf")
        self.attempt = 0
        self._view = view
        self._sinks = list(sinks)
        if view is not None:
            view.follow(self.activity)

    def __call__(self, event: MetricBatch | StepWindow) -> None:
        if isinstance(event, StepWindow):
            self.activity.add_window(event)
            if self._view is not None:
                self._view.activity_changed()
            self._publish_progress()
            return
        self.history.add(event, self.attempt)
        self.activity.add_reports(event)
        if self._view is not None:
            self._view.add(event)
        for sink in self._sinks:
            sink(event, self.attempt)

    def _publish_progress(self, final: bool = False) -> None:
        """Each rank's progress line on the run's state, for the side panel: at most once a second,
        and once more when the call ends (``final``), so the panel keeps the last figures."""
        now = time.monotonic()
        run = run_state.current_run()
        if run is None or (now - self._published < PROGRESS_PUBLISH_INTERVAL_S and not final):
            return
        if not run_state.run_listener_count():  # no panel to tell (a script): leave the figures be
            return
        if final and not self.activity.counting:
            return
        self._published = now
        rows = {row.rank: row for row in self.activity.rows()}
        for state in run.ranks:
            row = rows.get(state.rank)
            if row is not None:
                state.progress, state.figures = row.describe(), row.figures()
        run_state.publish()

    def call_ended(self) -> None:
        """The call's ranks answered or ended: their last figures, to the side panel."""
        self._publish_progress(final=True)

    def watch(self, group: RankGroup) -> None:
        """The ranks of ``group`` are the ones now running: their pids on this machine and GPUs."""
        run = run_state.current_run()
        pids = {state.rank: state.pid for state in run.ranks} if run is not None else {}
        here = {r.rank for r in group.plan.ranks if r.interface is None}  # another node's pid means nothing here
        self.activity.watch({r.rank: pids.get(r.rank) if r.rank in here else None for r in group.plan.ranks},
                            {r.rank: r.gpu for r in group.plan.ranks})

    def close(self) -> None:
        if self._view is not None:
            self._view.close()


_last_result: LaunchResult | None = None


def start_workers(the_plan: rank_plan.LaunchPlan, master_port: int | None, *, persistent: bool,
                  quiet: bool, on_step: StepHook | None = None, restart_count: int = 0,
                  helpers: HelperSource = shared_helper, threads: int | None = None) -> WorkerGroup:
    """Bind the rendezvous port and have a helper from ``helpers`` fork one worker per rank of
    ``the_plan`` (for attempt ``restart_count`` of a launch with restarts). ``threads``: each
    rank's thread budget (default: the machine's cores shared among this launch's ranks; a sweep,
    whose launches run at once, shares them among all of its ranks).

    An interrupt at any moment of this leaves no worker and no fd behind, and surfaces as
    :class:`~accelnb.errors.RunInterrupted`. ``on_step`` is for tests (see ``WorkerGroup``).
    """
    # A port the user chose is bound first: taken, it is the error, before any helper starts.
    store_socket = bind_rendezvous_socket(master_port) if master_port is not None else None
    group: WorkerGroup | None = None
    try:
        helper = helpers(on_step=on_step)
        _step(on_step, "helper-ready")
        this_group: GroupAhead | None = None
        if store_socket is None and helper.socket_held_ahead is not None:
            # The helper's waiting children may have joined this launch's group already, on a
            # socket bound for it (wire/group_ahead.py); the specs say which group it is.
            this_group = group_ahead(worker_specs(the_plan, persistent, restart_count, threads=threads))
            store_socket = helper.take_group_ahead(this_group) if this_group is not None else None
        if store_socket is None:
            store_socket = bind_rendezvous_socket(None)
        the_plan = the_plan.with_port(store_socket.getsockname()[1])
        router = OutputRouter(live_ranks={0}, prefix=False, sink=notebook_sink)
        group = WorkerGroup(the_plan, helper, router, persistent=persistent, on_step=on_step,
                            await_exits=persistent)
        specs = worker_specs(the_plan, persistent, restart_count, threads=threads)
        # The next launch is most likely like this one: its ranks can join its group ahead. Not
        # after a launch on a port the user chose, which the next most likely chooses again.
        next_group = None if master_port is not None else this_group or group_ahead(specs)
        group.start(specs, store_socket, next_group=next_group)
        if not quiet:
            show_start(the_plan, [w.pid for w in group.workers])
        _step(on_step, "started")
        return group
    except BaseException as error:
        if store_socket is not None:
            store_socket.close()  # once rank 0 has it, closing ours is what the start does anyway
        if group is not None:
            group.close()
        if isinstance(error, KeyboardInterrupt):
            raise start_interrupted() from None
        raise


def run_on_group(group: RankGroup, payload: Packed, settings: CallSettings, *, metrics: MetricRoute | None = None,
                 time_left: float | None = None, chosen_ranks: Sequence[int] | None = None) -> LaunchResult:
    """Run one packed call on every worker of ``group`` (or on ``chosen_ranks`` only, a session's
    chosen ranks) and gather what came back.

    With ``chosen_ranks``, "rank 0" in ``collect`` and ``output`` means the first rank listed, and the
    output of every chosen rank is shown with ``[rank N]`` prefixes (none with ``output="none"``).

    ``metrics`` receives the run's metric batches (a fresh route when None). ``time_left``: the
    part of ``timeout`` earlier attempts left (None: all of it); messages name ``timeout``.

    Raises what :func:`~accelnb.kernel.run.failure_report.exception_for` says the outcome calls for
    (``RankFailed``, ``RankCrashed``, ``LaunchTimeout``, ``HelperDied``, ``RunInterrupted``).
    """
    collect, timeout, output = settings.collect, settings.timeout, settings.output
    chosen = list(chosen_ranks) if chosen_ranks is not None else None
    ranks = [r.rank for r in group.plan.ranks]
    if chosen is None:
        group.output.live_ranks = {0} if output == "rank0" else (set(ranks) if output == "all" else set())
        group.output.prefix = output == "all"
    else:
        group.output.live_ranks = set() if output == "none" else set(chosen)
        group.output.prefix = True
    first = 0 if chosen is None else chosen[0]
    marks = {rank: group.output.position(rank) for rank in ranks}
    route = metrics if metrics is not None else MetricRoute()
    history = route.history
    group.metric_sink = route
    route.watch(group)
    started = time.perf_counter()
    started_at = time.time()
    global _last_result

    def result(values: dict[int, Any], error: BaseException | None, stopped_by: str | None = None) -> LaunchResult:
        return LaunchResult(values=dict(sorted(values.items())),  # in rank order, not in the order they answered
                            plan=group.plan, seconds=time.perf_counter() - started,
                            metrics=history, ranks=route.activity.summary(),
                            outputs={rank: group.output.text_since(rank, marks[rank]) for rank in ranks},
                            attempts=[Attempt.ended_by(route.attempt, started_at, error,
                                                       stopped=stopped_by is not None)],
                            value_rank=first, stopped_by=stopped_by)

    error: BaseException | None = None
    try:
        outcome = group.call(payload, {first} if collect == "rank0" else set(chosen or ranks),
                             timeout if time_left is None else time_left,
                             None if chosen is None else frozenset(chosen), stall_timeout=settings.stall_timeout,
                             stop_grace=settings.stop_grace)
        outcome.timeout = timeout  # the message names what the user set, which covers every attempt
        error = exception_for(outcome, show_output_of=set(group.output.live_ranks), persistent=group.persistent)
        if error is None and not group.persistent:
            group.shutdown()
    except KeyboardInterrupt:  # one that landed around the call's own handling of interrupts
        # No rank runs the call then (``RankGroup.call``): it was not sent yet, or it has ended.
        # A session that can take the next call keeps its ranks and their variables.
        kept = group.persistent and group.usable
        if not kept:
            group.close()
        error = interrupted_outside_call(persistent=group.persistent, kept=kept)
    except BaseException:  # a bug: nothing may outlive it either
        group.close()
        raise
    finally:
        group.output.tick(force=True)
        route.call_ended()
        if metrics is None:
            route.close()
    if error is not None:
        _last_result = result({}, error)  # failed or interrupted: keep what the ranks printed and reported
        if isinstance(error, LaunchFailed):
            error.metrics = history  # what was reported before the failure is not lost
        # The supervisor's frames would fill the cell and explain nothing; the message does.
        raise error.with_traceback(None) from None
    values = {rank: loads_in_kernel(data) for rank, data in outcome.values.items() if data is not None}
    if outcome.stop_asked_by is not None:  # the code saved and returned: a stopped run, not an error
        notebook_sink("stderr", stopped_message(outcome.stop_asked_by, outcome.stop_seconds))
    _last_result = result(values, None, outcome.stop_asked_by)
    return _last_result


def stopped_message(asked_by: str, seconds: float | None) -> str:
    """The cell's last line of a run whose ranks stopped where the code chose, on a Stop."""
    after = "" if seconds is None else f" {seconds:.1f} s after the request"
    return f"accelnb: stopped as asked ({asked_by}): every rank returned{after}.\n"


def remember(result: LaunchResult) -> None:
    """Make ``result`` what :func:`last_result` returns (a launch with restarts, once it ends)."""
    global _last_result
    _last_result = result


def _step(on_step: StepHook | None, name: str) -> None:
    if on_step is not None:
        on_step(name)


def last_result() -> LaunchResult | None:
    """The latest run in this kernel, however it was started (``notebook_launcher``,
    ``%%distributed``, a session): every rank's value, output and metrics, including output the
    cell skipped to stay responsive. After a failed or interrupted run ``values`` is empty and
    the output is what each rank printed before it ended."""
    return _last_result
