"""accelnb: multi-GPU PyTorch training from a Jupyter notebook, as easy as running a cell.

    from accelnb import notebook_launcher
    loss = notebook_launcher(train, args=(1e-3,), gpus="0,1")     # or num_processes=2 on CPU

or ``%load_ext accelnb`` and a ``%%distributed --gpus 0,1`` cell; ``Session.start(...)`` keeps
workers (and their variables) between calls; ``doctor()`` checks the machine before a launch,
``stacks()`` shows every rank's stack while it runs; ``max_restarts=N`` restarts every rank when one
fails (the function reads ``restart_count()``), ``log_dir=`` writes TensorBoard logs of
``report()``. Every launch option is described once, in
:class:`accelnb.options.LaunchOptions`. Importing accelnb has no side effects: no NVML, no CUDA,
no threads, no processes until the first launch.
"""

from accelnb.errors import (
    AccelnbError,
    GpuSelectionError,
    HelperDied,
    LaunchConfigError,
    LaunchFailed,
    LaunchTimeout,
    PortInUseError,
    RankCrashed,
    RankFailed,
    RankFailure,
    RunInterrupted,
    UnpicklableError,
    WorkerStartError,
)
from accelnb.kernel.display.metrics_history import MetricHistory
from accelnb.kernel.doctor.checks import doctor
from accelnb.kernel.doctor.report import Check, DoctorReport
from accelnb.kernel.helper.client import prewarm
from accelnb.kernel.planning.inventory import GpuInfo, Inventory, read_inventory, synthetic_inventory
from accelnb.kernel.planning.rank_plan import LaunchPlan, RankSpec
from accelnb.kernel.planning.selection import Selection, current_selection, set_selection
from accelnb.kernel.run.launch_result import LaunchResult
from accelnb.kernel.stacks.live import stacks
from accelnb.launcher import last_result, launch, notebook_launcher, plan
from accelnb.session import Session
from accelnb.worker.accelerate_tracker import AccelerateTracker
from accelnb.worker.progress import progress
from accelnb.worker.report import report
from accelnb.worker.restarts import restart_count

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
    "LaunchPlan",
    "LaunchResult",
    "LaunchTimeout",
    "MetricHistory",
    "Panel",
    "PortInUseError",
    "RankCrashed",
    "RankFailed",
    "RankFailure",
    "RankSpec",
    "RunInterrupted",
    "Selection",
    "Session",
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
    "stacks",
    "synthetic_inventory",
]


def __getattr__(name: str) -> object:
    # The widget panel pulls in ipywidgets: imported on first use, not with accelnb.
    if name == "Panel":
        from accelnb.notebook.panel import Panel

        return Panel
    raise AttributeError(f"module 'accelnb' has no attribute {name!r}")


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext accelnb``: the ``%%distributed`` magic, the side panel's comm target, and a
    head start for accelnb's helper process (so the first launch does not wait for torch)."""
    from accelnb.notebook.lab_bridge import register_comm_target
    from accelnb.notebook.magic import DistributedMagics

    ipython.register_magics(DistributedMagics)  # type: ignore[attr-defined]
    register_comm_target(ipython)  # type: ignore[arg-type]
    prewarm()


def unload_ipython_extension(ipython: object) -> None:
    """``%unload_ext accelnb``: the side panel can no longer connect; open panels are closed."""
    from accelnb.notebook.lab_bridge import unregister_comm_target

    unregister_comm_target(ipython)  # type: ignore[arg-type]
