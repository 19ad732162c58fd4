"""What the GPUs panel adds to the inventory (accelnb.notebook.gpu_watch): a minute of utilisation,
named processes (real ones, read from /proc), and the busy mark on a selected GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest

from accelnb.kernel.planning.inventory import GpuProcess, Inventory, synthetic_inventory
from accelnb.notebook.gpu_watch import UtilizationHistory, gpu_rows, kernel_pids, name_process


def with_utilization(*values: int | None) -> Inventory:
    inventory = synthetic_inventory(len(values))
    gpus = tuple(replace(gpu, utilization=value) for gpu, value in zip(inventory.gpus, values, strict=True))
    return replace(inventory, gpus=gpus)


def test_the_history_keeps_the_last_minute_oldest_first() -> None:
    history = UtilizationHistory(span_s=60)
    for second, value in [(0, 10), (30, 20), (61, 30), (62, 40)]:
        history.add(with_utilization(value, None), now=float(second))
    assert history.series(0, now=62.0) == [[32.0, 20], [1.0, 30], [0.0, 40]]  # the reading at 0 s is gone
    assert history.series(1, now=62.0) == []  # no utilisation figure, no history
    assert history.series(7, now=62.0) == []  # no such GPU


def test_readings_closer_than_the_gap_count_once() -> None:
    history = UtilizationHistory(min_gap_s=1.0)
    history.add(with_utilization(10), now=5.0)
    history.add(with_utilization(90), now=5.4)  # a second panel's read, right after the first
    history.add(with_utilization(30), now=6.0)
    assert history.series(0, now=6.0) == [[1.0, 10], [0.0, 30]]


@pytest.fixture
def other_process() -> Iterator[int]:
    """A process that is not this one's child: started by a shell that exits at once."""
    script = "import time; time.sleep(60)"
    started = subprocess.run(f"{sys.executable} -c '{script}' >/dev/null 2>&1 & echo $!", shell=True,
                             capture_output=True, text=True, check=True)
    pid = int(started.stdout)
    yield pid
    os.kill(pid, 9)


def test_a_process_is_named_by_its_program_and_owner(other_process: int) -> None:
    named = name_process(other_process)
    assert named.name == os.path.basename(sys.executable)  # `python -c ...`: no script to name
    assert named.user and named.user != str(os.getuid())  # a login name
    assert name_process(2**22 + 12345).name == ""  # not on this machine (another container's pid)


def test_this_kernels_processes_are_its_own_and_its_descendants(other_process: int) -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as child:
        try:
            ours = kernel_pids()
            assert {os.getpid(), child.pid} <= ours
            assert other_process not in ours
        finally:
            child.kill()


def test_a_selected_gpu_held_by_another_process_is_busy(other_process: int) -> None:
    inventory = synthetic_inventory(3)
    held = (GpuProcess(other_process, 5 * 2**30), GpuProcess(os.getpid(), 2**30))
    gpus = list(inventory.gpus)
    gpus[1] = replace(gpus[1], processes=held)
    gpus[2] = replace(gpus[2], processes=(GpuProcess(os.getpid(), 2**30),), utilization=97)
    inventory = replace(inventory, gpus=tuple(gpus))
    rows = gpu_rows(inventory, UtilizationHistory(), ours={os.getpid()}, selected=[1, 2], now=0.0)
    python = os.path.basename(sys.executable)
    assert rows[1]["busy"] == f"busy: held by {python} (pid {other_process})"
    assert rows[2]["busy"] == ""  # our own process, however busy
    assert [p["ours"] for p in rows[1]["processes"]] == [False, True]
    assert rows[1]["processes"][0]["memory_used"] == 5 * 2**30
    unselected = gpu_rows(inventory, UtilizationHistory(), ours={os.getpid()}, selected=[0], now=0.0)
    assert [row["busy"] for row in unselected] == ["", "", ""]  # marked only where it matters: chosen


def test_a_busy_gpu_with_no_process_listed_is_busy_by_its_utilisation() -> None:
    inventory = with_utilization(97, 20)  # a process in another container: NVML lists none here
    rows = gpu_rows(inventory, UtilizationHistory(), ours=set(), selected=[0, 1], now=0.0)
    assert rows[0]["busy"] == "busy: 97% utilised by a process not visible here"
    assert rows[1]["busy"] == ""


def test_this_kernels_ranks_are_named_by_rank(other_process: int) -> None:
    inventory = synthetic_inventory(1)
    inventory = replace(inventory, gpus=(replace(inventory.gpus[0], processes=(
        GpuProcess(os.getpid(), 2**30), GpuProcess(other_process, 2**30))),))
    rows = gpu_rows(inventory, UtilizationHistory(), ours={os.getpid()}, selected=None, now=0.0,
                    known={os.getpid(): "rank 0"})
    assert [(p["name"], p["ours"]) for p in rows[0]["processes"]] == [
        ("rank 0", True), (os.path.basename(sys.executable), False)]
