"""How a process of ours ended, in the words the cell shows: any exit status
(:func:`describe_exit_status`), and the helper's death (:class:`HelperExit`, :func:`helper_died`).

Here, below ``kernel/run``, because the helper's client (``kernel/helper/client.py``) raises
:class:`~accelnb.errors.HelperDied` itself while it starts workers, and the run's failure report
(``kernel/run/failure_report.py``) words a rank's exit the same way.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from accelnb.errors import HelperDied, RankFailure

_SIGNAL_HINTS = {
    "SIGKILL": " (sent by the kernel's OOM killer when memory runs out, or by `kill -9`)",
    "SIGSEGV": " (a segmentation fault in native code)",
    "SIGABRT": " (native code aborted, e.g. a failed CUDA/NCCL assertion)",
    "SIGBUS": " (bad memory access; on Docker often a too-small /dev/shm)",
}


@dataclass(frozen=True)
class HelperExit:
    """How accelnb's helper process ended."""

    pid: int
    exit_code: int | None  # negative: killed by that signal; None: not known (still a zombie?)
    stderr: str = ""  # what it printed before it was ready (start-up failures)


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit_status(exit_code: int | None) -> str:
    """``killed by SIGKILL (…)``, ``exited with code 1``, or that the status is unknown."""
    if exit_code is None:
        return "its exit status could not be read"
    if exit_code < 0:
        name = signal_name(-exit_code)
        return f"killed by {name}{_SIGNAL_HINTS.get(name, '')}"
    return f"exited with code {exit_code}"


def helper_died(death: HelperExit, moment: str, *, persistent: bool = False, had_workers: bool = True,
                failures: Sequence[RankFailure] = ()) -> HelperDied:
    """accelnb's helper process died ``moment`` ("while starting workers", "during the run"…)."""
    lines = [f"accelnb's helper process (pid {death.pid}, the clean process that forks the workers) died "
             f"{moment}: {describe_exit_status(death.exit_code)}."]
    if death.stderr.strip():
        lines += ["It printed:", *("  " + line for line in death.stderr.strip().splitlines())]
    if had_workers:
        lines.append("Every worker was ended with it.")
    if death.exit_code is not None and death.exit_code > 0:
        lines.append("Check that `python -c 'import torch'` works in this environment.")
    lines.append("The next launch starts a new helper"
                 + ("; if memory ran out, use fewer ranks or smaller batches." if death.exit_code == -9 else "."))
    if persistent:
        lines.append("The persistent session was closed. Start a new one with Session.start() or "
                     "%distributed start.")
    return HelperDied("\n".join(lines), tuple(failures), helper_pid=death.pid, exit_code=death.exit_code)
