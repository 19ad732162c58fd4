"""A launcher called inside a rank runs in place, or fails at once saying what to write instead.

Code written for other launchers often starts its processes itself: the PyTorch tutorials end in
``mp.spawn(demo_basic, args=(world_size,), nprocs=world_size)``, Accelerate's ``notebook_launcher``
starts a torchelastic agent (``elastic_launch``), Lightning's ``ddp_notebook``/``ddp_spawn``
strategies call ``torch.multiprocessing.start_processes``. Inside an accelnb rank each would
start the processes again, N per rank: they rendezvous on the same fixed port (29500, 12355) and
fail with "address already in use", or wait for peers that never come, or pickle a notebook
function that does not exist in a fresh interpreter.

So in a rank these entry points are accelnb's (:func:`patch` in the template, before it imports
the kernel's modules; :func:`place` in the rank):

- ``torch.multiprocessing.spawn`` / ``start_processes`` with ``join=True``, and
  ``torch.distributed.launcher.api.elastic_launch`` with a function: when the number of processes
  asked for is this node's number of ranks, the rank *is* the process the launcher would have
  started. It runs ``fn(local_rank, *args)`` (``entrypoint(*args)`` for ``elastic_launch``) in
  place and returns what the launcher returns. The code's ``init_process_group`` then finds
  accelnb's group (``process_group.py``).
- Anything else (another number of processes, ``join=False``, which is how Lightning's fork and
  spawn strategies call it and which needs processes that outlive the call, a script as
  ``elastic_launch``'s entry point) raises :class:`LaunchInsideLaunchError` before any process
  starts, with the numbers and what to write instead.

``accelnb.launch`` and ``Session.start`` inside a rank are refused by the kernel side of accelnb
when it settles the options (``accelnb.options``): the rank's environment says where it is.

Only module attributes are replaced, in the rank, and the originals are kept (``__wrapped__``);
``tests/test_frameworks_inside.py`` checks the names and parameters this relies on, against the
torch and Lightning that are installed, and runs Lightning, Fabric, Accelerate's
``notebook_launcher`` and ``mp.spawn`` on accelnb's ranks from real kernels.

Module-level state, one per rank process: ``_installed`` (the hooks go in once) and ``_place``
(this rank's place in the launch: a process is one rank).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

from accelnb.errors import LaunchInsideLaunchError
from accelnb.wire.spec import WorkerSpec
from accelnb.worker.other_launchers.import_hooks import when_imported

_installed = False
# (rank, world size, local rank, local world size) of this rank, taken once by install() from the
# spec accelnb gave the rank. Not read from the environment when a launcher is called: the code calling it
# may have rewritten the variables first (Accelerate's notebook_launcher sets WORLD_SIZE to the
# number of processes it was asked for), and a refusal must name accelnb's numbers, not those.
_place: tuple[int, int, int, int] | None = None


def patch() -> None:
    """Make ``mp.spawn``, ``mp.start_processes`` and ``elastic_launch`` accelnb's: they act as
    torch's until :func:`place` gave them a rank. Done in the template before it imports the
    kernel's modules, so that a name a module binds at import is accelnb's too; idempotent."""
    global _installed
    if _installed:
        return
    import torch.multiprocessing as mp

    # The module, not torch.multiprocessing's attribute of the same name (the function spawn).
    spawn_module: Any = importlib.import_module("torch.multiprocessing.spawn")
    # Both names, in torch.multiprocessing and in the module that defines them: a function pickled
    # in the notebook refers to them by their defining module.
    mp.start_processes = spawn_module.start_processes = _in_place_start_processes(spawn_module.start_processes)  # type: ignore[assignment]
    mp.spawn = spawn_module.spawn = _in_place_spawn(spawn_module.spawn)  # type: ignore[assignment]
    when_imported(_ELASTIC_API, _replace_elastic_launch)
    _installed = True


def place(spec: WorkerSpec) -> None:
    """This process is rank ``spec.rank``: a launcher called from here on runs in place, or refuses."""
    global _place
    patch()
    local_world = int(spec.env.get("LOCAL_WORLD_SIZE", spec.world_size))
    _place = (spec.rank, spec.world_size, spec.local_rank, local_world)


# torchelastic's launcher API: importing it costs a rank 25 ms, which most launches never need,
# so it is replaced when the code imports it (at once if the fork already holds it).
_ELASTIC_API = "torch.distributed.launcher.api"


def _replace_elastic_launch(module: Any) -> None:
    module.elastic_launch = _elastic_launch_in_place(module.elastic_launch)




def _where() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) of this rank, as accelnb placed it."""
    return _place if _place is not None else _read_place()


def _read_place() -> tuple[int, int, int, int]:
    env = os.environ
    return (int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))


def _refusal(launcher: str, asked: str, why: str, instead: str | None = None) -> LaunchInsideLaunchError:
    """The error for a launcher that would start processes again; ``instead``: what to write
    (by default: call the function directly, ask for this machine's number, or launch from the notebook)."""
    rank, world, _, local_world = _where()
    if instead is None:
        instead = (f"Either call the function directly, since this process already is one of the {world} "
                   f"ranks with torch.distributed set up, or ask for {local_world} processes and it runs in "
                   f"place on accelnb's ranks; or start the launch from the notebook "
                   f"(accelnb.spawn(fn, nprocs=N), %%distributed --procs N, %torchrun --nproc-per-node N).")
    return LaunchInsideLaunchError(
        f"{launcher} was called inside rank {rank} of an accelnb launch of {world} ranks: a launch "
        f"inside a launch ({asked}). {why} {instead}")


def _in_place_start_processes(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def start_processes(*args: Any, **kwargs: Any) -> Any:
        if _place is None:  # not a rank (the template): torch's
            return original(*args, **kwargs)
        asked = signature.bind(*args, **kwargs)
        asked.apply_defaults()
        chosen = asked.arguments
        return _run_in_place(f"torch.multiprocessing.{original.__name__}()", chosen["fn"], tuple(chosen["args"]),
                             int(chosen["nprocs"]), bool(chosen["join"]))

    return start_processes


def _in_place_spawn(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def spawn(*args: Any, **kwargs: Any) -> Any:
        if _place is None:  # not a rank (the template): torch's
            return original(*args, **kwargs)
        asked = signature.bind(*args, **kwargs)
        asked.apply_defaults()
        chosen = asked.arguments
        return _run_in_place("torch.multiprocessing.spawn()", chosen["fn"], tuple(chosen["args"]),
                             int(chosen["nprocs"]), bool(chosen["join"]))

    return spawn


def _run_in_place(launcher: str, fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, join: bool) -> None:
    _, _, local_rank, local_world = _where()
    if not join:
        framework = (getattr(fn, "__module__", None) or "").split(".", 1)[0]
        if framework in ("lightning", "pytorch_lightning", "lightning_fabric"):
            raise _refusal(launcher, f"nprocs={nprocs}, join=False",
                           "Lightning's strategy='ddp_notebook' (or 'ddp_spawn', 'ddp_fork') starts its own processes.",
                           f"Use strategy='ddp' or leave strategy out: Lightning then runs on accelnb's "
                           f"{local_world} ranks.")
        raise _refusal(launcher, f"nprocs={nprocs}, join=False",
                       "With join=False the processes must outlive the call, which cannot run in place.",
                       f"Call it with join=True and nprocs={local_world} (it then runs in place on accelnb's "
                       f"ranks), or call the function directly.")
    if nprocs != local_world:
        raise _refusal(launcher, f"nprocs={nprocs}", f"This machine runs {local_world} ranks of it.")
    fn(local_rank, *args)  # what the launcher's process `local_rank` would have run; spawn returns None


def _elastic_launch_in_place(original: type) -> type:
    class elastic_launch:  # torch's name (a class called like a function)
        """``elastic_launch(config, entrypoint)(*args)`` in a rank: the entry point, in place."""

        __wrapped__ = original
        __doc__ = original.__doc__

        def __init__(self, config: Any, entrypoint: Any = None) -> None:
            self._config = config
            self._entrypoint = entrypoint

        def __call__(self, *args: Any) -> dict[int, Any]:
            if _place is None:  # not a rank (the template): torch's
                return original(self._config, self._entrypoint)(*args)  # type: ignore[no-any-return]
            rank, _, _, local_world = _where()
            launcher = "torch.distributed elastic_launch() (Accelerate's notebook_launcher, torchrun's API)"
            nprocs = int(self._config.nproc_per_node)
            if not callable(self._entrypoint):
                raise _refusal(launcher, f"entrypoint={self._entrypoint!r}",
                               "A program as the entry point is a new process; run the script with %torchrun.")
            if nprocs != local_world or int(self._config.max_nodes) > 1:
                raise _refusal(launcher, f"nproc_per_node={nprocs}, max_nodes={self._config.max_nodes}",
                               f"This machine runs {local_world} ranks of it.")
            return {rank: self._entrypoint(*args)}  # elastic_launch returns {global rank: value}

    return elastic_launch
