"""The launch engine: bind the rendezvous port, fork workers, run a call on them, gather the result.

The public API (:mod:`accelnb.launcher`) and persistent sessions (:mod:`accelnb.session`) both
drive workers through these functions. Displays come in from outside: the caller passes the
metric view to draw on, so nothing here imports the notebook UI.

    >>> group = start_workers(plan, master_port=None, persistent=False, quiet=True)   # doctest: +SKIP
    >>> result = run_on_group(group, pack_call(fn, (), {}), collect="all", timeout=None,
    ...                       output="rank0", metrics_view=None)                      # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from accelnb.errors import LaunchFailed
from accelnb.kernel import planning
from accelnb.kernel.helper_client import shared_helper
from accelnb.kernel.launch_result import LaunchResult
from accelnb.kernel.metrics_history import MetricHistory
from accelnb.kernel.output import OutputRouter, notebook_sink
from accelnb.kernel.ports import bind_rendezvous_socket
from accelnb.kernel.supervisor import WorkerGroup
from accelnb.kernel.worker_specs import describe_start, worker_specs
from accelnb.wire.events import MetricBatch
from accelnb.wire.result_pickling import loads_in_kernel

OutputMode = Literal["rank0", "all", "none"]


class MetricsView(Protocol):
    """A live display of a run's metrics (the notebook's chart, or nothing)."""

    def add(self, batch: MetricBatch) -> None: ...

    def close(self) -> None: ...


MetricsViewFactory = Callable[[bool], MetricsView]  # all_ranks -> view

_last_result: LaunchResult | None = None


def start_workers(the_plan: planning.LaunchPlan, master_port: int | None, *, persistent: bool,
                  quiet: bool) -> WorkerGroup:
    """Bind the rendezvous port and fork one worker per rank of ``the_plan``."""
    store_socket = bind_rendezvous_socket(master_port)
    the_plan = the_plan.with_port(store_socket.getsockname()[1])
    try:
        helper = shared_helper()
    except BaseException:
        store_socket.close()
        raise
    router = OutputRouter(live_ranks={0}, prefix=False, sink=notebook_sink)
    group = WorkerGroup(the_plan, helper, router, persistent=persistent)
    group.start(worker_specs(the_plan, persistent), store_socket)
    if not quiet:
        notebook_sink("stdout", describe_start(the_plan, [w.pid for w in group.workers]) + "\n")
    return group


def run_on_group(group: WorkerGroup, payload: bytes, *, collect: Literal["rank0", "all"],
                 timeout: float | None, output: OutputMode,
                 metric_sink: Callable[[Any], None] | None = None,
                 metrics_view: MetricsViewFactory | None = None) -> LaunchResult:
    """Run one packed call on every worker of ``group`` and gather what came back."""
    ranks = [r.rank for r in group.plan.ranks]
    group.output.live_ranks = {0} if output == "rank0" else (set(ranks) if output == "all" else set())
    group.output.prefix = output == "all"
    marks = {rank: group.output.position(rank) for rank in ranks}
    history = MetricHistory()
    view = metrics_view(output == "all") if metrics_view is not None else None

    def on_metrics(batch: Any) -> None:
        history.add(batch)
        if view is not None:
            view.add(batch)
        if metric_sink is not None:
            metric_sink(batch)

    group.metric_sink = on_metrics
    started = time.perf_counter()
    global _last_result

    def outcome(values: dict[int, Any]) -> LaunchResult:
        return LaunchResult(values=values, plan=group.plan, seconds=time.perf_counter() - started,
                            metrics=history,
                            outputs={rank: group.output.text_since(rank, marks[rank]) for rank in ranks})

    succeeded = False
    try:
        pickled = group.call(payload, {0} if collect == "rank0" else set(ranks), timeout)
        if not group.persistent:
            group.shutdown()
        succeeded = True
    except LaunchFailed as failure:
        failure.metrics = history  # what was reported before the failure is not lost
        raise
    except KeyboardInterrupt as interrupt:
        # The stop button: the supervisor's frames would fill the cell and explain nothing;
        # the message says what happened.
        raise KeyboardInterrupt(*interrupt.args) from None
    finally:
        group.output.tick(force=True)
        if view is not None:
            view.close()
        if not succeeded:  # failed or interrupted: keep what the ranks printed and reported
            _last_result = outcome({})
    values = {rank: loads_in_kernel(data) for rank, data in pickled.items() if data is not None}
    _last_result = outcome(values)
    return _last_result


def last_result() -> LaunchResult | None:
    """The latest run in this kernel, however it was started (``notebook_launcher``,
    ``%%distributed``, a session): every rank's value, output and metrics, including output the
    cell skipped to stay responsive. After a failed or interrupted run ``values`` is empty and
    the output is what each rank printed before it ended."""
    return _last_result
