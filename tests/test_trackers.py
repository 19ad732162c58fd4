"""Experiment trackers work unchanged inside a launch: Accelerate's ``log_with="tensorboard"`` and
``log_with="wandb"`` (offline: no network here) log once per launch, from the main process; their
helper processes (wandb's service) and the DataLoader's forked workers are gone after the launch;
nothing deadlocks when both fork. Real launches, 2 CPU ranks, each with a 2-worker DataLoader.

The processes are checked by pid and start time (``faultkit.is_gone``), as ``test_rank_descendants`` does: the
guarantee comes from the worker being a child subreaper, which catches what a service detaches
with ``setsid`` and double forks.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from accelnb import launch
from tests.conftest import wait_until_no_workers
from tests.tracker_targets import train_with_tracker

sys.path.insert(0, str(Path(__file__).parent / "faults"))
from faultkit import is_gone

pytestmark = pytest.mark.usefixtures("no_leftovers")

GONE_BOUND_S = 3.0
DEADLOCK_BOUND_S = 180  # a deadlock fails the launch with every rank's stack instead of hanging


def still_running(started: list[tuple[int, float, str]]) -> list[str]:
    return [f"{name} (pid {pid})" for pid, created, name in started if not is_gone(pid, created)]


def launch_tracked(log_with: str, tmp_path: Path, env: dict[str, str]) -> dict[int, Any]:
    result = launch(train_with_tracker, args=(log_with, str(tmp_path / "project"), env), num_processes=2, cpu=True,
                    quiet=True, timeout=DEADLOCK_BOUND_S)
    wait_until_no_workers(GONE_BOUND_S)
    return result.values


def test_accelerates_tensorboard_tracker_logs_once_from_the_main_process(tmp_path: Path) -> None:
    values = launch_tracked("tensorboard", tmp_path, {})
    assert values[0]["main"] and not values[1]["main"]
    event_files = list((tmp_path / "project").rglob("events.out.tfevents.*"))
    # events.out.tfevents.<time>.<host>.<pid>.<n>: every file is rank 0's (the run's, and the
    # hparams run that add_hparams makes beside it)
    assert {int(path.name.split(".")[-2]) for path in event_files} == {values[0]["pid"]}, event_files
    run = EventAccumulator(str(tmp_path / "project" / "tracked"))
    run.Reload()
    assert [event.step for event in run.Scalars("loss")] == [0, 1, 2, 3]  # 64 samples / 8 / 2 ranks
    started = values[0]["started"] + values[1]["started"]
    assert sum("python" in name or "pt_" in name for _, _, name in started) >= 4  # the DataLoaders' workers
    assert still_running(started) == []


def test_wandb_offline_logs_one_run_and_its_service_is_gone_after_the_launch(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(wandb_dir),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_DISABLE_GIT": "true",
           "WANDB_DISABLE_CODE": "true", "WANDB_CONSOLE": "off", "WANDB_ERROR_REPORTING": "false"}
    values = launch_tracked("wandb", tmp_path, env)
    runs = list(wandb_dir.rglob("offline-run-*"))
    assert len(runs) == 1, runs  # one run per launch, not one per rank
    assert list(runs[0].glob("run-*.wandb")), "the offline run has its data file"
    services = [entry for entry in values[0]["started"] if "wandb" in entry[2]]
    assert services, f"wandb started no service process: {values[0]['started']}"
    assert values[1]["started"] == [] or all("wandb" not in name for _, _, name in values[1]["started"])
    assert still_running(values[0]["started"] + values[1]["started"]) == []
