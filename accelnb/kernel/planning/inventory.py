"""What GPUs this machine has, read from NVML, never by initialising CUDA in the kernel.

``read_inventory()`` returns an :class:`Inventory`: one :class:`GpuInfo` per GPU, numbered as
``nvidia-smi`` numbers them (PCI bus order), with a flag for whether this kernel may use it
(``CUDA_VISIBLE_DEVICES`` of the kernel is respected). Without an NVIDIA driver the inventory is
empty and launches fall back to CPU ranks.

For tests and demos on machines without a GPU, a synthetic inventory can be switched on::

    ACCELNB_SYNTHETIC_GPUS=8 jupyter lab          # eight fake "Synthetic GPU" devices

or installed in code with ``set_inventory_source(lambda: synthetic_inventory(4))``. A synthetic
inventory is marked ``synthetic=True`` and every display says so.

GPUs are found by index or by UUID (:meth:`Inventory.by_uuid`); ``nvidia-smi``'s ``GPU-`` prefix
is optional, and the kernel's own ``CUDA_VISIBLE_DEVICES`` may name a GPU by a unique prefix of
its UUID, as CUDA allows. Both go through :func:`find_by_uuid`.

    >>> inv = synthetic_inventory(2)
    >>> [g.index for g in inv.gpus]
    [0, 1]

Module-level state: ``_injected_source``, the inventory installed in code; a process sees one
machine, so it has one source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

SYNTHETIC_ENV = "ACCELNB_SYNTHETIC_GPUS"


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU."""

    pid: int
    memory_used: int | None  # bytes; None when the driver does not say


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as ``nvidia-smi`` shows it."""

    index: int  # nvidia-smi index (PCI bus order)
    name: str
    uuid: str  # "GPU-…"
    pci_bus_id: str
    memory_total: int  # bytes
    memory_used: int  # bytes
    utilization: int | None = None  # percent
    processes: tuple[GpuProcess, ...] = ()
    power_w: float | None = None  # board power draw, watts; None where the driver does not say
    visible: bool = True  # usable by this kernel under its CUDA_VISIBLE_DEVICES


@dataclass(frozen=True)
class Inventory:
    """Every GPU of the machine, and where the list came from."""

    gpus: tuple[GpuInfo, ...] = ()
    synthetic: bool = False
    source: str = "nvml"  # "nvml", "none" (no driver), "synthetic"
    note: str = ""  # why it is empty, when it is

    @property
    def visible(self) -> tuple[GpuInfo, ...]:
        return tuple(g for g in self.gpus if g.visible)

    def by_index(self, index: int) -> GpuInfo | None:
        return next((g for g in self.gpus if g.index == index), None)

    def by_uuid(self, uuid: str) -> GpuInfo | None:
        """The GPU with this UUID (with or without the ``GPU-`` prefix, any case)."""
        return find_by_uuid(self.gpus, uuid)


def find_by_uuid(gpus: Iterable[GpuInfo], uuid: str, *, prefix: bool = False) -> GpuInfo | None:
    """The first of ``gpus`` whose UUID is ``uuid``, or with ``prefix`` starts with it.

    Case and nvidia-smi's ``GPU-`` prefix do not matter. ``prefix=True`` is CUDA's rule for
    ``CUDA_VISIBLE_DEVICES`` (a UUID may be shortened); an empty ``uuid`` matches nothing.
    """
    wanted = _bare_uuid(uuid)
    if not wanted:
        return None
    for gpu in gpus:
        bare = _bare_uuid(gpu.uuid)
        if bare == wanted or (prefix and bare.startswith(wanted)):
            return gpu
    return None


def _bare_uuid(uuid: str) -> str:
    return uuid.strip().lower().removeprefix("gpu-")


InventorySource = Callable[[], Inventory]
_injected_source: InventorySource | None = None


def synthetic_inventory(count: int, name: str = "Synthetic GPU (no hardware)") -> Inventory:
    """A made-up inventory of ``count`` identical 80 GB GPUs, for tests and demos."""
    gpus = tuple(
        GpuInfo(
            index=i,
            name=name,
            uuid=f"GPU-00000000-0000-4000-8000-{i:012d}",
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
            memory_total=80 * 2**30,
            memory_used=(i * 3 % 7) * 2**30,
            utilization=(i * 13) % 100,
            power_w=70.0 + (i * 37) % 230,
        )
        for i in range(count)
    )
    return Inventory(gpus=gpus, synthetic=True, source="synthetic")


def read_inventory() -> Inventory:
    """The current inventory: an injected source, else the synthetic switch, else NVML."""
    if _injected_source is not None:
        return _injected_source()
    synthetic = os.environ.get(SYNTHETIC_ENV, "").strip()
    if synthetic:
        try:
            return synthetic_inventory(int(synthetic))
        except ValueError:
            raise ValueError(
                f"{SYNTHETIC_ENV}={synthetic!r} is not a number of GPUs; set it to e.g. 4, "
                "or unset it to read the real GPUs."
            ) from None
    return _read_nvml()


def set_inventory_source(source: InventorySource | None) -> None:
    """Install (or with ``None`` remove) an inventory source for the rest of the session."""
    global _injected_source
    _injected_source = source


def _kernel_visible_filter(gpus: list[GpuInfo]) -> list[GpuInfo]:
    """Mark GPUs hidden from this kernel by its own CUDA_VISIBLE_DEVICES as not visible."""
    setting = os.environ.get("CUDA_VISIBLE_DEVICES")
    if setting is None:
        return gpus
    allowed: set[int] = set()
    for token in (t.strip() for t in setting.split(",") if t.strip()):
        if token.isdigit():
            allowed.add(int(token))
        else:
            match = find_by_uuid(gpus, token, prefix=True)
            if match is None:
                break  # CUDA stops at the first invalid entry; so do we
            allowed.add(match.index)
    return [replace(g, visible=g.index in allowed) for g in gpus]


def _read_nvml() -> Inventory:
    try:
        import pynvml
    except ImportError:
        return Inventory(source="none", note="nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return Inventory(source="none", note=f"no NVIDIA driver found ({error})")
    try:
        gpus = [_read_one(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    return Inventory(gpus=tuple(_kernel_visible_filter(gpus)), source="nvml")


def _read_one(pynvml: object, index: int) -> GpuInfo:
    nv = pynvml  # typed loosely: nvidia-ml-py ships no type hints
    handle = nv.nvmlDeviceGetHandleByIndex(index)  # type: ignore[attr-defined]
    memory = nv.nvmlDeviceGetMemoryInfo(handle)  # type: ignore[attr-defined]
    try:
        utilization: int | None = nv.nvmlDeviceGetUtilizationRates(handle).gpu  # type: ignore[attr-defined]
    except Exception:  # not supported on some GPUs (MIG, vGPU)
        utilization = None
    try:
        power_w: float | None = nv.nvmlDeviceGetPowerUsage(handle) / 1000.0  # type: ignore[attr-defined]
    except Exception:  # not supported on some boards and on MIG instances
        power_w = None
    processes: list[GpuProcess] = []
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            for proc in getattr(nv, getter)(handle):
                used = proc.usedGpuMemory if isinstance(proc.usedGpuMemory, int) else None
                processes.append(GpuProcess(pid=proc.pid, memory_used=used))
        except Exception:  # permission or support varies by driver
            pass
    name = nv.nvmlDeviceGetName(handle)  # type: ignore[attr-defined]
    uuid = nv.nvmlDeviceGetUUID(handle)  # type: ignore[attr-defined]
    bus = nv.nvmlDeviceGetPciInfo(handle).busId  # type: ignore[attr-defined]
    return GpuInfo(
        index=index,
        name=name.decode() if isinstance(name, bytes) else name,
        uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
        pci_bus_id=bus.decode() if isinstance(bus, bytes) else bus,
        memory_total=int(memory.total),
        memory_used=int(memory.used),
        utilization=utilization,
        processes=tuple(processes),
        power_w=power_w,
    )
