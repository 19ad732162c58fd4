"""accelnb's helper process, the warm template every rank is forked from: fork speed, clean ranks.

Forking the kernel is fast but carries what the kernel decided (a CUDA context, tqdm.auto's widget
bar, transformers' notebook progress callback, the kernel's sockets and logging handlers, a
module's ``from torch.distributed import init_process_group``); spawning fresh interpreters is
clean but pays every import again on every launch. The template is a fresh interpreter, started by
``kernel/helper/client.py`` (never a fork of the kernel), that

1. imports torch and what every rank needs to start (:data:`DEFAULT_PREIMPORTS`);
2. installs accelnb's rank-side hooks (``worker/template/imports.install_rank_hooks``), so that any
   module imported after them binds accelnb's ``init_process_group`` and ``mp.spawn``;
3. says "ready", then imports what the kernel has imported, as the kernel asks
   (``FollowImports``, ``wire/template.py``): after each cell in the background while no rank of
   it runs, and before each launch, which waits for them;
4. forks one rank per spec on request: milliseconds, with everything imported, and nothing of the
   kernel's; or hands the spec to a child it forked while idle (``standby_ranks.py``), which
   waits for one. It never initialises CUDA nor starts a thread; an import that does makes it
   refuse to fork (``unsafe``), and the kernel starts another without that module. Its objects
   are frozen for the garbage collector first (``gc.freeze``): a rank's collections walk only
   what the rank made. While idle it moves its memory onto 2 MiB pages (``huge_pages.py``), so
   that a fork copies, and a rank's exit frees, a page table 512 times smaller.

Protocol, over one private ``AF_UNIX``/``SOCK_SEQPACKET`` socketpair inherited from the kernel
(no listening socket exists, so nobody else can reach it):

- template → kernel ``("ready", pid)`` once it can fork ranks;
- kernel → template a :class:`~accelnb.wire.template.FollowImports`; template → kernel
  ``("followed", request_id, [failed module…])`` once every module was tried, or
  ``("unsafe", request_id, module, reason)`` (then and ever after);
- kernel → template ``("spawn", request_id, [WorkerSpec…], group_ahead, sources)`` with each worker's
  fds attached (a :class:`~accelnb.wire.spec.RankFds` each: stdout, stderr, events, inbox, control, and
  for rank 0 the TCPStore's listening socket; ``split_fds`` reads them back by name), and, where
  ``group_ahead`` (a :class:`~accelnb.wire.group_ahead.GroupAhead`) is not None, the socket
  bound for the next launch's group, which the waiting children join ahead (``standby_ranks.py``);
  and, where ``sources`` is not None, last a file of the notebook's cell sources the template does
  not have yet (``wire/template.sources_file``), ``sources`` being how many it has been given with
  them: it registers them in its ``linecache`` before it forks, so that every rank forked from
  then on has their lines;
- template → kernel ``("spawned", request_id, [pid…], sources_held)`` or
  ``("spawn_failed", request_id, text)``. ``sources_held``: how many of the cell sources given so
  far every one of those ranks has (a child that waited since before the last ones has fewer:
  ``worker/cell_sources.TemplateSources``), so that a call carries them only what they lack;
- template → kernel ``("exited", pid, returncode, reaped_at)`` once for every worker it forked
  (``returncode`` negative for a signal, ``reaped_at`` the wall time it was reaped), sent only
  once every process that worker left behind is gone (see below; at most
  ``LEFTOVERS_LIMIT_S`` later, for a process stuck in the OS that SIGKILL cannot end at once).

**Nothing a rank starts outlives it.** A rank's children may leave its process group, even its
session (``start_new_session=True``, a double-forked daemon), so signalling the group is not
enough. Both the helper and every worker are *child subreapers* (``PR_SET_CHILD_SUBREAPER``): a
process orphaned while its rank lives is re-parented to the rank, not to init, so everything a
rank started stays in its process tree; when the rank dies, what is left of that tree is
re-parented to the helper, before the helper is told of the death. So when the helper reaps a
worker, every other child it has (but the children waiting for a spec) is something a dead rank
left behind: it SIGKILLs those and their descendants, reaps them, and only then reports the
worker's exit. Orphans are reaped silently; only the workers' exits are reported.

A worker, being a subreaper, also inherits zombies: a process orphaned inside the rank (the
daemon of a double fork) that exits while the rank runs stays a zombie until the rank ends,
since nobody in the rank waits for it. A zombie holds a pid and no memory; reaping them in the
worker would steal exit statuses from ``subprocess`` and ``multiprocessing``, which wait for
their own children by pid, and nothing marks a child as adopted rather than forked.

When the kernel's end closes (the kernel died or shut us down), every worker and everything
under it is killed and the helper exits. Workers also get ``PR_SET_PDEATHSIG`` so they die with
the helper. (If the helper itself is SIGKILLed, its workers die that way, and whatever they left
behind is re-parented to init: no process of accelnb's remains to end it.)

Run as ``python -m accelnb.worker.template.helper CONTROL_FD``.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import pickle
import select
import signal
import socket
import sys
import time
import traceback
from collections import deque
from typing import Any

from accelnb.wire.group_ahead import GroupAhead
from accelnb.wire.spec import RankFds, split_fds
from accelnb.wire.template import FollowImports, read_sources_file
from accelnb.worker.cell_sources import TemplateSources
from accelnb.worker.process_children import own_children
from accelnb.worker.template import imports as template_imports
from accelnb.worker.template.huge_pages import QUIET_BEFORE_COLLAPSE_S, HugePages
from accelnb.worker.template.standby_ranks import JoinAhead, StandbyRanks

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MAX_FDS_PER_MESSAGE = 250  # SCM_RIGHTS limit is 253
LEFTOVERS_LIMIT_S = 2.0  # SIGKILLed leftovers die at once, unless stuck in the kernel (D state)
START_FAILED_EXIT_CODE = 70  # EX_SOFTWARE: the worker failed before running anything of the user's
# Imported before "ready": what every worker needs to start and join its group.
DEFAULT_PREIMPORTS = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch.utils.data",
                      "accelnb.worker.main")
# Fork the next launch's ranks while this launch's run only where a core is left for it: on a
# 2-core machine a 10-15 ms fork beside 2 ranks joining their group slows this launch by as much.
CORES_HERE = len(os.sched_getaffinity(0))


def send(sock: socket.socket, message: Any) -> None:
    sock.send(pickle.dumps(message))


def preimport(modules: list[str]) -> None:
    os.environ.update(template_imports.TEMPLATE_ENV)
    for name in modules:
        importlib.import_module(name)
    _check_cuda_untouched()


def _check_cuda_untouched() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("a pre-imported module initialised CUDA; workers could not use CUDA")


def become_subreaper() -> None:
    """Orphans among our descendants become our children, not init's (see the module docstring)."""
    if ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


class Following:
    """The imports the kernel asked for and not yet made, in order, and whether this template is
    still fit to fork (see ``worker/template/imports.py``)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._queue: deque[tuple[FollowImports, list[str]]] = deque()  # (request, its modules left)
        self._optional: deque[tuple[FollowImports, list[str]]] = deque()  # only while nothing else waits
        self._failed: dict[int, list[str]] = {}  # request id -> modules that failed to import
        self._state_of: int | None = None  # the request whose sys.path, cwd and env are in force
        self.unsafe: tuple[str, str] | None = None  # (module, reason) once an import made it unfit

    def add(self, request: FollowImports) -> None:
        if self.unsafe is not None:
            send(self._sock, ("unsafe", request.request_id, *self.unsafe))
            return
        (self._optional if request.optional else self._queue).append((request, list(request.modules)))
        self._answer_finished()

    def has_work(self, ranks_running: bool) -> bool:
        """Something to import now: anything while no rank runs, else only for a waiting launch."""
        if not ranks_running:
            return bool(self._queue or self._optional)
        return any(request.urgent for request, _ in self._queue)

    def step(self) -> None:
        """Import the oldest request's next module not loaded yet (a second or more for a big
        library; most submodules came with their package and cost nothing)."""
        queue = self._queue or self._optional
        request, left = queue[0]
        if self._state_of != request.request_id:
            template_imports.take_kernel_state(request)
            self._state_of = request.request_id
        while left and left[0] in sys.modules:
            left.pop(0)
        if left:
            name = left.pop(0)
            if not template_imports.import_quietly(name):
                self._failed.setdefault(request.request_id, []).append(name)
            reason = template_imports.unfit_to_fork()
            if reason is not None:
                self.unsafe = (name, reason)
                for waiting, _ in (*self._queue, *self._optional):
                    send(self._sock, ("unsafe", waiting.request_id, name, reason))
                self._queue.clear()
                self._optional.clear()
                return
        self._answer_finished()

    def finish_all(self) -> bool:
        """Import everything asked for but the optional (a launch is about to fork); True when
        there was anything to do."""
        worked = False
        while self._queue and self.unsafe is None:
            self.step()
            worked = True
        return worked

    def _answer_finished(self) -> None:
        for queue in (self._queue, self._optional):
            while queue and not queue[0][1]:
                request, _ = queue.popleft()
                send(self._sock, ("followed", request.request_id, self._failed.pop(request.request_id, [])))


def serve(sock: socket.socket) -> None:
    """Answer the kernel until it goes, and import what it asks for.

    Imports run one module per turn of the loop, so that requests and exits are handled between
    them; while ranks run they wait (an import blocks the loop for a second or more, and a
    worker's exit must be reported the moment it happens), unless a launch waits for them.
    """
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    workers: set[int] = set()
    following = Following(sock)
    standby = StandbyRanks(close_in_child=(sock.fileno(), wake_r, wake_w),
                           become_rank=lambda spec, fds: _become_worker(spec, fds, leave_template=False),
                           leave_template=_leave_template_to_wait, join_ahead=_join_ahead)
    pages = HugePages()
    sources = TemplateSources()
    quiet_since = time.monotonic()  # when the kernel or a rank last gave the template something to do
    while True:
        importing = following.has_work(ranks_running=bool(workers))
        idle = not following.has_work(ranks_running=False) and len(workers) < CORES_HERE
        # Not while imports wait for the last rank to end: they would let the new child go at
        # once (a fork wasted, 10-15 ms of this process on a machine whose ranks are still ending).
        refilling = idle and following.unsafe is None and standby.short()
        # Only while no rank runs: its CPU is the ranks' (a pass takes 0.2-0.4 s), and it matters
        # only to the next fork.
        collapsing = idle and not workers and not refilling and pages.due()
        if importing or refilling:
            timeout: float | None = 0
        elif collapsing:  # once nothing came for a while: launches back to back are left alone
            timeout = max(0.0, quiet_since + QUIET_BEFORE_COLLAPSE_S - time.monotonic())
        else:
            timeout = None
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [], timeout)
        if readable:
            quiet_since = time.monotonic()
        if not readable and importing:
            standby.let_go()  # forked before this import: a rank must have all its template has
            following.step()
            pages.memory_changed()  # the import's memory too, once no more imports wait
            continue
        if not readable and refilling:
            sources.forked(standby.fork_one())
            continue
        if not readable and collapsing:
            pages.step()
            continue
        if wake_r in readable:
            _drain(wake_r)
        _reap(sock, workers, standby, sources, wake_r)
        if sock.fileno() in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 20, MAX_FDS_PER_MESSAGE)
            except OSError:
                data, fds = b"", []
            if not data:
                standby.let_go()
                _end_descendants(set(), wake_r)
                return
            message = pickle.loads(data)
            if isinstance(message, FollowImports):
                following.add(message)
            elif message[0] == "spawn":
                if following.finish_all():
                    standby.let_go()
                    pages.memory_changed()
                if message[4] is not None:  # the cell sources, the last fd
                    sources.add(read_sources_file(fds.pop()), count=message[4])
                if following.unsafe is not None:
                    for fd in fds:
                        os.close(fd)
                    module, reason = following.unsafe
                    send(sock, ("spawn_failed", message[1], f"the template became unsafe to fork after "
                                                            f"importing {module}: {reason}"))
                    continue
                group_ahead = message[3]  # the next launch's group, and its socket the last fd
                _spawn(sock, message[1], message[2], fds, workers, standby, sources, (wake_r, wake_w),
                       group_ahead, fds.pop() if group_ahead is not None else None)


def _spawn(sock: socket.socket, request_id: int, specs: list[Any], fds: list[int],
           workers: set[int], standby: StandbyRanks, sources: TemplateSources, own_fds: tuple[int, int],
           group_ahead: GroupAhead | None, listener_fd: int | None) -> None:
    """One rank per spec: the members that joined this launch's group ahead, else handed to a
    waiting child where one waits, else forked now. Then the next launch's group is joined ahead."""
    pids: list[int] = []
    standby.wanted = len(specs)  # the next launch most likely has as many
    # The template's objects (torch's ~300k) are never collected in a rank: a rank's full
    # collection would otherwise walk them all (0.1-0.35 s, a stall in its training loop) and
    # copy every page it touches (their GC headers), which a fork shares until written.
    gc.freeze()
    held = fds + ([] if listener_fd is None else [listener_fd])
    try:
        split = split_fds(fds, specs)
        joined = standby.hand_over_group(specs, split)
        if joined is not None:
            workers.update(joined)
            pids.extend(joined)
        for spec, mine in zip(specs, split, strict=True) if joined is None else ():
            pid = standby.hand_over(spec, mine)
            if pid is None:
                pid = os.fork()
            if pid == 0:
                # The other ranks' fds must not live on in this worker (the store socket would
                # stay bound, and pipes would not see end of file).
                for fd in set(held) - set(mine.flat()):
                    os.close(fd)
                sock.close()
                for fd in own_fds:
                    os.close(fd)
                standby.close_in_rank()
                _become_worker(spec, mine, leave_template=True)  # never returns
            workers.add(pid)
            pids.append(pid)
        standby.settle()
        send(sock, ("spawned", request_id, pids, sources.held_by(pids)))
    except Exception as error:
        for pid in pids:
            # Nobody learns these pids: end them as leftovers, reaped without a report.
            workers.discard(pid)
            _kill(pid)
        send(sock, ("spawn_failed", request_id, f"{type(error).__name__}: {error}"))
    finally:
        standby.settle()  # after a failure: only closes what is left
        for fd in fds:
            os.close(fd)
        standby.expect(group_ahead, None if listener_fd is None else socket.socket(fileno=listener_fd))


def _become_worker(spec: Any, fds: RankFds, leave_template: bool) -> None:
    """A child of the template from its spec to ``worker_main``; never returns. ``leave_template``:
    it has not yet done :func:`_leave_template` (a rank forked at launch; a waiting one has).

    Output goes to the rank's pipes first, so that a failure after that is visible: its
    traceback goes to the rank's stderr, and a set-up failure event to the kernel, which then
    shows the cause rather than a bare exit code.
    """
    code = START_FAILED_EXIT_CODE
    stderr_fd = fds.stderr  # until dup2 moved it to 2 (fd 2 is the helper's /dev/null before that)
    try:
        os.dup2(fds.stdout, 1)
        os.dup2(fds.stderr, 2)
        os.close(fds.stdout)
        os.close(fds.stderr)
        stderr_fd = 2
        if leave_template:
            _leave_template()
        from accelnb.worker.main import worker_main

        code = worker_main(spec, fds)
    except BaseException as error:
        _report_start_failure(spec.rank, stderr_fd, fds.events, error)
    finally:
        os._exit(code)


def _leave_template() -> None:
    """What a child of the template does first, whichever rank it becomes: a session of its own
    (a notebook interrupt must not reach it directly), death with the template, the subreaper's
    duty for what it starts, and default signal handling."""
    parent = os.getppid()
    os.setsid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the helper died between fork and prctl
        os._exit(START_FAILED_EXIT_CODE)
    become_subreaper()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _leave_template_to_wait() -> None:
    """A waiting child, first: leave the template, then start what any rank starts (its threads),
    while nothing waits for it."""
    _leave_template()
    from accelnb.worker.main import start_while_waiting

    start_while_waiting()


def _join_ahead(member: JoinAhead) -> None:
    """A member of the group ahead, while it waits: join the group (``process_group.join_ahead``)."""
    from accelnb.worker.other_launchers import process_group

    process_group.join_ahead(member.rank, member.group.world_size, member.port, member.listen_fd,
                             member.prefix, member.group.join_env)


def _report_start_failure(rank: int, stderr_fd: int, events_fd: int, error: BaseException) -> None:
    """Best effort, each step on its own: the traceback on the rank's stderr (this is accelnb's
    own failure, so its frames are the point), and a set-up failure event for the kernel."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        os.write(stderr_fd, f"accelnb could not start the worker of rank {rank}:\n{text}".encode(errors="replace"))
    except OSError:
        pass
    try:
        from accelnb.worker.main import report_setup_failure

        report_setup_failure(rank, events_fd, error)
    except BaseException:
        pass  # the traceback above is all we could do


def _reap(sock: socket.socket, workers: set[int], standby: StandbyRanks, sources: TemplateSources,
          wake_r: int) -> None:
    """Reap every dead child; for each dead worker, end what it left behind, then report it."""
    while True:
        exits = _reap_dead_children(workers, standby, sources)
        if not exits:
            return
        _end_descendants(workers | standby.pids, wake_r)
        for pid, code, reaped_at in exits:
            send(sock, ("exited", pid, code, reaped_at))


def _reap_dead_children(workers: set[int], standby: StandbyRanks,
                        sources: TemplateSources) -> list[tuple[int, int, float]]:
    """Wait for every child that has exited; returns the workers among them (pid, code, time)."""
    exits = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid in workers:  # anything else is a leftover of a dead rank or a waiting child: nobody's business
            workers.discard(pid)
            exits.append((pid, os.waitstatus_to_exitcode(status), time.time()))
        standby.forget(pid)  # one that died waiting: its pid may be reused, never to be killed
        sources.forget(pid)
    return exits


def _end_descendants(spare: set[int], wake_r: int) -> None:
    """SIGKILL and reap every descendant that is not under one of the ``spare`` workers.

    Repeats until none is left: a process may fork between our look and our kill, and what a
    killed process leaves is re-parented to us. Bounded by ``LEFTOVERS_LIMIT_S``.
    """
    # A dead rank's descendants were handed to us, the nearest subreaper, before it could be reaped,
    # so a leftover is a child of ours that is neither a live worker nor a waiting child.
    children = own_children()
    if children is not None and children <= spare:  # the common case, in 0.1 ms: nothing was left
        return
    deadline = time.monotonic() + LEFTOVERS_LIMIT_S
    me = os.getpid()
    unkillable: set[int] = set()  # another user's (a setuid program): not ours to end
    while True:
        tree = _children_by_parent()
        doomed = _descendants(me, tree, spare | unkillable)
        if not doomed:
            return
        unkillable.update(pid for pid in doomed if not _kill(pid))
        reaped = [pid for pid in tree.get(me, []) if pid not in spare and _reap_one(pid)]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if not reaped and select.select([wake_r], [], [], min(remaining, 0.05))[0]:  # a SIGCHLD came
            _drain(wake_r)


def _children_by_parent() -> dict[int, list[int]]:
    """Every process's children, from ``/proc/*/stat`` (``/proc/PID/task/*/children`` needs
    a kernel option that is often off)."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read()
        except OSError:  # it exited meanwhile
            continue
        # "pid (comm) state ppid …": comm may hold spaces and parentheses; the last ")" ends it.
        parent = int(fields[fields.rindex(b")") + 2:].split(b" ", 2)[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _descendants(root: int, tree: dict[int, list[int]], spare: set[int]) -> list[int]:
    """``root``'s descendants, parents before children, skipping ``spare`` and their subtrees."""
    found: list[int] = []
    pending = [pid for pid in tree.get(root, []) if pid not in spare]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending.extend(tree.get(pid, []))
    return found


def _reap_one(pid: int) -> bool:
    """Reap ``pid`` if it has exited; True when it had."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False


def _kill(pid: int) -> bool:
    """SIGKILL ``pid``; False when it is not ours to kill."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        return False
    return True


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    become_subreaper()
    preimport(list(DEFAULT_PREIMPORTS))
    template_imports.install_rank_hooks()  # before any module of the kernel's is imported here
    send(sock, ("ready", os.getpid()))
    # From now on nothing of ours should print; workers get their own fds.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    serve(sock)
    os._exit(0)  # skip interpreter teardown with torch loaded: the workers are already gone


if __name__ == "__main__":
    main(sys.argv[1:])
