"""Soak: 500 consecutive launches in one real Jupyter kernel, successes and failures mixed.

After a warm-up of 10 launches, the kernel's open file descriptors, threads, child processes and
resident memory are measured; after 500 more they must not have grown by more than 5%.

    .venv/bin/python -m pytest -m slow tests/soak -s        # or: make soak

Each launch is its own cell, as a user would run them; failures end the cell with the error, as
they would in a notebook.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "faults"))
from kernel_driver import NotebookKernel

from tests.conftest import REAP_DEPARTED_IN_KERNEL, live_descendants

LAUNCHES = int(os.environ.get("ACCELNB_SOAK_LAUNCHES", "500"))
WARM_UP = 10
MAX_GROWTH = 0.05

SETUP_CELL = """
import accelnb, os
from faultkit import fault_target, ok_target

def chatty():
    import torch.distributed as dist
    for i in range(200):
        print(f"rank {dist.get_rank()} step {i}")
    return ok_target()

def soak_launch(i, base):
    kind = KINDS[i % len(KINDS)]
    if kind == "ok":
        assert accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}
    elif kind == "chatty":
        assert accelnb.notebook_launcher(chatty, num_processes=2, cpu=True, output="all", quiet=True) == 2.0
    else:
        report_dir = os.path.join(base, str(i))
        os.mkdir(report_dir)
        accelnb.launch(fault_target, (kind, i % 2, "after" if i % 4 < 2 else "before", report_dir),
                       num_processes=2, cpu=True, quiet=True, timeout=0.5 if kind == "hang_python" else None)
"""
# 50 launches: 30 successes, 20 failures of every kind; then it repeats.
KINDS = (["ok", "chatty", "exception", "ok", "os_exit", "ok", "segfault", "ok", "sys_exit", "ok"] * 4
         + ["ok", "sigkill_self", "ok", "exception", "ok", "hang_python", "ok", "chatty", "os_exit", "ok"])
EXPECTED_ERROR = {"exception": "ValueError", "os_exit": "RankCrashed", "segfault": "RankCrashed",
                  "sys_exit": "RankFailed", "sigkill_self": "RankCrashed", "hang_python": "LaunchTimeout"}


@dataclass
class Usage:
    fds: int
    threads: int
    children: int
    rss_mb: float

    @classmethod
    def of(cls, pid: int) -> Usage:
        process = psutil.Process(pid)
        return cls(process.num_fds(), process.num_threads(), len(live_descendants(pid)),
                   process.memory_info().rss / 2**20)


# What the kernel keeps that is not accelnb's, let go before each reading:
# - IPython's history of each cell's outputs and exceptions (a failed launch's message is a few KB,
#   and 200 of the 500 launches fail): IPython's own, which its history_manager.reset() lets go
#   of (as %reset does, among other things);
# - the free memory glibc keeps at the top of its heap, where a launch's read buffers (256 KiB
#   each) leave some: over this soak's 500 launches, 86-88 MB before malloc_trim and 66.9-68.5
#   after it, every 100 launches, against 65.7 at the start. A leak grows in both.
LET_GO_OF_WHAT_IS_NOT_OURS = (
    "get_ipython().history_manager.reset(new_session=False)\n"
    "import ctypes, gc\ngc.collect()\nlibc = ctypes.CDLL(None)\n"
    "if hasattr(libc, 'malloc_trim'):  # glibc's; another libc keeps less, or says nothing\n"
    "    libc.malloc_trim(0)")


def settle(kernel: NotebookKernel) -> Usage:
    # The departed ranks reaped first (a launch need not wait for the OS to free them).
    kernel.value(f"{REAP_DEPARTED_IN_KERNEL}\n{LET_GO_OF_WHAT_IS_NOT_OURS}\nprint()")  # it collects too
    gc.collect()
    time.sleep(0.5)
    return Usage.of(kernel.pid)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_500_launches_leak_nothing(tmp_path: Path) -> None:
    kernel = NotebookKernel.start()
    try:
        kernel.value(SETUP_CELL + f"\nKINDS = {KINDS!r}\nprint(accelnb.kernel.helper.template.shared_helper().pid)")
        misreported: list[str] = []
        helper_pid = int(kernel.value("print(accelnb.kernel.helper.template.shared_helper().pid)"))

        def launch(i: int) -> None:
            cell = kernel.run(f"soak_launch({i}, {str(tmp_path)!r})", timeout=60)
            kind = KINDS[i % len(KINDS)]
            if kind in EXPECTED_ERROR:  # the cell fails; how it explains why is the matrix's business
                assert cell.error is not None, f"launch {i} ({kind}) did not fail"
                if cell.error["ename"] != EXPECTED_ERROR[kind]:
                    misreported.append(f"{kind}: {cell.error['evalue'].splitlines()[0][:100]}")
            else:
                assert cell.error is None, f"launch {i} ({kind}): {cell.seen[-2000:]}"

        for i in range(WARM_UP):
            launch(i)
        start, helper_start = settle(kernel), Usage.of(helper_pid)
        began = time.perf_counter()
        samples = []
        for i in range(WARM_UP, WARM_UP + LAUNCHES):
            launch(i)
            if (i - WARM_UP + 1) % 100 == 0:
                samples.append((i - WARM_UP + 1, Usage.of(kernel.pid)))
        seconds = time.perf_counter() - began
        end, helper_end = settle(kernel), Usage.of(helper_pid)
    finally:
        kernel.shutdown()

    failures = sum(1 for i in range(WARM_UP, WARM_UP + LAUNCHES) if KINDS[i % len(KINDS)] in EXPECTED_ERROR)
    print(f"\n{LAUNCHES} launches ({LAUNCHES - failures} successes, {failures} failures) in {seconds:.0f} s "
          f"({seconds / LAUNCHES * 1000:.0f} ms per launch, cell round trip included)")
    print(f"{'':10} {'fds':>6} {'threads':>8} {'children':>9} {'RSS MB':>8}")
    for name, usage in [("start", start), *((f"+{n}", u) for n, u in samples), ("end", end),
                        ("helper@0", helper_start), ("helper@end", helper_end)]:
        print(f"{name:10} {usage.fds:>6} {usage.threads:>8} {usage.children:>9} {usage.rss_mb:>8.1f}")
    if misreported:
        print(f"{len(misreported)} failures reported with another root cause than the injected one "
              "(see docs/faults.md), e.g.:", *misreported[:5], sep="\n  ")
    for field in ("fds", "threads", "children", "rss_mb"):
        before, after = getattr(start, field), getattr(end, field)
        assert after <= before * (1 + MAX_GROWTH), f"kernel {field} grew from {before} to {after}"
    assert helper_end.children == 0, "workers left under the helper"
