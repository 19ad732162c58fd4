"""One description of a launch's options: each option's default, check, help and magic flag.

Every entry point builds a :class:`LaunchOptions` and nothing else reads options:

    >>> from accelnb.options import LaunchOptions, START_OPTIONS
    >>> LaunchOptions(num_processes=2, timeout=30).output
    'rank0'
    >>> LaunchOptions().with_keywords({"gpu": "0"}, accepted=START_OPTIONS, caller="Session.start()")
    Traceback (most recent call last):
      ...
    accelnb.errors.LaunchConfigError: Session.start() got an unknown option 'gpu'; did you mean 'gpus'? ...

- ``notebook_launcher``, ``launch``, ``plan``, ``Session.start`` and ``Session.run`` turn their
  keywords into one (:meth:`LaunchOptions.with_keywords`: unknown names are refused with a
  suggestion, before anything starts);
- ``%%distributed`` and ``%distributed start`` generate their argparse grammars from the field
  metadata below (flag, choices, help), so the magic cannot drift from the API;
- :func:`settle` settles them once, before anything starts, local and cluster launches alike:
  the GPU picker's default selection, or the Accelerate config file's placement and settings,
  resolved into one :class:`SettledOptions`, which the launch passes on whole. ``accelnb.kernel``
  and ``accelnb.cluster`` may not import this top-level module (``tests/test_layout.py``), so
  what they read of it is a *view* they declare, a dataclass whose fields are named after the
  options and filled by name (:meth:`SettledOptions.view`): ``RankOptions`` (what every rank's
  environment gets) and ``ClusterRequest`` (what a cluster backend reads). The planner of this
  machine's ranks takes its few placement values as plain arguments, and stays callable without
  this object.

Each option has a *scope*: ``"start"`` options place the ranks and are fixed when workers start
(a session keeps them), ``"call"`` options apply to each run (``Session.run`` takes only those),
``"session"`` options only make sense for a call of a running session (``ranks``: some of its
ranks run the call, the others keep their state; a one-shot launch starts every rank it runs),
``"launch"`` options only make sense for a one-shot launch, which starts its own workers:
restarts (``max_restarts``, ``restart_delay``) start a fresh group of workers, and a session's
workers hold the user's variables, which a fresh group would silently lose. So ``Session.run``
refuses them (saying why), and a session that loses a rank ends, as before.

Adding an option (``gpus_per_rank``, ``config_file``, ``nodes``, ``max_restarts``, ``log_dir``)
is one field here, with its ``option(...)`` metadata, plus its line in the keyword dictionary of
its scope below (a test fails if the two disagree), plus its use: for an option that reaches the
ranks' environment, a field of ``RankOptions`` and its line in ``rank_environment``
(``accelnb/kernel/planning/rank_environment.py``); for one a cluster backend reads, a field of
``ClusterRequest`` and its use there. An option that describes this machine only says in its
metadata why a cluster launch refuses it (``not_on_a_cluster=``). Every entry point, its signature,
its docstring, the magic's flag, the cluster refusal and the road to its use follow from that, and
``tests/test_options.py`` fails for an option that nothing outside this module reads.

Why ``**options: Unpack[...]`` rather than explicit keywords: written out, the 13 keywords were
repeated in four signatures and four docstrings that drifted (the magic lacked ``fp8``). With
PEP 692 a type checker and an editor (mypy, Pylance in VS Code) still see every keyword with its
type, misspellings included, and :func:`documents_options` gives each function an
``inspect.signature`` and a "Keyword Args" docstring section generated from these fields, which
is what Jupyter's Shift-Tab, ``?`` and ``help()`` show. The price is the ``TypedDict`` lines below,
a second spelling of the names and types that a test keeps identical to the dataclass.
"""

from __future__ import annotations

import difflib
import inspect
import os
import textwrap
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, get_args

from accelnb.errors import LaunchConfigError, LaunchInsideLaunchError
from accelnb.kernel.planning.accelerate_config import AccelerateConfig, merge_placement, read_accelerate_config
from accelnb.kernel.planning.inventory import Inventory
from accelnb.kernel.planning.ports import check_port
from accelnb.kernel.planning.rank_environment import DEVICE_ENV, RankOptions
from accelnb.kernel.planning.rank_plan import GpuSpec
from accelnb.kernel.run.call_settings import DEFAULT_STALL_TIMEOUT_S, DEFAULT_STOP_GRACE_S, CollectMode, OutputMode
from accelnb.kernel.watched_state.selection import current_selection

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Scope = Literal["start", "call", "launch", "session"]
ClusterKind = Literal["local", "ray"]

KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "hccl")
MIXED_PRECISION_MODES = ("no", "fp16", "bf16", "fp8")
OUTPUT_MODES: tuple[str, ...] = get_args(OutputMode)
COLLECT_MODES: tuple[str, ...] = get_args(CollectMode)
CLUSTER_KINDS: tuple[str, ...] = get_args(ClusterKind)

_INFO = "accelnb.option"


@dataclass(frozen=True)
class OptionInfo:
    """What the API, the docs and the magic need to know about one option."""

    help: str  # written with API spellings (``num_processes=N``); the magic rewords it
    scope: Scope
    flag: str | None = None  # the %%distributed flag; None: not settable from the magic
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # how the magic reads the flag's text; None: as is
    metavar: str | None = None  # the flag's value in the magic's help
    check: Callable[[str, Any], None] | None = None  # raises LaunchConfigError for a bad value
    fix: str = ""  # what to do instead, added to a bad-choice error
    not_on_a_cluster: str = ""  # why a cluster launch refuses it (it describes this machine only); "": taken


def option(help: str, scope: Scope, **details: Any) -> dict[str, OptionInfo]:
    """The ``metadata=`` of a :class:`LaunchOptions` field."""
    return {_INFO: OptionInfo(help, scope, **details)}


# ── checks of single values (choices are checked generically) ──────────────────────────────────
def _whole_number_at_least(minimum: int) -> Callable[[str, Any], None]:
    """The check of an integer option whose smallest allowed value is ``minimum``."""
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise LaunchConfigError(f"{name} must be an integer, got {value!r}.")
        if value < minimum:
            least = "0 or more" if minimum == 0 else f"at least {minimum}"
            raise LaunchConfigError(f"{name} must be {least}, got {value}.")
    return check


_AT_LEAST_ONE = _whole_number_at_least(1)
_AT_LEAST_ZERO = _whole_number_at_least(0)


def _positive_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise LaunchConfigError(f"{name} must be a positive number of seconds, got {value!r}.")


def _positive_seconds_or_none(name: str, value: Any) -> None:
    if value is not None:
        _positive_seconds(name, value)


def _seconds_or_off(text: str) -> float | None:
    """``--stall-timeout 300`` or ``--stall-timeout none`` (off)."""
    return None if text.strip().lower() in ("none", "off") else float(text)


def _gpu_selection(name: str, value: Any) -> None:
    parts = value if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    if not all(isinstance(p, (int, str)) and not isinstance(p, bool) for p in parts):
        raise LaunchConfigError(f"{name}={value!r} is not a GPU selection; use e.g. {name}=\"0,1\", "
                                f"{name}=[0, 1], {name}=\"all\" or GPU UUIDs.")


def _seconds_at_least_zero(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise LaunchConfigError(f"{name} must be a number of seconds, 0 or more, got {value!r}.")


def _rank_numbers(text: str) -> list[int | str]:
    """``--ranks 0,2`` as the list ``[0, 2]``; what is not a number is left for the check to name."""
    return [int(part) if part.strip().isdigit() else part.strip() for part in text.split(",")]


def _rank_choice(name: str, value: Any) -> None:
    """Rank numbers, each once; which exist is checked against the session (``Session.run``)."""
    parts = value if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    if not parts or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts):
        raise LaunchConfigError(f"{name}={value!r} is not a choice of ranks; give rank numbers, e.g. "
                                f"{name}=[1] or {name}=[0, 2].")
    twice = sorted({p for p in parts if parts.count(p) > 1})
    if twice:
        raise LaunchConfigError(f"{name}={value!r} lists rank {', '.join(map(str, twice))} more than once; "
                                "give each rank once.")


def _directory(name: str, value: Any) -> None:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise LaunchConfigError(f"{name} must be a directory path (a str or pathlib.Path), got {value!r}.")


def _port(name: str, value: Any) -> None:
    check_port(value)


def _config_path(name: str, value: Any) -> None:
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise LaunchConfigError(f"{name} must be the path of an Accelerate config file (what `accelerate "
                                f"config` writes) or \"default\" for that file, got {value!r}.")


def _inventory(name: str, value: Any) -> None:
    if not isinstance(value, Inventory):
        raise LaunchConfigError(f"{name} must be an accelnb Inventory (read_inventory() or "
                                f"synthetic_inventory(n)), got {type(value).__name__}.")


@dataclass(frozen=True)
class LaunchOptions:
    """Everything that describes a launch besides the function and its arguments.

    Built by every entry point; checked here, value by value, when it is built. What needs the
    GPU inventory (does GPU 5 exist?) is checked by the planner.
    """

    # ── start: where the ranks run; a session keeps these ──────────────────────────────────
    gpus: GpuSpec = field(default=None, metadata=option(
        'GPUs as nvidia-smi numbers them ("0,1,3", "all") or their UUIDs; in code a list works '
        "too. Default: the picker's selection, else every visible GPU.",
        "start", flag="--gpus", metavar="IDS", check=_gpu_selection,
        not_on_a_cluster="it names GPUs of this machine; on a cluster Ray assigns them (use gpus_per_node=)"))
    num_processes: int | None = field(default=None, metadata=option(
        "number of ranks: CPU ranks (gloo) where there is no GPU, else the first N GPUs.",
        "start", flag="--procs", parse=int, metavar="N", check=_AT_LEAST_ONE))
    gpus_per_rank: int = field(default=1, metadata=option(
        "GPUs each rank owns and sees as cuda:0, cuda:1, …, for a model spread over GPUs with "
        'device_map="auto": gpus="0,1", gpus_per_rank=2 is one rank. The selection must divide '
        "evenly.", "start", flag="--gpus-per-rank", parse=int, metavar="N", check=_AT_LEAST_ONE,
        not_on_a_cluster="a cluster rank owns one GPU of Ray's assignment"))
    config_file: str | None = field(default=None, metadata=option(
        'an Accelerate config file (what `accelerate config` writes; "default" for its default '
        "path): its num_processes, gpu_ids, mixed_precision, distributed_type and FSDP, DeepSpeed "
        "and dynamo settings reach Accelerator() as `accelerate launch` would pass them. Keywords "
        "given beside it win.", "start", flag="--config", metavar="PATH", check=_config_path,
        not_on_a_cluster="pass its settings (mixed_precision=, num_processes=) as keywords instead"))
    cpu: bool = field(default=False, metadata=option(
        "run num_processes=N CPU ranks even where there are GPUs.", "start", flag="--cpu"))
    backend: str | None = field(default=None, metadata=option(
        "process-group backend; default nccl on GPUs, gloo on CPU.",
        "start", flag="--backend", choices=KNOWN_BACKENDS,
        fix="nccl for GPUs, gloo for CPU, or leave it unset to choose automatically"))
    master_port: int | None = field(default=None, metadata=option(
        "rendezvous port on 127.0.0.1; default a free one.",
        "start", flag="--port", parse=int, metavar="PORT", check=_port,
        not_on_a_cluster="the rendezvous port is chosen free on rank 0's node"))
    mixed_precision: str | None = field(default=None, metadata=option(
        "mixed precision that Accelerator() sees in every rank.",
        "start", flag="--mixed-precision", choices=MIXED_PRECISION_MODES))
    quiet: bool = field(default=False, metadata=option(
        "do not print the rank → device table at start.", "start", flag="--quiet"))
    inventory: Inventory | None = field(default=None, repr=False, metadata=option(
        "the GPUs to plan on; default read from NVML (tests and demos pass synthetic_inventory(8)).",
        "start", check=_inventory, not_on_a_cluster="the cluster's GPUs are Ray's to assign"))
    cluster: ClusterKind = field(default="local", metadata=option(
        '"local" runs the ranks on this machine; "ray" runs one Ray actor per rank across the nodes '
        "of the Ray cluster this kernel is connected to (ray.init(address=...), or RAY_ADDRESS), "
        "ranks packed per node. Needs pip install 'accelnb[ray]'.",
        "start", flag="--cluster", choices=CLUSTER_KINDS,
        fix='"ray" for a Ray cluster, or leave it unset for this machine'))
    nodes: int | None = field(default=None, metadata=option(
        'cluster="ray": spread the ranks over exactly N nodes, the same number on each.',
        "start", flag="--nodes", parse=int, metavar="N", check=_AT_LEAST_ONE))
    gpus_per_node: int | None = field(default=None, metadata=option(
        'cluster="ray": GPU ranks per node (one GPU each, from Ray\'s assignment); with nodes=N, '
        "N × this many ranks.",
        "start", flag="--gpus-per-node", parse=int, metavar="N", check=_AT_LEAST_ONE))

    group_timeout: float | None = field(default=None, metadata=option(
        "seconds a collective (all_reduce, barrier) of the group accelnb makes may wait for the "
        "other ranks before it fails; default: torch's (30 min for gloo, 10 for NCCL). A timeout the "
        "code gives its own init_process_group() wins.",
        "start", flag="--group-timeout", parse=float, metavar="SECONDS", check=_positive_seconds))

    # ── call: each run ─────────────────────────────────────────────────────────────────────
    timeout: float | None = field(default=None, metadata=option(
        "seconds; on expiry every rank's Python stack is shown, then all are stopped.",
        "call", flag="--timeout", parse=float, metavar="SECONDS", check=_positive_seconds))
    output: OutputMode = field(default="rank0", metadata=option(
        '"rank0" streams rank 0 live, "all" every rank with [rank N] prefixes, "none" nothing '
        "(the output of failed ranks is still shown).",
        "call", flag="--output", choices=OUTPUT_MODES))
    collect: CollectMode = field(default="all", metadata=option(
        '"all" brings back every rank\'s return value, "rank0" only rank 0\'s (the others are '
        "not pickled).", "call", choices=COLLECT_MODES))
    log_dir: str | os.PathLike[str] | None = field(default=None, metadata=option(
        "write rank 0's report() scalars as TensorBoard event files into this directory (one run; "
        "each launch adds an event file). Needs pip install 'accelnb[tensorboard]'.",
        "call", flag="--log-dir", metavar="DIR", check=_directory))

    stall_timeout: float | None = field(default=DEFAULT_STALL_TIMEOUT_S, metadata=option(
        "seconds without progress on any rank (a step, a report(), a line of output) after which "
        "the cell shows every rank's Python stack and what each waits in, once; the run goes on. "
        "None turns it off.",
        "call", flag="--stall-timeout", parse=_seconds_or_off, metavar="SECONDS", check=_positive_seconds_or_none))
    stop_grace: float | None = field(default=DEFAULT_STOP_GRACE_S, metadata=option(
        "seconds the ranks get to answer a Stop when the code checks accelnb.stop_requested() (the first "
        "press asks them to stop at their next check, so they can save); past this, or on a second press, "
        "they are stopped at once. None: as long as they take.",
        "call", flag="--stop-grace", parse=_seconds_or_off, metavar="SECONDS", check=_positive_seconds_or_none))

    # ── session: a call of a running session only ──────────────────────────────────────────
    ranks: Sequence[int] | None = field(default=None, metadata=option(
        "run the call only on these ranks of the session (e.g. [1] or [0, 2]), to inspect or change "
        "their state; the others keep theirs. Output is shown with [rank N] prefixes, and the value "
        "(and a cell's names) comes from the first rank listed. A collective (all_reduce, barrier, a "
        "DDP step) in such a call waits for the ranks not running it and hangs: set timeout= to bound "
        "it (a timeout ends the session).",
        "session", flag="--ranks", parse=_rank_numbers, metavar="N,M", check=_rank_choice))

    # ── launch: one-shot launches only (a restart starts fresh workers) ─────────────────────
    max_restarts: int = field(default=0, metadata=option(
        "when a rank fails, stop every rank and start them all again, up to N times; the function "
        "reads its attempt from accelnb.restart_count() or TORCHELASTIC_RESTART_COUNT.",
        "launch", flag="--max-restarts", parse=int, metavar="N", check=_AT_LEAST_ZERO))
    restart_delay: float = field(default=0.0, metadata=option(
        "seconds to wait before each restart (timeout= covers every attempt and these waits).",
        "launch", flag="--restart-delay", parse=float, metavar="SECONDS", check=_seconds_at_least_zero))

    def __post_init__(self) -> None:
        for each, info in described_fields():
            _check_value(each, info, getattr(self, each.name))
        if self.cpu and self.gpus is not None:
            raise LaunchConfigError("cpu=True runs CPU ranks; do not also pass gpus=.")
        if self.cpu and self.num_processes is None and self.cluster == "local":
            raise LaunchConfigError("cpu=True needs num_processes=N (how many CPU ranks to run).")
        if self.cluster == "local" and (self.nodes is not None or self.gpus_per_node is not None):
            given = "nodes=" if self.nodes is not None else "gpus_per_node="
            raise LaunchConfigError(f"{given} places ranks on the nodes of a cluster; pass cluster=\"ray\" "
                                    "too, or leave it out to run on this machine.")
        if self.cluster != "local":
            for each, info in described_fields():
                if info.not_on_a_cluster and getattr(self, each.name) != each.default:
                    raise LaunchConfigError(f"cluster={self.cluster!r} does not take {each.name}=: "
                                            f"{info.not_on_a_cluster}.")

    def view(self, kind: type[View]) -> View:
        """``kind`` (a dataclass) with each field set to the option of its name (see
        :meth:`SettledOptions.view`)."""
        return kind(**{each.name: getattr(self, each.name) for each in fields(kind)})

    def with_keywords(self, keywords: Mapping[str, Any], *, accepted: Collection[str],
                      caller: str) -> LaunchOptions:
        """These options with ``keywords`` applied; refuses names that ``caller`` does not take."""
        for name in keywords:
            if name not in accepted:
                raise LaunchConfigError(_refusal(name, accepted, caller))
        # A session's cell passes every call option, nearly all as they were: rebuilding (and
        # checking every field again) for those cost 30 µs of each cell. Frozen: the same options,
        # checked once, serve each call that changes nothing.
        changed = {name: value for name, value in keywords.items() if getattr(self, name) is not value}
        return replace(self, **changed) if changed else self


View = TypeVar("View", bound="DataclassInstance")


@dataclass(frozen=True)
class SettledOptions:
    """A launch's options once :func:`settle` has resolved every default it can before planning;
    passed whole from there on, to this machine's planner and a cluster backend alike.

    Code that may not import this module reads a :meth:`view` of it.
    """

    # Every option, the placement the GPU picker or the Accelerate config file chose filled in:
    # what the launch reads.
    options: LaunchOptions
    # The options as given, the picker's selection filled in: what a session keeps, so that its
    # restart runs on the same GPUs and reads the config file again.
    given: LaunchOptions
    accelerate: AccelerateConfig | None = None  # the config file that config_file= named, read
    from_file: tuple[str, ...] = ()  # the file's keys that placed the ranks: "gpu_ids", "num_processes", ...
    overridden: tuple[str, ...] = ()  # the file's settings that keywords given beside it replaced

    @property
    def accelerate_env(self) -> Mapping[str, str]:
        """The config file's settings for every rank's environment; empty without a file."""
        return self.accelerate.env if self.accelerate is not None else {}

    @property
    def notes(self) -> tuple[str, ...]:
        """Lines for the start table: where settings came from."""
        return () if self.accelerate is None else (self.accelerate.describe(self.from_file, self.overridden),)

    @property
    def rank_options(self) -> RankOptions:
        """What these options put into every rank's environment."""
        return self.view(RankOptions)

    def view(self, kind: type[View]) -> View:
        """``kind`` (a dataclass) with each field set to the settled value of its name: an option,
        or a property above. How the kernel and the cluster backends read the options without
        importing this module, and without a caller copying fields by hand."""
        return kind(**{each.name: self._value(each.name) for each in fields(kind)})

    def _value(self, name: str) -> Any:
        return getattr(self.options, name) if name in _DEFAULTS else getattr(self, name)


def settle(options: LaunchOptions) -> SettledOptions:
    """Resolve, once and before anything starts, what ``options`` leave to the environment: the
    Accelerate config file of ``config_file=`` (read and merged with the keywords given beside it,
    which win; raises on a bad file) or else, where they choose no devices, the GPU picker's
    selection. What needs the GPU inventory is left to the planner."""
    _refuse_a_launch_inside_a_launch()
    if options.config_file is not None:
        config = read_accelerate_config(options.config_file)
        placement = merge_placement(config, gpus=options.gpus, num_processes=options.num_processes,
                                    cpu=options.cpu, gpus_per_rank=options.gpus_per_rank)
        placed = replace(options, gpus=placement.gpus, num_processes=placement.num_processes, cpu=placement.cpu)
        return SettledOptions(placed, given=options, accelerate=config, from_file=placement.from_file,
                              overridden=_overridden(config, options))
    chosen = _with_picker_default(options)
    return SettledOptions(chosen, given=chosen)


def _refuse_a_launch_inside_a_launch() -> None:
    """A launch or session started from inside a rank would start a whole new set of ranks per
    rank; the rank's environment (``ACCELNB_DEVICE``, set only in ranks) says it is one."""
    if DEVICE_ENV not in os.environ:
        return
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    raise LaunchInsideLaunchError(
        f"accelnb was asked to start ranks from inside rank {rank} of an accelnb launch of {world} ranks: "
        f"a launch inside a launch would start a new set of ranks in every rank. Call the function "
        f"directly: this process already is one of the {world} ranks, with torch.distributed set up. "
        f"Or start the launch from the notebook, not from code that runs in a rank.")


def _with_picker_default(options: LaunchOptions) -> LaunchOptions:
    """``options`` with the GPU picker's selection filled in where they choose no devices of this
    machine (without a config file, which chooses them itself)."""
    if options.gpus is not None or options.num_processes is not None or options.cpu or options.cluster != "local":
        return options
    chosen = current_selection()
    if chosen is None:
        return options  # the planner's own default: every visible GPU
    # A number of ranks without GPUs is the picker's "CPU ranks": on a machine with GPUs,
    # num_processes alone would take the first N of them.
    return replace(options, gpus=chosen.gpus, num_processes=chosen.num_processes,
                   cpu=chosen.gpus is None and chosen.num_processes is not None)


def _overridden(config: AccelerateConfig, given: LaunchOptions) -> tuple[str, ...]:
    """The file's settings that keywords given beside it replaced."""
    pairs = (("gpus", config.gpu_ids), ("num_processes", config.num_processes),
             ("mixed_precision", config.mixed_precision if config.mixed_precision != "no" else None))
    return tuple(name for name, in_file in pairs if in_file is not None and getattr(given, name) not in (None, in_file))


def described_fields() -> Iterator[tuple[Field[Any], OptionInfo]]:
    """Every option with its description, in declaration order."""
    for each in fields(LaunchOptions):
        yield each, each.metadata[_INFO]


def names_in_scope(scope: Scope) -> frozenset[str]:
    return frozenset(each.name for each, info in described_fields() if info.scope == scope)


_DEFAULTS = {each.name: each.default for each in fields(LaunchOptions)}


def _check_value(each: Field[Any], info: OptionInfo, value: Any) -> None:
    if value is None and each.default is None:
        return  # unset
    if isinstance(each.default, bool) and not isinstance(value, bool):
        raise LaunchConfigError(f"{each.name} must be True or False, got {value!r}.")
    if info.choices is not None and value not in info.choices:
        fix = f" ({info.fix})" if info.fix else ""
        raise LaunchConfigError(f"{each.name}={value!r} must be {_either(info.choices)}{fix}.")
    if info.check is not None:
        info.check(each.name, value)


def _either(choices: Collection[str]) -> str:
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


_SCOPE_MEANING = {
    "start": "it places the ranks, so it is fixed when the workers start (pass it to "
             "Session.start, or %distributed start/restart)",
    "call": "it applies to each call (pass it to Session.run, or to the %%distributed cell)",
    "session": "it chooses ranks of a running session (pass it to Session.run, or to a %%distributed "
               "cell after %distributed start); a one-shot launch runs every rank it starts",
    "launch": "a restart starts a fresh group of workers, and a session's workers hold your "
              "variables, which it would lose; pass it to notebook_launcher/launch, or to a "
              "%%distributed cell outside a session",
}


def _refusal(name: str, accepted: Collection[str], caller: str) -> str:
    known = {each.name: info for each, info in described_fields()}
    if name in known:
        return f"{caller} does not take {name}=: {_SCOPE_MEANING[known[name].scope]}."
    close = difflib.get_close_matches(name, list(accepted), n=1)
    suggestion = f"; did you mean {close[0]!r}?" if close else "."
    return (f"{caller} got an unknown option {name!r}{suggestion} "
            f"Its options are: {', '.join(sorted(accepted))}.")


# ── the keywords each entry point takes, for type checkers and editors (PEP 692) ────────────────
# A second spelling of the fields above: tests/test_options.py keeps the names and types equal.
class _StartKeywordsExceptNumProcesses(TypedDict, total=False):
    gpus: GpuSpec
    gpus_per_rank: int
    config_file: str | None
    cpu: bool
    backend: str | None
    master_port: int | None
    mixed_precision: str | None
    quiet: bool
    inventory: Inventory | None
    cluster: ClusterKind
    nodes: int | None
    gpus_per_node: int | None
    group_timeout: float | None


class StartKeywords(_StartKeywordsExceptNumProcesses, total=False):
    """``Session.start`` and ``plan``: the options that place the ranks."""

    num_processes: int | None


class CallKeywords(TypedDict, total=False):
    """``Session.run``: the options of one call."""

    timeout: float | None
    output: OutputMode
    collect: CollectMode
    log_dir: str | os.PathLike[str] | None
    stall_timeout: float | None
    stop_grace: float | None


class SessionCallKeywords(CallKeywords, total=False):
    """``Session.run``: the options of one call, and the ranks to run it on."""

    ranks: Sequence[int] | None


class RestartKeywords(TypedDict, total=False):
    """The options only one-shot launches take: restarts start a fresh group of workers."""

    max_restarts: int
    restart_delay: float


class LaunchKeywords(_StartKeywordsExceptNumProcesses, CallKeywords, RestartKeywords, total=False):
    """``launch`` and ``notebook_launcher``, whose third positional parameter is num_processes."""


def keyword_names(keywords: type) -> frozenset[str]:
    """The keys of one of the keyword dictionaries above."""
    return frozenset(keywords.__required_keys__) | frozenset(keywords.__optional_keys__)  # type: ignore[attr-defined]


START_OPTIONS = keyword_names(StartKeywords)
CALL_OPTIONS = keyword_names(CallKeywords)
SESSION_CALL_OPTIONS = keyword_names(SessionCallKeywords)
RESTART_OPTIONS = keyword_names(RestartKeywords)
LAUNCH_OPTIONS = START_OPTIONS | CALL_OPTIONS | RESTART_OPTIONS  # what a one-shot launch takes
ALL_OPTIONS = LAUNCH_OPTIONS | SESSION_CALL_OPTIONS

F = TypeVar("F", bound=Callable[..., Any])


def documents_options(keywords: type, defaults: LaunchOptions | None = None) -> Callable[[F], F]:
    """Show the options a function takes through ``**options`` as if written out: keyword-only
    parameters in its ``inspect.signature`` (Jupyter's Shift-Tab, ``?``) and a "Keyword Args"
    section in its docstring, both generated from :class:`LaunchOptions`."""
    names = keyword_names(keywords)
    shown = defaults or LaunchOptions()

    def decorate(function: F) -> F:
        signature = inspect.signature(function)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        generated = [inspect.Parameter(each.name, inspect.Parameter.KEYWORD_ONLY,
                                       default=getattr(shown, each.name), annotation=each.type)
                     for each, _ in described_fields() if each.name in names and each.name not in
                     {p.name for p in own}]
        function.__signature__ = signature.replace(parameters=own + generated)  # type: ignore[attr-defined]
        function.__doc__ = _with_keyword_args(function.__doc__ or "", names - {p.name for p in own})
        return function

    return decorate


def _with_keyword_args(doc: str, names: Collection[str]) -> str:
    lines = ["Keyword Args:"] + [textwrap.fill(f"{each.name}: {info.help}", width=96, initial_indent="    ",
                                               subsequent_indent="        ")
                                 for each, info in described_fields() if each.name in names]
    text = inspect.cleandoc(doc)
    for heading in ("\nReturns:", "\nRaises:"):
        at = text.find(heading)
        if at >= 0:
            return text[:at] + "\n" + "\n".join(lines) + "\n" + text[at:]
    return text + "\n\n" + "\n".join(lines)
