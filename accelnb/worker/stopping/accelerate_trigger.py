"""Accelerate's ``check_trigger()`` also answers accelnb's stop request.

Accelerate's documented way for any rank to stop every rank is ``accelerator.set_trigger()`` on
one rank and ``if accelerator.check_trigger(): break`` on all: the check all-reduces a flag, so
every rank gets the same answer at the same call. Code written that way needs no change to stop
on accelnb's Stop: once this rank heard the request, its ``check_trigger()`` sets the trigger
first, and Accelerate's own all-reduce makes the answer the same everywhere. The first
``check_trigger()`` of a call also tells the kernel that the code checks.

Only Accelerate's public methods are used (``set_trigger``, ``check_trigger``); the wrapper is
installed when the code imports ``accelerate.accelerator`` (never imported for it), and
tests/test_stop_that_saves.py and tests/test_stop_libraries.py run it with the real library.
"""

from __future__ import annotations

import functools
from typing import Any

from accelnb.worker.other_launchers.import_hooks import when_imported
from accelnb.worker.stopping import rank_stop


def install() -> None:
    """Wrap ``Accelerator.check_trigger`` once the code imports Accelerate."""
    when_imported("accelerate.accelerator", _wrap_check_trigger)


def _wrap_check_trigger(module: Any) -> None:
    accelerator_class = module.Accelerator
    original = accelerator_class.check_trigger
    if getattr(original, "__accelnb_stop__", False):
        return

    @functools.wraps(original)
    def check_trigger(self: Any) -> bool:
        rank_stop.announce_checking()
        if rank_stop.heard():
            self.set_trigger()
        return bool(original(self))

    check_trigger.__accelnb_stop__ = True  # type: ignore[attr-defined]
    accelerator_class.check_trigger = check_trigger
