"""Answering the ranks' ``input()`` and ``(Pdb)`` prompts with the kernel's own ``input()``.

A rank asks for a line with an :class:`~accelnb.wire.events.InputRequest`
(``worker/interactive/rank_input.py``); the supervisor queues it in :class:`PendingPrompts` and its wait loop
asks the oldest with :func:`ask_in_kernel`, which calls ``builtins.input``. In a Jupyter kernel
that is ipykernel's ``raw_input`` while a cell runs: called from the thread running the cell
(where the launcher waits), it sends an ``input_request`` to the frontend, which shows its own
input box in the launching cell. In a script it reads the terminal. Prompts of ranks other than
0 are prefixed ``[rank N]``; ranks are asked one at a time, in the order they asked.

    >>> reply, seconds = ask_in_kernel(request, pump=lambda: group_pump(0.05))   # doctest: +SKIP

While the kernel waits in ``input()``, a thread keeps pumping the workers' pipes (``pump``):
output keeps reaching the cell, exits and other ranks' requests are seen, and no rank blocks on a
full pipe, so other ranks keep running, or wait in their collective, as under torchrun. The
seconds spent at the prompt come back so that ``timeout=`` can leave them out. A Ctrl-C (the
notebook's Stop button) lands in ``input()`` as ``KeyboardInterrupt`` and stops the run as it
would anywhere else in the wait. End of input (Ctrl-D, a closed stdin, a frontend that does not
allow input) is answered as end of input, with the reason: the rank's ``input()`` raises
``EOFError``, its debugger quits.
"""

from __future__ import annotations

import builtins
import contextvars
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from accelnb.wire.events import InputReply, InputRequest

END_OF_INPUT = "end of input (Ctrl-D, or the notebook process's stdin is closed)"
NO_STDIN_IN_FRONTEND = (
    "rank {rank} asked for input, but this frontend does not accept input requests (nbconvert, "
    "papermill, or a client executing with allow_stdin=False). Run the cell in JupyterLab, "
    "Notebook or VS Code, or remove the input()/breakpoint() call.")


class PendingPrompts:
    """Input requests from the ranks, oldest first."""

    def __init__(self) -> None:
        self._requests: deque[InputRequest] = deque()

    def __bool__(self) -> bool:
        return bool(self._requests)

    def add(self, request: InputRequest) -> None:  # from whichever thread pumps the pipes
        self._requests.append(request)

    def next(self) -> InputRequest:
        return self._requests.popleft()

    def take_all(self) -> list[InputRequest]:
        taken = list(self._requests)
        self._requests.clear()
        return taken


def prompt_text(request: InputRequest) -> str:
    """What the input box shows: the rank's prompt, ``[rank N]``-prefixed for ranks other than 0."""
    return request.prompt if request.rank == 0 else f"[rank {request.rank}] {request.prompt}"


def ask_in_kernel(request: InputRequest, pump: Callable[[], None]) -> tuple[InputReply, float]:
    """Ask the user with the kernel's own ``input()``; ``pump`` runs in a thread meanwhile.

    Returns the reply for the rank and the seconds spent at the prompt. ``KeyboardInterrupt``
    propagates, once the pumping thread is gone.
    """
    started = time.monotonic()
    with _pumping(pump):
        try:
            reply = InputReply(request.request_id, builtins.input(prompt_text(request)))
        except EOFError:
            reply = InputReply(request.request_id, None, END_OF_INPUT)
        except NotImplementedError:  # IPython's StdinNotImplementedError: the frontend allows no input
            reply = InputReply(request.request_id, None, NO_STDIN_IN_FRONTEND.format(rank=request.rank))
    return reply, time.monotonic() - started


@contextmanager
def _pumping(pump: Callable[[], None]) -> Iterator[None]:
    """Run ``pump`` over and over in a thread for the duration of the block.

    The thread runs in a copy of the caller's context: ipykernel keeps the running cell in
    context variables, so output drawn by the thread goes to the launching cell.
    """
    stop = threading.Event()
    failures: list[BaseException] = []

    def pump_until_stopped() -> None:
        try:
            while not stop.is_set():
                pump()
        except BaseException as error:  # a bug: surfaces in the caller's thread, below
            failures.append(error)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(pump_until_stopped,),
                              name="accelnb-prompt-pump", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        interrupted = False
        while thread.is_alive():  # never two threads pumping: wait it out, even through a Ctrl-C
            try:
                thread.join()
            except KeyboardInterrupt:
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt
    if failures:
        raise failures[0]
