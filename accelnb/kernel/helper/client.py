"""The kernel's handle on a template process (see ``worker/template/helper.py`` for the why).

A :class:`WorkerHelper` is one running template: a fresh interpreter (``python -m
accelnb.worker.template.helper``, never a fork of the kernel) and the private socket to it. Which template
the kernel uses, and when it is replaced, is ``kernel/helper/template.py``'s business. Usually only
the thread that launches talks to it; a sweep (``accelnb.sweep``) runs several launches at once,
one thread each, on this one template, so every exchange on its socket holds its lock: a spawn
request and its answer are one exchange (no thread reads another's answer), and a worker's exit,
whichever thread reads it, waits in :meth:`WorkerHelper.take_exit` for the group that owns the pid.

    >>> helper = WorkerHelper()                          # 1-2 s until ready (import torch)
    >>> helper.follow(["transformers"], wait=True)       # imports what the kernel has
    >>> spawned = helper.spawn(specs, fds)               # ms: forks one worker per spec
    >>> spawned.pids, spawned.newest_source              # and the cell sources they have

The template can die at any moment (the OOM killer picks it, a user's ``kill``). Its end of the
socket then closes: :attr:`WorkerHelper.lost` becomes True, whoever waits on it stops waiting,
and :meth:`WorkerHelper.death` says how it ended. Its workers die with it (``PR_SET_PDEATHSIG``).

A spawn request interrupted before its answer reached the launch (Ctrl-C) is reclaimed: the
workers it forked are killed before the interrupt goes on, so no worker outlives a launch that
never learned its pids. What is noted of a worker (its exit, a report to drop) is forgotten when
the template names its pid again: the OS reuses pids (after 32768 by default), and an old exit
taken for a new rank reported it "killed by SIGKILL" the moment it started.

Each spawn of a launch whose group can be joined ahead (``wire/group_ahead.py``) also hands the
template a freshly bound rendezvous socket for the next launch like it: its waiting children
join that launch's group on it. The kernel keeps its own copy, which
:meth:`WorkerHelper.take_group_ahead` gives the next launch when it is alike, and which the
next spawn closes when it was not used (the template lets that group go on any spawn).

Each spawn request also gives the template the notebook's cell sources it does not have yet
(``kernel/helper/cell_sources.py``), so a launch's call carries its ranks only those they lack
(:attr:`SpawnedRanks.newest_source`): a launch after 3,000 cells wrote and registered 0.7 MB of
them into every rank (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from accelnb.errors import WorkerStartError
from accelnb.kernel.helper.cell_sources import in_memory_sources
from accelnb.kernel.helper.process_exits import HelperExit, helper_died
from accelnb.kernel.planning.ports import bind_rendezvous_socket
from accelnb.wire.group_ahead import GroupAhead
from accelnb.wire.held_interrupts import held_interrupts
from accelnb.wire.spec import RankFds, WorkerSpec
from accelnb.wire.template import FollowImports, sources_file

HELPER_MODULE = "accelnb.worker.template.helper"  # named, not imported: it runs on the worker side
START_TIMEOUT_S = 120.0
# A report is one SEQPACKET message, read whole or cut short: this is far more than the longest
# (an unsafe import's description, a few KiB).
REPORT_BYTES = 1 << 20
SPAWN_TIMEOUT_S = 60.0
# A launch waits this long for the template to import what the kernel has (transformers and its
# dependencies take seconds; a slow file system or a loaded machine, more).
FOLLOW_TIMEOUT_S = 300.0
RECLAIM_WAIT_S = 2.0  # an interrupted spawn: how long to wait for the pids of what was forked
DEATH_STATUS_WAIT_S = 1.0  # its socket closed: how long the process may take to be reapable

StepHook = Callable[[str], None]  # called at named steps; tests inject faults there


class HelperSource(Protocol):
    """Where a launch gets its ready template: ``template.shared_helper``, or a test's own."""

    def __call__(self, *, on_step: StepHook | None = None) -> WorkerHelper: ...


@dataclass(frozen=True)
class SpawnedRanks:
    """What a spawn started: ``pids`` in the order of its specs; ``newest_source``, the newest of
    the notebook's cell sources that every one of them has from the template (and so every older
    one: they go to the template in order), None when they have none."""

    pids: list[int]
    newest_source: str | None


@dataclass(frozen=True)
class WorkerExit:
    """A worker's end, as the helper reaped it."""

    code: int  # negative: killed by that signal
    time: float  # wall time of the reaping


class TemplateUnsafe(Exception):
    """An import made the template unfit to fork (it started a thread or CUDA): use another."""

    def __init__(self, module: str, reason: str) -> None:
        super().__init__(f"importing {module} made accelnb's template unsafe to fork: {reason}")
        self.module = module


class WorkerHelper:
    """A running template process and the worker exits it reported."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The template must import this very accelnb, wherever the kernel found it.
        package_parent = str(Path(os.path.abspath(__file__)).parents[3])  # accelnb/kernel/helper/client.py
        python_path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONPATH": python_path}
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", HELPER_MODULE, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # the notebook's interrupt must not reach it
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.workers_started = 0  # how many it forked, ever
        self.considered: set[str] = set()  # modules of the kernel's it was asked for, or need not be
        self.modules_at_last_look = -1  # len(sys.modules) of the kernel when ``considered`` was last brought up to date
        self.unsafe: TemplateUnsafe | None = None  # set once an import made it unfit to fork
        self.unanswered: set[int] = set()  # follow requests it has not finished
        self._optional_unanswered: set[int] = set()  # the same for optional ones, which no launch waits for
        self._live_pids: set[int] = set()  # forked and not reported exited
        self._sock = ours
        # Each report is read into this, reused: a fresh 1 MiB bytes object per read cost ~80 µs.
        self._received = bytearray(REPORT_BYTES)
        self._ready = False
        self._closed = False
        self._next_request = 0
        self._exits: dict[int, WorkerExit] = {}
        # Answers to spawn requests, read but not yet taken by the spawn that asked: a Ctrl-C can
        # come between a read (which notes the answer) and its return to the waiting spawn.
        self._spawn_answers: dict[int, Any] = {}
        self._abandoned_requests: set[int] = set()  # spawns nobody waits for: their answer's pids are killed
        self._disowned_pids: set[int] = set()  # exits to drop when reported: no group waits for them
        self._departed: set[int] = set()  # said they leave nothing behind; not reported reaped yet
        # Departed workers whose exit was not 0 (pid: code): nobody waited for it, so a rank that
        # crashed on its way out (a library's thread aborting) is known here, and tests look.
        self._departed_crashes: dict[int, int] = {}
        self.lost = False  # its end of the socket closed: it died
        # The group the template's waiting children join ahead, and our copy of its bound socket.
        self._ahead: tuple[GroupAhead, socket.socket] | None = None
        self.pid = self._process.pid
        # The cell sources given to the template: their names, how many (the count it keeps), and
        # for each count it was given, the newest source it had then (``cell_sources.py``).
        self._sources_given: set[str] = set()
        self._sources_count = 0
        self._newest_given_at: dict[int, str] = {}
        # One exchange on the socket at a time: the launches of a sweep share the helper.
        self._lock = threading.RLock()

    # ── its life ────────────────────────────────────────────────────────────────────────────
    @property
    def alive(self) -> bool:
        return not self.lost and not self._closed and self._process.poll() is None

    def fileno(self) -> int:
        return self._sock.fileno()

    def wait_ready(self, on_step: StepHook | None = None) -> None:
        """Block until the helper imported torch; raises if it died or never got there."""
        with self._lock:
            if self._ready:
                return
            if on_step is not None:
                on_step("helper-starting")
            message = self._receive(timeout=START_TIMEOUT_S)
            if message is None and self.lost:
                raise helper_died(self.death(), "while starting, before it was ready", had_workers=False)
            if message is None or message[0] != "ready":
                self.close()
                raise WorkerStartError(
                    f"accelnb's helper process was not ready within {START_TIMEOUT_S:g} s (it imports torch "
                    "first), so accelnb ended it. Check that `python -c 'import torch'` works and is quick.")
            self._ready = True
            self._close_start_stderr()  # it points its stderr at /dev/null once ready

    def poll_ready(self) -> bool:
        """Whether it is ready, without waiting (reads what it sent so far)."""
        with self._lock:
            if not self._ready and not self.lost:
                message = self._receive(timeout=0)
                if message is not None and message[0] == "ready":
                    self._ready = True
                    self._close_start_stderr()
            return self._ready

    def death(self) -> HelperExit:
        """How it ended (call once :attr:`lost`): waits a moment for its exit status."""
        try:
            code: int | None = self._process.wait(timeout=DEATH_STATUS_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        return HelperExit(self.pid, code, self._start_stderr())

    def close(self) -> None:
        """Stop the helper (it kills any worker still running) and free its fds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drop_group_ahead()
        self._sock.close()
        self._close_start_stderr()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    # ── following the kernel's imports ──────────────────────────────────────────────────────
    def follow(self, modules: Sequence[str], *, wait: bool, optional: bool = False) -> None:
        """Ask the template to import ``modules`` in this process's ``sys.path``, working directory
        and environment as they are now (see ``wire/template.py``).

        ``wait``: a launch is about to fork; block until they are imported (raises
        :class:`TemplateUnsafe` when one made the template unfit, ``HelperDied`` when it died).
        Otherwise the template imports them while it has no ranks, and this returns at once;
        ``optional`` ones, only while nothing else waits, and no launch waits for them.
        """
        with self._lock:
            self._raise_if_unsafe()
            self._next_request += 1
            request = FollowImports(self._next_request, tuple(modules), tuple(sys.path), os.getcwd(),
                                    dict(os.environ), urgent=wait, optional=optional)
            try:
                self._sock.send(pickle.dumps(request))
            except OSError:
                if self._peer_closed():
                    raise helper_died(self.death(), "while importing what the notebook imported") from None
                raise
            (self._optional_unanswered if optional else self.unanswered).add(request.request_id)
            if not wait:
                return
            reply = self._await_reply(request.request_id, time.monotonic() + FOLLOW_TIMEOUT_S, ("followed", "unsafe"))
            if reply is None and self.lost:
                raise helper_died(self.death(), "while importing what the notebook imported")
            if reply is None:
                raise WorkerStartError(
                    f"accelnb's template did not import what the notebook imported within {FOLLOW_TIMEOUT_S:g} s. "
                    f"Check that importing these is quick in a plain python: {', '.join(modules) or '(none new)'}.")
            self._raise_if_unsafe()

    def wait_until_idle(self, timeout: float) -> bool:
        """Block until every import asked of the template is done, optional ones included (or it
        died, or ``timeout`` s passed); True when none is left."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while (self.unanswered or self._optional_unanswered) and not self.lost:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._receive(timeout=left)
            return not (self.unanswered or self._optional_unanswered)

    def _raise_if_unsafe(self) -> None:
        if self.unsafe is not None:
            raise self.unsafe

    # ── forking workers ─────────────────────────────────────────────────────────────────────
    def spawn(self, specs: Sequence[WorkerSpec], fds: Sequence[RankFds], on_step: StepHook | None = None, *,
              next_group: GroupAhead | None = None, forked: Callable[[list[int]], None] | None = None,
              ) -> SpawnedRanks:
        """Fork one worker per spec, handing it ``fds`` (the spec's, in the same order); returns
        their pids, and which cell sources they have. ``next_group``: the group of a next launch
        like this one (``group_ahead(specs)``), which the template's waiting children then join
        ahead (``wire/group_ahead.py``); None: none.
        ``forked(pids)`` is called with Ctrl-C held, as soon as the pids are known: an interrupt
        after that finds them in the caller's hands, never lost on the way back.

        Raises :class:`~accelnb.errors.HelperDied` when the helper dies meanwhile. Whatever
        interrupts the wait (Ctrl-C) leaves no worker of this request behind.
        """
        with self._lock:
            self.wait_ready()
            self._next_request += 1
            request = self._next_request
            self._drop_group_ahead()  # the template lets its group go on any spawn: one unused is dead
            ahead = next_group
            next_socket = bind_rendezvous_socket(None) if ahead is not None else None
            sent = False
            try:
                # A request sent is a request reclaimed if anything stops the wait for its answer:
                # a Ctrl-C just after the send once left its workers unknown, and their exits
                # noted for nobody. A second Ctrl-C gets out of a send that blocks.
                with held_interrupts(second_one_goes_through=True):
                    # The notebook's cell sources the template lacks go in the request itself: a
                    # message of their own woke the template, which could then fork a waiting
                    # child (10-15 ms) before the request came.
                    sources = in_memory_sources(already_sent=self._sources_given)
                    count = self._sources_count + len(sources)
                    sources_fd: int | None = None
                    try:
                        sources_fd = sources_file(sources) if sources else None
                        socket.send_fds(self._sock, [pickle.dumps(("spawn", request, list(specs), ahead,
                                                                   count if sources else None))],
                                        [fd for each in fds for fd in each.flat()]
                                        + ([] if next_socket is None else [next_socket.fileno()])
                                        + ([] if sources_fd is None else [sources_fd]))
                    except OSError:
                        if next_socket is not None:
                            next_socket.close()
                        if self._peer_closed():
                            raise helper_died(self.death(), "while starting workers") from None
                        raise
                    finally:
                        if sources_fd is not None:
                            os.close(sources_fd)
                    sent = True
                    if sources:
                        self._note_sources_given(sources, count)
                    if ahead is not None and next_socket is not None:
                        self._ahead = (ahead, next_socket)  # a failed or interrupted spawn drops it next time
                if on_step is not None:
                    on_step("spawn-requested")
                self._await_spawn_answer(request, time.monotonic() + SPAWN_TIMEOUT_S)
            except BaseException:
                if sent:
                    self._reclaim(request)
                raise
            with held_interrupts():  # an answer taken is an answer in the caller's hands
                reply = self._spawn_answers.pop(request, None)
                if reply is not None and reply[0] == "spawned":
                    self.workers_started += len(reply[2])
                    if forked is not None:
                        forked(reply[2])
            if reply is None and self.lost:
                raise helper_died(self.death(), "while starting workers")
            if reply is None:
                self._reclaim(request)
                raise WorkerStartError(f"accelnb's helper process did not fork the workers within "
                                       f"{SPAWN_TIMEOUT_S:g} s; they were stopped. Try again.")
            if reply[0] == "spawn_failed":
                raise WorkerStartError(f"accelnb's helper process could not fork the workers: {reply[2]}")
            return SpawnedRanks(reply[2], self._newest_given_at.get(reply[3]))

    def _note_sources_given(self, sources: tuple[tuple[str, str], ...], count: int) -> None:
        """The template has ``sources`` now (they went with a spawn request), ``count`` in all.

        The count is ours, sent with them: were they sent and a second Ctrl-C came before this
        note, they go again with the next spawn under a new count, and the count the template had
        meanwhile names none here (a call then carries its ranks all of them)."""
        self._sources_given.update(filename for filename, _ in sources)
        self._sources_count = count
        self._newest_given_at[count] = sources[0][0]

    @property
    def socket_held_ahead(self) -> socket.socket | None:
        """Our copy of the socket bound for the next launch's group, while we hold one."""
        return None if self._ahead is None else self._ahead[1]

    def take_group_ahead(self, ahead: GroupAhead) -> socket.socket | None:
        """The rendezvous socket of the group the template's waiting children joined ahead, for a
        launch whose group is ``ahead`` (:func:`~accelnb.wire.group_ahead.group_ahead` of its
        specs); None when that is another group (bind a fresh one). Taken: the caller closes it."""
        with self._lock:
            if self._ahead is None or self._ahead[0] != ahead:
                return None
            taken = self._ahead[1]
            self._ahead = None
            return taken

    def _drop_group_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead[1].close()
            self._ahead = None

    def _await_reply(self, request: int, deadline: float, kinds: tuple[str, ...]) -> Any | None:
        """The template's answer to ``request``; None when it died or the deadline passed."""
        while not self.lost:
            message = self._receive(timeout=max(0.0, deadline - time.monotonic()))
            if message is not None and message[0] in kinds and message[1] == request:
                return message
            if message is None and time.monotonic() >= deadline:
                return None
        return None

    def _await_spawn_answer(self, request: int, deadline: float) -> None:
        """Read reports until the template's answer to spawn ``request`` is noted (in
        ``_spawn_answers``), it died, or the deadline passed."""
        while request not in self._spawn_answers and not self.lost:
            if self._receive(timeout=max(0.0, deadline - time.monotonic())) is None and time.monotonic() >= deadline:
                return

    def _reclaim(self, request: int) -> None:
        """Kill whatever ``request`` forked and wait for their exits; bounded, and a second
        interrupt cuts it short. Its answer may have been read already, just before the interrupt."""
        deadline = time.monotonic() + RECLAIM_WAIT_S
        try:
            self._await_spawn_answer(request, deadline)
        except KeyboardInterrupt:
            deadline = 0.0  # no more patience; the workers still die on their sockets' end of file
        with held_interrupts():  # an answer taken is an answer acted on
            answer = self._spawn_answers.pop(request, None)
            if answer is None:
                self._abandoned_requests.add(request)  # its late answer is reclaimed in _note
                return
            pids = answer[2] if answer[0] == "spawned" else []
            self._kill_and_forget(pids)
        try:
            self._wait_until_reported(pids, deadline)
        except KeyboardInterrupt:
            pass

    # ── worker exits ────────────────────────────────────────────────────────────────────────
    def collect(self) -> None:
        """Read every message that is waiting, without blocking."""
        with self._lock:
            while self._receive(timeout=0) is not None:
                pass

    def take_exit(self, pid: int) -> WorkerExit | None:
        """The reported exit of ``pid``, forgotten once taken; None while it runs."""
        with self._lock:
            return self._exits.pop(pid, None)

    def forget(self, pids: Iterable[int]) -> None:
        """Exits of these pids are nobody's business any more (their group was closed)."""
        with self._lock:
            for pid in pids:
                if self._exits.pop(pid, None) is None:  # not reported yet: drop the report when it comes
                    self._disowned_pids.add(pid)

    def depart(self, pids: Iterable[int]) -> None:
        """These workers said they leave nothing behind and are exiting: their group ends without
        waiting for their exits, which are dropped when reported (:meth:`wait_for_departed`)."""
        pids = set(pids)
        with self._lock:
            self.forget(pids)
            self._departed.update(pids & self._disowned_pids)

    def wait_for_departed(self, deadline: float) -> bool:
        """Wait (until ``deadline``) until every departed worker is reported reaped; True if so."""
        while self._departed and not self.lost and not self._closed and time.monotonic() < deadline:
            self._receive(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
        return not self._departed or self.lost or self._closed  # a closed template ended its children first

    def wait_for_exits(self, pids: Iterable[int], deadline: float) -> None:
        """SIGKILL these workers' process groups and wait (until ``deadline``) for their exits."""
        pids = list(pids)
        self._kill_and_forget(pids)
        self._wait_until_reported(pids, deadline)

    def _kill_and_forget(self, pids: Iterable[int]) -> None:
        for pid in pids:
            _kill_group(pid)
        self.forget(pids)

    def _wait_until_reported(self, pids: Iterable[int], deadline: float) -> None:
        """Read reports until the exits of these forgotten pids came (or ``deadline``)."""
        waiting = set(pids)
        # Each read takes the lock on its own: another launch's thread may read these exits too
        # (it drops them, as disowned), and its own meanwhile.
        while waiting & self._disowned_pids and not self.lost and time.monotonic() < deadline:
            self._receive(timeout=min(0.05, max(0.0, deadline - time.monotonic())))

    # ── the socket ──────────────────────────────────────────────────────────────────────────
    def _receive(self, timeout: float) -> Any | None:
        """One message, or None when none came within ``timeout`` or the helper is gone."""
        with self._lock:
            if self.lost or self._closed:
                return None
            readable, _, _ = select.select([self._sock], [], [], timeout)
            if not readable:
                return None
            # A message read is a message noted: a Ctrl-C between the two would lose it, and a
            # lost "exited" leaves a departed rank waited for forever (a fresh clone's Ctrl-C at
            # many moments of start-up, then every later test of that pytest worker).
            with held_interrupts():
                try:
                    size = self._sock.recv_into(self._received)
                except OSError:
                    size = 0
                if not size:
                    self.lost = True
                    return None
                with memoryview(self._received) as received:
                    message = pickle.loads(received[:size])
                self._note(message)
            return message

    def take_departed_crashes(self) -> dict[int, int]:
        """Departed workers whose exit was not 0 (pid: code) since the last call, each told once."""
        with self._lock:
            crashes, self._departed_crashes = self._departed_crashes, {}
            return crashes

    @property
    def unclaimed_exits(self) -> dict[int, int]:
        """Exits reported for workers whose group has not taken them (pid: code). Empty once every
        launch ended: an exit left here would be taken for the next process given its pid."""
        with self._lock:
            return {pid: ended.code for pid, ended in self._exits.items()}

    @property
    def has_workers(self) -> bool:
        """Whether a worker it forked may still run (exits are read by :meth:`collect`); a
        departed one does not count: it is exiting, and closing the template ends it at once."""
        return bool(self._live_pids - self._departed)

    def _note(self, message: Any) -> None:
        if message[0] == "exited":
            pid, code, reaped_at = message[1], message[2], message[3]
            self._live_pids.discard(pid)
            if pid in self._departed:
                self._departed.discard(pid)
                if code != 0:
                    self._departed_crashes[pid] = code
            if pid in self._disowned_pids:
                self._disowned_pids.discard(pid)
            else:
                self._exits[pid] = WorkerExit(code, reaped_at)
        elif message[0] in ("spawned", "spawn_failed"):
            self._note_spawn_answer(message)
        elif message[0] in ("followed", "unsafe"):
            self.unanswered.discard(message[1])
            self._optional_unanswered.discard(message[1])
        if message[0] == "unsafe" and self.unsafe is None:
            self.unsafe = TemplateUnsafe(message[2], message[3])

    def _note_spawn_answer(self, answer: Any) -> None:
        request = answer[1]
        pids: list[int] = answer[2] if answer[0] == "spawned" else []
        for pid in pids:
            # The OS gave this pid again: what was noted of its earlier process (an exit nobody
            # took, a report to drop) is not this one's. Taken for it, a rank that had just
            # started was reported "killed by SIGKILL" (make soak, once pids wrapped around).
            self._exits.pop(pid, None)
            self._disowned_pids.discard(pid)
            self._departed.discard(pid)
        self._live_pids.update(pids)
        if request in self._abandoned_requests:  # nobody waits for it any more
            self._abandoned_requests.discard(request)
            self._kill_and_forget(pids)
        else:
            self._spawn_answers[request] = answer

    def _peer_closed(self) -> bool:
        self.collect()
        return self.lost

    def _start_stderr(self) -> str:
        stream = self._process.stderr
        if stream is None or stream.closed or self._process.returncode is None:
            return ""
        try:
            return stream.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def _close_start_stderr(self) -> None:
        if self._process.stderr is not None:
            self._process.stderr.close()


def _kill_group(pid: int) -> None:
    """SIGKILL a worker and its process group. The pid too: a worker forked a moment ago may not
    have called setsid() yet, and then no group of that id exists."""
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
