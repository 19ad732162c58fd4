"""``accelnb.stacks()``: every rank's current Python stack, while it runs, without stopping it.

A run that seems stuck can be looked at instead of killed. Call it from another thread while a
launch blocks the notebook, or between cells of a persistent session::

    >>> import accelnb, threading
    >>> threading.Thread(target=accelnb.notebook_launcher, args=(train,),
    ...                  kwargs={"num_processes": 2}).start()                 # doctest: +SKIP
    >>> print(accelnb.stacks())                                              # doctest: +SKIP
    ── rank 0 ──
    Main thread 0x00007f… (most recent call first):
      File "<cell 3>", line 12 in train

Each rank prints its stacks when asked (``wire/stack_signals.py``); the supervisor reads them off
the rank's stderr (keeping them out of the cell) and drops accelnb's own threads and frames
(:mod:`accelnb.kernel.stacks.faulthandler_dumps`). The value is a dict, rank to stack text, that prints readably.
"""

from __future__ import annotations

from typing import Any

from accelnb.errors import LaunchConfigError
from accelnb.kernel.run.run_state import current_run

DEFAULT_WAIT_S = 1.0
NO_DUMP = "(no stack came back in time: the rank may be inside C code that holds the GIL)"


class StackDump(dict[int, str]):
    """Rank → that rank's current Python stacks (empty: its dump did not come in time)."""

    def __str__(self) -> str:
        if not self:
            return "(no live ranks)"
        return "\n\n".join(f"── rank {rank} ──\n{text or NO_DUMP}" for rank, text in sorted(self.items()))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython shows it as text, not a dict repr
        printer.text(str(self))


def stacks(wait: float = DEFAULT_WAIT_S) -> StackDump:
    """Every rank's current Python stack, from the launch or session now running.

    Nothing stops or slows down beyond the moment each rank spends printing. Works from another
    thread while a launch runs, and between cells of a persistent session (``Session.stacks()``
    asks one session in particular).

    Args:
        wait: at most this many seconds for the dumps to arrive.

    Raises:
        LaunchConfigError: no launch or session is running.
    """
    run = current_run()
    if run is None or run.finished or run.collect_stacks is None:
        raise LaunchConfigError(
            "No launch or session is running, so there are no stacks to show. accelnb.stacks() "
            "looks at a run in progress: call it from another thread while a launch runs, or "
            "between cells of a persistent session (%distributed start).")
    return StackDump(run.collect_stacks(wait))
