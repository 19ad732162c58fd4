"""A stop request as one rank hears it, and the kernel's knowledge that the code checks for one.

The kernel sends :class:`~accelnb.wire.events.StopRequest` to every rank of a call when Stop is
pressed and the call's code has shown it checks (:class:`~accelnb.wire.events.ChecksForStop`,
sent here at the code's first check of each call). The rank's receiver delivers the request at
any moment (a local rank's inbox thread, a Ray actor's ``deliver``); the code reads it only
through :mod:`~accelnb.worker.stopping.agreement`, because ranks hear it at different points of
their step, and a rank acting on its own would leave the others waiting in a collective it never
enters. This module is the rank's receiving end of Stop; ``agreement`` is where the rank decides.

Without a kernel to tell (a rank started outside accelnb) nothing is sent, and no request ever
comes: the code runs as if Stop were never pressed.

Module-level state, one per rank process: ``_heard`` (the request arrived, set from the inbox
reader's thread), ``_call_id`` (the call it is for), ``_announced`` (``ChecksForStop`` went once
this call), and ``_writer`` and ``_rank`` (the rank's channel to the kernel).
"""

from __future__ import annotations

import threading

from accelnb.wire.channel import MessageWriter
from accelnb.wire.events import ChecksForStop, StopRequest

_heard = threading.Event()
_call_id: int | None = None
_announced = False
_writer: MessageWriter | None = None
_rank = 0


def attach(writer: MessageWriter, rank: int) -> None:
    """Where to tell the kernel that the code checks (the rank's events socket)."""
    global _writer, _rank
    _writer, _rank = writer, rank


def begin_call(call_id: int) -> None:
    """A new call: no request heard, the kernel not yet told that this call's code checks."""
    global _call_id, _announced
    _call_id, _announced = call_id, False
    _heard.clear()


def deliver(request: StopRequest) -> None:
    """The kernel's request (from the inbox thread); one for an earlier call is dropped."""
    if request.call_id == _call_id:
        _heard.set()


def heard() -> bool:
    """Whether this rank has heard the kernel's request during the current call."""
    return _heard.is_set()


def announce_checking() -> None:
    """Tell the kernel, once per call, that the code checks: a Stop press becomes a request."""
    global _announced
    if _announced or _writer is None or _call_id is None:
        return
    _announced = True
    _writer.send(ChecksForStop(_rank, _call_id))
