"""What the cell shows when no rank has made progress for ``stall_timeout`` seconds.

A run that stalls (a collective one rank never enters, a dead data loader, a deadlock) used to sit
silent until NCCL's watchdog or ``timeout=`` killed it. The call protocol
(:mod:`~accelnb.kernel.run.group.call_protocol`) notices that nothing came from any rank, no step,
no ``report()``, no line on stdout, for ``stall_timeout`` seconds, reads every rank's Python stack
without stopping anything, and shows :func:`stall_report` once; the run goes on, and Stop still
stops it. For each rank it says where it waits: the ``torch.distributed`` collective on its stack
(``barrier``, ``all_reduce``, …) and the line of the user's code that called it.

    >>> print(stall_report(612.0, {0: STACK}))                                   # doctest: +SKIP
    accelnb: no rank has made progress for 612 s (no step, report() or line of output).
      rank 0: waits in torch.distributed barrier(), called from train.py:14 in main
    ...
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# A frame line as faulthandler writes it (`  File "/path/x.py", line 12 in main`, most recent call
# first: a local rank's stacks) or as the traceback module does (`..., line 12, in main`, most
# recent call last, under a header that says so: a Ray rank's).
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<function>\S+)')
_OLDEST_FIRST = "most recent call last"
_DISTRIBUTED = ("/torch/distributed/", "\\torch\\distributed\\")
# Decorators torch wraps its collectives in: their frame names say nothing.
_WRAPPERS = {"wrapper", "inner", "_fn", "decorate_context"}
_LIBRARIES = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")


def where_it_waits(stack: str) -> str:
    """One line for one rank's stack: the collective it waits in and who called it, else the
    innermost line of the user's code, else that the stack did not come back."""
    frames = [match.groupdict() for line in stack.splitlines() if (match := _FRAME.match(line))]
    if _OLDEST_FIRST in stack:
        frames.reverse()  # most recent first, as faulthandler lists them
    if not frames:
        return "no Python stack came back (inside native code that holds the GIL, or gone)"
    collective = next((f for f in frames if any(part in f["file"] for part in _DISTRIBUTED)
                       and f["function"] not in _WRAPPERS), None)
    caller = next((f for f in frames if not any(part in f["file"] for part in _LIBRARIES)), None)
    called_from = f'{_short(caller["file"])}:{caller["line"]} in {caller["function"]}' if caller else "library code"
    if collective is not None:
        return f"waits in torch.distributed {collective['function']}(), called from {called_from}"
    return f"is at {called_from}"


def stall_report(quiet_for: float, stacks: Mapping[int, str]) -> str:
    """The cell's message: how long nothing moved, where each rank is, its stack, how to stop."""
    lines = [f"accelnb: no rank has made progress for {quiet_for:.0f} s (no step, report() or line of output)."]
    lines += [f"  rank {rank}: {where_it_waits(stack)}" for rank, stack in sorted(stacks.items())]
    lines.append("The run goes on. A rank waiting in a collective usually means another rank skipped it or "
                 "is stuck earlier. Stop (■) ends every rank; stall_timeout= (--stall-timeout) sets when "
                 "this shows, None turns it off.")
    for rank, stack in sorted(stacks.items()):
        lines.append(f"── rank {rank} ──")
        lines.append(stack.rstrip() or "(no stack came back in time)")
    return "\n".join(lines) + "\n"


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]
