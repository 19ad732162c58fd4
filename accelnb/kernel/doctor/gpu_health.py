"""The GPU facts the doctor judges, read from NVML, or given by a test.

:class:`GpuFacts` is plain data: the driver, each GPU's MIG mode, ECC errors and processes, and
whether each pair of selected GPUs can talk peer to peer. :func:`read_gpu_facts` fills it from
NVML without initialising CUDA; on a machine with no NVIDIA driver it says so and returns at
once. Tests construct ``GpuFacts`` themselves (a GPU held by another process, a pair without P2P).

    >>> GpuFacts(driver=None, note="no NVIDIA driver").gpus
    ()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

NvmlCall = Callable[..., Any]  # nvidia-ml-py ships no type hints: every call goes through one


@dataclass(frozen=True)
class GpuHealth:
    """One GPU as the doctor sees it (nvidia-smi numbering)."""

    index: int
    name: str
    mig_enabled: bool | None = None  # None: the driver does not say (not a MIG-capable GPU)
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors; None: ECC off or unknown
    process_pids: tuple[int, ...] = ()  # processes holding memory on it now


@dataclass(frozen=True)
class GpuFacts:
    """The driver and the selected GPUs; ``driver`` is None where there is no NVIDIA driver."""

    driver: str | None
    note: str = ""  # why there are no GPUs, when there are none
    gpus: tuple[GpuHealth, ...] = ()
    peer_to_peer: dict[tuple[int, int], bool] = field(default_factory=dict)  # (i, j), i < j


def read_gpu_facts(selected: Sequence[int] | None) -> GpuFacts:
    """Read the driver and the ``selected`` GPUs (all of them for None) from NVML."""
    try:
        import pynvml
    except ImportError:
        return GpuFacts(driver=None, note="nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return GpuFacts(driver=None, note=f"no NVIDIA driver found ({error})")
    try:
        return _read_with_nvml(pynvml, selected)
    finally:
        pynvml.nvmlShutdown()


def _read_with_nvml(nv: Any, selected: Sequence[int] | None) -> GpuFacts:
    def call(name: str, *args: object) -> Any:
        return getattr(nv, name)(*args)

    driver = call("nvmlSystemGetDriverVersion")
    count = int(call("nvmlDeviceGetCount"))
    indices = [i for i in (range(count) if selected is None else selected) if 0 <= i < count]
    handles = {i: call("nvmlDeviceGetHandleByIndex", i) for i in indices}
    gpus = tuple(_read_health(call, i, handle) for i, handle in handles.items())
    p2p: dict[tuple[int, int], bool] = {}
    for a in indices:
        for b in indices:
            if a < b:
                try:
                    status = call("nvmlDeviceGetP2PStatus", handles[a], handles[b],
                                  nv.NVML_P2P_CAPS_INDEX_READ)
                    p2p[(a, b)] = status == nv.NVML_P2P_STATUS_OK
                except Exception:  # not supported by this driver: say nothing rather than guess
                    pass
    return GpuFacts(driver=driver.decode() if isinstance(driver, bytes) else str(driver),
                    gpus=gpus, peer_to_peer=p2p)


def _read_health(nvml: NvmlCall, index: int, handle: object) -> GpuHealth:
    name = nvml("nvmlDeviceGetName", handle)
    mig: bool | None
    try:
        current, _pending = nvml("nvmlDeviceGetMigMode", handle)
        mig = bool(current)
    except Exception:
        mig = None
    ecc: int | None
    try:
        ecc = int(nvml("nvmlDeviceGetTotalEccErrors", handle, 0, 0))  # 0, 0: uncorrected, volatile
    except Exception:
        ecc = None
    pids: list[int] = []
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            pids += [proc.pid for proc in nvml(getter, handle)]
        except Exception:  # permission or support varies by driver
            pass
    return GpuHealth(index=index, name=name.decode() if isinstance(name, bytes) else str(name),
                     mig_enabled=mig, ecc_uncorrected=ecc, process_pids=tuple(dict.fromkeys(pids)))
