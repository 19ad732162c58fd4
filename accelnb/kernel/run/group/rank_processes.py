"""The local ranks' processes, from fork to gone: start via the helper, undo a half start, the stop
ladder, kill what survives a close, bury the workers of a helper that died.

:class:`RankProcesses` signals and waits; it decides nothing about failures. Each operation
returns what happened (:class:`StopReport`: which ranks it stopped, which would not go), and every
rank's :class:`RankProcess` keeps its exit code and the signals accelnb sent it, so that the
caller (:class:`~accelnb.kernel.run.supervisor.WorkerGroup`) tells a rank that crashed from one it
ended: torch elastic's ``PContext.wait`` returns a ``RunProcsResult`` in the same spirit and the
agent decides what to raise.

    >>> processes = RankProcesses(helper, on_step=None)                         # doctest: +SKIP
    >>> processes.spawn(specs, fds)                                             # doctest: +SKIP
    >>> report = processes.stop(grace=3.0, wait_for_exits=pump_until)           # doctest: +SKIP
    >>> report.stopped, report.unreaped                                         # doctest: +SKIP
    ([0, 1], [])

Exits are reported by the helper, whose socket the caller's pump reads: the ladder waits through
``wait_for_exits(deadline)``, the caller's function that pumps until every rank is gone or the
deadline passes (pumping also keeps a dying rank from blocking on a full pipe).

Process groups, not pids, are signalled to end a rank, so its own children (DataLoader workers)
go too; a rank's stack dump (``wire/stack_signals``) or a session's interrupt (SIGINT) goes to its pid only.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from accelnb.kernel.helper.client import StepHook, WorkerExit, WorkerHelper
from accelnb.wire.group_ahead import GroupAhead
from accelnb.wire.spec import RankFds, WorkerSpec

KILL_WAIT_S = 5.0  # after SIGKILL: how long until the helper reports the exits
BURY_WAIT_S = 1.0  # the helper died: how long its workers may take to be gone


@dataclass
class RankProcess:
    """One rank's worker process."""

    rank: int
    pid: int = 0  # 0 until the helper forked it
    exit_code: int | None = None  # negative: killed by that signal
    signals_sent: set[int] = field(default_factory=set)  # an exit by one of these is ours, not a crash
    departed: bool = False  # left nothing behind and exits 0: its group did not wait for the OS to free it
    # Its exit's report was taken, or handed back to the helper to drop: it is no longer expected.
    report_settled: bool = False

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    def ended_by_us(self, exit_code: int) -> bool:
        """Whether an exit with ``exit_code`` came from a signal accelnb sent (a SIGKILL from
        outside before ours is a crash)."""
        return -exit_code in self.signals_sent


@dataclass(frozen=True)
class StopReport:
    """What a stop did."""

    stopped: list[int]  # the ranks that were alive when it began
    unreaped: list[int]  # not reported gone after the SIGKILL wait (signalled once more)
    hurried: bool = False  # an interrupt cut the grace short: the user wants out, not a restart


class RankProcesses:
    """The worker processes of one group, one per rank, in rank order."""

    def __init__(self, helper: WorkerHelper, on_step: StepHook | None = None) -> None:
        self.helper = helper
        self._on_step = on_step
        self.ranks: list[RankProcess] = []
        self._by_rank: dict[int, RankProcess] = {}

    def get(self, rank: int) -> RankProcess | None:
        return self._by_rank.get(rank)

    def live_ranks(self) -> list[int]:
        return [p.rank for p in self.ranks if p.alive]

    def any_alive(self) -> bool:
        return any(p.alive for p in self.ranks)

    def is_alive(self, rank: int) -> bool:
        process = self.get(rank)
        return process is not None and process.alive

    # ── starting ────────────────────────────────────────────────────────────────────────────
    def spawn(self, specs: Sequence[WorkerSpec], fds: Sequence[RankFds], *,
              next_group: GroupAhead | None = None) -> str | None:
        """Have the helper fork one worker per spec; ``fds`` are their channel ends, in order.
        ``next_group``: see :meth:`~accelnb.kernel.helper.client.WorkerHelper.spawn`. Returns the
        newest notebook cell source every worker has from its template (None: none)."""
        self.ranks = [RankProcess(spec.rank) for spec in specs]
        self._by_rank = {process.rank: process for process in self.ranks}
        spawned = self.helper.spawn(specs, fds, on_step=self._on_step, next_group=next_group, forked=self._forked)
        if self._on_step is not None:
            self._on_step("spawned")
        return spawned.newest_source

    def _forked(self, pids: list[int]) -> None:
        for process, pid in zip(self.ranks, pids, strict=True):
            process.pid = pid

    def abort_start(self) -> None:
        """Undo a start that did not finish: kill what was forked (a second interrupt cuts the
        wait short; with their inboxes closed, the workers end themselves)."""
        try:
            # Only those not reported gone: a reaped pid may be another process's already.
            forked = [process for process in self.ranks if process.pid and process.alive]
            if forked and not self.helper.lost:
                self._settle_reports(forked)
                self.helper.wait_for_exits([process.pid for process in forked], time.monotonic() + KILL_WAIT_S)
        except KeyboardInterrupt:
            pass  # no more patience
        finally:
            for process in self.ranks:
                process.exit_code = process.exit_code if process.exit_code is not None else -signal.SIGKILL

    # ── signals ─────────────────────────────────────────────────────────────────────────────
    def signal(self, rank: int, sig: int) -> None:
        """Send ``sig`` to one rank's process only (a stack dump, an interrupt of its call)."""
        process = self.get(rank)
        if process is not None and process.alive:  # a reaped pid may be another process's already
            _signal_pid(process.pid, sig)

    # ── exits, as the helper reports them ───────────────────────────────────────────────────
    def take_exits(self) -> list[tuple[RankProcess, WorkerExit]]:
        """The exits the helper reported of ranks still counted alive, each taken once."""
        taken = []
        for process in self.ranks:
            if process.alive and not process.report_settled:
                ended = self.helper.take_exit(process.pid)
                if ended is not None:
                    process.report_settled = True
                    taken.append((process, ended))
        return taken

    def depart(self, rank: int) -> None:
        """The rank said it leaves nothing behind and closed its channels: it is as good as gone
        (:meth:`note_departure`), and its group ends without waiting for its exit, whose report
        the helper drops (:meth:`~accelnb.kernel.helper.client.WorkerHelper.depart`) unless it was
        taken already (under load an exit can come before the rank's last output is read).
        Counted gone first: a rank still counted alive would be killed by an interrupted stop."""
        self.note_departure(rank)
        process = self.get(rank)
        if process is not None and not process.report_settled:
            self._settle_reports([process])
            self.helper.depart([process.pid])

    def release(self) -> None:
        """The group is closed: the helper drops every exit report it has not handed over (a rank
        counted gone before its report came: an interrupt, a helper's death), so that none is left
        for a later process the OS gives the same pid."""
        unsettled = [process for process in self.ranks if process.pid and not process.report_settled]
        self._settle_reports(unsettled)
        if unsettled and not self.helper.lost:
            self.helper.forget([process.pid for process in unsettled])

    @staticmethod
    def _settle_reports(processes: Sequence[RankProcess]) -> None:
        for process in processes:
            process.report_settled = True

    def note_departure(self, rank: int) -> None:
        """The rank said it leaves nothing behind and closed its channels: it is as good as gone,
        with exit code 0, while the OS frees its process. One whose exit 0 was reaped first
        departed all the same (a failed exit stays a failure)."""
        process = self.get(rank)
        if process is not None and process.exit_code in (None, 0):
            process.exit_code, process.departed = 0, True

    def note_exit(self, rank: int, exit_code: int) -> None:
        process = self.get(rank)
        if process is not None:
            process.exit_code = exit_code

    # ── stopping ────────────────────────────────────────────────────────────────────────────
    def stop(self, grace: float, wait_for_exits: Callable[[float], None]) -> StopReport:
        """SIGTERM every live rank, SIGKILL what is left after ``grace``.

        ``wait_for_exits(deadline)`` pumps until every rank is gone or ``deadline``. A second
        interrupt while it waits cuts the grace short: SIGKILL at once.
        """
        stopped = self.live_ranks()
        hurried = False
        while True:
            try:
                unreaped = self._ladder(grace, wait_for_exits)
                break
            except KeyboardInterrupt:
                grace, hurried = 0.0, True
        return StopReport(stopped, unreaped, hurried)

    def _ladder(self, grace: float, wait_for_exits: Callable[[float], None]) -> list[int]:
        for process in self.ranks:
            if process.alive:
                _signal_group(process, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        wait_for_exits(time.monotonic() + grace)
        for process in self.ranks:
            if process.alive:
                _signal_group(process, signal.SIGKILL)
        wait_for_exits(time.monotonic() + KILL_WAIT_S)
        # A reaped worker is not signalled again: its pid may already be reused, and the helper
        # reports an exit only after ending everything that rank left behind (worker/template/helper.py).
        unreaped = [process for process in self.ranks if process.alive]
        for process in unreaped:
            _signal_group(process, signal.SIGKILL)
        return [process.rank for process in unreaped]

    def kill_survivors(self) -> list[int]:
        """SIGKILL every rank still running and wait until it is gone; returns those ranks."""
        survivors = [p for p in self.ranks if p.alive and p.pid]
        if not survivors:
            return []
        pids = [p.pid for p in survivors]
        self._settle_reports(survivors)
        if self.helper.lost:
            for process in survivors:
                _signal_group(process, signal.SIGKILL)
            _wait_gone(pids, time.monotonic() + BURY_WAIT_S)
        else:
            self.helper.wait_for_exits(pids, time.monotonic() + KILL_WAIT_S)
        for process in survivors:
            process.exit_code = -signal.SIGKILL
        return [p.rank for p in survivors]

    def bury(self) -> list[int]:
        """The helper died: its workers die with it (PDEATHSIG). Make sure (a rank's own children
        have no PDEATHSIG), and wait until they are gone; returns the ranks that were alive.

        Their exit codes are left to the caller, which first reads what they wrote last.
        """
        live = [p for p in self.ranks if p.alive]
        for process in live:
            _signal_group(process, signal.SIGKILL)
        _wait_gone([p.pid for p in live], time.monotonic() + BURY_WAIT_S)
        return [p.rank for p in live]


def _signal_group(process: RankProcess, sig: int) -> None:
    if process.alive:
        process.signals_sent.add(sig)
    try:
        # Just forked, a worker may not have called setsid() yet: then only its pid can be reached.
        # Never both: a function's own SIGTERM handler must run once.
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, sig)
        else:
            os.kill(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(pids: list[int], deadline: float) -> None:
    """Wait until none of ``pids`` runs (gone, or a zombie nobody reaps yet), or ``deadline``.

    They are not our children (the dead helper's, re-parented), so nothing can be waited on but a
    pidfd, which becomes readable when its process exits; /proc is polled where there is none.
    """
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone already
        except (AttributeError, OSError):  # no pidfd_open (Linux < 5.3)
            while _runs(pid) and time.monotonic() < deadline:
                time.sleep(0.005)
            continue
        try:
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(pidfd)


def _runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return False
    state = fields[fields.rindex(b")") + 2:][:1]  # after "pid (comm) "; comm may hold spaces
    return state not in (b"Z", b"X")
