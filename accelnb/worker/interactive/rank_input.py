"""A rank's standard input, forwarded to the notebook: ``input()`` and ``sys.stdin`` ask the kernel.

A rank has no terminal (its fd 0 is not the user's), so without this ``input()`` raises
``EOFError`` at once and a debugger quits before its first prompt. :func:`attach` replaces the
rank's ``builtins.input`` and ``sys.stdin``: each line is asked for with an
:class:`~accelnb.wire.events.InputRequest` on the events socket, and the kernel answers with its
own ``input()`` (Jupyter's input box in the launching cell, or the terminal of a script) through
an :class:`~accelnb.wire.events.InputReply` on the rank's control socket, which the control reader
hands to :func:`deliver`.

    >>> attach(events, rank=1, flush=flush_streams)     # doctest: +SKIP  (worker set-up)
    >>> input("batch size? ")                           # the cell shows "[rank 1] batch size? "

One prompt at a time per rank (threads of one rank queue up here; the kernel queues the ranks).
The rank's stdout is flushed before each request, so what it printed reaches the cell before the
prompt. A reply carries its request's id, and a rank interrupted while it waited drops the late
reply: replies never desynchronise the control socket, which also carries stop requests.

Module-level state, one per rank process (a process is one rank, with one channel to the
kernel): ``_rank``, ``_events`` and ``_flush`` (set when the rank attaches), ``_asking`` (one
prompt at a time, whatever thread asks), ``_replies`` (the answers the control reader delivers) and
``_request_ids``.
"""

from __future__ import annotations

import builtins
import io
import itertools
import queue
import sys
import threading
from collections.abc import Callable

from accelnb.wire.channel import MessageWriter
from accelnb.wire.events import InputReply, InputRequest

_asking = threading.Lock()
_replies: queue.Queue[InputReply] = queue.Queue()
_request_ids = itertools.count(1)
_events: MessageWriter | None = None
_rank = -1
_flush: Callable[[], None] | None = None


def attach(events: MessageWriter, rank: int, flush: Callable[[], None]) -> None:
    """Route this rank's ``input()`` and ``sys.stdin`` through the kernel (worker set-up only)."""
    global _events, _rank, _flush
    _events, _rank, _flush = events, rank, flush
    builtins.input = forwarded_input
    sys.stdin = ForwardedStdin()


def deliver(reply: InputReply) -> None:
    """Hand a reply that came on the control socket to the prompt waiting for it (a local rank's
    watcher thread reads that socket: ``worker/signal_watcher.py``)."""
    _replies.put(reply)


def ask(prompt: str, shown_first: str = "") -> str:
    """One line from the kernel, without its newline. ``EOFError`` at end of input.

    ``shown_first`` reaches the cell just before the prompt (a debugger's output).
    """
    if _events is None or _flush is None:
        raise EOFError("this process has no forwarded input: "
                       "accelnb.worker.interactive.rank_input.attach was not called")
    with _asking:
        request_id = next(_request_ids)
        _flush()  # what the rank printed goes out before the request, so before the prompt
        _events.send(InputRequest(_rank, request_id, prompt, shown_first))
        while True:
            reply = _replies.get()  # a Ctrl-C of a session's cell lands here, and the lock is released
            if reply.request_id == request_id:
                break  # earlier ids: the late answers to prompts that were interrupted
    if reply.line is None:
        raise EOFError(reply.eof_reason)
    return reply.line


def forwarded_input(prompt: object = "") -> str:
    """The rank's ``builtins.input``: the prompt shows in the notebook's input box."""
    return ask(str(prompt))


class ForwardedStdin(io.TextIOBase):
    """The rank's ``sys.stdin``: each line read is asked for in the notebook (no prompt text)."""

    @property
    def name(self) -> str:
        return "<stdin forwarded by accelnb>"

    encoding = "utf-8"

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        try:
            return ask("") + "\n"
        except EOFError:
            return ""

    def read(self, size: int | None = -1) -> str:
        return self.readline()
