"""Helpers of the GPU tier: real CUDA on whatever GPUs this machine has (`pytest -m gpu`, `make test-gpu`).

Every module here marks its tests ``gpu`` and asks for the GPUs it needs with :func:`needs_gpus`:
without CUDA, or with fewer GPUs than a test needs, the test is skipped and the reason says how
many GPUs it needs and how many there are (a skip is reported as a skip, never as a pass). The
physical truth the tests compare against is ``nvidia-smi`` and NVML, never accelnb's own inventory.

    @needs_gpus(2)
    def test_something_on_two_gpus() -> None: ...
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

SYNTHETIC = os.environ.get("ACCELNB_SYNTHETIC_GPUS", "").strip()


def cuda_gpu_count() -> int:
    """The GPUs CUDA sees in this process (0 without a CUDA build of torch or a driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip unless CUDA sees at least ``count`` GPUs and accelnb plans on the real ones."""
    have = cuda_gpu_count()
    if SYNTHETIC:
        return pytest.mark.skip(reason=f"needs {count} real GPU(s): ACCELNB_SYNTHETIC_GPUS={SYNTHETIC} makes "
                                       "accelnb plan on a synthetic inventory")
    return pytest.mark.skipif(have < count, reason=f"needs {count} CUDA GPU(s), this machine has {have}")


@dataclass(frozen=True)
class SmiGpu:
    """One GPU as ``nvidia-smi`` lists it."""

    index: int
    uuid: str  # "GPU-…"
    memory_total_mib: int


def nvidia_smi_gpus() -> list[SmiGpu]:
    """``nvidia-smi --query-gpu=index,uuid,memory.total``: every GPU of the machine, whatever this
    process's CUDA_VISIBLE_DEVICES says."""
    assert shutil.which("nvidia-smi"), "nvidia-smi is not on PATH"
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    rows = [[part.strip() for part in line.split(",")] for line in out.strip().splitlines()]
    return [SmiGpu(int(index), uuid, int(total)) for index, uuid, total in rows]


def bare_uuid(uuid: str) -> str:
    """A UUID as torch and nvidia-smi both can spell it: lower case, without ``GPU-``."""
    return str(uuid).strip().lower().removeprefix("gpu-")


def memory_used(index: int) -> int:
    """Bytes in use on GPU ``index`` (nvidia-smi numbering), read from NVML now."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    finally:
        pynvml.nvmlShutdown()


def seconds_until(condition: Callable[[], bool], bound_s: float, what: str) -> float:
    """Seconds until ``condition()`` holds (polled every 20 ms); fails the test past ``bound_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > bound_s:
            raise AssertionError(f"{what}: not within {bound_s} s")
        time.sleep(0.02)
    return time.monotonic() - start


@dataclass
class StopWhenMarked:
    """A launch's wait hook that presses the notebook's Stop (SIGINT to this process, as Jupyter
    sends the kernel) once ``marker`` exists: a rank writes it when it holds what the test
    wants to see freed. ``pressed_at`` is when (``time.monotonic()``)."""

    marker: Path
    pressed_at: list[float] = field(default_factory=list)

    def __call__(self) -> None:
        if not self.pressed_at and self.marker.exists():
            self.pressed_at.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)


@dataclass(frozen=True)
class KernelCell:
    """What one cell of a real Jupyter kernel showed."""

    stdout: str
    stderr: str
    errors: list[str]  # "Name: message" of each error output
    displays: list[dict[str, str]]  # the data of each display and its updates, in order


def run_in_a_kernel(cells: list[str], timeout: float = 300, **env: str | None) -> list[KernelCell]:
    """Run ``cells`` one after another in a fresh real kernel (this working tree's accelnb, ``env``
    set or, with None, removed); what each showed."""
    from tests.conftest import cell_messages, start_repo_kernel

    manager, client = start_repo_kernel(**env)
    try:
        shown = []
        for code in cells:
            messages = cell_messages(client, client.execute(code), timeout=timeout)
            streams = [m["content"] for m in messages if m["msg_type"] == "stream"]
            shown.append(KernelCell(
                "".join(s["text"] for s in streams if s["name"] == "stdout"),
                "".join(s["text"] for s in streams if s["name"] == "stderr"),
                [f"{m['content']['ename']}: {m['content']['evalue']}" for m in messages if m["msg_type"] == "error"],
                [m["content"]["data"] for m in messages if m["msg_type"] in ("display_data", "update_display_data")]))
        return shown
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
