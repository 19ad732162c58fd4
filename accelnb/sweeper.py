"""One experiment per GPU: ``sweep(fn, configs)`` runs ``fn(config)`` once per config, side by side.

    >>> import accelnb
    >>> def train(config):
    ...     for step in range(100):
    ...         loss = ...
    ...         accelnb.report(step=step, loss=loss)
    ...     return loss
    >>> trials = accelnb.sweep(train, [{"lr": lr} for lr in (1e-4, 3e-4, 1e-3, 3e-3)],
    ...                        best="loss")                                       # doctest: +SKIP
    >>> trials.best.config, trials.to_pandas()                                    # doctest: +SKIP

Each trial is one launch, made by the same pieces :func:`accelnb.launcher.launch_with` uses (its
plan, :func:`~accelnb.launcher.group_starter`, :func:`~accelnb.kernel.run.attempts.run_attempts`
with restarts and timeouts), on its own GPUs: the pool (``gpus=``, else the picker's selection,
else every visible GPU) cut into slots of ``gpus_per_trial`` (:mod:`accelnb.kernel.sweep.slots`),
so that no GPU runs two trials; a slot whose trial ended takes the next config. Without GPUs (or
with ``cpu=True``) trials run on CPU ranks, ``max_concurrent`` at a time (default: one rank per
core). How the trials run at once, one thread each, and why that is safe with the engine as it
is, is :mod:`accelnb.kernel.sweep.scheduler`'s docstring.

What is not the same as a launch, and why:

- nothing of a trial is printed in the cell (``output="none"``, no start table): the cell shows
  one live table of trials (:mod:`accelnb.notebook.sweep_table`), and each trial keeps its own
  output (``trial.output()``) and metrics (``trial.metrics``);
- each rank gets its share of the cores among all the ranks that run at once, not among its
  trial's ranks only (trials side by side would otherwise ask for several times the cores);
- ``log_dir=`` gets one TensorBoard run per trial, ``log_dir/trial-N``;
- ``master_port=`` is refused (the trials run at once, each needs its own port) and so are the
  options of a Ray cluster (a sweep places trials on this machine's GPUs).

Everything that can be checked is checked before any process starts: the configs, ``mode=``,
the options, every slot's plan against the GPUs, that ``fn`` and every config pickle. A failing
trial does not stop the others unless ``fail_fast=True``: then the first failure stops every
running trial and is raised, with the trials attached (``error.trials``). Stop (the kernel's
interrupt, a panel's Stop) ends every running trial and raises
:class:`~accelnb.errors.RunInterrupted` with the trials attached the same way: the finished
ones keep their values and metrics.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict

from accelnb.errors import LaunchConfigError, LaunchFailed, RunInterrupted
from accelnb.kernel.display.tensorboard_log import TensorBoardLog
from accelnb.kernel.helper.payload import check_picklable, pack_call
from accelnb.kernel.helper.template import shared_helper
from accelnb.kernel.planning.inventory import read_inventory
from accelnb.kernel.planning.rank_environment import kernel_omp_setting
from accelnb.kernel.planning.rank_plan import GpuSpec, LaunchPlan
from accelnb.kernel.run.attempts import run_attempts
from accelnb.kernel.run.call_settings import CallSettings
from accelnb.kernel.run.engine import MetricRoute
from accelnb.kernel.run.rank_group import RankGroup
from accelnb.kernel.run.sigterm import sigterm_as_stop
from accelnb.kernel.run.supervisor import WorkerGroup
from accelnb.kernel.sweep.scheduler import SweepStop, run_trials
from accelnb.kernel.sweep.slots import Slot, check_concurrency, cpu_slots, default_cpu_concurrency, gpu_slots
from accelnb.kernel.sweep.sweep_state import SweepPublisher
from accelnb.kernel.sweep.trials import MODES, Mode, Trial, Trials, describe_config
from accelnb.kernel.watched_state.selection import current_selection
from accelnb.launcher import group_starter, plan_launch
from accelnb.options import LaunchOptions, SettledOptions, documents_options, keyword_names, settle

if TYPE_CHECKING:
    from typing import Unpack

    from accelnb.kernel.planning.inventory import Inventory

__all__ = ["SweepKeywords", "Trial", "Trials", "run_sweep", "sweep"]


class SweepKeywords(TypedDict, total=False):
    """The launch options a sweep passes to every trial."""

    num_processes: int | None
    gpus_per_rank: int
    cpu: bool
    backend: str | None
    mixed_precision: str | None
    inventory: Inventory | None
    group_timeout: float | None
    timeout: float | None
    log_dir: str | os.PathLike[str] | None
    stall_timeout: float | None
    max_restarts: int
    restart_delay: float


SWEEP_OPTIONS = keyword_names(SweepKeywords)
# Launch options a sweep does not take, and why (the generic refusal would point at sessions).
_NOT_IN_A_SWEEP = {
    "master_port": "its trials run at once, and each binds a free port of its own",
    "cluster": "a sweep places its trials on this machine's GPUs",
    "nodes": "a sweep places its trials on this machine's GPUs",
    "gpus_per_node": "a sweep places its trials on this machine's GPUs",
    "config_file": "a config file places the ranks of one launch; pass its mixed_precision= as a keyword, "
                   "and the GPUs the trials share as gpus=",
    "output": "each trial's output is kept with the trial (trial.output()), and the cell shows the table of trials",
    "collect": "a trial's value is what its function returned on rank 0",
    "quiet": "the cell shows the table of trials, never a trial's start table",
    "ranks": "each trial is a launch of its own, on every rank it starts",
}
# A trial's value is rank 0's; its output stays with it; no start table among the trials' rows.
_TRIAL_DEFAULTS = LaunchOptions(collect="rank0", output="none", quiet=True)


@documents_options(SweepKeywords)
def sweep(
    fn: Callable[[Any], Any],
    configs: Iterable[Any],
    *,
    gpus: GpuSpec = None,
    gpus_per_trial: int = 1,
    max_concurrent: int | None = None,
    best: str | None = None,
    mode: Mode = "min",
    fail_fast: bool = False,
    **options: Unpack[SweepKeywords],
) -> Trials:
    """Run ``fn(config)`` once per config, each on its own GPUs, as many at once as the GPUs allow.

    Args:
        fn: the trial, defined anywhere (notebook cells included); it may ``report()`` metrics
            and use ``torch.distributed`` as in any launch (a trial of several ranks is a DDP group).
        configs: one per trial (a list of dicts, usually); each must pickle.
        gpus: the pool of GPUs the trials share (``"0,1,2,3"``, a list, ``"all"``). Default: the
            GPU picker's selection, else every visible GPU; without GPUs, CPU trials.
        gpus_per_trial: GPUs each trial owns: one rank each (``gpus_per_rank=`` for ranks of
            several GPUs). ``num_processes=N`` means N GPUs per trial too; on CPU, N ranks per trial.
        max_concurrent: at most this many trials at once. Default: every slot of the pool on
            GPUs; on CPU, one rank per core.
        best: the metric (a ``report()``ed name, or a key of the returned dict) whose best trial the
            table marks and ``trials.best`` returns.
        mode: ``"min"`` (lower is better, the default) or ``"max"``.
        fail_fast: stop every running trial and raise at the first failure.
        **options: launch options for every trial, listed under "Keyword Args".

    Returns:
        :class:`~accelnb.kernel.sweep.trials.Trials`: the trials in config order (``.config``,
        ``.value``, ``.error``, ``.metrics``, ``.latest``, ``.gpus``, ``.seconds``, ``.output()``),
        with ``.best`` and ``.to_pandas()``.

    Raises:
        LaunchConfigError: bad input, before anything starts.
        LaunchFailed: with ``fail_fast=True``, the first failure; ``error.trials`` holds every trial.
        RunInterrupted: Stop; every trial's ranks are gone, ``error.trials`` holds every trial.
    """
    return run_sweep(fn, configs, options, gpus=gpus, gpus_per_trial=gpus_per_trial,
                     max_concurrent=max_concurrent, best=best, mode=mode, fail_fast=fail_fast)


@dataclass(frozen=True)
class SweepLayout:
    """Where the trials run: the slots, and each slot's settled options and plan (checked already)."""

    slots: list[Slot]
    plans: dict[int, tuple[SettledOptions, LaunchPlan]]


def run_sweep(fn: Callable[..., Any], configs: Iterable[Any], options: Mapping[str, Any], *,
              gpus: GpuSpec = None, gpus_per_trial: int = 1, max_concurrent: int | None = None,
              best: str | None = None, mode: Mode = "min", fail_fast: bool = False, caller: str = "sweep()",
              args_of: Callable[[Any], tuple[Any, ...]] = lambda config: (config,),
              value_of: Callable[[Any], Any] = lambda value: value) -> Trials:
    """:func:`sweep` for callers that run something else per config (the magic runs its cell with
    ``config`` bound): each trial launches ``fn(*args_of(config))``, and its value is ``value_of``
    of rank 0's."""
    configs = _check_configs(configs)
    _check_choices(best, mode, gpus_per_trial, max_concurrent, caller)
    keywords = dict(options)
    for name in keywords:
        if name in _NOT_IN_A_SWEEP:
            raise LaunchConfigError(f"{caller} does not take {name}=: {_NOT_IN_A_SWEEP[name]}.")
    if keywords.get("cpu") and keywords.get("num_processes") is None:
        keywords["num_processes"] = gpus_per_trial  # CPU trials: ranks per trial
    base = _TRIAL_DEFAULTS.with_keywords(keywords, accepted=SWEEP_OPTIONS, caller=caller)
    layout = _layout(base, gpus, gpus_per_trial, max_concurrent)
    pack_call(fn, args_of(configs[0]), {})  # raises naming what of fn cannot travel
    for index, config in enumerate(configs):
        check_picklable(f"Config {index} (configs[{index}])", config)
    logs = _open_logs(base.log_dir, len(configs))  # raises when tensorboard is missing
    trials = Trials([Trial(index, config) for index, config in enumerate(configs)], metric=best, mode=mode)
    shared_helper()  # ready, with the kernel's imports done, before the trial threads ask for it
    table = _live_table(trials)
    publisher = SweepPublisher(trials, lambda trial: describe_config(trial.config, 40))

    threads = _threads_per_rank(layout)

    def run_one(trial: Trial, slot: Slot, stop: SweepStop) -> None:
        settled, the_plan = layout.plans[slot.index]
        _run_trial(trial, settled, the_plan, stop, pack=lambda: pack_call(fn, args_of(trial.config), {}),
                   value_of=value_of, log=logs[trial.index] if logs else None, threads=threads)

    try:
        with sigterm_as_stop():  # a pre-empted machine's SIGTERM is a Stop to every trial, then ends us
            ending = run_trials(trials, layout.slots, run_one, fail_fast=fail_fast, tick=table.refresh,
                                on_change=publisher.publish)
    finally:
        for log in logs:
            log.close()
        table.close()
        publisher.finish()
    if ending == "stopped":
        raise _with_trials(_interrupted(trials), trials)
    if ending == "failed_fast":
        raise _with_trials(_first_failure(trials), trials)
    return trials


# ── before anything starts ───────────────────────────────────────────────────────────────────
def _check_configs(configs: Iterable[Any]) -> list[Any]:
    if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, Iterable):
        raise LaunchConfigError(f"configs must be a list of configurations (one per trial), got "
                                f"{type(configs).__name__}. For one trial write [config].")
    listed = list(configs)
    if not listed:
        raise LaunchConfigError("configs is empty: a sweep runs one trial per config. Pass at least one, "
                                'e.g. [{"lr": 1e-3}, {"lr": 1e-2}].')
    return listed


def _check_choices(best: str | None, mode: str, gpus_per_trial: int, max_concurrent: int | None, caller: str) -> None:
    if mode not in MODES:
        raise LaunchConfigError(f"mode={mode!r} must be 'min' (lower {best or 'the metric'} is better) or 'max'.")
    if best is not None and not isinstance(best, str):
        raise LaunchConfigError(f"best= names a metric (a report()ed name, or a key of the returned dict), "
                                f"got {type(best).__name__} {best!r}.")
    if isinstance(gpus_per_trial, bool) or not isinstance(gpus_per_trial, int) or gpus_per_trial < 1:
        raise LaunchConfigError(f"gpus_per_trial must be a whole number of at least 1, got {gpus_per_trial!r}.")
    check_concurrency(max_concurrent)


def _layout(base: LaunchOptions, gpus: GpuSpec, gpus_per_trial: int, max_concurrent: int | None) -> SweepLayout:
    """The slots, and each slot's plan, checked against the GPUs (raises before anything starts)."""
    if base.cpu:
        return _cpu_layout(base, gpus_per_trial, max_concurrent)
    inventory = base.inventory or read_inventory()
    base = replace(base, inventory=inventory)  # NVML is read once; every trial plans on the same GPUs
    picked = current_selection() if gpus is None else None
    if gpus is None and not (picked is not None and picked.gpus) and not inventory.visible:
        return _cpu_layout(base, gpus_per_trial, max_concurrent)  # no GPU here: CPU trials
    # The pool, as a launch with these GPUs would take them (the picker's selection by default).
    pool_plan = plan_launch(replace(base, gpus=gpus, num_processes=None, gpus_per_rank=1))
    pool = [rank.gpu.index for rank in pool_plan.ranks if rank.gpu is not None]
    if not pool:  # the picker chose CPU ranks
        return _cpu_layout(base, gpus_per_trial, max_concurrent)
    per_trial = gpus_per_trial
    if base.num_processes is not None:
        if gpus_per_trial not in (1, base.num_processes * base.gpus_per_rank):
            raise LaunchConfigError(f"num_processes={base.num_processes} and gpus_per_trial={gpus_per_trial} "
                                    "disagree: pass only one of them.")
        per_trial = base.num_processes * base.gpus_per_rank
    slots = gpu_slots(pool, per_trial, max_concurrent)
    plans = {}
    for slot in slots:
        settled = settle(replace(base, gpus=list(slot.gpus), num_processes=None))
        plans[slot.index] = (settled, plan_launch(settled))
    return SweepLayout(slots, plans)


def _cpu_layout(base: LaunchOptions, gpus_per_trial: int, max_concurrent: int | None) -> SweepLayout:
    ranks = base.num_processes or gpus_per_trial
    settled = settle(replace(base, cpu=True, gpus=None, num_processes=ranks))
    the_plan = plan_launch(settled)
    slots = cpu_slots(max_concurrent or default_cpu_concurrency(ranks))
    return SweepLayout(slots, {slot.index: (settled, the_plan) for slot in slots})


def _threads_per_rank(layout: SweepLayout) -> int | None:
    """Each rank's threads: the cores shared among every rank of the trials that run at once (a
    launch alone would give each of its ranks ``cores / its ranks``, and trials side by side would
    then ask for several times the cores: on 2 cores, under load, four 300-step MLP trials two at
    a time took 31 s that way and 1.2 s with one thread each, ``benchmarks/bench_sweep.py``). None where the
    kernel sets ``OMP_NUM_THREADS``: that stays every rank's, as for a launch."""
    if kernel_omp_setting() is not None:
        return None
    ranks = sum(len(layout.plans[slot.index][1].ranks) for slot in layout.slots)
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def _open_logs(log_dir: str | os.PathLike[str] | None, count: int) -> list[TensorBoardLog]:
    if log_dir is None:
        return []
    logs: list[TensorBoardLog] = []
    try:
        for index in range(count):
            logs.append(TensorBoardLog(os.path.join(os.fspath(log_dir), f"trial-{index}")))
    except BaseException:
        for log in logs:
            log.close()
        raise
    return logs


def _live_table(trials: Trials) -> Any:
    """The cell's live table of trials (the UI is wired here, at the top, as the launcher does)."""
    from accelnb.notebook.sweep_table import SweepTable

    return SweepTable(trials)


# ── one trial, on its slot's thread ──────────────────────────────────────────────────────────
def _run_trial(trial: Trial, settled: SettledOptions, the_plan: LaunchPlan, stop: SweepStop, *,
               pack: Callable[[], Any], value_of: Callable[[Any], Any], log: TensorBoardLog | None,
               threads: int | None) -> None:
    """Launch one trial as :func:`accelnb.launcher.launch_with` would, and record how it ended.
    Raises nothing: a failure is the trial's ``error``."""
    options = settled.options
    starter = group_starter(settled, persistent=False, helpers=shared_helper, the_plan=the_plan, threads=threads)

    def start(restart_count: int) -> RankGroup:
        if stop.requested.is_set():
            raise RunInterrupted("accelnb stopped the sweep before this trial's ranks started.")
        group = starter(restart_count)
        trial.follow(group.output)
        if isinstance(group, WorkerGroup) and group.run is not None:
            stop.attach(trial.index, group.run)
        return group

    route = MetricRoute(None, [trial.add_metrics, *([log.add] if log is not None else [])])
    try:
        result = run_attempts(start, pack(), options.view(CallSettings), metrics=route,
                              max_restarts=options.max_restarts, restart_delay=options.restart_delay,
                              notice=trial.note)
        trial.succeed(result, value_of(result.value))
    except BaseException as error:  # a rank's failure, Stop, or a start that failed: the trial's end
        trial.fail(error)
    finally:
        stop.detach(trial.index)
        route.close()


# ── how a sweep that did not finish ends ─────────────────────────────────────────────────────
def _with_trials(error: BaseException, trials: Trials) -> BaseException:
    """``error`` carrying the sweep's trials, as a failed launch carries its metrics."""
    error.trials = trials  # type: ignore[attr-defined]
    return error.with_traceback(None)


def _interrupted(trials: Trials) -> RunInterrupted:
    done = sum(trial.ok for trial in trials)
    stopped = sum(trial.state == "stopped" for trial in trials)
    skipped = sum(trial.state == "skipped" for trial in trials)
    return RunInterrupted(f"accelnb stopped the sweep: {stopped} running trial(s) ended and every rank of theirs "
                          f"is gone, {skipped} never started. The {done} finished trial(s) are kept: "
                          "error.trials (or _sweep after a %%distributed --sweep cell).")


def _first_failure(trials: Trials) -> BaseException:
    failed = [trial for trial in trials if trial.state == "failed" and trial.error is not None]
    first = min(failed, key=lambda trial: trial.ended_at or 0.0)
    error = first.error
    assert error is not None
    note = (f"Trial {first.index} ({describe_config(first.config)}) failed, and fail_fast=True stopped the "
            f"sweep: {sum(t.ok for t in trials)} trial(s) done, {sum(t.state == 'stopped' for t in trials)} "
            f"stopped, {sum(t.state == 'skipped' for t in trials)} not started.")
    if isinstance(error, LaunchFailed):
        error.message = f"{note}\n{error.message}"
        error.args = (error.message,)
    return error
