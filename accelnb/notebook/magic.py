"""``%%distributed``: run a notebook cell on every rank. A thin adapter over the launcher.

    %load_ext accelnb

    %%distributed --gpus 0,1
    model = DDP(Net().to(device), device_ids=[device])   # Net comes from an earlier cell
    train(model)                                         # rank 0's prints appear live
    final_accuracy                                       # rank 0's value is the cell's result

Every option maps one-to-one onto a keyword of :func:`accelnb.launch`. The notebook names the
cell reads are shipped to every rank by cloudpickle (modules are imported there instead), the
names it assigns come back from rank 0, and the last result is ``_distributed`` (a
:class:`~accelnb.kernel.launch_result.LaunchResult`, with ``.metrics``). Line forms manage persistent
sessions: ``%distributed start --procs 2``, ``status``, ``stop``, ``restart``, ``panel``.
"""

from __future__ import annotations

import types
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from accelnb.errors import GpuSelectionError, LaunchConfigError
from accelnb.kernel.launch_result import LaunchResult
from accelnb.kernel.payload import check_picklable
from accelnb.launcher import launch
from accelnb.session import Session
from accelnb.wire.result_pickling import loads_in_kernel
from accelnb.worker.cell_analysis import assigned_names, used_names
from accelnb.worker.cell_runner import CellOutcome, CellRequest, run_cell

RANK_NAMES = ("rank", "local_rank", "world_size", "device")
# IPython's own bookkeeping names; never worth shipping.
_SHELL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_ih", "_oh", "_dh", "_", "__", "___",
                "_distributed"}
_SHIP_HINT = "Create it inside the %%distributed cell instead, or turn it into something that pickles."


@magics_class
class DistributedMagics(Magics):
    """Holds the session (if any) and turns magic lines into launcher calls."""

    shell: Any  # IPython sets it; always present while the magic runs

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session: Session | None = None
        self._session_line = ""
        self._names_on_ranks: set[str] = set()  # assigned by earlier cells of the session

    @magic_arguments()
    @argument("command", nargs="?", default=None,
              help="line form only: start | stop | status | restart | panel")
    @argument("--gpus", default=None,
              help='GPUs as nvidia-smi numbers them: "0,1,3", "all", or UUIDs. '
                   "Default: the picker's selection, else every visible GPU.")
    @argument("--procs", type=int, default=None,
              help="number of ranks: CPU ranks where there is no GPU, else the first N GPUs")
    @argument("--cpu", action="store_true", help="run --procs CPU ranks even where there are GPUs")
    @argument("--backend", default=None, help="process-group backend (default nccl on GPUs, gloo on CPU)")
    @argument("--port", type=int, default=None, help="rendezvous port on 127.0.0.1 (default: a free one)")
    @argument("--timeout", type=float, default=None,
              help="seconds; on expiry every rank's stack is shown and all are stopped")
    @argument("--output", choices=("rank0", "all", "none"), default="rank0",
              help="stream rank 0 (default), every rank with [rank N] prefixes, or none")
    @argument("--mixed-precision", dest="mixed_precision", choices=("no", "fp16", "bf16"), default=None,
              help="mixed precision seen by Accelerator()")
    @argument("--return", dest="return_names", default=None,
              help='names to bring back from rank 0, comma-separated, or "none" (default: every '
                   "name the cell assigns)")
    @argument("--quiet", action="store_true", help="do not print the rank → device table")
    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> Any:
        """Run this cell on every rank (cell form), or manage a persistent session (line form).

        Cell: ``%%distributed --gpus 0,1`` / ``--procs 2``. Predefined on every rank: ``rank``,
        ``local_rank``, ``world_size``, ``device``.
        Line: ``%distributed start --procs 2`` keeps workers (and their variables) alive for the
        next cells; ``%distributed status``; ``%distributed stop``; ``%distributed restart``;
        ``%distributed panel`` shows the GPU picker.
        """
        args = parse_argstring(self.distributed, line)
        if cell is None:
            return self._line_command(args, line)
        if args.command is not None:
            raise UsageError(f"Unexpected {args.command!r} on the %%distributed line; options start with --.")
        return self._run_cell(args, cell, header=f"%%distributed {line}".rstrip())

    # ── cells ───────────────────────────────────────────────────────────────────────────────
    def _run_cell(self, args: Any, source: str, header: str) -> Any:
        in_session = self.session is not None and self.session.alive
        if in_session and _chooses_devices(args):
            raise UsageError("A persistent session is running; its devices are fixed. Drop --gpus/--procs, "
                             "or `%distributed stop` first.")
        # IPython has already counted this cell when magics run: the prompt shows one less.
        request = CellRequest(source=source, filename=f"<cell In[{self.shell.execution_count - 1}]>",
                              header=header, names={}, modules={},
                              return_names=_parse_return(args.return_names))
        request.names.update(self._ship(source, skip=self._names_on_ranks if in_session else set()))
        request.modules.update(self._modules(source))
        try:
            if in_session:
                assert self.session is not None
                result = self.session.run(run_cell, (request,), collect="rank0", timeout=args.timeout,
                                          output=args.output)
                self._names_on_ranks.update(assigned_names(source))
            else:
                result = launch(run_cell, (request,), args.procs, gpus=args.gpus, cpu=args.cpu,
                                backend=args.backend, master_port=args.port, timeout=args.timeout,
                                output=args.output, mixed_precision=args.mixed_precision,
                                quiet=args.quiet, collect="rank0")
        except GpuSelectionError as error:
            raise UsageError(_magic_wording(str(error))) from None
        except LaunchConfigError as error:
            raise UsageError(str(error)) from None
        finally:
            if self.session is not None and not self.session.alive:
                self.session = None
        return self._bring_back(result)

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

    def _bring_back(self, result: LaunchResult) -> Any:
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
        if arrived:
            notes.append("accelnb: brought back from rank 0: " + ", ".join(arrived))
        for name, why in outcome.not_returned.items():
            notes.append(f"accelnb: not brought back: {name} ({why})")
        if notes:
            print("\n".join(notes))
        if outcome.last_value is not None:
            return loads_in_kernel(outcome.last_value)
        if outcome.last_value_repr is not None:
            return _Repr(outcome.last_value_repr)
        return None

    # ── sessions ────────────────────────────────────────────────────────────────────────────
    def _line_command(self, args: Any, line: str) -> Any:
        command = args.command or "status"
        if command == "start":
            if self.session is not None and self.session.alive:
                raise UsageError("A session is already running. Use `%distributed restart` to start "
                                 "a new one, or `%distributed stop`.")
            return self._start(args, line)
        if command == "stop":
            self._stop()
            print("accelnb: session stopped; every worker has exited.")
            return None
        if command == "restart":
            self._stop()
            new_line = line.replace("restart", "start", 1) if _chooses_devices(args) else self._session_line
            return self._start(parse_argstring(self.distributed, new_line or "start"), new_line)
        if command == "status":
            print(self.session.status() if self.session is not None else
                  "accelnb: no session. `%distributed start --procs 2` (or --gpus 0,1) starts one.")
            return None
        if command == "panel":
            from accelnb.notebook.panel import show_panel

            return show_panel()
        raise UsageError(f"Unknown command {command!r}: use start, stop, status, restart or panel.")

    def _start(self, args: Any, line: str) -> None:
        try:
            self.session = Session.start(args.gpus, args.procs, cpu=args.cpu, backend=args.backend,
                                         master_port=args.port, mixed_precision=args.mixed_precision,
                                         quiet=args.quiet)
        except GpuSelectionError as error:
            raise UsageError(_magic_wording(str(error))) from None
        except LaunchConfigError as error:
            raise UsageError(str(error)) from None
        self._session_line = line
        self._names_on_ranks = set()

    def _stop(self) -> None:
        if self.session is not None:
            self.session.stop()
        self.session = None
        self._names_on_ranks = set()


class _Repr:
    """Displays a rank-0 value that could not travel, by its repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _chooses_devices(args: Any) -> bool:
    return args.gpus is not None or args.procs is not None or args.cpu


def _parse_return(option: str | None) -> list[str] | None:
    if option is None:
        return None
    if option.strip().lower() == "none":
        return []
    return [name.strip() for name in option.split(",") if name.strip()]


def _magic_wording(message: str) -> str:
    return (message.replace("num_processes=N", "--procs N").replace("num_processes=", "--procs ")
            .replace("gpus=", "--gpus ").replace("cpu=True", "--cpu"))
