"""Every exception accelnb raises, in one tree.

::

    AccelnbError
    ├── LaunchConfigError (ValueError)      bad input, raised before any process starts
    │   ├── GpuSelectionError               unknown, duplicate, invisible or empty GPU selection
    │   ├── PortInUseError                  an explicit master_port= is taken
    │   └── UnpicklableError (TypeError)    an argument or notebook name cannot travel to workers
    ├── WorkerStartError (RuntimeError)     the worker helper process could not start
    └── LaunchFailed (RuntimeError)         a run started and ended badly
        ├── RankFailed                      a rank raised; also an instance of the original type
        ├── RankCrashed                     a rank died by a signal or exited without a result
        └── LaunchTimeout (TimeoutError)    ``timeout=`` expired; carries every rank's stacks

A stop by the user (kernel interrupt) surfaces as ``KeyboardInterrupt`` after all workers are gone.
Every message says what happened, the likely cause, and how to fix it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from accelnb.kernel.metrics_history import MetricHistory


FailureKind = Literal["exception", "signal", "exit", "stopped", "timeout"]


@dataclass(frozen=True)
class RankFailure:
    """Why one rank did not finish."""

    rank: int
    pid: int | None
    kind: FailureKind
    summary: str  # one line: "ValueError: bad input", "killed by SIGSEGV"
    traceback: str = ""  # the remote traceback, launcher frames removed
    exit_code: int | None = None
    signal_name: str | None = None
    type_name: str | None = None
    exception: bytes | None = field(default=None, repr=False)
    output_tail: str = ""
    timestamp: float = field(default_factory=time.time)


class AccelnbError(Exception):
    """Base of every accelnb exception."""


class LaunchConfigError(AccelnbError, ValueError):
    """The launch request is invalid; nothing was started."""


class GpuSelectionError(LaunchConfigError):
    """The GPU selection names GPUs that do not exist, repeat, or cannot be used."""


class PortInUseError(LaunchConfigError):
    """An explicitly requested ``master_port`` is already bound by another process."""

    def __init__(self, port: int) -> None:
        self.port = port
        super().__init__(
            f"master_port={port} is already in use on 127.0.0.1 by another process. "
            "Leave master_port unset to let accelnb pick a free port, or choose another one."
        )


class UnpicklableError(LaunchConfigError, TypeError):
    """Something that has to travel to the workers cannot be pickled."""

    def __init__(self, what: str, value: object, reason: str, hint: str) -> None:
        self.what = what
        self.type_name = f"{type(value).__module__}.{type(value).__qualname__}"
        super().__init__(
            f"{what} of type {self.type_name} cannot be sent to the worker processes: {reason}. "
            f"{hint}"
        )


class WorkerStartError(AccelnbError, RuntimeError):
    """The clean helper process that forks workers could not be started."""


@dataclass(eq=False)
class LaunchFailed(AccelnbError, RuntimeError):
    """A distributed run started and at least one rank did not finish.

    ``failures`` holds one record per failed rank, root cause (the earliest failure) first.
    """

    message: str
    failures: Sequence[RankFailure] = field(default_factory=tuple)
    metrics: MetricHistory | None = None  # the MetricHistory reported before the failure, set by the launcher

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)

    def __str__(self) -> str:
        return self.message

    @property
    def root_cause(self) -> RankFailure | None:
        return self.failures[0] if self.failures else None

    def _render_traceback_(self) -> list[str]:
        """IPython hook: show the workers' tracebacks, not the launcher's frames."""
        return self.message.splitlines()


class RankFailed(LaunchFailed):
    """A rank raised an exception. Instances also subclass the original exception type
    where that is possible, so ``except ValueError`` catches a remote ``ValueError``."""


class RankCrashed(LaunchFailed):
    """A rank exited without reporting a result: killed by a signal or ``os._exit``."""


class LaunchTimeout(LaunchFailed, TimeoutError):
    """The run exceeded ``timeout=`` seconds; the message carries every rank's Python stack."""
