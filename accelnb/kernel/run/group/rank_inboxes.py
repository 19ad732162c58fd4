"""What the kernel writes to the local ranks: a call and ``Shutdown`` into their inboxes, a reply
to a prompt and a stop request into their control sockets (``wire/spec.py`` says why two).

A call is one frame for all ranks (its big buffers are written once, each rank maps them); a
reply, a stop request or ``Shutdown`` is one small frame, each written whole.
:class:`RankInboxes` also keeps how far the current call got (:attr:`~RankInboxes.phase`). A
Ctrl-C while a call is written waits until every rank has it whole, then interrupts it as a
running call; only what gets through anyway (a second Ctrl-C, for a rank too frozen to read)
leaves half a frame in an inbox, and such inboxes take nothing more
(:attr:`~RankInboxes.half_written`), so the group cannot go on.

    >>> inboxes = RankInboxes(on_step=None)                                         # doctest: +SKIP
    >>> inboxes.send_call(call_id, payload, value_ranks, [c.inbox, ...], every_rank=True)  # doctest: +SKIP
    >>> inboxes.phase                                                                # doctest: +SKIP
    'running'

The call carries the notebook's cell sources that not every rank has yet
(:mod:`accelnb.kernel.helper.cell_sources`): none the ranks had from their template
(:meth:`RankInboxes.ranks_have_sources_to`), and none an earlier call of a session gave them.
"""

from __future__ import annotations

import socket

from accelnb.kernel.helper.cell_sources import in_memory_sources
from accelnb.kernel.helper.client import StepHook
from accelnb.kernel.run.call_outcome import CallPhase
from accelnb.wire.buffers import Packed
from accelnb.wire.channel import encode, send_frame
from accelnb.wire.events import InputReply, RunCall, Shutdown, StopRequest
from accelnb.wire.held_interrupts import held_interrupts


class RankInboxes:
    """Writes to the ranks' inboxes, and what an interrupted write left behind."""

    def __init__(self, on_step: StepHook | None = None) -> None:
        self.phase: CallPhase = "unsent"  # of the current call; "running" once every frame is out
        self.half_written = False  # an interrupted write left half a frame in an inbox
        # Notebook cell sources every rank has; with each, every older one (cell_sources.py).
        self._sources_sent: set[str] = set()
        self._on_step = on_step

    def ranks_have_sources_to(self, newest: str | None) -> None:
        """The ranks were forked with the notebook's cell sources up to ``newest`` (their
        template's, given in order): calls carry only newer ones. None: they have none."""
        if newest is not None:
            self._sources_sent.add(newest)

    def send_call(self, call_id: int, payload: Packed, value_ranks: set[int], inboxes: list[socket.socket],
                  *, every_rank: bool) -> None:
        """Write one call to ``inboxes`` (the live ranks it runs on); ``every_rank``: the call runs
        on every rank, so every rank has its cell sources afterwards."""
        sources = in_memory_sources(already_sent=self._sources_sent)
        call = RunCall(call_id, payload, frozenset(value_ranks), sources=sources)
        # A Ctrl-C waits until every rank has the call whole (writing it takes microseconds unless
        # a rank is frozen: a second Ctrl-C goes through), then interrupts the running call. Cut
        # between two frames, the call would run on some ranks only: the session would be lost.
        with encode(call) as frame, held_interrupts(second_one_goes_through=True):
            for inbox in inboxes:
                self._step("call-writing")
                self.phase = "sending"
                self.half_written = True  # until the whole frame is out
                try:
                    send_frame(inbox, frame, self._after_write)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it died already; its exit report explains why
                self.half_written = False
            if every_rank:  # a --ranks call gave them to some ranks only
                self._sources_sent.update(filename for filename, _ in sources)
            self.phase = "running"
            self._step("call-sent")

    def send_reply(self, control: socket.socket | None, reply: InputReply) -> None:
        """A rank's line for its prompt (or end of input), to its control socket; nothing when
        it cannot take it (a call half written into an inbox: the group is being stopped)."""
        if control is None or self.half_written:
            return
        with encode(reply) as frame, held_interrupts():  # a reply goes out whole, or not at all
            try:
                send_frame(control, frame)
            except OSError:
                pass  # it died meanwhile; its exit report explains why

    def send_stop_request(self, call_id: int, controls: list[socket.socket]) -> bool:
        """Ask the ranks of these control sockets to stop ``call_id`` at their next check; False
        (nothing sent) when an inbox holds half a frame: its rank never got the call whole."""
        if self.half_written:
            return False
        with encode(StopRequest(call_id)) as frame, held_interrupts():  # whole, or not at all
            for control in controls:
                try:
                    send_frame(control, frame)
                except OSError:
                    pass  # it died meanwhile; its exit report explains why
        return True

    def send_shutdown(self, inboxes: list[socket.socket]) -> bool:
        """Ask these ranks to leave; False (nothing sent) when an inbox holds half a frame."""
        if self.half_written:
            return False
        shutdown = encode(Shutdown())
        for inbox in inboxes:
            try:
                send_frame(inbox, shutdown)
            except OSError:
                pass
        return True

    def _after_write(self, bytes_left: int) -> None:
        if bytes_left:
            self._step("call-part-written")

    def _step(self, name: str) -> None:
        if self._on_step is not None:
            self._on_step(name)
