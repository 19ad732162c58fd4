"""Persistent sessions: workers that stay alive across cells, process group joined.

A one-shot launch forks workers, runs, and tears everything down. A session keeps the workers,
so the next call costs a pipe round trip instead of a launch, and each rank keeps its variables
(a model built in one ``%%distributed`` cell is trained in the next).

    >>> from accelnb import Session
    >>> with Session.start(num_processes=2) as session:                    # doctest: +SKIP
    ...     session.run(lambda: torch.distributed.get_rank()).values
    {0: 0, 1: 1}

``Session.start`` takes the options that place ranks (devices, backend, port: fixed for the
session's life); ``Session.run`` takes those of one call (``timeout``, ``output``, ``collect``,
``log_dir``, and ``ranks``: run it on some ranks only, to inspect or change their state).
Sessions take no ``max_restarts``: a restart starts fresh workers, and a session's
workers hold the variables of earlier calls, which a restart would silently lose; use a one-shot
``notebook_launcher(..., max_restarts=N)`` for a run that should survive a failed rank.
Leaving the ``with`` block, ``stop()``, or dropping the last reference to the session ends its
workers.

An exception that every rank reports leaves the session usable; a rank that dies, or one that
does not respond to an interrupt (stuck in a collective), ends it with the root cause shown.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psutil

from accelnb.errors import LaunchConfigError
from accelnb.kernel.display.rank_activity import RankActivity
from accelnb.kernel.helper.payload import pack_call
from accelnb.kernel.planning import rank_plan
from accelnb.kernel.planning.inventory import Inventory, read_inventory
from accelnb.kernel.run.call_settings import CallSettings
from accelnb.kernel.run.engine import AttemptSink, run_on_group
from accelnb.kernel.run.launch_result import LaunchResult
from accelnb.kernel.run.live_stacks import DEFAULT_WAIT_S, StackDump
from accelnb.kernel.run.rank_group import RankGroup
from accelnb.kernel.run.sigterm import sigterm_as_stop
from accelnb.kernel.run.supervisor import WorkerGroup
from accelnb.launcher import group_starter, metric_route
from accelnb.options import (
    SESSION_CALL_OPTIONS,
    START_OPTIONS,
    LaunchOptions,
    SessionCallKeywords,
    StartKeywords,
    documents_options,
    settle,
)

if TYPE_CHECKING:
    from typing import Unpack


class Session:
    """Workers kept alive between calls. Create with :meth:`Session.start`."""

    def __init__(self, group: RankGroup, options: LaunchOptions) -> None:
        self._group = group
        self.options = options  # what the session was started with, the picker's choice resolved
        # A session the user drops (reassigned, deleted, kernel shutting down) must not leave its
        # workers waiting for calls that never come. The finalizer holds the group, never self.
        self._finalizer = weakref.finalize(self, group.shutdown)
        self._activity: RankActivity | None = None  # the ranks' progress in the latest call
        self._last_call: tuple[dict[str, Any], LaunchOptions] | None = None  # see _call_options

    @classmethod
    @documents_options(StartKeywords)
    def start(cls, **options: Unpack[StartKeywords]) -> Session:
        """Start one worker per rank and keep them for :meth:`run`.

        Args:
            **options: the options that place ranks, listed under "Keyword Args".

        Raises:
            LaunchConfigError: bad input, before anything starts.
        """
        return cls.start_with(LaunchOptions().with_keywords(options, accepted=START_OPTIONS,
                                                            caller="Session.start()"))

    @classmethod
    def start_with(cls, options: LaunchOptions) -> Session:
        """:meth:`start` from a :class:`LaunchOptions` (the magic's restart reuses one). Its call
        options, if set, are the defaults of every :meth:`run`."""
        settled = settle(options)
        group = group_starter(settled, persistent=True)(0)
        try:
            return cls(group, settled.given)
        except BaseException:  # an interrupt before the finalizer holds the group
            group.shutdown()
            raise

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    @property
    def plan(self) -> rank_plan.LaunchPlan:
        return self._group.plan

    @property
    def alive(self) -> bool:
        return self._group.usable

    @documents_options(SessionCallKeywords)
    def run(
        self,
        function: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        metric_sink: Callable[[Any], None] | None = None,
        **options: Unpack[SessionCallKeywords],
    ) -> LaunchResult:
        """Run ``function`` on every rank of the session (see :func:`accelnb.launch`), or on
        the ranks in ``ranks=``.

            >>> session.run(set_learning_rate, (1e-4,), ranks=[1])        # doctest: +SKIP

        Args:
            function, args, kwargs, metric_sink: as for :func:`accelnb.launch`.
            **options: the options of one call, listed under "Keyword Args".

        Raises:
            LaunchConfigError: the session has ended, or bad input.
            RankFailed / RankCrashed / LaunchTimeout: see the module docstring for which end it.
        """
        call = self._call_options(options)
        if not self.alive:
            raise LaunchConfigError("This session has ended. Start a new one with Session.start() "
                                    "or %distributed start.")
        if call.ranks is not None:
            self._check_ranks(call.ranks)
        payload = pack_call(function, args, kwargs or {})
        try:
            sinks: list[AttemptSink] = [] if metric_sink is None else [lambda batch, attempt: metric_sink(batch)]
            with sigterm_as_stop(), metric_route(call, sinks) as route:
                self._activity = route.activity  # what status() shows, live during the call
                return run_on_group(self._group, payload, call.view(CallSettings), metrics=route,
                                    chosen_ranks=call.ranks)
        finally:
            if not self._group.usable:
                self._group.close()

    def _call_options(self, keywords: Mapping[str, Any]) -> LaunchOptions:
        """The session's options with this call's ``keywords`` applied and checked. A notebook's
        cells pass the same keywords cell after cell (``collect="rank0"`` differs from the
        session's): those are checked once, not again for every cell (14 µs of each, 30-40 in a
        kernel between cells). Only plain values are remembered, so a list changed in place since
        is checked again."""
        last = self._last_call
        if last is not None and last[0].keys() == keywords.keys() and all(
                keywords[name] is value for name, value in last[0].items()):
            return last[1]
        call = self.options.with_keywords(keywords, accepted=SESSION_CALL_OPTIONS, caller="Session.run()")
        if all(value is None or isinstance(value, (bool, int, float, str)) for value in keywords.values()):
            self._last_call = (dict(keywords), call)
        return call

    def _check_ranks(self, ranks: Sequence[int]) -> None:
        size = len(self.plan.ranks)
        missing = [rank for rank in ranks if rank >= size]
        if missing:
            raise LaunchConfigError(f"ranks={list(ranks)}: this session has {size} rank{'s' if size > 1 else ''} "
                                    f"(0 to {size - 1}), so there is no rank {', '.join(map(str, missing))}. "
                                    f"Choose among 0 to {size - 1}, or restart the session with more ranks.")

    def stacks(self, wait: float = DEFAULT_WAIT_S) -> StackDump:
        """Every rank's current Python stack, without stopping anything (see
        :func:`accelnb.stacks`). Between cells this thread reads the ranks' dumps itself, for up
        to ``wait`` s; during a call from another thread, that call's thread reads them."""
        return StackDump(self._group.collect_stacks(wait))

    def stop(self) -> None:
        """End every worker and free their resources. Safe to call more than once."""
        self._finalizer()  # runs group.shutdown once, and detaches the finalizer

    def status(self, inventory: Inventory | None = None) -> str:
        """Ranks, devices, pids and memory (host, and GPU where a rank has one), as
        ``%distributed status`` shows them. GPU memory comes from NVML, as nvidia-smi's."""
        if not isinstance(self._group, WorkerGroup):  # ranks on other machines: the group describes them
            return str(self._group.status())  # type: ignore[attr-defined]
        gpus_now = None if self.plan.simulated_gpus or all(r.gpu is None for r in self.plan.ranks) \
            else (inventory or read_inventory())
        lines = [f"accelnb session: {len(self.plan.ranks)} rank(s), backend {self.plan.backend}, "
                 f"{'running' if self.alive else 'ended'}"]
        for worker, spec in zip(self._group.workers, self.plan.ranks, strict=True):
            try:
                rss = f"{psutil.Process(worker.pid).memory_info().rss / 2**20:,.0f} MiB"
            except psutil.Error:
                rss = "gone"
            line = f"  {spec.describe(self.plan.simulated_gpus)}  pid {worker.pid}  memory {rss}"
            if gpus_now is not None and spec.gpu is not None:
                line += f"  GPU memory {gpu_memory_of(worker.pid, spec.gpu.uuid, gpus_now)}"
            lines.append(line)
        if self._activity is not None and self._activity.counting:
            self._activity.sample()
            lines.append("progress in the last call:")
            lines.extend(f"  rank {row.rank}: {row.describe()}" for row in self._activity.rows())
        return "\n".join(lines)


def gpu_memory_of(pid: int, gpu_uuid: str, inventory: Inventory) -> str:
    """What ``status()`` says of the GPU memory process ``pid`` holds on the GPU ``gpu_uuid``."""
    gpu = inventory.by_uuid(gpu_uuid)
    if gpu is None:
        return "unknown (GPU not found by NVML)"
    total = f"of {gpu.memory_total / 2**20:,.0f} MiB"
    mine = [p for p in gpu.processes if p.pid == pid]
    if not mine:
        return f"none listed for this pid {total}"  # no CUDA context yet (or NVML sees host pids)
    if mine[0].memory_used is None:
        return f"in use, amount not reported by the driver, {total}"
    return f"{mine[0].memory_used / 2**20:,.0f} MiB {total}"
