"""Pure planning: a device selection and a GPU inventory in, one spec per rank out.

Nothing here starts a process, opens NVML or touches CUDA, so every rule about device mapping is
testable on a machine without a GPU::

    >>> from accelnb.kernel.inventory import synthetic_inventory
    >>> p = plan(gpus="3,4,5,7", inventory=synthetic_inventory(8))
    >>> [(r.rank, r.device, r.gpu.index) for r in p.ranks]
    [(0, 'cuda:0', 3), (1, 'cuda:1', 4), (2, 'cuda:2', 5), (3, 'cuda:3', 7)]
    >>> p.ranks[0].env["CUDA_VISIBLE_DEVICES"]
    '3,4,5,7'

The rules:

- GPUs are named as ``nvidia-smi`` names them (index or UUID); workers get
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA numbers them the same way.
- Every worker sees the selected GPUs in selection order (``CUDA_VISIBLE_DEVICES``), and local
  rank *i* uses ``cuda:i``; so ``cuda:{LOCAL_RANK}``, ``rank % device_count()`` and
  ``Accelerator()`` all land on the right card.
- With several nodes the global rank is ``node_rank * local_world_size + local_rank``; the
  device always follows the local rank.
- A synthetic inventory (tests, demos) plans GPU ranks that run on the CPU with gloo.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from accelnb.errors import GpuSelectionError, LaunchConfigError
from accelnb.kernel.inventory import GpuInfo, Inventory
from accelnb.kernel.selection import current_selection

GpuSpec = str | int | Sequence[int | str] | None

KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "hccl")
MIXED_PRECISION_MODES = ("no", "fp16", "bf16", "fp8")


@dataclass(frozen=True)
class RankSpec:
    """Everything one worker needs to know about its place in the run."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: str  # "cuda:N" as the worker sees it, or "cpu"
    gpu: GpuInfo | None  # the physical GPU behind ``device``
    env: Mapping[str, str] = field(default_factory=dict)

    def describe(self, simulated: bool = False) -> str:
        if self.gpu is None:
            return f"rank {self.rank} → cpu"
        where = "cpu, simulating " if simulated else f"{self.device} → "
        return (f"rank {self.rank} → {where}GPU {self.gpu.index} "
                f"({self.gpu.name}, {self.gpu.uuid}, bus {self.gpu.pci_bus_id})")


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks of one node, and how they find each other."""

    ranks: tuple[RankSpec, ...]
    backend: str
    master_addr: str
    master_port: int  # 0 until the launcher binds a free one
    simulated_gpus: bool = False  # GPUs come from a synthetic inventory; ranks run on CPU

    @property
    def world_size(self) -> int:
        return self.ranks[0].world_size

    @property
    def uses_gpus(self) -> bool:
        return self.ranks[0].gpu is not None and not self.simulated_gpus

    def with_port(self, port: int) -> LaunchPlan:
        ranks = tuple(replace(r, env={**r.env, "MASTER_PORT": str(port)}) for r in self.ranks)
        return replace(self, ranks=ranks, master_port=port)

    def table(self) -> str:
        """The rank → device mapping as shown at the start of a run."""
        header = f"accelnb: {len(self.ranks)} rank(s), backend {self.backend}"
        if self.simulated_gpus:
            header += " (synthetic GPU inventory: ranks run on the CPU)"
        return "\n".join([header] + ["  " + r.describe(self.simulated_gpus) for r in self.ranks])


def plan(
    gpus: GpuSpec = None,
    num_processes: int | None = None,
    *,
    inventory: Inventory,
    cpu: bool = False,
    backend: str | None = None,
    mixed_precision: str | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    use_default_selection: bool = True,
) -> LaunchPlan:
    """Plan the ranks of this node. Raises :class:`LaunchConfigError` on any bad input."""
    if num_processes is not None and (isinstance(num_processes, bool) or not isinstance(num_processes, int)):
        raise LaunchConfigError(f"num_processes must be an integer, got {num_processes!r}.")
    if num_processes is not None and num_processes < 1:
        raise LaunchConfigError(f"num_processes must be at least 1, got {num_processes}.")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchConfigError(f"node_rank must be in [0, nnodes={nnodes}), got {node_rank}.")
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION_MODES:
        raise LaunchConfigError(
            f"mixed_precision={mixed_precision!r} is not one of {', '.join(MIXED_PRECISION_MODES)}.")

    if gpus is None and num_processes is None and not cpu and use_default_selection:
        chosen = current_selection()
        if chosen is not None:
            gpus, num_processes = chosen.gpus, chosen.num_processes

    selected = _select_gpus(gpus, num_processes, inventory, cpu)
    if selected is None:
        assert num_processes is not None
        count = num_processes
    else:
        count = len(selected)

    simulated = selected is not None and inventory.synthetic
    chosen_backend = _choose_backend(backend, selected is not None and not simulated)
    world_size = count * nnodes
    ranks = []
    for local_rank in range(count):
        rank = node_rank * count + local_rank
        gpu = selected[local_rank] if selected is not None else None
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(count),
            "NODE_RANK": str(node_rank),
            "GROUP_RANK": str(node_rank),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            # CPU ranks on a GPU machine must not grab a GPU behind the user's back.
            "CUDA_VISIBLE_DEVICES": ",".join(str(g.index) for g in selected) if selected else "",
        }
        if mixed_precision is not None:
            env["ACCELERATE_MIXED_PRECISION"] = mixed_precision
        if selected is None or simulated:
            env["ACCELERATE_USE_CPU"] = "true"
        device = f"cuda:{local_rank}" if gpu is not None and not simulated else "cpu"
        ranks.append(RankSpec(rank, local_rank, world_size, count, node_rank,
                              device, gpu, env))
    return LaunchPlan(tuple(ranks), chosen_backend, master_addr, master_port, simulated)


def _select_gpus(gpus: GpuSpec, num_processes: int | None, inventory: Inventory,
                 cpu: bool) -> list[GpuInfo] | None:
    """The GPUs to use in rank order, or None for CPU ranks."""
    if cpu:
        if gpus is not None:
            raise LaunchConfigError("cpu=True runs CPU ranks; do not also pass gpus=.")
        if num_processes is None:
            raise LaunchConfigError("cpu=True needs num_processes= (how many CPU ranks to run).")
        return None
    visible = inventory.visible
    if gpus is None:
        if num_processes is None:
            if not visible:
                raise GpuSelectionError(
                    "No GPU is visible to this kernel"
                    + (f" ({inventory.note})" if inventory.note else "")
                    + ". Pass num_processes=N to run N CPU ranks with the gloo backend.")
            return list(visible)
        if not visible:
            return None  # N CPU ranks
        if num_processes > len(visible):
            raise GpuSelectionError(
                f"num_processes={num_processes} asks for more GPUs than the {len(visible)} visible "
                f"({_list_gpus(visible)}). Use num_processes<={len(visible)}, or cpu=True for CPU ranks.")
        return list(visible[:num_processes])

    tokens = _tokens(gpus)
    if tokens == ["all"]:
        if not visible:
            raise GpuSelectionError('gpus="all" but no GPU is visible to this kernel. '
                                    "Pass num_processes=N to run N CPU ranks instead.")
        selected = list(visible)
    else:
        if not tokens:
            raise GpuSelectionError("The GPU selection is empty. Name at least one GPU, e.g. gpus=\"0,1\".")
        selected = [_resolve(token, inventory) for token in tokens]
        seen: set[int] = set()
        duplicates = sorted({g.index for g in selected if g.index in seen or seen.add(g.index)})  # type: ignore[func-returns-value]
        if duplicates:
            raise GpuSelectionError(
                f"GPU {', '.join(map(str, duplicates))} is selected more than once; each GPU can "
                "hold one rank. Remove the repeated id(s).")
    if num_processes is not None and num_processes != len(selected):
        raise LaunchConfigError(
            f"gpus= selects {len(selected)} GPU(s) but num_processes={num_processes}. "
            "Pass only one of them, or make them agree.")
    return selected


def _tokens(gpus: str | int | Sequence[int | str]) -> list[str]:
    if isinstance(gpus, bool):
        raise GpuSelectionError(f"gpus={gpus!r} is not a GPU selection; use e.g. gpus=\"0,1\" or gpus=[0, 1].")
    if isinstance(gpus, int):
        return [str(gpus)]
    if isinstance(gpus, str):
        return [t.strip() for t in gpus.split(",") if t.strip()]
    return [str(t).strip() for t in gpus]


def _resolve(token: str, inventory: Inventory) -> GpuInfo:
    gpu = inventory.by_index(int(token)) if token.lstrip("-").isdigit() else inventory.by_uuid(token)
    if gpu is None:
        what = f"GPU {token}" if token.lstrip("-").isdigit() else f"GPU with UUID {token}"
        raise GpuSelectionError(
            f"{what} does not exist on this machine. "
            + (f"GPUs visible to this kernel: {_list_gpus(inventory.visible)}." if inventory.visible
               else "No GPU is visible to this kernel; pass num_processes=N for CPU ranks."))
    if not gpu.visible:
        raise GpuSelectionError(
            f"GPU {gpu.index} exists but is hidden from this kernel by its CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}. Visible: {_list_gpus(inventory.visible)}.")
    return gpu


def _list_gpus(gpus: Sequence[GpuInfo]) -> str:
    return ", ".join(f"{g.index} ({g.name})" for g in gpus) or "none"


def _choose_backend(backend: str | None, on_gpu: bool) -> str:
    if backend is None:
        return "nccl" if on_gpu else "gloo"
    if backend not in KNOWN_BACKENDS:
        raise LaunchConfigError(
            f"Unknown backend {backend!r}. Use one of {', '.join(KNOWN_BACKENDS)} "
            "(nccl for GPUs, gloo for CPU), or leave it unset to choose automatically.")
    if backend == "nccl" and not on_gpu:
        raise LaunchConfigError(
            "backend='nccl' needs GPUs, but this launch runs CPU ranks. "
            "Use backend='gloo' (or leave it unset), or select GPUs with gpus=.")
    return backend
