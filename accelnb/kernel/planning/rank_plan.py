"""Pure planning: a device selection and a GPU inventory in, one spec per rank out.

Nothing here starts a process, opens NVML, touches CUDA or reads notebook state (the picker's
default selection is resolved by :mod:`accelnb.launcher` before it calls in), so every rule about
device mapping is testable on a machine without a GPU::

    >>> from accelnb.kernel.planning.inventory import synthetic_inventory
    >>> p = plan(gpus="3,4,5,7", inventory=synthetic_inventory(8))
    >>> [(r.rank, r.device, r.gpu.index) for r in p.ranks]
    [(0, 'cpu', 3), (1, 'cpu', 4), (2, 'cpu', 5), (3, 'cpu', 7)]
    >>> p.ranks[0].env["CUDA_VISIBLE_DEVICES"]
    '3,4,5,7'
    >>> [r.env["CUDA_VISIBLE_DEVICES"] for r in plan(gpus="all", gpus_per_rank=4,
    ...                                             inventory=synthetic_inventory(8)).ranks]
    ['0,1,2,3', '4,5,6,7']

The rules:

- GPUs are named as ``nvidia-smi`` names them (index or UUID); workers get
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA numbers them the same way.
- One GPU per rank (the default): every worker sees the selected GPUs in selection order
  (``CUDA_VISIBLE_DEVICES``), and local rank *i* uses ``cuda:i``; so ``cuda:{LOCAL_RANK}``,
  ``rank % device_count()`` and ``Accelerator()`` all land on the right card.
- Several GPUs per rank (``gpus_per_rank=k``, for a model spread over GPUs with
  ``device_map="auto"``, or pipeline stages inside data parallelism): the selection is cut into
  consecutive groups of *k*, and each rank sees only its own group (``CUDA_VISIBLE_DEVICES``), in
  selection order, as ``cuda:0`` … ``cuda:k-1``. Seeing only its own GPUs is what makes a rank
  safe: ``device_map="auto"`` spreads a model over every GPU the process can see, so a shared
  list would put rank 1's layers on rank 0's cards. Each rank's own device (the one the worker
  makes current and binds its process group to) is ``cuda:{LOCAL_RANK % k}``: exactly what
  ``Accelerator()`` (``local_process_index % device_count()``) and ``rank % device_count()``
  compute, so those idioms and the process group agree on one card of the rank's own.
  ``cuda:{LOCAL_RANK}`` agrees too while there are no more ranks than *k* (2 ranks × 2 GPUs,
  2 × 4); beyond that it names a device the rank cannot see, and CUDA refuses it ("invalid device
  ordinal"): never another rank's GPU. Code written for several GPUs per process usually asks
  ``torch.cuda.current_device()`` or lets ``device_map`` place everything.
- The device is decided here, once: ``"cuda:N"`` or ``"cpu"``. A synthetic inventory (tests,
  demos) plans GPU ranks that run on the CPU with gloo. Each rank finds its device in
  ``ACCELNB_DEVICE`` (what ``%%distributed`` calls ``device``), so no worker re-derives it.
- One machine: ranks rendezvous on 127.0.0.1. There are no ``nnodes``/``node_rank`` inputs:
  nothing launched them, and the multi-node backend to come (Ray, issue 14) learns each node's
  ranks and rank 0's address from its placement group at run time, so it needs a planner input of
  that shape (the placement), not a static node index.

Inputs are checked value by value by :class:`accelnb.options.LaunchOptions` before they get
here; this module checks them against the inventory (does GPU 5 exist, is it visible, is it
selected twice, are there that many GPUs, does nccl have GPUs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from accelnb.errors import GpuSelectionError, LaunchConfigError
from accelnb.kernel.planning.inventory import GpuInfo, Inventory
from accelnb.kernel.planning.rank_environment import RankOptions, RankPlace, rank_environment
from accelnb.wire.spec import LOOPBACK, MAX_LOCAL_RANKS

GpuSpec = str | int | Sequence[int | str] | None


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
    # Its environment as planned, built by rank_environment (the attempt and thread budget are
    # added when it starts).
    env: Mapping[str, str] = field(default_factory=dict)
    # Every GPU this rank owns, in the order it sees them (cuda:0, cuda:1, …); () for CPU ranks.
    # With one GPU per rank, ``(gpu,)``: the rank sees the other ranks' GPUs too, but owns one.
    gpus: tuple[GpuInfo, ...] = ()
    visible_gpus: tuple[str, ...] = ()  # what its CUDA_VISIBLE_DEVICES lists, in the order it sees them
    interface: str | None = None  # the network interface of its node (cluster ranks); None: this machine

    def describe(self, simulated: bool = False) -> str:
        """One line for a rank with one GPU; a rank with several lists each under its first line."""
        if self.gpu is None:
            return f"rank {self.rank} → cpu"
        if len(self.gpus) <= 1:
            where = "cpu, simulating " if simulated else f"{self.device} → "
            return f"rank {self.rank} → {where}GPU {_gpu_line(self.gpu)}"
        indices = ",".join(str(g.index) for g in self.gpus)
        first = (f"rank {self.rank} → cpu, simulating GPUs {indices}" if simulated else
                 f"rank {self.rank} → GPUs {indices} as cuda:0-{len(self.gpus) - 1}, its device {self.device}")
        return "\n".join([first] + [f"    cuda:{n} → GPU {_gpu_line(g)}" for n, g in enumerate(self.gpus)])


    def summary(self, simulated: bool = False) -> str:
        """One line, whatever it owns: rank → cuda:N → GPU index and name (no UUID, no bus id)."""
        if self.gpu is None:
            return f"rank {self.rank} → cpu"
        gpus = self.gpus or (self.gpu,)
        names = ", ".join(dict.fromkeys(g.name for g in gpus))
        if len(gpus) == 1:
            where = "cpu, simulating" if simulated else f"{self.device} →"
            return f"rank {self.rank} → {where} GPU {self.gpu.index} ({names})"
        indices = ",".join(str(g.index) for g in gpus)
        if simulated:
            return f"rank {self.rank} → cpu, simulating GPUs {indices} ({names})"
        return f"rank {self.rank} → cuda:0-{len(gpus) - 1} → GPUs {indices} ({names}), its device {self.device}"


def _gpu_line(gpu: GpuInfo) -> str:
    return f"{gpu.index} ({gpu.name}, {gpu.uuid}, bus {gpu.pci_bus_id})"


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks of one launch, and how they find each other."""

    ranks: tuple[RankSpec, ...]
    backend: str
    master_addr: str = LOOPBACK
    master_port: int = 0  # 0 until the launcher binds a free one
    simulated_gpus: bool = False  # GPUs come from a synthetic inventory; ranks run on CPU
    notes: tuple[str, ...] = ()  # lines the table shows under its header (where options came from)
    options: RankOptions = field(default_factory=RankOptions)  # what the launch's options put in every rank

    @property
    def world_size(self) -> int:
        return self.ranks[0].world_size

    def with_port(self, port: int) -> LaunchPlan:
        return replace(self, master_port=port).with_environments()

    def with_options(self, options: RankOptions, notes: Sequence[str] = ()) -> LaunchPlan:
        """This plan with ``options`` in every rank's environment and ``notes`` in its table: how a
        launch applies its settled options to the ranks a planner placed."""
        return replace(self, options=options, notes=self.notes + tuple(notes)).with_environments()

    def with_environments(self) -> LaunchPlan:
        """Every rank's ``env`` built from this plan by :func:`rank_environment` (how a planner
        finishes a plan, and how a new port or new options reach every rank)."""
        return replace(self, ranks=tuple(replace(r, env=rank_environment(self.options, self.place(r)))
                                         for r in self.ranks))

    def place(self, rank: RankSpec, *, restart_count: int | None = None, threads: int | None = None) -> RankPlace:
        """Where ``rank`` runs in this plan; with ``restart_count`` and ``threads``, as it starts."""
        return RankPlace(rank=rank.rank, local_rank=rank.local_rank, world_size=rank.world_size,
                         local_world_size=rank.local_world_size, node_rank=rank.node_rank, device=rank.device,
                         visible_gpus=rank.visible_gpus, gpus_owned=len(rank.gpus), master_addr=self.master_addr,
                         master_port=self.master_port, interface=rank.interface, restart_count=restart_count,
                         threads=threads)

    def table(self, pids: Sequence[int] | None = None) -> str:
        """The rank → device mapping in full (with each rank's pid): every GPU's UUID and PCI bus
        id, which tell GPUs apart where indices do not (another machine, a container)."""
        lines = self._header()
        for n, rank in enumerate(self.ranks):
            first, *more = rank.describe(self.simulated_gpus).split("\n")
            lines.append(f"  {first}" + (f"  (pid {pids[n]})" if pids is not None else ""))
            lines.extend("  " + line for line in more)
        return "\n".join(lines)

    def summary(self, pids: Sequence[int] | None = None) -> str:
        """What the cell shows as the run starts: one line per rank (rank → cuda:N → GPU index and
        name, its pid); :meth:`table` has the UUIDs and bus ids."""
        return "\n".join(self._header() + [
            f"  {rank.summary(self.simulated_gpus)}" + (f"  (pid {pids[n]})" if pids is not None else "")
            for n, rank in enumerate(self.ranks)])

    @property
    def on_gpus(self) -> bool:
        """Whether any rank owns a GPU (a simulated one included)."""
        return any(rank.gpu is not None for rank in self.ranks)

    def _header(self) -> list[str]:
        header = f"accelnb: {len(self.ranks)} rank(s), backend {self.backend}"
        if self.simulated_gpus:
            header += " (synthetic GPU inventory: ranks run on the CPU)"
        return [header] + ["  " + note for note in self.notes]


def plan(
    gpus: GpuSpec = None,
    num_processes: int | None = None,
    *,
    inventory: Inventory,
    cpu: bool = False,
    backend: str | None = None,
    gpus_per_rank: int = 1,
) -> LaunchPlan:
    """Plan the ranks of this machine. Raises :class:`GpuSelectionError` or
    :class:`LaunchConfigError` when the selection does not fit ``inventory``.

    ``cpu=True`` needs ``num_processes`` (``LaunchOptions`` refuses it without). With
    ``gpus_per_rank=k``, ``num_processes`` counts ranks, each of *k* GPUs. The options that do not
    place ranks join every rank's environment by :meth:`LaunchPlan.with_options`.
    """
    selected = _select_gpus(gpus, num_processes, inventory, cpu, gpus_per_rank)
    simulated = selected is not None and inventory.synthetic
    on_gpus = selected is not None and not simulated
    count = len(selected) // gpus_per_rank if selected is not None else num_processes
    assert count is not None, "cpu ranks need num_processes (checked by LaunchOptions)"
    if count > MAX_LOCAL_RANKS:
        raise LaunchConfigError(
            f"{count} ranks on this machine: accelnb starts at most {MAX_LOCAL_RANKS} ranks on one machine (the "
            f"channels of a launch's ranks reach its helper process in one message). Ask for at most "
            f"{MAX_LOCAL_RANKS}, or spread the ranks over several machines with cluster=\"ray\".")
    ranks = tuple(_rank_spec(local_rank, count, selected, on_gpus, gpus_per_rank) for local_rank in range(count))
    return LaunchPlan(ranks, _choose_backend(backend, on_gpus), simulated_gpus=simulated).with_environments()


def _rank_spec(local_rank: int, count: int, selected: Sequence[GpuInfo] | None, on_gpus: bool,
               gpus_per_rank: int) -> RankSpec:
    if gpus_per_rank == 1:
        # Today's layout, kept exactly: every rank sees the whole selection and owns one card.
        own = tuple(selected[local_rank:local_rank + 1]) if selected else ()
        visible = selected or ()
        device = f"cuda:{local_rank}" if on_gpus else "cpu"
    else:
        assert selected is not None, "several GPUs per rank need GPUs (checked by _select_gpus)"
        own = tuple(selected[local_rank * gpus_per_rank:(local_rank + 1) * gpus_per_rank])
        visible = own
        device = f"cuda:{local_rank % gpus_per_rank}" if on_gpus else "cpu"  # see the module docstring
    gpu = own[local_rank % gpus_per_rank] if own else None
    # One machine: the global rank is the local rank, and its environment is built with the plan's.
    return RankSpec(local_rank, local_rank, count, count, 0, device, gpu, gpus=own,
                    visible_gpus=tuple(str(g.index) for g in visible))


def _select_gpus(gpus: GpuSpec, num_processes: int | None, inventory: Inventory,
                 cpu: bool, gpus_per_rank: int) -> list[GpuInfo] | None:
    """The GPUs to use in rank order, or None for CPU ranks."""
    if cpu:
        if gpus_per_rank > 1:
            raise LaunchConfigError(f"cpu=True runs CPU ranks, which own no GPU; gpus_per_rank={gpus_per_rank} "
                                    "needs GPUs. Remove one of them.")
        return None
    if gpus is None:
        selected = _default_gpus(num_processes, inventory, gpus_per_rank)
    else:
        selected = _named_gpus(gpus, inventory)
        if num_processes is not None and num_processes * gpus_per_rank != len(selected):
            per_rank = f" × gpus_per_rank={gpus_per_rank}" if gpus_per_rank > 1 else ""
            raise LaunchConfigError(
                f"gpus= selects {len(selected)} GPU(s) but num_processes={num_processes}{per_rank}. "
                "Pass only one of them, or make them agree.")
    if selected is not None and len(selected) % gpus_per_rank:
        raise LaunchConfigError(
            f"gpus_per_rank={gpus_per_rank} cannot divide the {len(selected)} selected GPU(s) "
            f"({', '.join(str(g.index) for g in selected)}) into whole ranks. Select a multiple of "
            f"{gpus_per_rank} GPUs, or a gpus_per_rank that divides {len(selected)}.")
    return selected


def _default_gpus(num_processes: int | None, inventory: Inventory, gpus_per_rank: int) -> list[GpuInfo] | None:
    """Without gpus=: every visible GPU, the first ``num_processes`` ranks' worth of them, or CPU ranks."""
    visible = inventory.visible
    if num_processes is None:
        if not visible:
            raise GpuSelectionError(
                "No GPU is visible to this kernel"
                + (f" ({inventory.note})" if inventory.note else "")
                + ". Pass num_processes=N to run N CPU ranks with the gloo backend.")
        return list(visible)
    if not visible:
        if gpus_per_rank > 1:
            raise GpuSelectionError(
                f"gpus_per_rank={gpus_per_rank} needs GPUs, but no GPU is visible to this kernel"
                + (f" ({inventory.note})" if inventory.note else "")
                + ". Leave gpus_per_rank unset to run num_processes CPU ranks.")
        return None  # N CPU ranks
    wanted = num_processes * gpus_per_rank
    if wanted > len(visible):
        per_rank = f" × gpus_per_rank={gpus_per_rank}" if gpus_per_rank > 1 else ""
        raise GpuSelectionError(
            f"num_processes={num_processes}{per_rank} asks for more GPUs than the {len(visible)} visible "
            f"({_list_gpus(visible)}). Use num_processes<={len(visible) // gpus_per_rank}, or cpu=True "
            "for CPU ranks.")
    return list(visible[:wanted])


def _named_gpus(gpus: str | int | Sequence[int | str], inventory: Inventory) -> list[GpuInfo]:
    tokens = _tokens(gpus)
    if tokens == ["all"]:
        if not inventory.visible:
            raise GpuSelectionError('gpus="all" but no GPU is visible to this kernel. '
                                    "Pass num_processes=N to run N CPU ranks instead.")
        return list(inventory.visible)
    if not tokens:
        raise GpuSelectionError("The GPU selection is empty. Name at least one GPU, e.g. gpus=\"0,1\".")
    selected = [_resolve(token, inventory) for token in tokens]
    repeated = sorted(index for index, times in Counter(g.index for g in selected).items() if times > 1)
    if repeated:
        raise GpuSelectionError(
            f"GPU {', '.join(map(str, repeated))} is selected more than once; each GPU can "
            "hold one rank. Remove the repeated id(s).")
    return selected


def _tokens(gpus: str | int | Sequence[int | str]) -> list[str]:
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
            f"GPU {gpu.index} exists but is hidden from this kernel by its CUDA_VISIBLE_DEVICES. "
            f"Visible: {_list_gpus(inventory.visible)}. Select one of those, or restart the kernel "
            "without CUDA_VISIBLE_DEVICES to use every GPU.")
    return gpu


def _list_gpus(gpus: Sequence[GpuInfo]) -> str:
    return ", ".join(f"{g.index} ({g.name})" for g in gpus) or "none"


def _choose_backend(backend: str | None, on_gpu: bool) -> str:
    if backend is None:
        return "nccl" if on_gpu else "gloo"
    if backend == "nccl" and not on_gpu:
        raise LaunchConfigError(
            "backend='nccl' needs GPUs, but this launch runs CPU ranks. "
            "Use backend='gloo' (or leave it unset), or select GPUs with gpus=.")
    return backend
