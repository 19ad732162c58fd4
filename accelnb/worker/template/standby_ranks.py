"""Ranks forked ahead of a launch: the template keeps them waiting for their spec.

A fork of the template costs the template 10-15 ms (copying the page tables of an interpreter that
imported torch), and the child as much again before it runs a line of its rank; a launch of two
ranks paid both, one after the other, before any rank could join its group: 30 of a 2-rank
launch's 85 ms on a 2-core machine. So, while the template has nothing else to do, it forks as
many children as the last launch had ranks; each does the part of becoming a rank that does not
depend on which rank (its own session, death with the template, subreaper, the rank's threads:
``worker/main.py``) and then waits on a socket of its own for a spec and its fds. A launch hands
each spec to a waiting child (one ``sendmsg``) instead of forking, and forks only for the ranks
that found none.

A waiting child is a fork of the template as it was: it is let go (SIGKILL, reaped silently like
any leftover) as soon as the template imports anything more or takes new kernel state, so a rank
never lacks a module its template has; and when the template becomes unfit to fork, none is
forked. A child that died while waiting is found when its spec cannot be sent, and the rank is
forked instead. They are the template's children, so whatever ends the template ends them.

The template reports a handed child's pid only once the child has said it is a rank (it has
taken the template's name back): whoever learns the pid never finds it named like a waiting child.

When the kernel sent the group the next launch will most likely have (``wire/group_ahead.py``)
and a socket bound for it, the waiting children are that group's members: each joins it while it
waits (its store, gloo's connections, the join barrier), as the rank of the order it was forked
in, and says so. A launch of that group, on that socket, gets them all at once
(:meth:`StandbyRanks.hand_over_group`), once every one has joined. A launch that comes before
all were forked (back to back with the last, whose ranks had the cores), or of any other group,
lets them go and forks its ranks as before: they are reaped first, so that no store of theirs
accepts on the socket the launch's rank 0 is given. A member that dies on its own ends the
group's joining ahead until the next launch: its peers are let go, and none are forked again
for it, so a join that cannot succeed is not retried in a loop. Each set of members keys the
store with a prefix of its own: what a set that was let go had written, or still had queued on
the socket, never reaches the next one.

    >>> standby = StandbyRanks(close_in_child, become_rank, leave_template, join_ahead)  # doctest: +SKIP
    >>> standby.wanted = 2; standby.fork_one()  # while idle                            # doctest: +SKIP
    >>> pids = standby.hand_over_group(specs, fds)  # None: not joined ahead            # doctest: +SKIP
    >>> pid = standby.hand_over(spec, fds)      # None: none waits, fork this rank      # doctest: +SKIP
    >>> standby.settle()                        # then report the pids                  # doctest: +SKIP
    >>> standby.expect(ahead, listener)         # the next launch's group (or None)     # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelnb.wire.group_ahead import GroupAhead, group_ahead
from accelnb.wire.spec import FDS_PER_RANK, RankFds, WorkerSpec, split_fds

MAX_STANDBY = 16  # a launch of more ranks forks the rest; a waiting child holds about 2 MiB of its own
MAX_SPEC_BYTES = 1 << 20
MAX_FDS = FDS_PER_RANK + 1  # a rank's RankFds: stdout, stderr, events, inbox, control, and maybe the store
# What ps, top and psutil call a waiting child (the kernel's ``comm``, 15 bytes at most): someone
# who finds idle processes under their kernel sees what they are, not a leak. The template carries
# it while it forks one, so the child is born with it; a rank takes the template's name back.
STANDBY_NAME = "accelnb-standby"
PR_SET_NAME = 15
RANK_NOW = b"r"  # a child to the template: renamed, a rank from now on
JOINED = b"j"  # a member to the template: joined the group ahead, waiting for its spec
SETTLE_LIMIT_S = 5.0  # a child takes a millisecond to say so; one stopped (SIGSTOP) is not waited for
JOIN_LIMIT_S = 5.0  # a launch waits this long for its members to have joined (milliseconds, unloaded)


@dataclass(frozen=True)
class JoinAhead:
    """What a member joins: the group's rank ``rank`` of ``group.world_size``, on the store at
    ``port`` (listening on ``listen_fd`` in rank 0), under the key ``prefix`` of its set."""

    group: GroupAhead
    rank: int
    port: int
    listen_fd: int | None
    prefix: str


@dataclass
class _Ahead:
    """The group the waiting children join ahead, and its members."""

    group: GroupAhead
    listener: socket.socket  # the template's copy of the socket the kernel bound for it
    prefix: str  # this set of members' store keys; a new set gets a new one
    members: dict[int, int] = field(default_factory=dict)  # pid -> its rank in the group
    failed: bool = False  # a member died on its own: no more are forked for this group

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])



class StandbyRanks:
    """The template's waiting children: ``wanted`` of them, forked one per idle turn."""

    def __init__(self, close_in_child: Iterable[int], become_rank: Callable[[Any, RankFds], None],
                 leave_template: Callable[[], None], join_ahead: Callable[[JoinAhead], None]) -> None:
        """In a child: ``leave_template()`` runs at once, ``join_ahead(...)`` next in a member, and
        ``become_rank(spec, fds)`` once a spec came (it never returns)."""
        self.wanted = 0
        self._close_in_child = tuple(close_in_child)  # the template's own fds, none of a rank's business
        self._become_rank = become_rank
        self._leave_template = leave_template
        self._join_ahead = join_ahead
        self._waiting: dict[int, socket.socket] = {}  # pid -> the template's end of its socket
        self._handed: list[socket.socket] = []  # handed a spec, not yet heard to be a rank
        self._ahead: _Ahead | None = None
        self._set_numbers = itertools.count(1)  # each set of members' store prefix

    @property
    def pids(self) -> set[int]:
        """The children waiting: not ranks, not leftovers of a dead rank."""
        return set(self._waiting)

    def short(self) -> bool:
        """Fewer wait than the last launch had ranks (than the group ahead has, while it joins)."""
        if self._ahead is not None:
            return not self._ahead.failed and len(self._ahead.members) < self._ahead.group.world_size
        return len(self._waiting) < min(self.wanted, MAX_STANDBY)

    def fork_one(self) -> int:
        """Fork one more waiting child: the next member of the group ahead, where there is one.
        Returns its pid."""
        ahead = self._ahead
        member: JoinAhead | None = None
        if ahead is not None:
            rank = min(set(range(ahead.group.world_size)) - set(ahead.members.values()))
            member = JoinAhead(ahead.group, rank, ahead.port, ahead.listener.fileno() if rank == 0 else None,
                               ahead.prefix)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        gc.freeze()  # as for a rank forked at launch: the template's objects are never collected there
        template_name = _name()
        _set_name(STANDBY_NAME)  # the child is born with it: never a moment where it looks like a rank
        pid = -1
        try:
            pid = os.fork()
        finally:
            if pid != 0:
                _set_name(template_name)
        if pid == 0:
            try:
                ours.close()
                for other in self._waiting.values():  # or their end of file would never come
                    other.close()
                for fd in self._close_in_child:
                    os.close(fd)
                if ahead is not None:
                    if member is not None and member.rank == 0:
                        ahead.listener.detach()  # the store's from now on: never closed under it
                    else:
                        ahead.listener.close()
                self._leave_template()
                if member is not None:
                    self._join_ahead(member)
                    theirs.send(JOINED)
                handed = _wait_for_spec(theirs)
                if handed is not None:
                    _set_name(template_name)
                    theirs.send(RANK_NOW)  # the template reports our pid only once we look like a rank
                theirs.close()
            except BaseException:
                os._exit(1)
            if handed is None:  # let go by the template
                os._exit(0)
            self._become_rank(*handed)
            os._exit(1)  # unreachable: become_rank ends the process
        theirs.close()
        self._waiting[pid] = ours
        if ahead is not None and member is not None:
            ahead.members[pid] = member.rank
        return pid

    def hand_over_group(self, specs: Sequence[WorkerSpec], fds: Sequence[RankFds]) -> list[int] | None:
        """Give a launch the members that joined its group ahead: their pids in the order of
        ``specs``, once every one has joined. None when the launch's group is not the one joined
        ahead, or not all its members were forked yet, or one failed to join: its members are
        gone then (reaped), and the caller starts the ranks as for any launch. The fds stay the
        caller's to close."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if group_ahead(specs) != ahead.group or specs[0].master_port != ahead.port:
            self._end_members(ahead)
            ahead.listener.close()
            return None
        ahead.listener.close()  # rank 0 has it, or the launch's rank 0 gets the kernel's copy
        # Not all forked yet (launches back to back: none, while the last launch's ranks had the
        # cores): its ranks join at launch, as before, and the reply does not wait for them.
        if ahead.failed or len(ahead.members) < ahead.group.world_size or not self._all_joined(ahead):
            self._end_members(ahead)
            return None
        by_rank = {rank: pid for pid, rank in ahead.members.items()}
        pids: list[int] = []
        try:
            for spec, mine in zip(specs, fds, strict=True):
                pid = by_rank[spec.rank]
                pids.append(pid)
                ours = self._waiting.pop(pid)
                ahead.members.pop(pid)
                self._handed.append(ours)  # settle() closes it
                socket.send_fds(ours, [pickle.dumps(spec)], mine.flat())
        except OSError:  # one died between joining and now: its peers would wait for it in vain
            for pid in pids:
                _kill(pid)  # leftovers now, reaped by the serve loop; the launch fails to start
            self._end_members(ahead)
            raise
        return pids

    def _all_joined(self, ahead: _Ahead) -> bool:
        """Whether every member said JOINED within JOIN_LIMIT_S (once per set: a launch takes it or lets it go)."""
        deadline = time.monotonic() + JOIN_LIMIT_S
        for pid in ahead.members:
            ours = self._waiting[pid]
            try:
                ours.settimeout(max(0.0, deadline - time.monotonic()))
                said = ours.recv(1)
            except OSError:  # timed out, or it died
                return False
            finally:
                ours.settimeout(None)
            if said != JOINED:
                return False
        return True

    def hand_over(self, spec: Any, fds: RankFds) -> int | None:
        """Give ``spec`` and its fds to a waiting child; its pid, or None when none could take it
        (the launch forks that rank). The fds stay the caller's to close."""
        while self._waiting:
            pid, ours = self._waiting.popitem()
            try:
                socket.send_fds(ours, [pickle.dumps(spec)], fds.flat())
            except OSError:  # it died while waiting (an OOM kill): the next one, or a fork
                ours.close()
                _kill(pid)
                continue
            self._handed.append(ours)
            return pid
        return None

    def settle(self) -> None:
        """Wait until every child handed a spec has become a rank (taken the template's name back),
        so that whoever learns its pid never finds it called a standby. One that dies instead ends
        the wait for it: its death is that rank's exit, reported as any other."""
        deadline = time.monotonic() + SETTLE_LIMIT_S
        for ours in self._handed:
            try:
                ours.settimeout(max(0.0, deadline - time.monotonic()))
                ours.recv(1)
            except OSError:
                pass
            finally:
                ours.close()
        self._handed.clear()

    def expect(self, group: GroupAhead | None, listener: socket.socket | None) -> None:
        """After a launch: the group the next one will most likely have, and the socket the kernel
        bound for it (both None: the launch's group could not be joined ahead). The children
        still waiting are let go where their group changes."""
        if self._ahead is not None:
            self._end_members(self._ahead)
            self._ahead.listener.close()
            self._ahead = None
        if group is None or listener is None:
            return
        self.let_go()  # forked for no group: each would be a rank that joins at launch
        self._ahead = _Ahead(group, listener, f"accelnb/ahead-{next(self._set_numbers)}/")

    def let_go(self) -> None:
        """End every waiting child (the template changed since they were forked); the serve
        loop reaps them silently, as it does any child that is not a rank. The group's members
        are reaped here (see :meth:`_end_members`); new ones join under a new prefix."""
        if self._ahead is not None:
            self._end_members(self._ahead)
            self._ahead.prefix = f"accelnb/ahead-{next(self._set_numbers)}/"
        while self._waiting:
            pid, ours = self._waiting.popitem()
            ours.close()
            _kill(pid)

    def forget(self, pid: int) -> None:
        """``pid`` was reaped (a waiting child that died, or any other child): never signal it.
        A member that died ends the group's joining ahead (its peers would wait for it forever)."""
        ours = self._waiting.pop(pid, None)
        if ours is not None:
            ours.close()
        if self._ahead is not None and self._ahead.members.pop(pid, None) is not None:
            self._end_members(self._ahead)
            self._ahead.failed = True

    def close_in_rank(self) -> None:
        """In a rank forked at launch: the waiting and handed children's sockets, and the next
        launch's socket, are not its to hold."""
        for ours in (*self._waiting.values(), *self._handed):
            ours.close()
        if self._ahead is not None:
            self._ahead.listener.close()

    def _end_members(self, ahead: _Ahead) -> None:
        """Kill the group's members and reap them before returning: a member of rank 0 runs a store
        on the group's socket, and nothing else may accept on it while that one could."""
        for pid in list(ahead.members):
            ours = self._waiting.pop(pid, None)
            if ours is not None:
                ours.close()
            _kill(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # the serve loop reaped it first
                pass
        ahead.members.clear()


def _wait_for_spec(theirs: socket.socket) -> tuple[Any, RankFds] | None:
    data, fds, _, _ = socket.recv_fds(theirs, MAX_SPEC_BYTES, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    spec = pickle.loads(data)
    return spec, split_fds(fds, [spec])[0]


def _name() -> str:
    with open("/proc/self/comm") as comm:
        return comm.read().strip()


def _set_name(name: str) -> None:
    ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15])


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
