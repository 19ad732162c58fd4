"""``%%distributed``: run a notebook cell on every rank. A thin adapter over the launcher.

    %load_ext accelnb

    %%distributed --gpus 0,1
    model = DDP(Net().to(device), device_ids=[device])   # Net comes from an earlier cell
    train(model)                                         # rank 0's prints appear live
    final_accuracy                                       # rank 0's value is the cell's result

    %distributed start --procs 2        # a persistent session: the next cells run on its workers

    %%distributed --ranks 1             # in a session: this cell runs on rank 1 only, [rank 1] prefixed
    print(optimizer.param_groups[0]["lr"])
    %distributed status | stop | restart [--procs 3] | panel | doctor

Each form has its own grammar, as ipyparallel's magics do: the cell form takes every launch
option plus ``--return``; ``start`` and ``restart`` take the options that place ranks; ``stop``,
``status``, ``panel`` and ``doctor`` take nothing, so ``%distributed stop --gpus 0`` is a usage error rather
than silently ignored. The flags, their choices and their help are generated from
:class:`accelnb.options.LaunchOptions`, and parsing ends in one: the magic cannot drift from the API.

The notebook names the cell reads are shipped to every rank by cloudpickle (modules are imported
there instead), the names it assigns come back from rank 0 (the first of ``--ranks``), and the last result is
``_distributed`` (a :class:`~accelnb.kernel.run.launch_result.LaunchResult`, with ``.metrics``).
``--sweep NAME`` runs the cell once per config of the list ``NAME`` instead, with ``config`` bound
(:mod:`accelnb.notebook.sweep_cell`).
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import MagicArgumentParser

from accelnb.errors import CellSyntaxError, LaunchConfigError, LaunchFailed, UnpicklableError
from accelnb.kernel.display.byte_sizes import describe_limit, human_bytes, parse_byte_size
from accelnb.kernel.doctor.checks import doctor
from accelnb.kernel.helper.payload import check_picklable
from accelnb.kernel.run.launch_result import LaunchResult
from accelnb.launcher import check_launch, launch_with
from accelnb.notebook.sweep_cell import CONFIG_NAME, SWEEP_FLAGS, run_cell_sweep
from accelnb.options import (
    ALL_OPTIONS,
    RESTART_OPTIONS,
    SESSION_CALL_OPTIONS,
    START_OPTIONS,
    LaunchOptions,
    Scope,
    described_fields,
)
from accelnb.other_launchers import torchrun
from accelnb.session import Session
from accelnb.wire.cell_analysis import syntax_error, used_names
from accelnb.wire.cell_contract import DEFAULT_RETURN_LIMIT, RUN_CELL, CellOutcome, CellRequest
from accelnb.wire.result_pickling import loads_in_kernel

RANK_NAMES = ("rank", "local_rank", "world_size", "device")
# IPython's own bookkeeping names; never worth shipping.
_SHELL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_ih", "_oh", "_dh", "_", "__", "___",
                "_distributed"}
_SHIP_HINT = "Create it inside the %%distributed cell instead, or turn it into something that pickles."
# The cell's result comes from rank 0 only (run_cell returns None elsewhere).
_CELL_DEFAULTS = LaunchOptions(collect="rank0")


# ── grammars ────────────────────────────────────────────────────────────────────────────────
def magic_wording(text: str) -> str:
    """An API-worded message or help text in the magic's terms: ``num_processes=N`` → ``--procs N``,
    ``cpu=True`` → ``--cpu``, ``timeout must`` → ``--timeout must``."""
    for each, info in described_fields():
        if info.flag is None:
            continue
        if isinstance(each.default, bool):
            text = text.replace(f"{each.name}=True", info.flag)
        text = text.replace(f"{each.name}=", f"{info.flag} ").replace(f"{each.name} must ", f"{info.flag} must ")
    return text


def _option_parser(prog: str, description: str, scopes: tuple[Scope, ...]) -> MagicArgumentParser:
    """A parser for the options of ``scopes`` that have a flag. Options not given are absent from
    the result (``SUPPRESS``), so what the user typed is exactly what reaches LaunchOptions."""
    parser = MagicArgumentParser(prog=prog, description=description)
    for each, info in described_fields():
        if info.flag is None or info.scope not in scopes:
            continue
        details: dict[str, Any] = {"dest": each.name, "default": argparse.SUPPRESS,
                                   "help": magic_wording(info.help).replace("%", "%%")}  # argparse %-formats help
        if isinstance(each.default, bool):
            details["action"] = "store_true"
        else:
            details.update(type=info.parse, choices=info.choices, metavar=info.metavar)
        parser.add_argument(info.flag, **details)
    return parser


# IPython's help formatter adds one "%" to each prog.
CELL_GRAMMAR = _option_parser("%distributed", "Run this cell on every rank (or, in a session, on --ranks).",
                              ("start", "call", "launch", "session"))
CELL_GRAMMAR.add_argument("--return", dest="return_names", default=None, metavar="NAMES",
                          help='names to bring back from rank 0, comma-separated, whatever their size, '
                               'or "none" (default: every name the cell assigns, within --return-limit)')
CELL_GRAMMAR.add_argument("--return-limit", dest="return_limit", default=None, metavar="SIZE",
                          help="how much the assigned names may weigh together when they come back "
                               f"(default {describe_limit(DEFAULT_RETURN_LIMIT)}; e.g. 1GB, 512MiB, or "
                               '"none" for no limit); past it the biggest stay on the ranks')
CELL_GRAMMAR.add_argument("--sweep", dest="sweep", default=argparse.SUPPRESS, metavar="NAME",
                          help="run the cell once per config of the notebook's list NAME, each run a trial on "
                               "GPUs of its own (accelnb.sweep), with `config` bound in the cell; the table of "
                               "trials is the cell's output, and the trials are _sweep")
CELL_GRAMMAR.add_argument("--gpus-per-trial", dest="gpus_per_trial", type=int, default=argparse.SUPPRESS,
                          metavar="N", help="with --sweep: GPUs each trial owns (default 1)")
CELL_GRAMMAR.add_argument("--max-concurrent", dest="max_concurrent", type=int, default=argparse.SUPPRESS,
                          metavar="N", help="with --sweep: at most N trials at once")
CELL_GRAMMAR.add_argument("--best", dest="best", default=argparse.SUPPRESS, metavar="METRIC",
                          help="with --sweep: the metric whose best trial the table marks")
CELL_GRAMMAR.add_argument("--mode", dest="mode", choices=("min", "max"), default=argparse.SUPPRESS,
                          help="with --sweep: whether a lower (min, the default) or higher --best is better")
CELL_GRAMMAR.add_argument("--fail-fast", dest="fail_fast", action="store_true", default=argparse.SUPPRESS,
                          help="with --sweep: the first failed trial stops the others")
START_GRAMMAR = _option_parser("distributed start",
                               "Start a persistent session (restart: stop it, then start it again "
                               "with the same options, or with these).", ("start",))
COMMANDS = ("start", "stop", "status", "restart", "panel", "doctor")


def parse_cell_line(line: str) -> tuple[dict[str, Any], CellReturns]:
    """The options given on a ``%%distributed`` line, and what it brings back."""
    given, returns = _parsed_cell_line(line)
    return copy.deepcopy(given), CellReturns(None if returns.names is None else list(returns.names), returns.limit)


@functools.lru_cache(maxsize=64)
def _parsed_cell_line(line: str) -> tuple[dict[str, Any], CellReturns]:
    """Parsed once per distinct line (argparse took 80 µs of each session cell); the caller copies."""
    first = line.split(maxsplit=1)[0] if line.strip() else ""
    if first and not first.startswith("-"):
        raise UsageError(f"Unexpected {first!r} on the %%distributed line: the cell form takes only "
                         f"options (--procs 2, …). Session commands are line magics: %distributed {first}.")
    given = vars(CELL_GRAMMAR.parse_argstring(line))
    return given, CellReturns(_parse_return(given.pop("return_names")), _parse_return_limit(given.pop("return_limit")))


def parse_start_options(arguments: str) -> dict[str, Any]:
    """The options given to ``%distributed start`` or ``restart``."""
    return vars(START_GRAMMAR.parse_argstring(arguments))


@contextmanager
def _as_usage_error() -> Iterator[None]:
    """Bad input is shown as a short usage error in the magic's terms, not as a traceback.
    An unpicklable notebook name stays what it is: its message names the variable and its type."""
    try:
        yield
    except (UnpicklableError, LaunchFailed):  # a rank's failure stays the cell's error, whatever its type
        raise
    except LaunchConfigError as error:
        raise UsageError(magic_wording(str(error))) from None


@magics_class
class DistributedMagics(Magics):
    """Holds the session (if any) and turns magic lines into launcher calls."""

    shell: Any  # IPython sets it; always present while the magic runs

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session: Session | None = None
        self._session_options: LaunchOptions | None = None  # kept for restart, even after a crash
        self._names_on_ranks: set[str] = set()  # assigned by earlier cells of the session
        # What the last cell brought back, and from which rank: the line is shown when it changes.
        # A cell run again and again says nothing new, and each line is one more IOPub message in
        # Jupyter's round trip (0.85 ms of a 12 ms cell: benchmarks/bench_session_cell.py).
        self._last_brought_back = ""

    @no_var_expand
    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> Any:
        """Run this cell on every rank (cell form), or manage a persistent session (line form).

        Cell: ``%%distributed --gpus 0,1`` / ``--procs 2``. Predefined on every rank: ``rank``,
        ``local_rank``, ``world_size``, ``device`` (the rank's planned device).
        Line: ``%distributed start --procs 2`` keeps workers (and their variables) alive for the
        next cells; ``%distributed status``; ``%distributed stop``; ``%distributed restart`` (the
        same options, or new ones); ``%distributed panel`` shows the GPU picker;
        ``%distributed doctor`` checks the machine (shm, file limit, NCCL variables, GPUs, ports).
        """
        if any(mark in line for mark in "{}$"):
            # IPython's ``{name}``/``$name`` expansion, only for a line that has one: IPython's own,
            # before every magic, copies the notebook's whole namespace (``var_expand``), a cost
            # every session cell paid that grows with the notebook. 2: IPython's count from
            # here to the frame that ran the magic's line (this method, IPython's run_*_magic).
            line = self.shell.var_expand(line, 2)
        if cell is not None:
            given, returns = parse_cell_line(line)
            return self._run_cell(given, returns, cell, header=f"%%distributed {line}".rstrip())
        command, _, arguments = line.strip().partition(" ")
        if command and command not in COMMANDS:
            where = " Options go after a command (%distributed start --procs 2) or on a %%distributed cell." \
                if command.startswith("-") else ""
            raise UsageError(f"Unknown command {command!r}: use {', '.join(COMMANDS)}.{where}")
        if command in ("start", "restart"):
            given = parse_start_options(arguments)
            return self._start(given) if command == "start" else self._restart(given)
        if arguments.strip():
            raise UsageError(f"%distributed {command} takes no options, got {arguments.strip()!r}. "
                             "Options go to `%distributed start`/`restart`, or on a %%distributed cell.")
        return self._bare_command(command or "status")

    @line_magic
    def torchrun(self, line: str) -> None:
        """Run a torchrun command line on accelnb's ranks: ``%torchrun --nproc-per-node 2 train.py
        --epochs 3`` (``-m package.module`` for a module). Replacing ``!torchrun`` with ``%torchrun``
        is the whole change: each rank runs the script as ``__main__`` with its arguments, the
        notebook's working directory and torchrun's environment; rank 0's output streams into the
        cell, Stop stops every rank and whatever they started, and a non-zero exit code is reported
        with the rank and the line that exited. accelnb's flags (``--gpus 0,1``, ``--timeout``,
        ``--output all``, ``--log-dir``, ``--max-restarts``, …) may stand among torchrun's; without
        ``--nproc-per-node`` or ``--gpus`` the GPU picker's selection is used.
        """
        with _as_usage_error():
            torchrun(line)

    # ── cells ───────────────────────────────────────────────────────────────────────────────
    def _run_cell(self, given: dict[str, Any], returns: CellReturns, source: str, header: str) -> Any:
        in_session = self.session is not None and self.session.alive
        sweep = {flag: given.pop(flag) for flag in SWEEP_FLAGS if flag in given}
        if sweep:
            return self._run_sweep(given, sweep, returns, source, header, in_session)
        fixed = sorted(name for name in given if name in START_OPTIONS)
        if in_session and fixed:
            flags = ", ".join(magic_wording(f"{name}=").strip() for name in fixed)
            raise UsageError(f"A persistent session is running; its devices and process group are fixed, "
                             f"so {flags} cannot change here. Drop {flags}, or `%distributed restart "
                             f"{flags} …` to start it again with them.")
        one_shot_only = sorted(name for name in given if name in RESTART_OPTIONS)
        if in_session and one_shot_only:
            flags = ", ".join(magic_wording(f"{name}=").strip() for name in one_shot_only)
            raise UsageError(f"A persistent session is running, and {flags} cannot apply to it: a restart "
                             f"starts fresh workers, and the session's workers hold the variables of earlier "
                             f"cells. `%distributed stop` first to run this cell as a one-shot launch with "
                             f"restarts.")
        if "ranks" in given and not in_session:
            raise UsageError("--ranks runs the cell on some ranks of a running session, and no session is "
                             "running. Start one with `%distributed start --procs 2` (or --gpus 0,1), then "
                             "run this cell again; or drop --ranks to run it on every rank of a one-shot launch.")
        with _as_usage_error():
            options = _CELL_DEFAULTS.with_keywords(given, accepted=ALL_OPTIONS, caller="%%distributed")
        request = self._request(source, header, returns, reply_rank=options.ranks[0] if options.ranks else 0)
        request.names.update(self._ship(source, skip=self._names_on_ranks if in_session else set()))
        request.modules.update(self._modules(source))
        try:
            with _as_usage_error():
                if in_session:
                    assert self.session is not None
                    result = self.session.run(RUN_CELL, (request,), **_call_keywords(options))
                    if options.ranks is None:  # names a --ranks cell assigns are on its ranks only:
                        self._names_on_ranks.update(request.assigned_names)  # later cells ship them
                else:
                    result = launch_with(RUN_CELL, (request,), {}, options)
        finally:
            if self.session is not None and not self.session.alive:
                self.session = None
        return self._bring_back(result, returns, in_session)

    def _run_sweep(self, given: dict[str, Any], sweep: dict[str, Any], returns: CellReturns, source: str,
                   header: str, in_session: bool) -> None:
        name = sweep.pop("sweep", None)
        if name is None:
            flags = ", ".join("--" + flag.replace("_", "-") for flag in sweep)
            raise UsageError(f"{flags} apply to a sweep: add --sweep NAME (NAME a list of configs in the notebook).")
        if in_session:
            raise UsageError("--sweep runs each config as a launch of its own, on GPUs of its own, and a persistent "
                             "session is running on its workers. `%distributed stop` first, or run the configs "
                             "one cell at a time in the session.")
        if returns.names:
            raise UsageError("--return brings names back from one run of the cell; a sweep runs it once per config. "
                             "Make the value you want the cell's last expression: it is each trial's value.")
        if name not in self.shell.user_ns:
            raise UsageError(f"--sweep {name}: no {name!r} in the notebook. Define it first, e.g. "
                             f'{name} = [{{"lr": 1e-3}}, {{"lr": 1e-2}}].')
        request = self._request(source, header, CellReturns([], returns.limit))
        request.names.update(self._ship(source, skip={CONFIG_NAME}))
        request.modules.update(self._modules(source))
        with _as_usage_error():
            run_cell_sweep(request, self.shell.user_ns[name], given, sweep, self.shell.user_ns)

    def _request(self, source: str, header: str, returns: CellReturns, reply_rank: int = 0) -> CellRequest:
        """The cell's request, read in the kernel: a cell Python cannot parse stops here, before any
        process starts, shown at its line as the notebook shows a syntax error."""
        filename = f"<cell In[{self.shell.execution_count - 1}]>"  # IPython counted this cell before its magic ran
        try:
            return CellRequest.read(source, filename=filename, header=header, names={}, modules={},
                                    return_names=returns.names, return_limit=returns.limit, reply_rank=reply_rank)
        except SyntaxError as error:  # reported for the cell as the notebook shows it, below the magic's line
            raise CellSyntaxError.of(syntax_error(source, filename, lines_before=1) or error) from None

    def _ship(self, source: str, skip: set[str]) -> dict[str, Any]:
        namespace = self.shell.user_ns
        shipped = {}
        for name in sorted(used_names(source)):
            if name in RANK_NAMES or name in _SHELL_NAMES or name in skip or name not in namespace:
                continue
            value = namespace[name]
            if isinstance(value, types.ModuleType) or name.startswith("_i"):
                continue
            check_picklable(f"The notebook variable {name!r}", value, _SHIP_HINT)
            shipped[name] = value
        return shipped

    def _modules(self, source: str) -> dict[str, str]:
        namespace = self.shell.user_ns
        return {name: namespace[name].__name__ for name in used_names(source)
                if isinstance(namespace.get(name), types.ModuleType)}

    def _bring_back(self, result: LaunchResult, returns: CellReturns, in_session: bool) -> Any:
        self.shell.user_ns["_distributed"] = result
        outcome: CellOutcome | None = result.value
        if outcome is None:
            return None
        arrived = []
        for name, data in outcome.returned.items():
            try:
                self.shell.user_ns[name] = loads_in_kernel(data)
                arrived.append(name + (" (its .module)" if name in outcome.unwrapped else ""))
            except Exception as error:  # it pickled on the rank but cannot be rebuilt here
                outcome.not_returned[name] = f"cannot be rebuilt in the notebook: {type(error).__name__}: {error}"
        notes = []
        brought_back = f"accelnb: brought back from rank {result.value_rank}: " + ", ".join(arrived)
        if arrived and brought_back != self._last_brought_back:
            notes.append(brought_back)
        self._last_brought_back = brought_back if arrived else ""
        for name, why in outcome.not_returned.items():
            notes.append(f"accelnb: not brought back: {name} ({why})")
        notes += _kept_for_size_notes(outcome.kept_for_size, returns.limit, in_session)
        if notes:
            print("\n".join(notes))
        if outcome.last_value is not None:
            return loads_in_kernel(outcome.last_value)
        if outcome.last_value_repr is not None:
            return _Repr(outcome.last_value_repr)
        return None

    # ── sessions ────────────────────────────────────────────────────────────────────────────
    def _start(self, given: dict[str, Any]) -> None:
        if self.session is not None and self.session.alive:
            raise UsageError("A session is already running. Use `%distributed restart` to start "
                             "a new one, or `%distributed stop`.")
        with _as_usage_error():
            self._begin(Session.start_with(_start_options(given)))

    def _restart(self, given: dict[str, Any]) -> None:
        """Stop the session and start it again: with the options it had, or with ``given``.
        New options are checked and planned before the running session is stopped."""
        if not given and self._session_options is None:
            raise UsageError("No session to restart. `%distributed start --procs 2` (or --gpus 0,1) "
                             "starts one.")
        with _as_usage_error():
            options = _start_options(given) if given else self._session_options
            assert options is not None
            check_launch(options)  # bad options leave the running session alone
        self._stop()
        with _as_usage_error():
            self._begin(Session.start_with(options))

    def _begin(self, session: Session) -> None:
        self.session = session
        self._session_options = session.options
        self._names_on_ranks = set()
        self._last_brought_back = ""

    def _bare_command(self, command: str) -> Any:
        if command == "stop":
            self._stop()
            print("accelnb: session stopped; every worker has exited.")
        elif command == "status":
            print(self.session.status() if self.session is not None else
                  "accelnb: no session. `%distributed start --procs 2` (or --gpus 0,1) starts one.")
        elif command == "panel":
            from accelnb.notebook.panel import show_panel

            return show_panel()
        elif command == "doctor":
            doctor()  # prints the table; the line returns nothing, so the cell does not repeat it
        return None

    def _stop(self) -> None:
        if self.session is not None:
            self.session.stop()
        self.session = None
        self._names_on_ranks = set()
        self._last_brought_back = ""


# `%distributed?` shows both grammars, generated like the parsers themselves.
DistributedMagics.distributed.__doc__ = "\n\n".join([
    inspect.cleandoc(DistributedMagics.distributed.__doc__ or ""), CELL_GRAMMAR.format_help(),
    START_GRAMMAR.format_help()])


class _Repr:
    """Displays a rank-0 value that could not travel, by its repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _start_options(given: dict[str, Any]) -> LaunchOptions:
    return LaunchOptions().with_keywords(given, accepted=START_OPTIONS, caller="%distributed start")


def _call_keywords(options: LaunchOptions) -> dict[str, Any]:
    """The call options of ``options``, as keywords of ``Session.run``."""
    return {name: getattr(options, name) for name in SESSION_CALL_OPTIONS}


def _kept_for_size_notes(sizes: dict[str, int], limit: int | None, in_session: bool) -> list[str]:
    """One line per name left on the ranks by the budget: its size and how to get it."""
    if not sizes:
        return []
    where = ("it stays on the ranks for the next cells of this session" if in_session else
             "a persistent session (%distributed start) would keep it on the ranks for the next cells")
    notes = [f"accelnb: kept on the ranks, over the {describe_limit(limit or 0)} return budget "
             "(--return-limit): " + ", ".join(f"{name} ({human_bytes(size)})" for name, size in sizes.items())]
    for name in sizes:
        notes.append(f"  {name}: `%%distributed --return {name}` brings it back whatever its size; {where}.")
    return notes


@dataclass(frozen=True)
class CellReturns:
    """What a ``%%distributed`` line asks to bring back: names (None: every assigned one) and a budget."""

    names: list[str] | None
    limit: int | None  # bytes; None: no budget


def _parse_return_limit(option: str | None) -> int | None:
    if option is None:
        return DEFAULT_RETURN_LIMIT
    if option.strip().lower() == "none":
        return None
    try:
        return parse_byte_size(option)
    except ValueError as error:
        raise UsageError(f"--return-limit: {error}, or none for no limit.") from None


def _parse_return(option: str | None) -> list[str] | None:
    if option is None:
        return None
    if option.strip().lower() == "none":
        return []
    return [name.strip() for name in option.split(",") if name.strip()]
