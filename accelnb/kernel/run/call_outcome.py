"""What one call on a group of workers came to: data from the supervisor, no judgement in it.

The supervisor (:mod:`accelnb.kernel.run.supervisor`) runs a call and returns a :class:`CallOutcome`;
:mod:`accelnb.kernel.run.engine` asks :mod:`accelnb.kernel.run.failure_report` which exception, if any, it
calls for. Process handling so never decides what the user reads (torch elastic splits its
``RunProcsResult`` from ``ChildFailedError`` the same way).

    >>> outcome = group.call(payload, value_ranks={0}, timeout=None)     # doctest: +SKIP
    >>> outcome.ending, outcome.values                                    # doctest: +SKIP
    ('answered', {0: b'...', 1: None})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from accelnb.errors import RankFailure
from accelnb.kernel.helper.process_exits import HelperExit
from accelnb.wire.buffers import Packed

# answered: every rank returned (values for the ranks that were asked for one);
# failed: a rank raised, crashed or exited early;
# timed_out: ``timeout=`` expired (``stacks`` has every rank's Python stack);
# interrupted: Ctrl-C (the kernel's stop button) or a display's Stop (``run_state.request_stop``);
# helper_died: accelnb's helper process died, and every worker with it.
Ending = Literal["answered", "failed", "timed_out", "interrupted", "helper_died"]

# Where the call was when an interrupt landed: "unsent" (no byte of it reached a worker), "sending"
# (a half-sent call cannot be taken back from a worker's inbox, so a session cannot go on), or
# "running" (every rank has it).
CallPhase = Literal["unsent", "sending", "running"]

# What stopped an interrupted call.
StopSource = Literal["interrupt", "stop_request"]


@dataclass
class CallOutcome:
    """One call's ending, what came back, and what accelnb had to stop."""

    ending: Ending
    values: dict[int, Packed | None] = field(default_factory=dict)  # rank -> pickled value
    failures: list[RankFailure] = field(default_factory=list)  # in arrival order; unsorted
    stopped: list[int] = field(default_factory=list)  # ranks accelnb ended that had not failed
    stacks: dict[int, str] = field(default_factory=dict)  # timed_out: each rank's Python stack
    timeout: float | None = None
    workers_kept: bool = False  # a persistent group can take the next call
    phase: CallPhase = "running"
    stop_source: StopSource = "interrupt"
    helper_exit: HelperExit | None = None
    ranks: list[int] | None = None  # the ranks the call ran on; None: every rank
    # A Stop the code was asked to answer (kernel/run/group/stop_presses.py): what pressed it, and
    # the seconds from the request to the call's end. With ending "answered", the ranks stopped
    # where the code chose, and returned.
    stop_asked_by: str | None = None
    stop_seconds: float | None = None
    # A Ctrl-C came while accelnb ended the ranks (a failure's, a timeout's): it only hurried
    # their end, and the failure is still the call's, but no restart may follow it.
    interrupted_while_stopping: bool = False
