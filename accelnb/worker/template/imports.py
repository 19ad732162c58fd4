"""In the template: import what the kernel imported, and stay a process that is safe to fork.

A rank forked from the template finds every module the template imported already loaded (the
pages are shared copy-on-write), so it starts at fork speed without being a fork of the kernel:
whatever the kernel decided at its imports (tqdm.auto's widget bar, transformers' notebook
progress callback, a user module's ``from torch.distributed import init_process_group``) is
decided again here, in a plain process, after accelnb's rank-side hooks were installed
(:func:`install_rank_hooks`).

An import runs in the kernel's ``sys.path``, working directory and environment as they are at the
request (:func:`take_kernel_state`), so that a module of the notebook's folder is found and a
library that reads a variable at import reads the kernel's. A failed import is not an error here:
the rank imports the module itself when the code needs it, and the user sees their own error there.

After each import the template checks it can still fork safely (:func:`unfit_to_fork`): a module
that started a thread (a fork copies only the forking thread, and locks the others held stay
held) or initialised CUDA (a forked CUDA context is unusable) makes this template unfit.

    >>> take_kernel_state(request)                 # doctest: +SKIP
    >>> import_quietly("transformers")             # False if it failed; the rank will see why
    >>> unfit_to_fork()                            # None, or why the template must not fork
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading

from accelnb.wire.template import FollowImports

# Set in the template for as long as it lives: torch asks NVML, not the CUDA runtime, whether
# CUDA exists, so that torch.cuda.is_available() in an imported module does not make forks unsafe.
TEMPLATE_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def install_rank_hooks() -> None:
    """accelnb's rank-side replacements of names code binds at import, before anything else imports.

    A module imported after this that does ``from torch.distributed import init_process_group``
    or ``from torch.multiprocessing import spawn`` binds accelnb's functions, which act as torch's
    until a rank's launch gives them its place (``process_group.join_default_group``,
    ``launches_inside.place``).
    """
    import torch.distributed as dist

    from accelnb.worker.other_launchers import launches_inside, process_group

    process_group.route_through_accelnb(dist)
    launches_inside.patch()


def take_kernel_state(request: FollowImports) -> None:
    """The kernel's ``sys.path``, working directory and environment, as they were at ``request``."""
    sys.path[:] = list(request.sys_path)
    try:
        os.chdir(request.cwd)
    except OSError:  # removed since: imports resolve through sys.path all the same
        pass
    os.environ.clear()
    os.environ.update(request.env)
    os.environ.update(TEMPLATE_ENV)


def import_quietly(name: str) -> bool:
    """Import ``name``; False when it failed (its error is the rank's to show, if the code needs it)."""
    if name in sys.modules:
        return True
    try:
        importlib.import_module(name)
    except BaseException:  # anything, SystemExit included: a module that exits on import
        return False
    finally:
        empty_what_every_rank_empties()
    return True


def empty_what_every_rank_empties() -> None:
    """Empty ``torch._dynamo``'s trace-rule caches here, once, as every rank's ``init_process_group``
    empties them (``trace_rules.clear_lru_cache``: rules computed during an import may lack the
    distributed ones).

    Importing ``torch._dynamo`` fills one with ~2,800 torch functions. Emptying it in a rank frees
    that dict, which writes to the reference count of every function it held: ~370 pages the rank
    copies from the template, 1.2 ms of CPU in each rank of every launch (``benchmarks/RESULTS.md``).
    Emptied in the template, the ranks find it empty, and whatever needs it computes it in the rank,
    as after any ``init_process_group``.
    """
    trace_rules = getattr(sys.modules.get("torch._dynamo"), "trace_rules", None)
    clear = getattr(trace_rules, "clear_lru_cache", None)
    if clear is not None:
        with contextlib.suppress(Exception):  # a torch whose caches changed: the ranks empty them, as before
            clear()


def unfit_to_fork() -> str | None:
    """Why forking this process would hand its ranks something broken, or None when it is fit.

    Python threads count (a logging or tracker thread holds Python-level locks a fork copies held);
    the native pools a BLAS library starts when it is loaded (OpenBLAS, which numpy and torch load:
    one thread per core) do not: they end and restart themselves around a fork
    (``pthread_atfork``), and every earlier helper forked with them.
    """
    threads = threading.active_count()
    if threads > 1:
        names = ", ".join(thread.name for thread in threading.enumerate() if thread is not threading.main_thread())
        return f"it started {threads - 1} thread(s) ({names}); a fork copies only the forking one"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in it (a forked CUDA context is unusable)"
    return None
