"""The one launch API every entry point (code, ``%%distributed``, panels) ends up calling.

    >>> from accelnb import notebook_launcher
    >>> def train(lr):
    ...     import torch.distributed as dist
    ...     return dist.get_rank(), lr
    >>> notebook_launcher(train, args=(1e-3,), num_processes=2)     # doctest: +SKIP
    (0, 0.001)

``launch`` returns a :class:`~accelnb.kernel.launch_result.LaunchResult` with every rank's value, the
metric history and the output; ``notebook_launcher`` returns rank 0's value (its first three
parameters match Accelerate's ``notebook_launcher``, so it is a drop-in replacement).

Order of work: validate and plan (pure, raises on bad input), pickle the call (raises naming an
unpicklable argument), bind the rendezvous port (raises if a requested one is taken), and only
then fork workers from the clean helper process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from accelnb.errors import LaunchConfigError
from accelnb.kernel import planning
from accelnb.kernel.inventory import Inventory, read_inventory
from accelnb.kernel.launch_result import LaunchResult
from accelnb.kernel.payload import pack_call
from accelnb.kernel.runs import MetricsView, OutputMode, last_result, run_on_group, start_workers

__all__ = ["check_output_mode", "last_result", "launch", "notebook_launcher"]


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
                            metric_sink=metric_sink, metrics_view=live_metrics_view)
    except KeyboardInterrupt as interrupt:
        # The stop button: the engine's frames would fill the cell and explain nothing.
        raise KeyboardInterrupt(*interrupt.args) from None
    finally:
        group.close()


def check_output_mode(output: str, timeout: float | None) -> None:
    if output not in ("rank0", "all", "none"):
        raise LaunchConfigError(f"output={output!r} must be 'rank0', 'all' or 'none'.")
    if timeout is not None and timeout <= 0:
        raise LaunchConfigError(f"timeout must be a positive number of seconds, got {timeout}.")


def live_metrics_view(all_ranks: bool) -> MetricsView:
    """The notebook's live chart of ``report()`` metrics (imported only when a run reports)."""
    from accelnb.notebook.metrics_view import LiveMetricsView  # the UI is wired here, at the top

    return LiveMetricsView(all_ranks=all_ranks)
