"""A stalled run shows itself: ``stall_timeout=`` (``kernel/run/group/stall_report.py``).

Real launches of 2 CPU ranks (gloo). A mismatched collective (rank 0 in ``barrier()``, rank 1 in
``all_reduce()``) stalls for good: soon after ``stall_timeout`` the cell gets every rank's stack
and the collective each waits in, once, and the run is still stopped by Ctrl-C (the notebook's
Stop). A run that makes progress only through ``report()`` or a line of output raises nothing.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

import accelnb
from accelnb import launch
from accelnb.kernel.run import run_state, supervisor
from accelnb.kernel.run.group.stall_report import where_it_waits
from tests.conftest import worker_processes
from tests.stall_targets import mismatched_collective, prints_without_reporting, reports_without_printing

pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture
def cell(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str, str]]:
    """What accelnb's group writes into the cell, with the time it wrote it."""
    written: list[tuple[float, str, str]] = []
    real_sink = supervisor.notebook_sink

    def recording_sink(stream: Any, text: str) -> None:
        written.append((time.monotonic(), stream, text))
        real_sink(stream, text)

    monkeypatch.setattr(supervisor, "notebook_sink", recording_sink)
    return written


def test_a_mismatched_collective_shows_every_ranks_stack_once_and_stays_stoppable(
        cell: list[tuple[float, str, str]]) -> None:
    launch(int, num_processes=2, cpu=True, quiet=True)  # the helper is up: the clock below is the stall's
    stall_seen: list[float] = []

    def stop_once_the_stall_shows() -> None:  # a display's wait hook, inside the wait for answers
        if not stall_seen and any("no rank has made progress" in text for _, _, text in cell):
            stall_seen.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)  # the notebook's Stop

    remove_hook = run_state.add_wait_hook(stop_once_the_stall_shows)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(mismatched_collective, num_processes=2, cpu=True, quiet=True, stall_timeout=2, timeout=60)
    finally:
        remove_hook()
    reports = [text for _, _, text in cell if "no rank has made progress" in text]
    assert len(reports) == 1, reports
    assert stall_seen and stall_seen[0] - started < 2 + 20  # stall_timeout=2, and the ranks' start on a loaded machine
    report = reports[0]
    assert "rank 0: waits in torch.distributed barrier(), called from stall_targets.py" in report, report
    assert "rank 1: waits in torch.distributed all_reduce(), called from stall_targets.py" in report, report
    assert report.count("── rank ") == 2 and "in mismatched_collective" in report
    assert worker_processes() == []


@pytest.mark.parametrize("function", [reports_without_printing, prints_without_reporting])
def test_a_run_that_makes_progress_raises_no_stall(function: Any, cell: list[tuple[float, str, str]]) -> None:
    # 4.5 s of steps 0.3 s apart, stall_timeout=3: each step resets the clock (without that, the
    # report would show 3 s in). The 3 s also cover the ranks' start on a loaded machine.
    result = launch(function, args=(15,), num_processes=2, cpu=True, quiet=True, stall_timeout=3, output="none")
    assert result.values == {0: 15, 1: 15}
    assert not any("no rank has made progress" in text for _, _, text in cell)


def test_stall_timeout_none_turns_off_the_report_that_a_short_one_shows(cell: list[tuple[float, str, str]]) -> None:
    # The same stall twice, each ended by timeout=: with stall_timeout=1 the report shows (so the
    # view works, and shows within the run), with None it does not. Without the first run this
    # test would pass with a broken stall view.
    def reports() -> int:
        return sum("no rank has made progress" in text for _, _, text in cell)

    launch(int, num_processes=2, cpu=True, quiet=True)  # the helper is up: the timeouts below are the stalls'
    with pytest.raises(accelnb.LaunchTimeout):
        launch(mismatched_collective, num_processes=2, cpu=True, quiet=True, stall_timeout=1, timeout=6)
    assert reports() == 1
    with pytest.raises(accelnb.LaunchTimeout):
        launch(mismatched_collective, num_processes=2, cpu=True, quiet=True, stall_timeout=None, timeout=6)
    assert reports() == 1


def test_where_it_waits_reads_a_faulthandler_stack() -> None:
    stack = ('Current thread 0x00007f (most recent call first):\n'
             '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper\n'
             '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4800 in barrier\n'
             '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper\n'
             '  File "/home/me/train.py", line 14 in main\n')
    assert where_it_waits(stack) == "waits in torch.distributed barrier(), called from train.py:14 in main"
    assert where_it_waits('  File "/home/me/train.py", line 9 in loop\n') == "is at train.py:9 in loop"
    assert where_it_waits("") .startswith("no Python stack came back")


def test_where_it_waits_reads_a_traceback_stack_most_recent_last() -> None:
    # A Ray rank's stacks come from the traceback module: "line 5, in f", oldest frame first.
    stack = ("Stack of the call (most recent call last):\n"
             '  File "/home/me/train.py", line 30, in main\n    fit()\n'
             '  File "/home/me/train.py", line 14, in fit\n    dist.barrier()\n'
             '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper\n'
             '    return func(*args, **kwargs)\n'
             '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356, '
             'in barrier\n    work.wait()\n')
    assert where_it_waits(stack) == "waits in torch.distributed barrier(), called from train.py:14 in fit"
