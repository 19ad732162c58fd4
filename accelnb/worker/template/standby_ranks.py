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

    >>> standby = StandbyRanks(close_in_child=(sock.fileno(), wake_r, wake_w))        # doctest: +SKIP
    >>> standby.wanted = 2; standby.fork_one(become_rank, leave_template)   # while idle  # doctest: +SKIP
    >>> pid = standby.hand_over(spec, fds)      # None: none waits, fork this rank      # doctest: +SKIP
    >>> standby.settle()                        # then report the pids                  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from accelnb.wire.spec import RankFds, split_fds

MAX_STANDBY = 16  # a launch of more ranks forks the rest; a waiting child holds about 2 MiB of its own
MAX_SPEC_BYTES = 1 << 20
MAX_FDS = 5  # a rank's RankFds: stdout, stderr, events, inbox, and maybe the store
# What ps, top and psutil call a waiting child (the kernel's ``comm``, 15 bytes at most): someone
# who finds idle processes under their kernel sees what they are, not a leak. The template carries
# it while it forks one, so the child is born with it; a rank takes the template's name back.
STANDBY_NAME = "accelnb-standby"
PR_SET_NAME = 15
RANK_NOW = b"r"  # a child to the template: renamed, a rank from now on
SETTLE_LIMIT_S = 5.0  # a child takes a millisecond to say so; one stopped (SIGSTOP) is not waited for


class StandbyRanks:
    """The template's waiting children: ``wanted`` of them, forked one per idle turn."""

    def __init__(self, close_in_child: Iterable[int]) -> None:
        self.wanted = 0
        self._close_in_child = tuple(close_in_child)  # the template's own fds, none of a rank's business
        self._waiting: dict[int, socket.socket] = {}  # pid -> the template's end of its socket
        self._handed: list[socket.socket] = []  # handed a spec, not yet heard to be a rank

    @property
    def pids(self) -> set[int]:
        """The children waiting: not ranks, not leftovers of a dead rank."""
        return set(self._waiting)

    def short(self) -> bool:
        """Fewer wait than the last launch had ranks."""
        return len(self._waiting) < min(self.wanted, MAX_STANDBY)

    def fork_one(self, become_rank: Callable[[Any, RankFds], None], leave_template: Callable[[], None]) -> None:
        """Fork one more waiting child. In the child, ``leave_template`` runs at once and
        ``become_rank(spec, fds)`` once a spec came; neither returns (nor does the child)."""
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
                leave_template()
                handed = _wait_for_spec(theirs)
                if handed is not None:
                    _set_name(template_name)
                    theirs.send(RANK_NOW)  # the template reports our pid only once we look like a rank
                theirs.close()
            except BaseException:
                os._exit(1)
            if handed is None:  # let go by the template
                os._exit(0)
            become_rank(*handed)
            os._exit(1)  # unreachable: become_rank ends the process
        theirs.close()
        self._waiting[pid] = ours

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

    def let_go(self) -> None:
        """End every waiting child (the template changed since they were forked); the serve
        loop reaps them silently, as it does any child that is not a rank."""
        while self._waiting:
            pid, ours = self._waiting.popitem()
            ours.close()
            _kill(pid)

    def forget(self, pid: int) -> None:
        """``pid`` was reaped (a waiting child that died, or any other child): never signal it."""
        ours = self._waiting.pop(pid, None)
        if ours is not None:
            ours.close()

    def close_in_rank(self) -> None:
        """In a rank forked at launch: the waiting and handed children's sockets are not its to hold."""
        for ours in (*self._waiting.values(), *self._handed):
            ours.close()


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
