"""What one call of a launch or a session is run with: :class:`CallSettings`.

A view of the options (``SettledOptions.view`` or ``LaunchOptions.view``), filled by field name,
so that the per-call options reach the engine as one value: a new one is a field here and its use
in :mod:`accelnb.kernel.run.engine`, nothing in between copies it. tests/test_options.py keeps the
names and defaults those of the options.

    >>> CallSettings(timeout=60.0, stall_timeout=None).output
    'rank0'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OutputMode = Literal["rank0", "all", "none"]
CollectMode = Literal["rank0", "all"]
# No rank made progress (a step, a report, a line of output) for this long: the cell shows every
# rank's stack, once, and the run goes on (stall_timeout=).
DEFAULT_STALL_TIMEOUT_S = 600.0
# How long ranks asked to stop at their next stop_requested() check get, before they are stopped.
DEFAULT_STOP_GRACE_S = 120.0


@dataclass(frozen=True, kw_only=True)
class CallSettings:
    """The options of one call, as the engine reads them."""

    collect: CollectMode = "all"
    timeout: float | None = None
    output: OutputMode = "rank0"
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S
    stop_grace: float | None = DEFAULT_STOP_GRACE_S
