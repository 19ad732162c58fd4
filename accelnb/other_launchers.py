"""Entry points shaped like the launchers people's code was written for.

- :func:`spawn` takes ``torch.multiprocessing.spawn``'s arguments and meaning, ``fn(rank, *args)``
  on ``nprocs`` ranks, for a function defined in a notebook cell (``mp.spawn`` cannot unpickle
  one: "Can't get attribute ... on <module '__main__'>"), with everything a launch gives.

    >>> def demo_basic(rank, world_size):
    ...     import torch.distributed as dist
    ...     dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ...     return rank
    >>> accelnb.spawn(demo_basic, args=(2,), nprocs=2)        # doctest: +SKIP
    [0, 1]

- :func:`torchrun` takes the command line a user gives ``torchrun`` (``--nproc-per-node 2
  train.py --epochs 3``), plus accelnb's flags (``--gpus``, ``--timeout``, ``--output``, …), and
  runs the script on the ranks as ``__main__`` (``worker/other_launchers/script_main.py``), with
  torchrun's environment. ``%torchrun`` is this, as a line magic: replacing ``!torchrun`` with
  ``%torchrun`` is the whole change. Flags that need another machine are refused, with why.

    >>> accelnb.torchrun("--nproc-per-node 2 train.py --epochs 3")   # doctest: +SKIP

Both are thin: they turn their arguments into a :func:`accelnb.launcher.launch_with` call, so
options, output, Stop and restarts are the launcher's own.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from accelnb.errors import LaunchConfigError
from accelnb.kernel.planning.inventory import read_inventory
from accelnb.kernel.run.launch_result import LaunchResult
from accelnb.launcher import launch_with
from accelnb.options import LAUNCH_OPTIONS, LaunchKeywords, LaunchOptions, described_fields, documents_options
from accelnb.wire.cell_contract import WorkerFunction

if TYPE_CHECKING:
    from typing import Unpack

__all__ = ["TORCHRUN_USAGE", "parse_torchrun", "spawn", "torchrun"]


@dataclass(frozen=True)
class RankFirst:
    """``fn(rank, *args)`` on every rank, the rank read from the rank's environment (as
    ``mp.spawn`` passes its process index). Module-level, so it travels by reference and ``fn``
    by value."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]

    def __call__(self) -> Any:
        return self.fn(int(os.environ["RANK"]), *self.args)


@documents_options(LaunchKeywords)
def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    **options: Unpack[LaunchKeywords],
) -> list[Any]:
    """``torch.multiprocessing.spawn`` for the notebook: ``fn(rank, *args)`` on ``nprocs`` ranks.

    Replacing ``mp.spawn(`` with ``accelnb.spawn(`` is the whole change; the function may be
    defined in a cell. Its ``init_process_group`` finds the launch's group (its ``MASTER_PORT``
    is not needed), and the ranks get devices, live output, the root cause of a failure and Stop
    as with :func:`accelnb.launch`.

    Args:
        fn, args, nprocs: as for ``mp.spawn``: ``fn`` gets the rank, then ``args``.
        join: must be True: the cell waits for the ranks (for ranks that stay between calls,
            use :class:`accelnb.Session`).
        daemon, start_method: accepted for ``mp.spawn``'s signature; accelnb starts its ranks from
            its clean helper process either way, and ends them with the run.
        **options: the launch options listed under "Keyword Args" (``gpus=``, ``timeout=``, ...).

    Returns:
        Every rank's return value, in rank order (``mp.spawn`` returns None).

    Raises:
        LaunchConfigError: bad input, before anything starts.
        RankFailed / RankCrashed / LaunchTimeout: as :func:`accelnb.launch`.
    """
    if not join:
        raise LaunchConfigError(
            "accelnb.spawn(join=False): the cell waits for the ranks, as with join=True. For ranks "
            "that stay between calls, use accelnb.Session.start(num_processes=N) and session.run(fn).")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchConfigError(f"accelnb.spawn(nprocs={nprocs!r}): nprocs is the number of ranks, a whole number ≥ 1.")
    if "num_processes" in options:
        raise LaunchConfigError("accelnb.spawn() takes nprocs=, as mp.spawn does, not num_processes=.")
    chosen = LaunchOptions().with_keywords({**options, "num_processes": nprocs, "collect": "all"},
                                           accepted=LAUNCH_OPTIONS, caller="accelnb.spawn()")
    result = launch_with(RankFirst(fn, tuple(args)), (), None, chosen)
    return [result.values[rank] for rank in sorted(result.values)]


# ── torchrun ───────────────────────────────────────────────────────────────────────────────────
# What each rank runs; named, so the kernel never imports worker code (see wire/cell_contract.py).
RUN_SCRIPT = WorkerFunction("accelnb.worker.other_launchers.script_main", "run_script")
_LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "::1")
_ONE_MACHINE = ("%torchrun runs the ranks on this machine{}. For several machines use a Ray cluster "
                "(--cluster ray --nodes N), or run torchrun on each node.")


class _TorchrunParser(argparse.ArgumentParser):
    """argparse whose errors are :class:`LaunchConfigError` (shown as a usage error, before
    anything starts), never ``SystemExit``."""

    def error(self, message: str) -> NoReturn:
        raise LaunchConfigError(f"%torchrun: {message}. Usage: {self.format_usage().strip()}")


def _torchrun_parser() -> _TorchrunParser:
    parser = _TorchrunParser(prog="%torchrun", allow_abbrev=False, add_help=False,
                             description="torchrun's command line, run on accelnb's ranks.")
    # accelnb's own flags, spelled as %%distributed spells them.
    for each, info in described_fields():
        if info.flag is None or info.scope not in ("start", "call", "launch") or info.flag == "--max-restarts":
            continue
        details: dict[str, Any] = {"dest": each.name, "default": argparse.SUPPRESS}
        if isinstance(each.default, bool):
            details["action"] = "store_true"
        else:
            details.update(type=info.parse, choices=info.choices)
        parser.add_argument(info.flag, **details)
    # torchrun's flags (both spellings, as torchrun takes them).
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node")
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0)
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=argparse.SUPPRESS)
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=argparse.SUPPRESS)
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="")
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("--no-python", "--no_python", dest="no_python", action="store_true")
    parser.add_argument("--standalone", action="store_true")  # what accelnb always is
    parser.add_argument("--run-path", "--run_path", dest="run_path", action="store_true")  # what accelnb does
    # Accepted and without effect here, each for its reason: accelnb makes the rendezvous itself
    # (rdzv), streams every rank's output into the cell (redirects, tee, filter), watches its ranks
    # itself (monitor interval) and starts them from its clean helper (start method).
    for flags in (("--rdzv-backend", "--rdzv_backend"), ("--rdzv-id", "--rdzv_id"), ("--rdzv-conf", "--rdzv_conf"),
                  ("--monitor-interval", "--monitor_interval"), ("--start-method", "--start_method"), ("--role",),
                  ("-r", "--redirects"), ("-t", "--tee"), ("--local-ranks-filter", "--local_ranks_filter")):
        parser.add_argument(*flags, dest=f"ignored_{flags[-1].lstrip('-')}")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


TORCHRUN_USAGE = _torchrun_parser().format_usage()


@dataclass(frozen=True)
class TorchrunCommand:
    """A parsed ``torchrun`` command line: what to run, its arguments, and the launch's keywords."""

    target: str  # a script's path, or with as_module a module's name
    arguments: tuple[str, ...]
    as_module: bool
    options: dict[str, Any]


def parse_torchrun(command: str | Sequence[str]) -> TorchrunCommand:
    """Parse a torchrun command line (without the word ``torchrun``); raises
    :class:`LaunchConfigError` on a flag that needs another machine, with why."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    if words[:1] == ["torchrun"]:
        words = words[1:]
    given = vars(_torchrun_parser().parse_args(words))
    if given.pop("no_python"):
        raise LaunchConfigError("%torchrun --no-python: the ranks run Python scripts; for another program "
                                "keep !torchrun --no-python.")
    nnodes = given.pop("nnodes")
    if nnodes not in ("1", "1:1"):
        raise LaunchConfigError(f"--nnodes {nnodes}: " + _ONE_MACHINE.format(", one node"))
    node_rank = given.pop("node_rank")
    if node_rank != 0:
        raise LaunchConfigError(f"--node-rank {node_rank}: " + _ONE_MACHINE.format(", which is node 0"))
    for flag, address in (("--master-addr", given.pop("master_addr") or ""),
                          ("--rdzv-endpoint", given.pop("rdzv_endpoint").rsplit(":", 1)[0])):
        if address not in _LOCAL_HOSTS:
            raise LaunchConfigError(f"{flag} {address}: " + _ONE_MACHINE.format(
                ", and accelnb makes their rendezvous on it itself"))
    options = {name: value for name, value in given.items()
               if not name.startswith("ignored_") and name not in ("script", "script_args", "module", "standalone",
                                                                    "run_path", "nproc_per_node")}
    options.update(_ranks_asked(given["nproc_per_node"], options))
    return TorchrunCommand(given["script"], tuple(given["script_args"]), given["module"], options)


def _ranks_asked(nproc_per_node: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """torchrun's ``--nproc-per-node`` as accelnb's placement keywords."""
    if nproc_per_node is None:
        return {}  # the picker's selection, or --gpus/--procs, as in %%distributed
    if nproc_per_node.isdigit():
        return {"num_processes": int(nproc_per_node)}
    if nproc_per_node == "gpu":
        return {}  # every GPU of the selection (the planner says so if this machine has none)
    if nproc_per_node == "cpu":
        return {"num_processes": os.cpu_count() or 1, "cpu": True}
    if nproc_per_node == "auto":  # torchrun's: every GPU, else one rank per core
        has_gpus = "gpus" in options or bool(read_inventory().gpus)
        return {} if has_gpus else {"num_processes": os.cpu_count() or 1, "cpu": True}
    raise LaunchConfigError(f"--nproc-per-node {nproc_per_node}: give a number, or gpu, cpu or auto.")


def _check_target(command: TorchrunCommand) -> None:
    if command.as_module:
        # Where the ranks look (the working directory first, as python -m), for the top-level
        # package only: finding a submodule would import its packages here, in the kernel.
        top = command.target.split(".", 1)[0]
        found = top in sys.modules or PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is not None
        if not found:
            raise LaunchConfigError(f"%torchrun -m {command.target}: no module of that name can be imported "
                                    f"here (working directory {os.getcwd()}).")
    elif not Path(command.target).is_file():
        raise LaunchConfigError(f"%torchrun {command.target}: no such file in the working directory "
                                f"{os.getcwd()}. Give the script's path, as for torchrun.")


@documents_options(LaunchKeywords)
def torchrun(command: str | Sequence[str], **options: Unpack[LaunchKeywords]) -> LaunchResult:
    """Run a torchrun command line on accelnb's ranks: what ``%torchrun`` does, from Python.

    Args:
        command: torchrun's arguments, as one string or a list of words:
            ``"--nproc-per-node 2 train.py --epochs 3"`` (a leading ``torchrun`` is allowed),
            ``-m package.module`` for a module. accelnb's flags (``--gpus 0,1``, ``--timeout``,
            ``--output all``, ``--log-dir``, …) may stand among torchrun's.
        **options: the launch options listed under "Keyword Args"; they win over the command line.

    Returns:
        The :class:`LaunchResult` (each rank's value is None; the output is in it).

    Raises:
        LaunchConfigError: bad input or a flag that needs another machine, before anything starts.
        RankFailed: a rank raised, or exited with a non-zero code (an :class:`accelnb.ScriptExited`).
        RankCrashed / LaunchTimeout: as :func:`accelnb.launch`.
    """
    parsed = parse_torchrun(command)
    _check_target(parsed)
    chosen = LaunchOptions().with_keywords({**parsed.options, **options}, accepted=LAUNCH_OPTIONS,
                                           caller="torchrun()")
    try:
        return launch_with(RUN_SCRIPT, (parsed.target, list(parsed.arguments), parsed.as_module), None, chosen)
    except LaunchConfigError as error:  # bad input, nothing started: say it in torchrun's words
        error.args = (str(error).replace("num_processes=", "--nproc-per-node "),)
        raise
