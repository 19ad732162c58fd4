"""The doctor's checks, run silently before every launch: a ``fail`` stops it, warnings show once.

Every launch (``notebook_launcher``, ``launch``, ``%%distributed``, ``Session.start``) calls
:func:`preflight` with its plan, before the rendezvous port is bound or anything is forked:

    >>> preflight(plan)                        # doctest: +SKIP
    accelnb doctor: warn  /dev/shm  64 MB in all, 60 MB free: under 1.0 GB, NCCL fails with ...
                          fix: give the container more: `docker run --shm-size=16g …` ...

A check that ``fail``\\s (127.0.0.1 unreachable, no port to bind) raises
:class:`~accelnb.errors.LaunchConfigError` naming the check and its fix. A warning is shown the
first time this kernel (process) sees it, then never again: the same small ``/dev/shm`` need not
fill every cell. ``accelnb.doctor()`` still shows every check, every time.

It has to stay cheap, since it is on every launch's path: it reads only what costs microseconds
(``statvfs`` of ``/dev/shm``, the file limit, the environment, one loopback connection), and
takes the GPUs from the plan, that is from the inventory the planner already read: no NVML
call of its own (MIG, ECC and peer-to-peer are ``doctor()``'s, which reads NVML), and no port
scan. Tests install other facts with :func:`set_facts_source` (a small ``/dev/shm``, a loopback
that refuses), as they install a GPU inventory.

The name lookup that torch's rendezvous store makes in every rank (``checks.MAPPED_LOOPBACK``) is
timed at the first launch of a process only, waiting at most ``FIRST_LAUNCH_LOOKUP_WAIT_S`` (twice that
when a first answer is slow, which is timed again: ``checks.time_rendezvous_lookup``): 1-3 ms
where a name server answers, and where none does, every launch of any launcher would wait the
resolver's timeout in each rank, with torch's one-line warning as the only clue.

Module-level state, one per kernel: ``_injected_source``, the facts a test installed (one
machine's facts per process), ``_warned``, the warnings already shown (each once per kernel), and
``_lookup_timed``, whether this process timed the name lookup already.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable

from accelnb.errors import LaunchConfigError
from accelnb.kernel.display.output import notebook_sink
from accelnb.kernel.doctor.checks import (
    MachineFacts,
    check_environment,
    check_gpus,
    check_network,
    check_open_files,
    check_shm,
    own_pids,
    probe_loopback,
    read_shm,
    resource_limit,
    time_rendezvous_lookup,
)
from accelnb.kernel.doctor.gpu_health import GpuFacts, GpuHealth
from accelnb.kernel.doctor.report import Check, DoctorReport
from accelnb.kernel.planning.rank_plan import LaunchPlan

LAUNCH_CHECKS: tuple[Callable[[MachineFacts], list[Check]], ...] = (
    check_shm, check_open_files, check_environment, check_gpus, check_network)
FactsSource = Callable[[LaunchPlan], MachineFacts]

_injected_source: FactsSource | None = None
_warned: set[tuple[str, str]] = set()  # (check, what it saw): shown once per kernel
_lookup_timed = False
FIRST_LAUNCH_LOOKUP_WAIT_S = 0.5


def preflight(plan: LaunchPlan) -> DoctorReport:
    """Judge this machine for ``plan``; raise on a ``fail``, show warnings not shown before.

    Raises:
        LaunchConfigError: a check failed; the launch could not work. Nothing has started.
    """
    facts = (_injected_source or read_launch_facts)(plan)
    report = DoctorReport()
    for check in LAUNCH_CHECKS:
        report.extend(check(facts))
    failed = [check for check in report if check.status == "fail"]
    if failed:
        raise LaunchConfigError("accelnb's pre-launch checks found a problem that stops every launch:\n"
                                + "\n".join(_describe(check) for check in failed)
                                + "\nNothing was started. accelnb.doctor() (or %distributed doctor) shows "
                                  "every check.")
    fresh = [check for check in report if check.status == "warn" and (check.name, check.detail) not in _warned]
    if fresh:
        _warned.update((check.name, check.detail) for check in fresh)
        notebook_sink("stderr", "\n".join(_describe(check) for check in fresh)
                      + "\n(accelnb shows each warning once per kernel; accelnb.doctor() shows every check.)\n")
    return report


def read_launch_facts(plan: LaunchPlan) -> MachineFacts:
    """The facts :data:`LAUNCH_CHECKS` judge, read cheaply; the GPUs are the plan's."""
    global _lookup_timed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    loopback_error, free_port = probe_loopback()
    lookup_s = None if _lookup_timed else time_rendezvous_lookup(FIRST_LAUNCH_LOOKUP_WAIT_S)
    _lookup_timed = True
    return MachineFacts(
        shm=read_shm(), open_files=(resource_limit(soft), resource_limit(hard)), environ=dict(os.environ),
        torch_module=None, gpus=gpu_facts_of(plan), own_pids=own_pids(), versions={},
        loopback_error=loopback_error, free_port=free_port, other_launchers_port_free=True, helper_pid=None,
        rendezvous_lookup_s=lookup_s)


def gpu_facts_of(plan: LaunchPlan) -> GpuFacts:
    """The plan's GPUs with the processes the planner's inventory saw on them (no NVML read)."""
    seen = {gpu.index: gpu for rank in plan.ranks for gpu in (rank.gpus or ((rank.gpu,) if rank.gpu else ()))}
    if not seen:
        return GpuFacts(driver=None, note="CPU ranks")
    return GpuFacts(driver="as the launch's inventory read it", gpus=tuple(
        GpuHealth(index=gpu.index, name=gpu.name, process_pids=tuple(p.pid for p in gpu.processes))
        for _, gpu in sorted(seen.items())))


def set_facts_source(source: FactsSource | None) -> None:
    """Install (or with ``None`` remove) what :func:`preflight` judges instead of this machine."""
    global _injected_source
    _injected_source = source


def forget_warnings() -> None:
    """Show every warning again at the next launch (tests; a kernel shows each once)."""
    _warned.clear()


def _describe(check: Check) -> str:
    fix = f"\n    fix: {check.fix}" if check.fix else ""
    return f"accelnb doctor: {check.status} {check.name}: {check.detail}{fix}"
