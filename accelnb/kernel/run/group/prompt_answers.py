"""The local ranks' ``input()`` and ``(Pdb)`` prompts, answered from the kernel's own ``input()``.

A rank's :class:`~accelnb.wire.events.InputRequest` is queued here by the pump
(:meth:`PromptAnswers.add`); the call's wait loop asks the user for the oldest one
(:meth:`PromptAnswers.answer_next`, with :func:`~accelnb.kernel.run.rank_prompts.ask_in_kernel`)
while a thread keeps pumping, and sends the line back. A request nobody will ask the user about
(one made between cells, or left when the cell ended) gets end of input
(:meth:`PromptAnswers.refuse_all`), so that the rank's ``input()`` raises ``EOFError`` instead of
waiting forever.

    >>> prompts = PromptAnswers(router, alive=processes.is_alive, reply=send_reply)   # doctest: +SKIP
    >>> seconds = prompts.answer_next(answers, pump, drain)                             # doctest: +SKIP

The ranks' output printed before the prompt is read first (``drain``), so the user sees it above
the input box; a rank that fails while the prompt waits is announced under it.
"""

from __future__ import annotations

from collections.abc import Callable

from accelnb.errors import RankFailure
from accelnb.kernel.display.output import OutputRouter
from accelnb.kernel.run.group.call_answers import CallAnswers
from accelnb.kernel.run.rank_prompts import PendingPrompts, ask_in_kernel
from accelnb.wire.events import InputReply, InputRequest

# While the kernel waits at a prompt, its pumping thread wakes this often: the prompt returns only
# once the thread has stopped, so this bounds the delay each answer adds (50 ms made it 100 ms).
PROMPT_PUMP_SLICE_S = 0.01


class PromptAnswers:
    """The prompts the ranks are waiting in, and how their lines get back to them."""

    def __init__(self, output: OutputRouter, alive: Callable[[int], bool],
                 reply: Callable[[int, InputReply], None]) -> None:
        self.output = output
        self._alive = alive
        self._reply = reply  # sends a reply to a rank's inbox, if it can take one
        self._pending = PendingPrompts()  # ranks waiting in input() or their debugger

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, rank: int, request: InputRequest) -> None:
        """Queue ``rank``'s request (from whichever thread pumps the pipes)."""
        self._pending.add(request)
        self.output.show_rank(rank)  # what it prints between prompts must be seen

    def answer_next(self, answers: CallAnswers, pump: Callable[[float], None],
                    drain: Callable[[int], None]) -> float:
        """Ask the user for the oldest rank's line, send it; returns the seconds at the prompt.

        ``pump(timeout)`` reads the ranks into ``answers`` meanwhile; ``drain(rank)`` reads what
        the rank printed so far.
        """
        request = self._pending.next()
        rank = request.rank
        if not self._alive(rank):
            return 0.0
        # The rank flushed before asking: everything it printed is in its pipes, and goes first.
        drain(rank)
        self.output.add_text(rank, "stdout", request.shown_first)
        self.output.tick(force=True)
        told: list[RankFailure] = []

        def pump_and_tell() -> None:
            pump(PROMPT_PUMP_SLICE_S)
            if answers.failures and not told:  # the run will stop once the prompt is answered
                told.append(failure := answers.failures[0])
                self.output.add_text(rank, "stderr", (
                    f"accelnb: rank {failure.rank} failed ({failure.summary}) while this prompt "
                    "waits; answer it, or press Stop, to end the run.\n"))

        reply, seconds = ask_in_kernel(request, pump=pump_and_tell)
        if reply.line is None and reply.eof_reason:
            self.output.add_text(rank, "stderr", f"accelnb: {reply.eof_reason}\n")
            self.output.tick(force=True)
        self._reply(rank, reply)
        return seconds

    def refuse_all(self, why: str) -> None:
        """End of input for every rank still waiting: nobody will ask the user for it."""
        for request in self._pending.take_all():
            self._reply(request.rank, InputReply(request.request_id, None, why))
