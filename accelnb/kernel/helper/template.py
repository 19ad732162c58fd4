"""The kernel's template: the one clean process its ranks are forked from, kept in step with it.

A process (a kernel, or a script) has one current template (``worker/template/helper.py`` says what it is).
It is started on first use, ahead of time by :func:`prewarm` (``%load_ext accelnb``), or after a
cell of a kernel that imported accelnb (:func:`follow_in_background`, which the notebook side
calls from IPython's ``post_run_cell``), so that the first launch finds it warm. It follows the
kernel's imports (``kernel_imports.modules_to_follow``): after each cell in the background, and
before each launch, which waits until it imported what is new.

It is replaced, by a fresh one that imports everything again, when

- it died (the OOM killer, a user's ``kill``);
- it is stale (``kernel_imports.Freshness``: a package installed, a module's file changed);
- an import made it unsafe to fork (a thread, CUDA): the next one leaves that module out, and the
  ranks import it themselves.

A replaced template whose ranks still run (a session's) is retired, not closed: closing it would
end them. It is closed once they have all ended (checked whenever a template is looked for), or
when the kernel exits.

    >>> helper = shared_helper()     # ready, and has imported what this process has
    >>> follow_in_background()       # after a cell: start or feed the template, never block

Module-level state, one per process (a process forks its ranks from one template): ``_current``,
the template, and ``_freshness``, what its imports depended on; ``_retired``, the templates
replaced while ranks of theirs ran; ``_unsafe_modules``, the packages found unfit to import
there; ``_exit_hook_registered``; all under ``_lock`` (the launches of a sweep run on threads).
How many modules the process had when the template last followed it is the template's own
(:attr:`WorkerHelper.modules_at_last_look`): a cell that imported nothing costs one ``len``.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time

from accelnb.errors import HelperDied, WorkerStartError
from accelnb.kernel.helper.client import FOLLOW_TIMEOUT_S, StepHook, TemplateUnsafe, WorkerHelper
from accelnb.kernel.helper.kernel_imports import Freshness, modules_to_follow
from accelnb.wire.template import TRAINING_PREIMPORTS

# "off" (or "0", "no"): no template is started nor fed in the background; a launch still starts
# one and has it import what the kernel has, then waits for it. "bare": templates import only what
# every rank needs (torch, and while idle what training touches first), never the kernel's modules,
# which each rank imports itself: for a process whose thousands of modules the ranks do not need
# (a test runner's).
TEMPLATE_VARIABLE = "ACCELNB_TEMPLATE"

_current: WorkerHelper | None = None
_freshness = Freshness()  # what the current template's imports depended on
_retired: list[WorkerHelper] = []  # replaced while ranks of theirs ran
_unsafe_modules: set[str] = set()  # packages whose import made a template unfit to fork
_lock = threading.Lock()
_exit_hook_registered = False
MAX_UNSAFE_TEMPLATES = 8  # each try leaves out one more package; a loop past this is a bug of ours
DEPARTED_WAIT_S = 10.0  # how long the OS may take to free departed ranks (~20 ms each, here)


def shared_helper(wait: bool = True, on_step: StepHook | None = None) -> WorkerHelper:
    """This process's template, ready and in step with its imports (``wait=False``: just started).

    ``on_step("helper-starting")`` runs before waiting for a template that is not ready yet (tests).
    """
    for _ in range(MAX_UNSAFE_TEMPLATES):
        with _lock:
            helper = _current_template()
        if not wait:
            return helper
        try:
            helper.wait_ready(on_step)
        except WorkerStartError:
            helper.close()  # dead or hopeless: the next launch starts afresh
            raise
        try:
            _follow(helper, wait=True)
        except TemplateUnsafe as unsafe:  # the next template leaves that module out
            with _lock:
                _leave_out(unsafe)
                _replace(helper)
            continue
        except HelperDied:
            if helper.has_workers:
                raise
            with _lock:  # it died idle, between launches (a user's kill): nothing was lost, start another
                _replace(helper)
            continue
        except WorkerStartError:
            helper.close()  # dead or hopeless: the next launch starts afresh
            raise
        return helper
    raise WorkerStartError(
        f"{MAX_UNSAFE_TEMPLATES} templates in a row became unsafe to fork while importing what the notebook "
        f"imported ({', '.join(sorted(_unsafe_modules))} started threads or CUDA). Set {TEMPLATE_VARIABLE}=off "
        "and report this to accelnb.")


def follow_in_background() -> None:
    """After a cell: start the template if there is none (or replace a stale one) and ask it to
    import what the kernel imported since; returns at once. Never raises: a launch would meet the
    same problem and report it."""
    if not background_warming():
        return
    try:
        with _lock:
            helper = _current_template()  # replaced first if it died, went stale or unsafe
        _follow(helper, wait=False)
    except Exception:  # a cell's end is no place for accelnb's errors
        return


def background_warming() -> bool:
    """Whether templates start and follow the kernel on their own (``ACCELNB_TEMPLATE``)."""
    return _template_setting() not in ("off", "0", "no", "false")


def _template_setting() -> str:
    return os.environ.get(TEMPLATE_VARIABLE, "on").strip().lower()


def prewarm(wait: bool = False) -> None:
    """Start the template now, so that the first launch does not wait for ``import torch``.

    ``wait=True``: return once it has imported everything asked of it, this process's modules and
    what training touches first (``torch._dynamo``, Accelerate: a launch that comes while the
    template imports one waits for it). For a script or a benchmark that wants its first launch
    to find the template warm.
    """
    helper = shared_helper(wait=wait)
    follow_in_background()
    if wait:
        helper.wait_until_idle(FOLLOW_TIMEOUT_S)


def unsafe_packages() -> frozenset[str]:
    """The packages this process's templates leave to the ranks (their import started a thread or CUDA)."""
    return frozenset(_unsafe_modules)


def running_helper_pid() -> int | None:
    """The pid of this process's template while one runs, else None (nothing is started)."""
    helper = _current
    return helper.pid if helper is not None and helper.alive else None


def wait_for_departed_ranks(timeout: float = DEPARTED_WAIT_S) -> bool:
    """Wait until this process's templates have reaped every rank that departed: a launch ends as
    soon as its ranks said they leave nothing behind, while the OS still frees their processes
    (``kernel/run/supervisor.py``). True once none is left, False after ``timeout`` s. For whoever
    must see no process of a finished launch at all: tests, and tools that count processes."""
    deadline = time.monotonic() + timeout
    return all([helper.wait_for_departed(deadline) for helper in _templates()])


def take_departed_crashes() -> dict[int, int]:
    """Departed ranks that did not exit 0 since the last call, pid: exit code (negative: the
    signal); each is told once. Always empty unless something in a rank's last moments is broken:
    nobody waited for those exits."""
    return {pid: code for helper in _templates() for pid, code in helper.take_departed_crashes().items()}


def unclaimed_exits() -> dict[int, int]:
    """Reported exits of workers that no group took (pid: exit code), from every template. Always
    empty once every launch ended; for tests and tools that check a launch left nothing noted."""
    return {pid: code for helper in _templates() for pid, code in helper.unclaimed_exits.items()}


def sockets_held_ahead() -> list[socket.socket]:
    """The rendezvous sockets this process holds for its templates' next launches, bound and
    listening on purpose (``wire/group_ahead.py``): each is closed by the next spawn, or with its
    template. For whoever checks that a launch left no socket behind: tests, and tools."""
    return [held for helper in _templates() if (held := helper.socket_held_ahead) is not None]


def _templates() -> list[WorkerHelper]:
    with _lock:
        return [helper for helper in (_current, *_retired) if helper is not None]


def shutdown_helper() -> None:
    """End every template of this process (their ranks with them)."""
    global _current
    with _lock:
        for helper in (_current, *_retired):
            if helper is not None:
                helper.close()
        _current = None
        _retired.clear()


def _follow(helper: WorkerHelper, *, wait: bool) -> None:
    if _template_setting() == "bare":
        return
    with _lock:
        first = not helper.considered
        # After a cell that imported nothing (most cells), in O(1): this runs after every cell of
        # the notebook. A launch looks in full (a cell may have removed a module and added one).
        if not wait and not first and len(sys.modules) == helper.modules_at_last_look:
            return
        names = modules_to_follow(helper.considered, _unsafe_modules)
        helper.modules_at_last_look = len(sys.modules)
        if helper is _current:
            _freshness.add(names)
    # A launch with nothing new still waits for what earlier cells asked for, if any is unanswered.
    if names or (wait and helper.unanswered):
        helper.follow(names, wait=wait)
    if first:  # after the kernel's own: what training touches first, which no launch waits for
        _ask_for_training_imports(helper)


def _ask_for_training_imports(helper: WorkerHelper) -> None:
    """What an optimizer's first step or a DDP model imports (``torch._dynamo``: 1-3 s in each rank
    that lacks it), imported while the template is idle; no launch waits for it."""
    helper.follow([name for name in TRAINING_PREIMPORTS if name.split(".", 1)[0] not in _unsafe_modules],
                  wait=False, optional=True)


def _current_template() -> WorkerHelper:
    """The current template, replaced first if it died, went stale or unsafe (hold ``_lock``)."""
    global _current, _freshness, _exit_hook_registered
    if _current is not None and _current.poll_ready():
        _current.collect()  # notices its death (its socket closed) and an "unsafe" it sent
    if _current is not None and _current.unsafe is not None:
        _leave_out(_current.unsafe)
    if _current is not None and (not _current.alive or _current.unsafe is not None or _freshness.stale_because()):
        _replace(_current)
    _close_retired_without_ranks()
    if _current is None:
        if not _exit_hook_registered:
            atexit.register(shutdown_helper)
            _exit_hook_registered = True
        _current = WorkerHelper()
        _freshness = Freshness.now()
        if _template_setting() == "bare":  # nothing of the kernel's, but what every training rank needs
            _ask_for_training_imports(_current)
    return _current


def _leave_out(unsafe: TemplateUnsafe) -> None:
    """No later template imports the package whose import made one unsafe (hold ``_lock``)."""
    _unsafe_modules.add(unsafe.module.split(".", 1)[0])


def _replace(helper: WorkerHelper) -> None:
    """``helper`` serves no new launch: closed now, or retired while ranks of it run (hold ``_lock``)."""
    global _current
    if helper is _current:
        _current = None
    if helper.alive and helper.has_workers:
        _retired.append(helper)
    else:
        helper.close()


def _close_retired_without_ranks() -> None:
    for helper in list(_retired):
        if helper.alive:
            helper.collect()
        if not helper.alive or not helper.has_workers:
            helper.close()
            _retired.remove(helper)
