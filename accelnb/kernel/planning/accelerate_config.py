"""Accelerate's config file (what ``accelerate config`` writes), read as ``accelerate launch`` reads it.

``notebook_launcher(fn, config_file="fsdp.yaml")`` must hand ``Accelerator()`` in every rank the
same settings ``accelerate launch --config_file fsdp.yaml`` would. Those settings travel as
environment variables (``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_FSDP``, ``FSDP_*``,
``ACCELERATE_DYNAMO_*``, ``ACCELERATE_DEEPSPEED_*`` …), so this module does not map the file's
keys itself: it runs Accelerate's own launch code on the file — the ``accelerate launch`` argument
parser, ``_validate_launch_command`` (which folds the file into the arguments) and the environment
function that ``launch_command`` would pick (``prepare_multi_gpu_env`` for MULTI_GPU and FSDP,
``prepare_deepspeed_cmd_env`` for DeepSpeed, ``prepare_simple_launcher_cmd_env`` otherwise) —
and keeps what that environment adds. A new Accelerate version that adds a setting is followed
without a change here.

    >>> config = read_accelerate_config("fsdp.yaml")            # doctest: +SKIP
    >>> config.num_processes, config.env["ACCELERATE_USE_FSDP"]   # doctest: +SKIP
    (2, 'true')

What the file says about *placement* (``num_processes``, ``gpu_ids``, ``use_cpu``) comes back as
plain values for the planner, which places ranks itself; the keys a launcher owns
(:data:`LAUNCHER_OWNED`: which GPUs a rank sees, the rendezvous address, the thread budget) are
left out of ``env`` because accelnb sets them per rank. Everything is checked here, before
anything starts, and every error names the file and the key.

Accelerate is imported only when a launch names a config file: it is an optional dependency.
Nothing here touches CUDA (``launch_command``'s RTX 4000 probe, which does, is not run: that
probe only disables NCCL peer-to-peer on consumer cards, and NCCL's own detection does as well).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accelnb.errors import LaunchConfigError

DEFAULT = "default"
# The distributed types a single-machine notebook launch can run (Accelerate's names).
SUPPORTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED")
# Keys of the launch environment that accelnb sets for each rank itself: the planner decides
# which GPUs each rank sees (from gpu_ids, per rank) and where ranks rendezvous (a free loopback
# port it binds), worker_specs the thread budget, and the worker its own sys.path.
LAUNCHER_OWNED = frozenset({"CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH"})
# Accelerate's own variables, kept even where the kernel already has the same value (a helper
# process started before the kernel set it would not have it).
ACCELERATE_PREFIXES = ("ACCELERATE_", "FSDP_", "MEGATRON_LM_", "PARALLELISM_CONFIG_")


@dataclass(frozen=True)
class AccelerateConfig:
    """What one config file means for a launch."""

    path: str
    distributed_type: str  # one of SUPPORTED_TYPES
    num_processes: int | None  # None: the file leaves it to the launcher
    gpu_ids: str | None  # "0,1"; None: all
    use_cpu: bool
    mixed_precision: str | None
    env: Mapping[str, str] = field(default_factory=dict)  # what `accelerate launch` adds, LAUNCHER_OWNED left out
    sections: tuple[str, ...] = ()  # the settings sections it has: "fsdp_config (8)", …

    def describe(self, used: tuple[str, ...], overridden: tuple[str, ...]) -> str:
        """One line for the start table: what came from the file, and what keywords overrode."""
        parts = [f"distributed_type {self.distributed_type}"]
        if "num_processes" in used:
            parts.append(f"num_processes {self.num_processes}")
        if "gpu_ids" in used:
            parts.append(f"gpu_ids {self.gpu_ids}")
        if "use_cpu" in used:
            parts.append("use_cpu")
        if self.mixed_precision not in (None, "no") and "mixed_precision" not in overridden:
            parts.append(f"mixed_precision {self.mixed_precision}")
        parts.extend(self.sections)
        won = f"; keywords won for {', '.join(overridden)}" if overridden else ""
        return f"from {self.path}: {', '.join(parts)}{won}"


def resolve_path(config_file: str | os.PathLike[str]) -> str:
    """``"default"`` is the file ``accelerate config`` writes (Accelerate's own constant)."""
    if os.fspath(config_file) == DEFAULT:
        from accelerate.commands.config.config_args import default_config_file

        return str(default_config_file)
    return os.path.abspath(os.path.expanduser(os.fspath(config_file)))


def read_accelerate_config(config_file: str | os.PathLike[str]) -> AccelerateConfig:
    """Read and check ``config_file`` and derive the environment ``accelerate launch`` gives a
    script for it. Raises :class:`LaunchConfigError` naming the file and the key."""
    _require_accelerate()
    path = resolve_path(config_file)
    raw = _parse(path, config_file)
    distributed_type = _check_keys(path, raw)
    settings = _load_with_accelerate(path)
    env = _launch_environment(path, distributed_type, file_counts_processes=raw.get("num_processes", -1) != -1)
    num_processes = settings.num_processes if isinstance(settings.num_processes, int) and \
        settings.num_processes > 0 else None
    gpu_ids = None if settings.gpu_ids in (None, "all") else str(settings.gpu_ids)
    config = AccelerateConfig(
        path=path, distributed_type=distributed_type, num_processes=num_processes, gpu_ids=gpu_ids,
        use_cpu=bool(settings.use_cpu) or distributed_type == "MULTI_CPU",
        mixed_precision=settings.mixed_precision, env=env,
        sections=tuple(f"{name} ({len(raw[name])})" for name in ("fsdp_config", "deepspeed_config", "dynamo_config")
                       if isinstance(raw.get(name), dict) and raw[name]))
    return config


def _require_accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError as missing:
        raise LaunchConfigError(
            "config_file= is Accelerate's config file, but accelerate is not installed in this kernel's "
            "environment. Install it (pip install accelerate), or pass the options as keywords.") from missing


def _parse(path: str, given: str | os.PathLike[str]) -> dict[str, Any]:
    if not os.path.isfile(path):
        how = ("run `accelerate config` in a terminal to write it, or pass config_file= the path of "
               "an existing file") if os.fspath(given) == DEFAULT else \
              "check the path (relative paths start in the kernel's working directory, " \
              f"{os.getcwd()}), or run `accelerate config --config_file {path}` to write one"
        raise LaunchConfigError(f"config_file={os.fspath(given)!r}: {path} does not exist. To fix it, {how}.")
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            raw = json.load(file) if path.endswith(".json") else yaml.safe_load(file)
    except (yaml.YAMLError, json.JSONDecodeError) as malformed:
        raise LaunchConfigError(
            f"{path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {_one_line(malformed)}. "
            "Fix the file, or write it again with `accelerate config`.") from None
    except OSError as unreadable:
        raise LaunchConfigError(f"{path} cannot be read: {unreadable}.") from None
    if not isinstance(raw, dict):
        raise LaunchConfigError(f"{path} holds a {type(raw).__name__}, not the key: value settings of an "
                                "Accelerate config file. Write it with `accelerate config`.")
    return raw


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _check_keys(path: str, raw: Mapping[str, Any]) -> str:
    """The file's distributed_type, once the keys accelnb depends on are known to make sense."""
    environment = raw.get("compute_environment", "LOCAL_MACHINE")
    if environment != "LOCAL_MACHINE":
        raise LaunchConfigError(f"{path}: compute_environment: {environment} launches elsewhere; a notebook "
                                "launch runs on this machine. Use a file with compute_environment: LOCAL_MACHINE.")
    if "distributed_type" not in raw:
        raise LaunchConfigError(f"{path} has no distributed_type key. Add one of {', '.join(SUPPORTED_TYPES)}.")
    distributed_type = str(raw["distributed_type"])
    if raw["distributed_type"] is False:  # YAML 1.1 reads a bare NO as false
        raise LaunchConfigError(f"{path}: distributed_type: NO must be quoted, distributed_type: 'NO' (YAML reads "
                                "a bare NO as false), as `accelerate config` writes it.")
    if distributed_type not in SUPPORTED_TYPES:
        raise LaunchConfigError(
            f"{path}: distributed_type: {distributed_type} is not one accelnb can launch. Use one of "
            f"{', '.join(SUPPORTED_TYPES)} (a notebook launch is one machine's CPU or GPU ranks).")
    machines = raw.get("num_machines", 1)
    if machines != 1:
        raise LaunchConfigError(f"{path}: num_machines: {machines}, but a notebook launch runs on this machine "
                                "only. Set num_machines: 1.")
    processes = raw.get("num_processes")
    if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int)
                                  or (processes < 1 and processes != -1)):
        raise LaunchConfigError(f"{path}: num_processes: {processes!r} is not a number of processes. "
                                "Use a whole number of at least 1.")
    if distributed_type == "DEEPSPEED":
        from accelerate.utils import is_deepspeed_available

        if not is_deepspeed_available():
            raise LaunchConfigError(
                f"{path}: distributed_type: DEEPSPEED, but deepspeed is not installed in this kernel's "
                "environment. Install it (pip install deepspeed; it needs CUDA), or use a file with "
                "distributed_type: FSDP for sharded training.")
    return distributed_type


def _load_with_accelerate(path: str) -> Any:
    """Accelerate's own reading of the file (its defaults, its checks of unknown keys and values)."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        return load_config_from_file(path)
    except (ValueError, TypeError, KeyError) as refused:
        raise LaunchConfigError(f"Accelerate refuses {path}: {_one_line(refused)}") from None


def _launch_environment(path: str, distributed_type: str, file_counts_processes: bool) -> dict[str, str]:
    """What ``accelerate launch --config_file path`` would add to a script's environment.

    A file without num_processes makes ``accelerate launch`` demand ``--num_processes``; here the
    planner counts the ranks (from the keywords or the GPUs), and the count changes nothing in
    this environment, so Accelerate is given a stand-in.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    count = [] if file_counts_processes else ["--num_processes", "1"]
    args = launch_command_parser().parse_args(["--config_file", path, *count, "<notebook function>"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # about Accelerate's default port, which accelnb does not use
            args, defaults, mixed_precision_from_file = _validate_launch_command(args)
            args.main_process_port = 0  # accelnb binds its own port: keep Accelerate off 29500
            # The same choice as accelerate.commands.launch.launch_command.
            if args.use_deepspeed and not args.cpu:
                fields = list(defaults.deepspeed_config.keys()) if defaults else []
                if mixed_precision_from_file:
                    fields.append("mixed_precision")
                args.deepspeed_fields_from_accelerate_config = ",".join(fields)
                _, env = prepare_deepspeed_cmd_env(args)
            elif (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
                env = prepare_multi_gpu_env(args)
            else:
                _, env = prepare_simple_launcher_cmd_env(args)
    except (ValueError, RuntimeError, ImportError, AssertionError) as refused:
        raise LaunchConfigError(f"Accelerate cannot launch {path} (distributed_type: {distributed_type}): "
                                f"{_one_line(refused)}") from None
    return {key: value for key, value in env.items()
            if key not in LAUNCHER_OWNED and (os.environ.get(key) != value or key.startswith(ACCELERATE_PREFIXES))}


@dataclass(frozen=True)
class Placement:
    """Where the ranks run, once the file's values and the keywords given beside it are merged."""

    gpus: Any  # a GPU selection as ``gpus=`` takes it, or None
    num_processes: int | None
    cpu: bool
    from_file: tuple[str, ...]  # the file's keys that were used: "num_processes", "gpu_ids", "use_cpu"


def merge_placement(config: AccelerateConfig, *, gpus: Any, num_processes: int | None, cpu: bool,
                    gpus_per_rank: int) -> Placement:
    """Keywords win over the file, key by key: ``gpus=`` over ``gpu_ids``, ``num_processes=`` over
    ``num_processes``, ``cpu=True``/``gpus=`` over ``use_cpu``. Raises when what is left conflicts."""
    used: list[str] = []
    if gpus is None and not cpu and config.gpu_ids is not None and not config.use_cpu:
        gpus = config.gpu_ids
        used.append("gpu_ids")
    if num_processes is None and config.num_processes is not None:
        num_processes = config.num_processes
        used.append("num_processes")
    if not cpu and gpus is None and config.use_cpu:
        cpu = True
        used.append("use_cpu" if config.distributed_type != "MULTI_CPU" else "distributed_type")
        if num_processes is None:
            raise LaunchConfigError(f"{config.path}: distributed_type: {config.distributed_type} runs CPU ranks, "
                                    "but the file has no num_processes. Add num_processes: N to it, or pass "
                                    "num_processes=N.")
    count = _count(gpus)
    if "num_processes" in used and count is not None and num_processes is not None \
            and count != num_processes * gpus_per_rank:
        where = f"gpu_ids: {gpus}" if "gpu_ids" in used else f"gpus={gpus!r}"
        per_rank = f" × gpus_per_rank={gpus_per_rank}" if gpus_per_rank > 1 else ""
        raise LaunchConfigError(
            f"{config.path}: num_processes: {num_processes}{per_rank} conflicts with {where} ({count} GPU(s)). "
            "Make them agree in the file, or pass num_processes= as well to override the file's.")
    return Placement(gpus, num_processes, cpu, tuple(used))


def _count(gpus: Any) -> int | None:
    """How many GPUs a selection names, where that is known without the inventory."""
    if gpus is None or (isinstance(gpus, str) and gpus.strip() == "all"):
        return None
    if isinstance(gpus, int):
        return 1
    tokens = gpus.split(",") if isinstance(gpus, str) else list(gpus)
    return len([t for t in tokens if str(t).strip()])
