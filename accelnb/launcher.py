"""The one launch API every entry point (code, ``%%distributed``, panels) ends up calling.

    >>> from accelnb import notebook_launcher
    >>> def train(lr):
    ...     import torch.distributed as dist
    ...     return dist.get_rank(), lr
    >>> notebook_launcher(train, args=(1e-3,), num_processes=2)     # doctest: +SKIP
    (0, 0.001)

``launch`` returns a :class:`~accelnb.launch_result.LaunchResult` with every rank's value, the
metric history and the output; ``notebook_launcher`` returns rank 0's value (its first three
parameters match Accelerate's ``notebook_launcher``, so it is a drop-in replacement).

Order of work: validate and plan (pure, raises on bad input), pickle the call (raises naming an
unpicklable argument), bind the rendezvous port (raises if a requested one is taken), and only
then fork workers from the clean helper process.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from accelnb import planning
from accelnb.errors import LaunchConfigError, LaunchFailed
from accelnb.inventory import Inventory, read_inventory
from accelnb.launch_result import LaunchResult
from accelnb.metrics_history import MetricHistory
from accelnb.metrics_view import LiveMetricsView
from accelnb.output import OutputRouter, notebook_sink
from accelnb.payload import pack_call
from accelnb.ports import bind_rendezvous_socket
from accelnb.result_pickling import loads_in_kernel
from accelnb.supervisor import WorkerGroup
from accelnb.worker import WorkerSpec
from accelnb.zygote_client import shared_helper

OutputMode = Literal["rank0", "all", "none"]

_last_result: LaunchResult | None = None


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    gpus: planning.GpuSpec = None,
    cpu: bool = False,
    backend: str | None = None,
    master_port: int | None = None,
    timeout: float | None = None,
    output: OutputMode = "rank0",
    mixed_precision: str | None = None,
    quiet: bool = False,
) -> Any:
    """Run ``function(*args, **kwargs)`` on every rank and return rank 0's return value.

    Args:
        function: defined anywhere, notebook cells included; travels by cloudpickle.
        args, kwargs: its arguments; they must pickle (a clear error says which does not).
        num_processes: number of ranks. Without GPUs, CPU ranks on gloo; with GPUs, the first N.
        gpus: ``"0,1,2,3"``, ``[0, 1]``, ``"all"`` or GPU UUIDs, numbered as nvidia-smi does.
            Without ``gpus`` and ``num_processes``: the picker's selection, else every visible GPU.
        cpu: run ``num_processes`` CPU ranks even where GPUs exist.
        backend: process-group backend; default nccl on GPUs, gloo on CPU.
        master_port: rendezvous port on 127.0.0.1; default a free one.
        timeout: seconds; on expiry every rank's Python stack is shown, then all are stopped.
        output: ``"rank0"`` streams rank 0 live, ``"all"`` every rank with ``[rank N]`` prefixes,
            ``"none"`` nothing (output of failed ranks is still shown).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``, seen by ``Accelerator()``.
        quiet: do not print the rank → device table at start.

    Raises:
        LaunchConfigError: bad input, before anything starts.
        RankFailed / RankCrashed / LaunchTimeout: the run failed; every worker is gone.
        KeyboardInterrupt: the run was interrupted; every worker is gone.
    """
    result = launch(function, args, num_processes, kwargs=kwargs, gpus=gpus, cpu=cpu, backend=backend,
                    master_port=master_port, timeout=timeout, output=output,
                    mixed_precision=mixed_precision, quiet=quiet, collect="rank0")
    return result.value


def launch(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    gpus: planning.GpuSpec = None,
    cpu: bool = False,
    backend: str | None = None,
    master_port: int | None = None,
    timeout: float | None = None,
    output: OutputMode = "rank0",
    mixed_precision: str | None = None,
    quiet: bool = False,
    collect: Literal["rank0", "all"] = "all",
    inventory: Inventory | None = None,
    metric_sink: Callable[[Any], None] | None = None,
) -> LaunchResult:
    """Like :func:`notebook_launcher`, but returns a :class:`LaunchResult` with every rank's value
    (``collect="all"``), the metric history and each rank's output."""
    check_output_mode(output, timeout)
    the_plan = planning.plan(gpus, num_processes, inventory=inventory or read_inventory(), cpu=cpu,
                             backend=backend, mixed_precision=mixed_precision)
    payload = pack_call(function, args, kwargs or {})
    group = start_workers(the_plan, master_port, persistent=False, quiet=quiet)
    try:
        return run_on_group(group, payload, collect=collect, timeout=timeout, output=output,
                            metric_sink=metric_sink)
    finally:
        group.close()


def check_output_mode(output: str, timeout: float | None) -> None:
    if output not in ("rank0", "all", "none"):
        raise LaunchConfigError(f"output={output!r} must be 'rank0', 'all' or 'none'.")
    if timeout is not None and timeout <= 0:
        raise LaunchConfigError(f"timeout must be a positive number of seconds, got {timeout}.")


def start_workers(the_plan: planning.LaunchPlan, master_port: int | None, *, persistent: bool,
                  quiet: bool) -> WorkerGroup:
    """Bind the rendezvous port and fork one worker per rank of ``the_plan``."""
    store_socket = bind_rendezvous_socket(master_port)
    the_plan = the_plan.with_port(store_socket.getsockname()[1])
    try:
        helper = shared_helper()
    except BaseException:
        store_socket.close()
        raise
    router = OutputRouter(live_ranks={0}, prefix=False, sink=notebook_sink)
    group = WorkerGroup(the_plan, helper, router, persistent=persistent)
    group.start(worker_specs(the_plan, persistent), store_socket)
    if not quiet:
        notebook_sink("stdout", describe_start(the_plan, [w.pid for w in group.workers]) + "\n")
    return group


def run_on_group(group: WorkerGroup, payload: bytes, *, collect: Literal["rank0", "all"],
                 timeout: float | None, output: OutputMode,
                 metric_sink: Callable[[Any], None] | None = None) -> LaunchResult:
    """Run one packed call on every worker of ``group`` and gather what came back."""
    ranks = [r.rank for r in group.plan.ranks]
    group.output.live_ranks = {0} if output == "rank0" else (set(ranks) if output == "all" else set())
    group.output.prefix = output == "all"
    marks = {rank: group.output.position(rank) for rank in ranks}
    history = MetricHistory()
    view = LiveMetricsView(all_ranks=output == "all")

    def on_metrics(batch: Any) -> None:
        history.add(batch)
        view.add(batch)
        if metric_sink is not None:
            metric_sink(batch)

    group.metric_sink = on_metrics
    started = time.perf_counter()
    global _last_result

    def outcome(values: dict[int, Any]) -> LaunchResult:
        return LaunchResult(values=values, plan=group.plan, seconds=time.perf_counter() - started,
                            metrics=history,
                            outputs={rank: group.output.text_since(rank, marks[rank]) for rank in ranks})

    succeeded = False
    try:
        pickled = group.call(payload, {0} if collect == "rank0" else set(ranks), timeout)
        if not group.persistent:
            group.shutdown()
        succeeded = True
    except LaunchFailed as failure:
        failure.metrics = history  # what was reported before the failure is not lost
        raise
    except KeyboardInterrupt as interrupt:
        # The stop button: the supervisor's frames would fill the cell and explain nothing;
        # the message says what happened.
        raise KeyboardInterrupt(*interrupt.args) from None
    finally:
        group.output.tick(force=True)
        view.close()
        if not succeeded:  # failed or interrupted: keep what the ranks printed and reported
            _last_result = outcome({})
    values = {rank: loads_in_kernel(data) for rank, data in pickled.items() if data is not None}
    _last_result = outcome(values)
    return _last_result


def last_result() -> LaunchResult | None:
    """The latest run in this kernel, however it was started (``notebook_launcher``,
    ``%%distributed``, a session): every rank's value, output and metrics, including output the
    cell skipped to stay responsive. After a failed or interrupted run ``values`` is empty and
    the output is what each rank printed before it ended."""
    return _last_result


def worker_specs(the_plan: planning.LaunchPlan, persistent: bool = False) -> list[WorkerSpec]:
    """The per-rank specs the helper forks workers from."""
    cpus = os.cpu_count() or 1
    threads = max(1, cpus // len(the_plan.ranks))
    specs = []
    for rank in the_plan.ranks:
        env = dict(rank.env)
        if the_plan.master_addr == "127.0.0.1":
            # Keep gloo's and NCCL's own sockets on loopback too (they otherwise bind the
            # address the hostname resolves to).
            env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            env.setdefault("NCCL_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", "lo"))
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(threads)
        specs.append(WorkerSpec(
            rank=rank.rank, local_rank=rank.local_rank, world_size=rank.world_size,
            device=rank.device, backend=the_plan.backend, env=env,
            master_addr=the_plan.master_addr, master_port=the_plan.master_port,
            cwd=os.getcwd(), sys_path=[p for p in sys.path if p != ""] + [os.getcwd()],
            persistent=persistent,
            holds_store=rank.rank == 0,
            threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", threads)),
        ))
    return specs


def describe_start(the_plan: planning.LaunchPlan, pids: Sequence[int]) -> str:
    lines = the_plan.table().splitlines()
    return "\n".join([lines[0]] + [f"{line}  (pid {pid})" for line, pid in zip(lines[1:], pids, strict=True)])
