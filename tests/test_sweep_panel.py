"""JupyterLab's side panel during a sweep: its state messages say which trial each GPU runs, and
its Stop ends the whole sweep. The panel's kernel side (``PanelConnection``) runs here with a
recording comm; the sweep's trials are real (synthetic GPUs: the ranks run on CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import accelnb
from accelnb import RunInterrupted, synthetic_inventory
from accelnb.kernel.run import run_state
from accelnb.notebook.lab_bridge import PanelConnection
from tests.conftest import worker_processes
from tests.test_lab_bridge import RecordingComm, gpu_count
from tests.test_sweep import marks_then_waits, timed_trial

pytestmark = pytest.mark.usefixtures("no_leftovers")


def _running_on(state: dict[str, Any]) -> dict[int, int]:
    sweep = state.get("sweep")
    if not sweep or sweep["finished"]:
        return {}
    return {gpu: trial["index"] for trial in sweep["trials"] if trial["state"] == "running" for gpu in trial["gpus"]}


def test_the_panel_is_told_which_trial_each_gpu_runs() -> None:
    panel_comm = RecordingComm()
    connection = PanelConnection(panel_comm, lambda: synthetic_inventory(2))  # type: ignore[arg-type]
    connection.start()
    try:
        panel_comm.wait_for_state(gpu_count(2))
        accelnb.sweep(timed_trial, [0, 1, 2], inventory=synthetic_inventory(2), backend="gloo")
    finally:
        connection.close()
    states = [m for m in panel_comm.sent if m["type"] == "state" and m.get("sweep")]
    assert {0: 0, 1: 1} in [_running_on(state) for state in states]  # both GPUs busy, one trial each
    assert any(2 in _running_on(state).values() for state in states)  # the third took a freed GPU
    last = states[-1]["sweep"]
    assert last["finished"] and [t["state"] for t in last["trials"]] == ["done"] * 3
    assert last["trials"][1]["label"] == "1"


def test_the_panels_stop_ends_every_trial_of_the_sweep(tmp_path: Path) -> None:
    panel_comm = RecordingComm()
    connection = PanelConnection(panel_comm, lambda: synthetic_inventory(2))  # type: ignore[arg-type]
    connection.start()
    marks = [tmp_path / "a", tmp_path / "b"]
    pressed: list[bool] = []

    def press_stop_once_both_run() -> None:  # the panel's Stop click, as the wait hook reads it
        if not pressed and all(mark.exists() for mark in marks):
            pressed.append(True)
            panel_comm.handlers["msg"]({"content": {"data": {"type": "stop"}}})

    remove_hook = run_state.add_wait_hook(press_stop_once_both_run)
    try:
        panel_comm.wait_for_state(gpu_count(2))
        with pytest.raises(RunInterrupted, match="2 running trial"):
            accelnb.sweep(marks_then_waits, [{"mark": str(mark)} for mark in marks] + [{"quick": True}],
                          inventory=synthetic_inventory(2), backend="gloo")
    finally:
        remove_hook()
        connection.close()
    assert worker_processes() == []
    last = [m for m in panel_comm.sent if m["type"] == "state" and m.get("sweep")][-1]["sweep"]
    assert [t["state"] for t in last["trials"]] == ["stopped", "stopped", "skipped"]
