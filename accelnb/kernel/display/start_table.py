"""The table a cell shows as its ranks start: one line per rank, the GPUs' UUIDs and bus ids one
click away.

With eight ranks, a UUID and a bus id per rank is sixteen lines before the first line of output.
So the cell shows :meth:`LaunchPlan.summary <accelnb.kernel.planning.rank_plan.LaunchPlan.summary>`
(rank → cuda:N → GPU index and name, and its pid) and, in a notebook, the full
:meth:`~accelnb.kernel.planning.rank_plan.LaunchPlan.table` inside an HTML ``<details>`` the user
opens when it matters. CPU ranks own no GPU: their table is text, as every line already fits.
Outside a notebook (a script, a terminal IPython) the summary is printed; ``plan(...).table()``
prints the full one anywhere.

    >>> show_start(the_plan, pids=[4242, 4243])   # doctest: +SKIP
"""

from __future__ import annotations

import html
import sys
from collections.abc import Sequence

from accelnb.kernel.display.output import Sink, notebook_sink
from accelnb.kernel.planning.rank_plan import LaunchPlan

DETAIL_SUMMARY = "GPU UUIDs and PCI bus ids"


def start_bundle(the_plan: LaunchPlan, pids: Sequence[int]) -> dict[str, str]:
    """The start table as a display bundle: the summary as text, and as HTML with the full table
    in a ``<details>`` below it."""
    summary = the_plan.summary(pids)
    full = the_plan.table(pids)
    pre = 'style="margin:0; padding:0; background:none"'  # the look of the stream output around it
    return {
        "text/plain": summary,
        "text/html": (f'<pre class="accelnb-start" {pre}>{html.escape(summary)}</pre>'
                      f'<details class="accelnb-start-detail"><summary>{DETAIL_SUMMARY}</summary>'
                      f'<pre {pre}>{html.escape(full)}</pre></details>'),
    }


def show_start(the_plan: LaunchPlan, pids: Sequence[int], sink: Sink = notebook_sink) -> None:
    """Show the start table in the running cell (or print its summary outside a notebook)."""
    if len(pids) != len(the_plan.ranks):
        raise ValueError(f"{len(pids)} pid(s) for {len(the_plan.ranks)} rank(s)")
    if the_plan.on_gpus and _in_notebook():
        from IPython.display import display

        sys.stdout.flush()  # what the cell printed before comes first
        display(start_bundle(the_plan, pids), raw=True)
    else:
        sink("stdout", the_plan.summary(pids) + "\n")


def _in_notebook() -> bool:
    shell_module = sys.modules.get("IPython")
    get_ipython = getattr(shell_module, "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None
