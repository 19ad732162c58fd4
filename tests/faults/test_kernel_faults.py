"""Faults 7 and 8, in a real Jupyter kernel: the stop button, and the kernel process killed.

7. ``interrupt_kernel()`` (SIGINT to the kernel's process group, as Jupyter's stop button) while
   the ranks hang: the cell ends with RunInterrupted (a KeyboardInterrupt) and every pid is gone within 3 s, also
   when a rank ignores SIGTERM and SIGINT; the next launch in the same kernel works.
8. SIGKILL to the kernel while the ranks run: the helper and every worker are gone within 5 s,
   nothing listens on the rendezvous port; the next launch in the restarted kernel works.

And a Ctrl-C after each call into C of a session's ``%%distributed`` cell, in a kernel whose
first cell imported torch, tqdm.auto, transformers and accelnb: the session and its ranks stay,
and the next cell runs a collective on both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faultkit import RunWatcher, listens_of_its_own, ports_left_listening, wait_for_report, wait_gone
from kernel_driver import NotebookKernel

INTERRUPT_BOUND_S = 3.0
KERNEL_DEATH_BOUND_S = 5.0

SETUP_CELL = """
import accelnb
from accelnb.kernel.helper.template import shared_helper
import faultkit
from faultkit import fault_target, ok_target
print(shared_helper().pid)
"""
HELD_AHEAD_CELL = "import json; print(json.dumps(sorted(faultkit.ports_held_ahead())))"
NEXT_LAUNCH_CELL = "print(sorted(accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values.items()))"


def prepare(kernel: NotebookKernel) -> None:
    kernel.extra["helper_pid"] = int(kernel.value(SETUP_CELL))
    assert kernel.value(NEXT_LAUNCH_CELL) == "[(0, 2.0), (1, 2.0)]"  # warm


@pytest.fixture(scope="module")
def kernel() -> Iterator[NotebookKernel]:
    kernel = NotebookKernel.start()
    try:
        prepare(kernel)
        yield kernel
    finally:
        kernel.shutdown()


def launch_cell(fault: str, rank: int, phase: str, report_dir: Path) -> str:
    return (f"accelnb.launch(fault_target, ({fault!r}, {rank}, {phase!r}, {str(report_dir)!r}), "
            "num_processes=2, cpu=True)")


def wait_until_faulted(report_dir: Path, fault: str, rank: int) -> None:
    wait_for_report(str(report_dir), rank, "armed_at" if fault == "ignore_sigterm" else "fault_at")
    wait_for_report(str(report_dir), 1 - rank, "collective_at")  # the other rank waits in all_reduce


def assert_ports_free(watcher: RunWatcher, ours: set[int], held_ahead: set[int]) -> None:
    assert watcher.ports, "no rendezvous port was seen"
    left = ports_left_listening(watcher, ours, held_ahead)
    assert not left, (f"ports still listening: {left}; first seen as "
                      f"{ {port: watcher.seen_on.get(port) for port in left} }; held for the next launch: {held_ahead}")


@pytest.mark.parametrize(("fault", "rank", "phase"), [
    pytest.param("hang_python", 0, "before", id="rank0-sleeping-before"),
    pytest.param("hang_collective", 1, "after", id="rank1-in-collective-after"),
    pytest.param("ignore_sigterm", 0, "after", id="rank0-ignores-sigterm-and-sigint"),
])
def test_kernel_interrupt(kernel: NotebookKernel, fault: str, rank: int, phase: str, tmp_path: Path,
                          fault_record: dict[str, Any]) -> None:
    helper_pid = kernel.extra["helper_pid"]
    with RunWatcher(helper_pid, tmp_path) as watcher:
        msg_id = kernel.submit(launch_cell(fault, rank, phase, tmp_path))
        wait_until_faulted(tmp_path, fault, rank)
        interrupted = time.time()
        kernel.km.interrupt_kernel()
        cell = kernel.collect(msg_id, timeout=30)
    printed = {int(p) for p in re.findall(r"\(pid (\d+)\)", cell.stdout)}
    gone = wait_gone(watcher.processes(printed), 10)
    cleanup = None if gone is None else gone - interrupted
    error = cell.error or {}
    fault_record.update(fault="kernel_interrupt", label=fault, rank=rank, phase=phase,
                        raised=error.get("ename", "(nothing raised)"),
                        first_line=error.get("evalue", "").splitlines()[0] if error.get("evalue") else "",
                        cleanup_s=cleanup, bound_s=INTERRUPT_BOUND_S, measured_from="interrupt")

    assert cell.finished, cell.seen
    assert error.get("ename") == "RunInterrupted", cell.seen  # accelnb's KeyboardInterrupt, one line
    assert "accelnb stopped the run: every worker was ended on the interrupt" in error["evalue"]
    assert printed == set(watcher.fact("pid")) and len(printed) == 2
    assert cleanup is not None and cleanup <= INTERRUPT_BOUND_S, f"cleanup {cleanup} s"
    held_ahead = set(json.loads(kernel.value(HELD_AHEAD_CELL)))
    assert_ports_free(watcher, watcher.pids | {helper_pid, kernel.pid}, held_ahead)
    assert not listens_of_its_own(helper_pid, kernel.pid)
    assert kernel.value(NEXT_LAUNCH_CELL) == "[(0, 2.0), (1, 2.0)]"


@pytest.mark.parametrize(("fault", "rank", "phase"), [
    pytest.param("hang_python", 0, "before", id="rank0-sleeping-before"),
    pytest.param("hang_collective", 1, "after", id="rank1-in-collective-after"),
])
def test_kernel_killed(kernel: NotebookKernel, fault: str, rank: int, phase: str, tmp_path: Path,
                       fault_record: dict[str, Any]) -> None:
    helper_pid = kernel.extra["helper_pid"]
    with RunWatcher(helper_pid, tmp_path) as watcher:
        kernel.submit(launch_cell(fault, rank, phase, tmp_path))
        wait_until_faulted(tmp_path, fault, rank)
        killed = time.time()
        os.kill(kernel.pid, signal.SIGKILL)
        gone = wait_gone(watcher.processes({helper_pid, kernel.pid}), 10)
    cleanup = None if gone is None else gone - killed
    fault_record.update(fault="kernel_killed", label=fault, rank=rank, phase=phase,
                        raised="(kernel died: Jupyter restarts it)", first_line="",
                        cleanup_s=cleanup, bound_s=KERNEL_DEATH_BOUND_S, measured_from="kernel SIGKILL")

    assert len(watcher.fact("pid")) == 2 and watcher.pids >= set(watcher.fact("pid"))
    assert cleanup is not None and cleanup <= KERNEL_DEATH_BOUND_S, \
        f"cleanup {cleanup} s; still running: {watcher.still_running({helper_pid})}"
    assert_ports_free(watcher, watcher.pids | {helper_pid, kernel.pid}, set())  # the kernel held none: it died
    kernel.restart()
    prepare(kernel)  # the next launch, in the restarted kernel, works


# In the kernel: a Ctrl-C after each call into C of accelnb's side of a session cell
# (interrupt_points.py), then a cell with a collective on both ranks. A cell interrupted while it
# runs stops on each rank where the interrupt finds it, so their n may differ afterwards (the
# interrupt's message says so when some ranks had finished it): the check sets it back.
MAGIC_SWEEP_CELL = r"""
from interrupt_points import sweep
ip = get_ipython()
magic = ip.magics_manager.registry["DistributedMagics"]
apart = []

def run():
    ip.run_cell_magic("distributed", "", "n = n + 1\nm = n * 2")

def check(point):
    if magic.session is None or not magic.session.alive:
        return "the session ended"
    total, expected = ip.run_cell_magic("distributed", "--return none",
        "import torch, torch.distributed as dist\nt = torch.tensor([float(n)])\ndist.all_reduce(t)\n"
        "(t.item(), n * world_size)")
    if total != expected:
        apart.append(point.where)
        ip.run_cell_magic("distributed", "", "n = 0")
    return None

swept = sweep(run, check)
print(json.dumps({"points": swept.points, "interrupted": swept.interrupted, "problems": swept.problems,
                  "apart": apart}))
"""


def test_interrupt_after_each_call_into_c_of_a_session_cell() -> None:
    kernel = NotebookKernel.start()
    try:
        for cell in ("import torch, tqdm.auto, transformers, accelnb, json\n%load_ext accelnb",
                     "%distributed start --procs 2 --cpu --quiet", "%%distributed\nn = 0"):
            assert kernel.run(cell).error is None, cell
        swept = kernel.run(MAGIC_SWEEP_CELL, timeout=300)
        assert swept.error is None, swept.seen
        report = json.loads(swept.stdout.strip().splitlines()[-1])
        after = kernel.run("%%distributed\nprint('world', world_size)")
    finally:
        kernel.shutdown()

    assert report["points"] >= 100, report
    assert report["problems"] == [], report["problems"]
    assert report["interrupted"] >= report["points"] - 2, report
    assert after.error is None and "world 2" in after.stdout, after.seen
