"""The public surface is small and deliberate; importing it has no side effects."""

from __future__ import annotations

import subprocess
import sys

import accelnb

EXPECTED = {
    "AccelerateTracker", "AccelnbError", "GpuInfo", "GpuSelectionError", "Inventory", "LaunchConfigError",
    "LaunchFailed", "LaunchPlan", "LaunchResult", "LaunchTimeout", "MetricHistory", "Panel", "PortInUseError",
    "RankCrashed", "RankFailed", "RankFailure", "RankSpec", "Selection", "UnpicklableError", "WorkerStartError",
    "current_selection", "last_result", "launch", "notebook_launcher", "plan", "prewarm", "progress",
    "read_inventory", "report", "set_selection", "synthetic_inventory",
}


def test_all_is_pinned() -> None:
    assert set(accelnb.__all__) == EXPECTED
    for name in accelnb.__all__:
        assert getattr(accelnb, name) is not None


def test_import_starts_nothing() -> None:
    code = ("import sys, threading, accelnb; "
            "print(threading.active_count(), 'torch' in sys.modules, 'pynvml' in sys.modules, "
            "accelnb.kernel.helper_client._shared is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "False", "False", "True"]
