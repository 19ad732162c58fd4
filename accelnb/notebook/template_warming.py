"""In a kernel that imported accelnb: the template follows the kernel cell by cell.

``import accelnb`` (any form of it) or ``%load_ext accelnb`` in a Jupyter kernel registers
:func:`after_cell` on IPython's ``post_run_cell`` event. At the end of every cell it starts the
template if there is none (or replaces a stale one) and asks it to import what the cell imported
(``kernel/helper/template.follow_in_background``): a few milliseconds, never a wait, so the
first launch, a cell or more later, finds the ranks' libraries already imported.
``ACCELNB_TEMPLATE=off`` turns this off; outside a kernel nothing is registered.

    >>> follow_cells(get_ipython())        # doctest: +SKIP

Module-level state: ``_following``, the shells whose cells are followed; a kernel has one shell,
and following it twice would warm twice per cell.
"""

from __future__ import annotations

from typing import Any

from accelnb.kernel.helper.template import follow_in_background

_following: set[int] = set()  # ids of the shells whose cells are followed (one per kernel)


def follow_cells(shell: Any, *, now: bool = False) -> None:
    """Follow ``shell``'s cells from the end of this one (``now``: start the template at once)."""
    if id(shell) not in _following:
        shell.events.register("post_run_cell", after_cell)
        _following.add(id(shell))
    if now:
        follow_in_background()


def after_cell(result: object = None) -> None:
    """IPython's ``post_run_cell`` callback."""
    follow_in_background()
