"""``accelnb.sweep`` and ``%%distributed --sweep`` in a real Jupyter kernel, read off its IOPub channel.

The cell shows one display, the table of trials, updated in place (``update_display_data`` on the
same display id, at most about once a second), and nothing a trial prints: each trial keeps its
own output. The magic runs its cell once per config with ``config`` bound.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import cell_messages, start_repo_kernel

pytestmark = pytest.mark.usefixtures("no_leftovers")

SWEEP_CELL = """
import time, accelnb

def trial(config):
    import time, accelnb
    print("noise from trial", config["lr"])
    for step in range(4):
        accelnb.report(step=step, loss=config["lr"] * (4 - step))
        time.sleep(0.5)
    if config["lr"] == 0.3:
        raise ValueError("diverged at lr 0.3")
    return config["lr"] * 10

started = time.monotonic()
trials = accelnb.sweep(trial, [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}, {"lr": 0.4}], cpu=True, max_concurrent=2,
                       best="loss")
took = time.monotonic() - started
print("took", took, [t.state for t in trials], "output kept:", repr(trials[1].output()))
"""

MAGIC_CELLS = ["%load_ext accelnb", "configs = [{'x': 1}, {'x': 2}, {'x': 3}]\nconfig = 'the notebook own'",
               "%%distributed --sweep configs --cpu --procs 2 --max-concurrent 1\n"
               "import torch.distributed as dist\n"
               "print('cell run on rank', dist.get_rank(), 'of', dist.get_world_size())\n"
               "config['x'] * 100 + dist.get_world_size()",
               "print([t.value for t in _sweep], [t.state for t in _sweep], config)",
               "%%distributed --sweep nothing_here --cpu\n1", "%%distributed --best loss --cpu --procs 1\n1"]


def run_cells(cells: list[str]) -> list[list[dict[str, Any]]]:
    """Each cell's IOPub messages, in one fresh kernel."""
    manager, client = start_repo_kernel()
    try:
        return [cell_messages(client, client.execute(code)) for code in cells]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _printed(messages: list[dict[str, Any]]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


def test_the_cell_shows_one_table_updated_in_place_and_the_magic_binds_config() -> None:
    sweep, *magic = run_cells([SWEEP_CELL, *MAGIC_CELLS])
    printed = _printed(sweep)
    errors = [m["content"] for m in sweep if m["msg_type"] == "error"]
    assert not errors, errors
    assert "['done', 'done', 'failed', 'done']" in printed and "output kept: 'noise from trial 0.2\\n'" in printed
    assert "noise from trial" not in printed.split("output kept")[0]  # no trial's output in the cell
    took = float(printed.split("took ")[1].split()[0])
    shown = [m for m in sweep if m["msg_type"] in ("display_data", "update_display_data")]
    assert shown[0]["msg_type"] == "display_data", [m["msg_type"] for m in sweep]
    assert len({m["content"]["transient"]["display_id"] for m in shown}) == 1  # one table, updated in place
    live = [m for m in shown if "accelnb sweep (live)" in m["content"]["data"]["text/plain"]]
    assert 2 <= len(live) <= took + 1, (len(live), took)  # it moved while trials ran, at most once a second
    final = shown[-1]["content"]["data"]
    assert final["text/plain"].startswith("accelnb sweep (final): 4 trials: 3 done, 1 failed"), final["text/plain"]
    assert "rank 0: ValueError: diverged at lr 0.3" in final["text/plain"]
    assert "★" in final["text/plain"].splitlines()[2]  # trial 0: the lowest loss
    assert 'class="accelnb-sweep"' in final["text/html"]

    _loaded, _defined, cell, check, missing, no_sweep = magic
    assert not [m for m in cell if m["msg_type"] == "error"], [m["content"] for m in cell]
    assert "cell run on rank" not in _printed(cell)  # the trials' output stays with them
    assert len({m["content"]["transient"]["display_id"] for m in cell
                if m["msg_type"] in ("display_data", "update_display_data")}) == 1
    # config is each trial's own, and the notebook's own config is left as it was
    assert "[102, 202, 302] ['done', 'done', 'done'] the notebook own" in _printed(check), _printed(check)
    # IPython shows a UsageError as one line on stderr, no traceback
    assert "UsageError: --sweep nothing_here: no 'nothing_here' in the notebook" in _printed(missing), missing
    assert "UsageError: --best apply to a sweep: add --sweep NAME" in _printed(no_sweep), no_sweep


STOPPED_CELL = """%%distributed --sweep configs --cpu --max-concurrent 2
import os, pathlib, time
if config.get("mark"):
    pathlib.Path(config["mark"]).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)
config["value"]
"""


def test_the_stop_button_ends_every_running_trial_and_keeps_the_finished_ones(tmp_path: Path) -> None:
    marks = [tmp_path / "a", tmp_path / "b"]
    configs = [{"value": 1}, {"mark": str(marks[0])}, {"mark": str(marks[1])}, {"value": 4}]
    manager, client = start_repo_kernel()
    try:
        cell_messages(client, client.execute(f"%load_ext accelnb\nconfigs = {configs!r}"))
        msg_id = client.execute(STOPPED_CELL)
        deadline = time.monotonic() + 120
        while not all(mark.exists() and mark.read_text() for mark in marks):  # both trials run
            assert time.monotonic() < deadline, "the trials never started"
            time.sleep(0.05)
        pids = [int(mark.read_text()) for mark in marks]
        manager.interrupt_kernel()  # the notebook's Stop button
        stopped = cell_messages(client, msg_id)
        # the cell answered: by then the trials' ranks are gone (the kernel still runs, and its helper)
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        check = cell_messages(client, client.execute("print([(t.state, t.value) for t in _sweep])"))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    error = next(m["content"] for m in stopped if m["msg_type"] == "error")
    assert "accelnb stopped the sweep: 2 running trial(s) ended" in "".join(error["traceback"]), error
    assert "[('done', 1), ('stopped', None), ('stopped', None), ('skipped', None)]" in _printed(check)
    assert alive == []
