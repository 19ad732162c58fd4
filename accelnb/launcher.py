"""The one launch API every entry point (code, ``%%distributed``, panels, sessions) ends up calling.

    >>> from accelnb import notebook_launcher
    >>> def train(lr):
    ...     import torch.distributed as dist
    ...     return dist.get_rank(), lr
    >>> notebook_launcher(train, args=(1e-3,), num_processes=2)     # doctest: +SKIP
    (0, 0.001)

``launch`` returns a :class:`~accelnb.kernel.run.launch_result.LaunchResult` with every rank's value, the
metric history and the output; ``notebook_launcher`` returns rank 0's value (its first three
parameters match Accelerate's ``notebook_launcher``, so it is a drop-in replacement). ``plan``
shows what a launch with the same options would run, without starting anything.

Every keyword is an option described once in :mod:`accelnb.options`, and settled once
(:func:`accelnb.options.settle`: the picker's default selection, the Accelerate config file)
into the one object every later step reads, local and cluster launches alike. This module is the
composition root: it wires the notebook's displays into the engine, and orders the work so that
bad input fails before anything starts: check and settle the options, plan (raises on a
selection that does not fit the GPUs),
read the thread budget, pickle the call (raises naming an unpicklable argument), open the
TensorBoard log of ``log_dir=`` (raises if tensorboard is not installed), bind the rendezvous
port (raises if a requested one is taken), and only then fork workers from the template process
(:mod:`accelnb.kernel.helper.template`: clean, never a fork of the kernel, with the kernel's
imports done). With ``max_restarts=`` that start, run
and stop is repeated by :mod:`accelnb.kernel.run.attempts` when a rank fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from accelnb.cluster import ClusterRequest, cluster_backend
from accelnb.errors import LaunchConfigError
from accelnb.kernel.display.tensorboard_log import TensorBoardLog
from accelnb.kernel.doctor.preflight import preflight
from accelnb.kernel.helper.client import HelperSource
from accelnb.kernel.helper.payload import pack_call
from accelnb.kernel.helper.template import shared_helper
from accelnb.kernel.planning import rank_plan
from accelnb.kernel.planning.inventory import read_inventory
from accelnb.kernel.planning.worker_specs import threads_per_rank
from accelnb.kernel.run.attempts import run_attempts
from accelnb.kernel.run.call_settings import CallSettings
from accelnb.kernel.run.engine import AttemptSink, MetricRoute, MetricsView, last_result, start_workers
from accelnb.kernel.run.launch_result import LaunchResult
from accelnb.kernel.run.rank_group import RankGroup
from accelnb.kernel.run.sigterm import sigterm_as_stop
from accelnb.kernel.run.supervisor import WorkerGroup
from accelnb.options import (
    LAUNCH_OPTIONS,
    START_OPTIONS,
    LaunchKeywords,
    LaunchOptions,
    SettledOptions,
    StartKeywords,
    documents_options,
    settle,
)
from accelnb.wire.buffers import Packed

if TYPE_CHECKING:
    from typing import Unpack

__all__ = ["check_launch", "group_starter", "last_result", "launch", "launch_with", "metric_route",
           "notebook_launcher", "plan", "plan_launch", "start_group"]

# notebook_launcher returns rank 0's value, so by default it leaves the others' on the ranks.
_RANK0_VALUE = LaunchOptions(collect="rank0")


@documents_options(LaunchKeywords, defaults=_RANK0_VALUE)
def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    **options: Unpack[LaunchKeywords],
) -> Any:
    """Run ``function(*args, **kwargs)`` on every rank and return rank 0's return value.

    Args:
        function: defined anywhere, notebook cells included; travels by cloudpickle.
        args: its positional arguments; they must pickle (a clear error says which does not).
        num_processes: number of ranks. Without GPUs, CPU ranks on gloo; with GPUs, the first N.
        kwargs: its keyword arguments; they must pickle too.
        **options: the launch options listed under "Keyword Args" (described once in
            :class:`accelnb.options.LaunchOptions`); a misspelt one is refused with a suggestion.

    Returns:
        What ``function`` returned on rank 0.

    Raises:
        LaunchConfigError: bad input, before anything starts.
        RankFailed / RankCrashed / LaunchTimeout: the run failed; every worker is gone.
        KeyboardInterrupt: the run was interrupted; every worker is gone.
    """
    chosen = _RANK0_VALUE.with_keywords({**options, "num_processes": num_processes},
                                        accepted=LAUNCH_OPTIONS, caller="notebook_launcher()")
    return launch_with(function, args, kwargs, chosen).value


@documents_options(LaunchKeywords)
def launch(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    metric_sink: Callable[[Any], None] | None = None,
    **options: Unpack[LaunchKeywords],
) -> LaunchResult:
    """Like :func:`notebook_launcher`, but returns a :class:`LaunchResult` with every rank's value
    (``collect="all"``, the default here), the metric history and each rank's output.

    Args:
        function, args, num_processes, kwargs: as for :func:`notebook_launcher`.
        metric_sink: also called with every batch of ``report()`` metrics, as it arrives.
        **options: the launch options listed under "Keyword Args".

    Raises:
        The same as :func:`notebook_launcher`.
    """
    chosen = LaunchOptions().with_keywords({**options, "num_processes": num_processes},
                                           accepted=LAUNCH_OPTIONS, caller="launch()")
    return launch_with(function, args, kwargs, chosen, metric_sink=metric_sink)


def launch_with(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                options: LaunchOptions, *, metric_sink: Callable[[Any], None] | None = None) -> LaunchResult:
    """:func:`launch` for callers that already hold a :class:`LaunchOptions` (the magic)."""
    settled = settle(options)  # raises on a bad config file
    options = settled.options
    local_plan = plan_launch(settled) if options.cluster == "local" else None  # raises on a bad selection
    payload = pack_call(function, args, kwargs or {})
    sinks: list[AttemptSink] = []
    if metric_sink is not None:
        sinks.append(lambda batch, attempt: metric_sink(batch))
    start = group_starter(settled, persistent=False, the_plan=local_plan)
    # A log_dir= that cannot be written fails here, before start; a SIGTERM is a Stop press from here on.
    with metric_route(options, sinks) as route, sigterm_as_stop():
        return _run_attempts(start, payload, options, route)


def _run_attempts(start: Callable[[int], RankGroup], payload: Packed, options: LaunchOptions,
                  route: MetricRoute) -> LaunchResult:
    try:
        return run_attempts(start, payload, options.view(CallSettings), metrics=route,
                            max_restarts=options.max_restarts, restart_delay=options.restart_delay)
    except KeyboardInterrupt as interrupt:
        # The stop button: the engine's frames would fill the cell and explain nothing. The
        # exception itself (its type and message say what was stopped) is kept.
        raise interrupt.with_traceback(None) from None


@contextmanager
def metric_route(options: LaunchOptions, sinks: Sequence[AttemptSink] = ()) -> Iterator[MetricRoute]:
    """Where a run's ``report()`` batches go: its history, the notebook's live chart, ``sinks``,
    and the TensorBoard log of ``log_dir=`` (opened before anything starts, closed at the end)."""
    log = TensorBoardLog(options.log_dir) if options.log_dir is not None else None
    route = MetricRoute(live_metrics_view(options.output == "all"), [*sinks, *([log.add] if log else [])])
    try:
        yield route
    finally:
        route.close()
        if log is not None:
            log.close()


@documents_options(StartKeywords)
def plan(**options: Unpack[StartKeywords]) -> rank_plan.LaunchPlan:
    """The ranks a launch with these options would run, as ``launch`` would plan them (the picker's
    selection included), without starting anything: ``print(plan(gpus="0,1").table())``.

    Args:
        **options: the options that place ranks, listed under "Keyword Args".

    Raises:
        LaunchConfigError: the options, or the selection against the GPUs, are wrong.
    """
    chosen = LaunchOptions().with_keywords(options, accepted=START_OPTIONS, caller="plan()")
    if chosen.cluster != "local":
        raise LaunchConfigError("plan() shows the ranks of this machine. On a cluster the ranks are planned once "
                                "Ray has placed them: the table a launch prints at its start shows them.")
    return plan_launch(chosen)


def plan_launch(options: LaunchOptions | SettledOptions) -> rank_plan.LaunchPlan:
    """The plan of this machine's ranks for ``options`` (settled here unless they are already):
    the pure planner places the ranks from plain values, then the settled options join every
    rank's environment."""
    settled = options if isinstance(options, SettledOptions) else settle(options)
    placing = settled.options
    try:
        the_plan = rank_plan.plan(placing.gpus, placing.num_processes, inventory=placing.inventory or read_inventory(),
                                  cpu=placing.cpu, backend=placing.backend, gpus_per_rank=placing.gpus_per_rank)
    except LaunchConfigError as error:
        if not settled.from_file:
            raise
        raise type(error)(f"{error} ({', '.join(settled.from_file)} from {placing.config_file})") from None
    return the_plan.with_options(settled.rank_options, notes=settled.notes)


def group_starter(settled: SettledOptions, *, persistent: bool, helpers: HelperSource = shared_helper,
                  the_plan: rank_plan.LaunchPlan | None = None,
                  threads: int | None = None) -> Callable[[int], RankGroup]:
    """What starts the ranks of ``settled`` (given a restart count), once everything that can be
    checked before anything starts has been: this machine's plan (``the_plan``, if the caller
    made it already), or the cluster backend's checks (Ray installed, a cluster reachable and big
    enough). Local workers are forked by a helper from ``helpers``, each with ``threads`` threads
    (default: the cores shared among this launch's ranks)."""
    options = settled.options
    if options.cluster != "local":
        backend = cluster_backend(options.cluster)
        request = settled.view(ClusterRequest)
        backend.check(request)
        return lambda restart_count: backend.start(request, persistent=persistent, restart_count=restart_count)
    local_plan = the_plan or plan_launch(settled)
    return lambda restart_count: start_group(local_plan, options, persistent=persistent, restart_count=restart_count,
                                             helpers=helpers, threads=threads)


def check_launch(options: LaunchOptions) -> None:
    """Raise what a launch with ``options`` would raise before starting anything."""
    group_starter(settle(options), persistent=False)


def start_group(the_plan: rank_plan.LaunchPlan, options: LaunchOptions, *, persistent: bool,
                restart_count: int = 0, helpers: HelperSource = shared_helper,
                threads: int | None = None) -> WorkerGroup:
    """Fork the workers of ``the_plan``; a bad ``OMP_NUM_THREADS`` or a failed pre-launch check
    (:mod:`accelnb.kernel.doctor.preflight`) fails first, before the port is bound or anything is forked."""
    threads_per_rank(len(the_plan.ranks))
    if restart_count == 0:  # a restart runs on the machine the first attempt was judged on
        preflight(the_plan)
    return start_workers(the_plan, options.master_port, persistent=persistent, quiet=options.quiet,
                         restart_count=restart_count, helpers=helpers, threads=threads)


def live_metrics_view(all_ranks: bool) -> MetricsView:
    """The notebook's live chart of ``report()`` metrics (imported only when a run reports)."""
    from accelnb.notebook.metrics_view import LiveMetricsView  # the UI is wired here, at the top

    return LiveMetricsView(all_ranks=all_ranks)
