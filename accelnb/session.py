"""Persistent sessions: workers that stay alive across cells, process group joined.

A one-shot launch forks workers, runs, and tears everything down. A session keeps the workers,
so the next call costs a pipe round trip instead of a launch, and each rank keeps its variables
(a model built in one ``%%distributed`` cell is trained in the next).

    >>> session = Session.start(num_processes=2)                  # doctest: +SKIP
    >>> session.run(lambda: torch.distributed.get_rank()).values  # doctest: +SKIP
    {0: 0, 1: 1}
    >>> session.stop()                                            # doctest: +SKIP

An exception that every rank reports leaves the session usable; a rank that dies, or one that
does not respond to an interrupt (stuck in a collective), ends it with the root cause shown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import psutil

from accelnb.errors import LaunchConfigError
from accelnb.kernel import planning
from accelnb.kernel.inventory import Inventory, read_inventory
from accelnb.kernel.launch_result import LaunchResult
from accelnb.kernel.payload import pack_call
from accelnb.kernel.runs import OutputMode, run_on_group, start_workers
from accelnb.kernel.supervisor import WorkerGroup
from accelnb.launcher import check_output_mode, live_metrics_view


class Session:
    """Workers kept alive between calls. Create with :meth:`Session.start`."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group

    @classmethod
    def start(
        cls,
        gpus: planning.GpuSpec = None,
        num_processes: int | None = None,
        *,
        cpu: bool = False,
        backend: str | None = None,
        master_port: int | None = None,
        mixed_precision: str | None = None,
        quiet: bool = False,
        inventory: Inventory | None = None,
    ) -> Session:
        the_plan = planning.plan(gpus, num_processes, inventory=inventory or read_inventory(), cpu=cpu,
                                 backend=backend, mixed_precision=mixed_precision)
        return cls(start_workers(the_plan, master_port, persistent=True, quiet=quiet))

    @property
    def plan(self) -> planning.LaunchPlan:
        return self._group.plan

    @property
    def alive(self) -> bool:
        return self._group.usable

    def run(
        self,
        function: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        output: OutputMode = "rank0",
        collect: Literal["rank0", "all"] = "all",
    ) -> LaunchResult:
        """Run ``function`` on every rank of the session (see :func:`accelnb.launch`)."""
        if not self.alive:
            raise LaunchConfigError("This session has ended. Start a new one with Session.start() "
                                    "or %distributed start.")
        check_output_mode(output, timeout)
        payload = pack_call(function, args, kwargs or {})
        try:
            return run_on_group(self._group, payload, collect=collect, timeout=timeout, output=output,
                                metrics_view=live_metrics_view)
        finally:
            if not self._group.usable:
                self._group.close()

    def stop(self) -> None:
        """End every worker and free their resources."""
        self._group.shutdown()

    def status(self, inventory: Inventory | None = None) -> str:
        """Ranks, devices, pids and memory (host, and GPU where a rank has one), as
        ``%distributed status`` shows them. GPU memory comes from NVML, as nvidia-smi's."""
        gpus_now = None if self.plan.simulated_gpus or all(r.gpu is None for r in self.plan.ranks) \
            else (inventory or read_inventory())
        lines = [f"accelnb session: {len(self.plan.ranks)} rank(s), backend {self.plan.backend}, "
                 f"{'running' if self.alive else 'ended'}"]
        for worker, spec in zip(self._group.workers, self.plan.ranks, strict=True):
            try:
                rss = f"{psutil.Process(worker.pid).memory_info().rss / 2**20:,.0f} MiB"
            except psutil.Error:
                rss = "gone"
            line = f"  {spec.describe(self.plan.simulated_gpus)}  pid {worker.pid}  memory {rss}"
            if gpus_now is not None and spec.gpu is not None:
                line += f"  GPU memory {_gpu_memory_of(worker.pid, spec.gpu.uuid, gpus_now)}"
            lines.append(line)
        return "\n".join(lines)


def _gpu_memory_of(pid: int, gpu_uuid: str, inventory: Inventory) -> str:
    gpu = inventory.by_uuid(gpu_uuid)
    if gpu is None:
        return "unknown (GPU not found by NVML)"
    total = f"of {gpu.memory_total / 2**20:,.0f} MiB"
    mine = [p for p in gpu.processes if p.pid == pid]
    if not mine:
        return f"none listed for this pid {total}"  # no CUDA context yet (or NVML sees host pids)
    if mine[0].memory_used is None:
        return f"in use, amount not reported by the driver, {total}"
    return f"{mine[0].memory_used / 2**20:,.0f} MiB {total}"
