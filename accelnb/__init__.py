"""accelnb: multi-GPU PyTorch training from a Jupyter notebook, as easy as running a cell.

    from accelnb import notebook_launcher
    loss = notebook_launcher(train, args=(1e-3,), gpus="0,1")     # or num_processes=2 on CPU

or ``%load_ext accelnb`` and a ``%%distributed --gpus 0,1`` cell; ``Session.start(...)`` keeps
workers (and their variables) between calls; ``sweep(fn, configs)`` runs one trial per config
side by side, each on its own GPUs; ``doctor()`` checks the machine before a launch,
``stacks()`` shows every rank's stack while it runs; ``max_restarts=N`` restarts every rank when one
fails (the function reads ``restart_count()``), ``stop_requested()`` turns Stop into a save
and a clean end, ``log_dir=`` writes TensorBoard logs of
``report()``. Every launch option is described once, in
:class:`accelnb.options.LaunchOptions`. Importing accelnb has no side effects: no NVML, no CUDA,
no threads, no processes until the first launch.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what each public name is, for type checkers and editors; imported on first use
    from accelnb.errors import (
        AccelnbError,
        GpuSelectionError,
        HelperDied,
        LaunchConfigError,
        LaunchFailed,
        LaunchInsideLaunchError,
        LaunchTimeout,
        PortInUseError,
        RankCrashed,
        RankFailed,
        RankFailure,
        RunInterrupted,
        ScriptExited,
        UnpicklableError,
        WorkerStartError,
    )
    from accelnb.kernel.display.metrics_history import MetricHistory
    from accelnb.kernel.doctor.checks import doctor
    from accelnb.kernel.doctor.report import Check, DoctorReport
    from accelnb.kernel.helper.template import prewarm
    from accelnb.kernel.planning.inventory import GpuInfo, Inventory, read_inventory, synthetic_inventory
    from accelnb.kernel.planning.rank_plan import LaunchPlan, RankSpec
    from accelnb.kernel.run.launch_result import LaunchResult
    from accelnb.kernel.run.live_stacks import stacks
    from accelnb.kernel.watched_state.selection import Selection, current_selection, set_selection
    from accelnb.launcher import last_result, launch, notebook_launcher, plan
    from accelnb.other_launchers import spawn, torchrun
    from accelnb.session import Session
    from accelnb.sweeper import Trial, Trials, sweep
    from accelnb.worker.accelerate_tracker import AccelerateTracker
    from accelnb.worker.progress import progress
    from accelnb.worker.report import report
    from accelnb.worker.restarts import restart_count
    from accelnb.worker.stopping.library_callbacks import LightningSaveOnStop, TrainerSaveOnStop
    from accelnb.worker.stopping.rank_stop import stop_requested

# Every public name and the module that defines it. Nothing is imported with ``accelnb``: a rank
# imports ``accelnb.worker.*``, which runs this file first, and must not load the kernel's 30-odd
# modules, the launcher and the session with it (tests/test_layout.py checks a real rank's
# ``sys.modules``); in the kernel each name costs its import once, on first use.
_DEFINED_IN: dict[str, str] = {
    "AccelnbError": "accelnb.errors",
    "GpuSelectionError": "accelnb.errors",
    "HelperDied": "accelnb.errors",
    "LaunchConfigError": "accelnb.errors",
    "LaunchFailed": "accelnb.errors",
    "LaunchInsideLaunchError": "accelnb.errors",
    "LaunchTimeout": "accelnb.errors",
    "PortInUseError": "accelnb.errors",
    "RankCrashed": "accelnb.errors",
    "RankFailed": "accelnb.errors",
    "RankFailure": "accelnb.errors",
    "ScriptExited": "accelnb.errors",
    "RunInterrupted": "accelnb.errors",
    "UnpicklableError": "accelnb.errors",
    "WorkerStartError": "accelnb.errors",
    "MetricHistory": "accelnb.kernel.display.metrics_history",
    "doctor": "accelnb.kernel.doctor.checks",
    "Check": "accelnb.kernel.doctor.report",
    "DoctorReport": "accelnb.kernel.doctor.report",
    "prewarm": "accelnb.kernel.helper.template",
    "GpuInfo": "accelnb.kernel.planning.inventory",
    "Inventory": "accelnb.kernel.planning.inventory",
    "read_inventory": "accelnb.kernel.planning.inventory",
    "synthetic_inventory": "accelnb.kernel.planning.inventory",
    "LaunchPlan": "accelnb.kernel.planning.rank_plan",
    "RankSpec": "accelnb.kernel.planning.rank_plan",
    "Selection": "accelnb.kernel.watched_state.selection",
    "current_selection": "accelnb.kernel.watched_state.selection",
    "set_selection": "accelnb.kernel.watched_state.selection",
    "LaunchResult": "accelnb.kernel.run.launch_result",
    "stacks": "accelnb.kernel.run.live_stacks",
    "last_result": "accelnb.launcher",
    "launch": "accelnb.launcher",
    "notebook_launcher": "accelnb.launcher",
    "spawn": "accelnb.other_launchers",
    "torchrun": "accelnb.other_launchers",
    "plan": "accelnb.launcher",
    "Session": "accelnb.session",
    "sweep": "accelnb.sweeper",
    "Trial": "accelnb.sweeper",
    "Trials": "accelnb.sweeper",
    "AccelerateTracker": "accelnb.worker.accelerate_tracker",
    "progress": "accelnb.worker.progress",
    "report": "accelnb.worker.report",
    "restart_count": "accelnb.worker.restarts",
    "stop_requested": "accelnb.worker.stopping.rank_stop",
    "TrainerSaveOnStop": "accelnb.worker.stopping.library_callbacks",
    "LightningSaveOnStop": "accelnb.worker.stopping.library_callbacks",
    "Panel": "accelnb.notebook.panel",  # pulls in ipywidgets
}


__all__ = [
    "AccelerateTracker",
    "AccelnbError",
    "Check",
    "DoctorReport",
    "GpuInfo",
    "GpuSelectionError",
    "HelperDied",
    "Inventory",
    "LaunchConfigError",
    "LaunchFailed",
    "LaunchInsideLaunchError",
    "LaunchPlan",
    "LaunchResult",
    "LaunchTimeout",
    "LightningSaveOnStop",
    "MetricHistory",
    "Panel",
    "PortInUseError",
    "RankCrashed",
    "RankFailed",
    "RankFailure",
    "RankSpec",
    "RunInterrupted",
    "ScriptExited",
    "Selection",
    "Session",
    "TrainerSaveOnStop",
    "Trial",
    "Trials",
    "UnpicklableError",
    "WorkerStartError",
    "current_selection",
    "doctor",
    "last_result",
    "launch",
    "notebook_launcher",
    "plan",
    "prewarm",
    "progress",
    "read_inventory",
    "report",
    "restart_count",
    "set_selection",
    "spawn",
    "stacks",
    "stop_requested",
    "sweep",
    "synthetic_inventory",
    "torchrun",
]


def __getattr__(name: str) -> object:
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module 'accelnb' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext accelnb``: the ``%%distributed`` magic, the side panel's comm target, and a
    head start for accelnb's helper process (so the first launch does not wait for torch)."""
    from accelnb.kernel.helper.template import prewarm
    from accelnb.notebook.lab_bridge import register_comm_target
    from accelnb.notebook.magic import DistributedMagics

    ipython.register_magics(DistributedMagics)  # type: ignore[attr-defined]
    register_comm_target(ipython)  # type: ignore[arg-type]
    prewarm()


def unload_ipython_extension(ipython: object) -> None:
    """``%unload_ext accelnb``: the side panel can no longer connect; open panels are closed."""
    from accelnb.notebook.lab_bridge import unregister_comm_target

    unregister_comm_target(ipython)  # type: ignore[arg-type]


def _follow_cells_in_a_kernel() -> None:
    """Importing accelnb in a Jupyter kernel, in any form, has the template the ranks fork from
    warm by the next cell (``accelnb/notebook/template_warming.py``). Nothing is started here, and
    nothing at all outside a kernel (a rank, a script, a test): IPython is not even imported."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return
    from accelnb.notebook.template_warming import follow_cells

    follow_cells(shell)


_follow_cells_in_a_kernel()
