"""The small vocabulary workers and the kernel speak, one dataclass per message.

Kernel → worker (the worker's inbox pipe): :class:`RunCall`, :class:`Shutdown`.
Worker → kernel (the worker's event pipe): :class:`Joined`, :class:`CallResult`,
:class:`CallError`, :class:`MetricBatch`.
Output does not travel as events: it is the worker's real stdout/stderr file descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunCall:
    """Run a cloudpickled ``(fn, args, kwargs)``; send back the value if ``want_value``."""

    call_id: int
    payload: bytes
    want_value: bool


@dataclass(frozen=True)
class Shutdown:
    """Tear down the process group and exit."""


@dataclass(frozen=True)
class Joined:
    """The worker joined the default process group and waits for calls."""

    rank: int
    pid: int
    seconds: float  # how long joining took


@dataclass(frozen=True)
class CallResult:
    rank: int
    call_id: int
    value: bytes | None  # cloudpickled return value, None when not wanted
    seconds: float


@dataclass(frozen=True)
class CallError:
    """The user's code (or the set-up before it) raised on this rank."""

    rank: int
    call_id: int | None  # None: failed while setting up, before any call
    type_name: str  # "ValueError", "torch.distributed.DistBackendError"
    message: str
    traceback: str  # formatted, launcher frames removed
    exception: bytes | None  # the pickled exception, when it pickles
    timestamp: float
    keyboard_interrupt: bool = False


@dataclass(frozen=True)
class MetricBatch:
    """Scalars reported with ``accelnb.report`` since the last batch."""

    rank: int
    records: list[tuple[int | None, float, dict[str, float]]] = field(default_factory=list)
    # each record: (step, wall time, {name: value})


Event = Joined | CallResult | CallError | MetricBatch
Command = RunCall | Shutdown
AnyMessage = Any
