"""``accelnb.sweep``: one trial per config, on real CPU ranks (gloo), queued onto slots.

Every sweep here starts real workers through the shared helper; the trials of a sweep run at the
same time, one thread each (``kernel/sweep/scheduler.py``). The GPU layout is tested with a
synthetic inventory (ranks run on CPU, their environment names the slot's GPUs). No test asserts a
duration: ``benchmarks/bench_sweep.py`` measures.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import accelnb
from accelnb import LaunchConfigError, RankFailed, RunInterrupted, synthetic_inventory
from accelnb.kernel.helper.template import sockets_held_ahead
from accelnb.kernel.run import run_state
from accelnb.kernel.run.group.stop_presses import PANEL_STOP
from accelnb.kernel.sweep.slots import Slot, cpu_slots, default_cpu_concurrency, gpu_slots
from accelnb.kernel.sweep.sweep_state import current_sweep, on_sweep_change
from accelnb.kernel.sweep.trials import Trial, Trials
from accelnb.notebook.sweep_table import render_html, render_text
from tests.conftest import worker_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")


# ── trial functions (module level: the ranks import this module to find them) ─────────────────
def reporting_trial(config: dict[str, Any]) -> float:
    import accelnb

    for step in range(3):
        accelnb.report(step=step, loss=config["lr"] * (3 - step), other=float(step))
    print(f"trial with lr={config['lr']}")
    if config.get("fail"):
        raise ValueError(f"lr {config['lr']} diverged")
    return config["lr"] * 10


def ddp_trial(config: int) -> tuple[int, float, str]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank() + config)])
    dist.all_reduce(total)
    return dist.get_world_size(), total.item(), os.environ.get("CUDA_VISIBLE_DEVICES", "")


def timed_trial(config: int) -> tuple[str, float, float]:
    started = time.time()
    time.sleep(0.3)
    return os.environ.get("CUDA_VISIBLE_DEVICES", ""), started, time.time()


def marks_then_waits(config: dict[str, Any]) -> str:
    """Quick configs return at once; the others write a file saying they run, then run until stopped."""
    if config.get("quick"):
        return "quick"
    if config.get("fail"):
        raise ValueError("this trial fails at once")
    Path(config["mark"]).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


# ── the pure pieces ───────────────────────────────────────────────────────────────────────────
def test_the_pool_is_cut_into_slots_and_no_gpu_is_in_two() -> None:
    assert gpu_slots([3, 5, 6, 7, 1], per_trial=2) == [Slot(0, (3, 5)), Slot(1, (6, 7))]
    assert gpu_slots([0, 1, 2, 3], per_trial=1, max_concurrent=3) == [Slot(0, (0,)), Slot(1, (1,)), Slot(2, (2,))]
    assert cpu_slots(2) == [Slot(0, ()), Slot(1, ())]
    assert Slot(0, (2, 3)).label == "GPUs 2,3" and Slot(0, ()).label == "cpu"
    with pytest.raises(LaunchConfigError, match="gpus_per_trial=3 is more than the 2 GPU"):
        gpu_slots([0, 1], per_trial=3)
    assert default_cpu_concurrency(1, cores=2) == 2
    assert default_cpu_concurrency(2, cores=2) == 1
    assert default_cpu_concurrency(4, cores=2) == 1


def _trial(index: int, state: str, latest: dict[str, float], value: Any = None) -> Trial:
    trial = Trial(index, {"lr": index / 10})
    trial.latest = latest
    trial.state = state  # type: ignore[assignment]
    trial.value = value
    return trial


def test_best_counts_finished_trials_and_the_leader_running_ones_too() -> None:
    trials = Trials([_trial(0, "done", {"loss": 0.5}), _trial(1, "running", {"loss": 0.1}),
                     _trial(2, "done", {}, value={"loss": 0.3}), _trial(3, "failed", {"loss": 0.0})],
                    metric="loss")
    assert trials.best is trials[2]  # the returned dict's loss counts; a failed trial never does
    assert trials.leader() is trials[1]  # while it runs, its last report counts for the table's ★
    trials.mode = "max"
    assert trials.best is trials[0]
    assert Trials(trials).best is None  # no best= metric: no best


def test_the_table_shows_each_trial_and_a_failures_root_cause() -> None:
    failed = _trial(1, "failed", {"loss": 0.2})
    failed.error = RankFailed.like(ValueError, "rank 0 failed", [accelnb.RankFailure(0, 1, "exception",
                                                                                     "ValueError: diverged")])
    trials = Trials([_trial(0, "done", {"loss": 0.5}, value=2.5), failed, _trial(2, "queued", {})], metric="loss")
    text = render_text(trials, final=True)
    assert text.startswith("accelnb sweep (final): 3 trials: 1 queued, 1 done, 1 failed"), text
    row0, row1 = text.splitlines()[2], text.splitlines()[3]
    assert "lr=0.0" in row0 and "loss 0.5" in row0 and "2.5" in row0 and "★" in row0, row0
    assert "rank 0: ValueError: diverged" in row1 and "★" not in row1, row1
    html = render_html(trials, final=False)
    assert html.startswith("<!-- accelnb-sweep -->") and "rank 0: ValueError: diverged" in html


def test_accelnb_sweep_is_the_function_once_its_module_is_imported_too() -> None:
    import importlib
    import inspect

    importlib.import_module("accelnb.sweeper")  # a submodule sets its name on the package: not "sweep"
    assert inspect.isfunction(accelnb.sweep) and accelnb.sweep.__module__ == "accelnb.sweeper"


# ── real trials ───────────────────────────────────────────────────────────────────────────────
def test_one_rank_trials_run_two_at_a_time_and_come_back_in_config_order() -> None:
    configs = [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3, "fail": True}, {"lr": 0.4}]
    trials = accelnb.sweep(reporting_trial, configs, cpu=True, max_concurrent=2, best="loss")
    assert isinstance(trials, list) and [t.config for t in trials] == configs
    assert [t.state for t in trials] == ["done", "done", "failed", "done"]
    assert [t.value for t in trials] == [1.0, 2.0, None, 4.0]
    for trial in trials:
        assert trial.gpus == () and trial.seconds is not None and trial.seconds > 0
        assert trial.metrics.series("loss") == [(0, trial.config["lr"] * 3), (1, trial.config["lr"] * 2),
                                                (2, trial.config["lr"])]
        assert trial.latest == {"loss": trial.config["lr"], "other": 2.0}
        assert f"trial with lr={trial.config['lr']}" in trial.output()  # its own output, not the others'
        assert all(f"lr={other['lr']}" not in trial.output() for other in configs if other is not trial.config)
    failure = trials[2].error
    assert isinstance(failure, RankFailed) and isinstance(failure, ValueError)  # as a launch raises it
    assert failure.root_cause is not None and failure.root_cause.summary == "ValueError: lr 0.3 diverged"
    assert trials[2].error_summary == "rank 0: ValueError: lr 0.3 diverged"
    assert trials.best is trials[0]
    frame = trials.to_pandas()
    assert list(frame["trial"]) == [0, 1, 2, 3] and list(frame["lr"]) == [0.1, 0.2, 0.3, 0.4]
    assert list(frame["state"]) == ["done", "done", "failed", "done"]
    assert frame["loss"].tolist() == [0.1, 0.2, 0.3, 0.4]
    assert frame["error"].tolist()[2] == "rank 0: ValueError: lr 0.3 diverged"
    assert "3 done, 1 failed" in repr(trials) and "best: trial 0" in repr(trials)


def test_two_rank_trials_are_ddp_groups_of_their_own() -> None:
    trials = accelnb.sweep(ddp_trial, [10, 20, 30], cpu=True, num_processes=2)
    assert [t.value[:2] for t in trials] == [(2, 21.0), (2, 41.0), (2, 61.0)]  # rank 0 + rank 1, each + config


def test_many_short_trials_four_at_a_time_share_one_helper() -> None:
    """More trials at once than cores: their starts and ends interleave on the one helper's socket
    (a spawn answer read by another trial's thread would leave that start waiting 60 s, then fail)."""
    trials = accelnb.sweep(ddp_trial, list(range(16)), cpu=True, max_concurrent=4)
    assert [t.value[:2] for t in trials] == [(1, float(i)) for i in range(16)], [t.error for t in trials]


def threads_trial(config: int) -> int:
    import torch

    return torch.get_num_threads()


def test_trials_side_by_side_share_the_cores() -> None:
    if os.environ.get("OMP_NUM_THREADS"):
        pytest.skip("the kernel's OMP_NUM_THREADS is every rank's thread count, in a sweep as in a launch")
    trials = accelnb.sweep(threads_trial, [0, 1, 2], cpu=True, max_concurrent=2)
    assert [t.value for t in trials] == [max(1, (os.cpu_count() or 1) // 2)] * 3  # a launch alone: all the cores


def test_gpu_trials_own_their_slot_and_no_gpu_runs_two_at_once() -> None:
    trials = accelnb.sweep(timed_trial, list(range(6)), gpus_per_trial=2, inventory=synthetic_inventory(5),
                           backend="gloo")
    assert all(t.ok for t in trials), [t.error for t in trials]
    assert {t.gpus for t in trials} <= {(0, 1), (2, 3)}  # GPU 4 is left over: 5 is not a multiple of 2
    for trial in trials:
        assert trial.value[0] == ",".join(map(str, trial.gpus))  # the ranks see their slot's GPUs only
    for a in trials:
        for b in trials:
            if a is not b and set(a.gpus) & set(b.gpus):  # sharing a GPU: one after the other
                assert a.value[2] <= b.value[1] or b.value[2] <= a.value[1], (a, b)


def test_the_pickers_selection_is_the_default_pool() -> None:
    from accelnb.kernel.watched_state.selection import clear_selection, set_selection

    set_selection(gpus=[1, 3])
    try:
        trials = accelnb.sweep(timed_trial, [0, 1, 2], inventory=synthetic_inventory(4), backend="gloo")
    finally:
        clear_selection()
    assert all(t.ok for t in trials) and {t.gpus for t in trials} <= {(1,), (3,)}, [(t.gpus, t.error) for t in trials]
    assert {t.value[0] for t in trials} <= {"1", "3"}


def test_the_side_panel_hears_which_trial_each_gpu_runs() -> None:
    seen: list[dict[int, int]] = []
    unsubscribe = on_sweep_change(lambda state: seen.append(
        {gpu: row.index for gpu, row in state.running_on().items()} if state else {}))
    try:
        accelnb.sweep(timed_trial, [0, 1, 2], inventory=synthetic_inventory(2), backend="gloo")
    finally:
        unsubscribe()
    assert {0: 0, 1: 1} in seen  # trial 0 on GPU 0 and trial 1 on GPU 1 at once
    assert any(2 in running.values() for running in seen)
    final = current_sweep()
    assert final is not None and final.finished and [row.state for row in final.trials] == ["done"] * 3


@pytest.mark.parametrize(("configs", "keywords", "message"), [
    ([], {}, "configs is empty"),
    ({"lr": 1}, {}, "configs must be a list"),
    ([1, 2], {"mode": "median"}, "mode='median' must be 'min'"),
    ([1, 2], {"best": 3}, "best= names a metric"),
    ([1, 2], {"gpus_per_trial": 0}, "gpus_per_trial must be a whole number"),
    ([1, 2], {"max_concurrent": 0}, "max_concurrent must be a whole number"),
    ([1, 2], {"gpus_per_trial": 3, "inventory": synthetic_inventory(2)}, "gpus_per_trial=3 is more than the 2 GPU"),
    ([1, 2], {"gpus": "0,7", "inventory": synthetic_inventory(2)}, "GPU 7 does not exist"),
    ([1, 2], {"master_port": 29500}, "sweep\\(\\) does not take master_port=: its trials run at once"),
    ([1, 2], {"cluster": "ray"}, "sweep\\(\\) does not take cluster=: a sweep places"),
    ([1, 2], {"lr": 3}, "sweep\\(\\) got an unknown option 'lr'"),
    ([1, threading.Lock()], {"cpu": True}, "Config 1 \\(configs\\[1\\]\\)"),
])
def test_bad_input_is_refused_before_anything_starts(configs: Any, keywords: dict[str, Any], message: str) -> None:
    run_before = run_state.current_run()
    with pytest.raises(LaunchConfigError, match=message):
        accelnb.sweep(timed_trial, configs, **keywords)
    assert run_state.current_run() is run_before  # no launch began: no worker was started


def test_an_unpicklable_function_is_refused_before_anything_starts() -> None:
    lock = threading.Lock()

    def uses_a_lock(config: int) -> bool:
        return lock.locked()

    with pytest.raises(accelnb.UnpicklableError, match="'lock'"):
        accelnb.sweep(uses_a_lock, [1, 2], cpu=True)


def test_fail_fast_stops_the_running_trials_and_raises_the_first_failure(tmp_path: Path) -> None:
    configs = [{"fail": True}, {"mark": str(tmp_path / "b")}, {"mark": str(tmp_path / "c")}]
    with pytest.raises(ValueError, match="this trial fails at once") as info:
        accelnb.sweep(marks_then_waits, configs, cpu=True, max_concurrent=2, fail_fast=True)
    assert ("Trial 0 (fail=True) failed, and fail_fast=True stopped the sweep: 0 trial(s) done, 1 stopped, "
            "1 not started") in str(info.value)
    trials = info.value.trials  # type: ignore[attr-defined]
    assert [t.state for t in trials] == ["failed", "stopped", "skipped"]
    assert isinstance(trials[1].error, RunInterrupted)
    assert worker_processes() == []  # every rank of the stopped trial is gone when it raises


def _fds() -> int:
    return psutil.Process().num_fds() - len(sockets_held_ahead())  # those are for the next launch, on purpose


def _interrupt_when_marked(*marks: Path, stop_request: bool = False) -> Any:
    """A display's wait hook (the sweep runs them on the waiting thread): Ctrl-C (or a panel's Stop)
    once every mark exists, that is once those trials run."""
    fired: list[float] = []

    def hook() -> None:
        if not fired and all(mark.exists() for mark in marks):
            fired.append(time.monotonic())
            if stop_request:
                run_state.request_stop(PANEL_STOP)
            else:
                os.kill(os.getpid(), signal.SIGINT)  # what the kernel's stop button sends

    return hook


@pytest.mark.parametrize("stop_request", [False, True], ids=["ctrl-c", "panel-stop"])
def test_stop_ends_every_running_trial_and_keeps_the_finished_ones(tmp_path: Path, stop_request: bool) -> None:
    accelnb.sweep(timed_trial, [0], cpu=True)  # the helper runs now: what is counted below is the sweep's
    fds_before = _fds()
    marks = [tmp_path / "b", tmp_path / "c"]
    configs = [{"quick": True}, {"mark": str(marks[0])}, {"mark": str(marks[1])}, {"quick": True}]
    remove_hook = run_state.add_wait_hook(_interrupt_when_marked(*marks, stop_request=stop_request))
    try:
        with pytest.raises(KeyboardInterrupt, match="accelnb stopped the sweep: 2 running trial") as info:
            accelnb.sweep(marks_then_waits, configs, cpu=True, max_concurrent=2)
    finally:
        remove_hook()
    assert isinstance(info.value, RunInterrupted)
    assert worker_processes() == []  # gone when the interrupt reached the caller
    trials = info.value.trials  # type: ignore[attr-defined]
    assert [t.state for t in trials] == ["done", "stopped", "stopped", "skipped"]
    assert trials[0].value == "quick"
    pids = [int(mark.read_text()) for mark in marks]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    assert _fds() <= fds_before, (fds_before, _fds())
    again = accelnb.sweep(timed_trial, [0, 1], cpu=True)
    assert [t.state for t in again] == ["done", "done"]  # the next sweep works


def sleeps(config: float) -> None:
    time.sleep(config)


def test_launch_options_reach_every_trial(tmp_path: Path) -> None:
    trials = accelnb.sweep(reporting_trial, [{"lr": 0.1}, {"lr": 0.2}], cpu=True, log_dir=tmp_path / "runs")
    for trial in trials:  # one TensorBoard run per trial
        run = tmp_path / "runs" / f"trial-{trial.index}"
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(run))
    # 6 s: a launch whose function returns at once must fit, on a loaded 2-core machine too (with
    # three test files at a time, it did not fit in 1 s).
    timed = accelnb.sweep(sleeps, [0.0, 600.0], cpu=True, timeout=6.0, max_concurrent=2)
    assert [t.state for t in timed] == ["done", "failed"]
    assert isinstance(timed[1].error, accelnb.LaunchTimeout)  # timeout= is each trial's, as each launch's


def saves_on_stop(config: dict[str, Any]) -> str:
    """A trial whose code checks stop_requested() every step: Stop makes it save and return."""
    import accelnb

    step = 0
    while not accelnb.stop_requested():
        if step == 3:
            Path(config["mark"]).write_text(str(os.getpid()))
        time.sleep(0.01)
        step += 1
    return "saved"


def test_stop_lets_a_trial_that_checks_stop_requested_save(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    marks = [tmp_path / "saves", tmp_path / "plain"]
    remove_hook = run_state.add_wait_hook(_interrupt_when_marked(*marks))
    try:
        with pytest.raises(RunInterrupted) as info:
            accelnb.sweep(_saves_or_waits, [{"mark": str(marks[0]), "saves": True}, {"mark": str(marks[1])}],
                          cpu=True, max_concurrent=2)
    finally:
        remove_hook()
    trials = info.value.trials  # type: ignore[attr-defined]
    assert [(t.state, t.value) for t in trials] == [("done", "saved"), ("stopped", None)]
    assert worker_processes() == []
    assert "stop requested (the stop button)" in capfd.readouterr().err  # named by what pressed it


def _saves_or_waits(config: dict[str, Any]) -> str:
    return saves_on_stop(config) if config.get("saves") else marks_then_waits(config)


def test_to_pandas_without_pandas_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # what an environment without pandas looks like
    with pytest.raises(ImportError, match="needs pandas: pip install pandas"):
        Trials([_trial(0, "done", {})]).to_pandas()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


SWEEP_SCRIPT = """
import os, sys, time
from pathlib import Path
import accelnb

def marks_then_waits(mark):
    Path(mark).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)

if __name__ == "__main__":
    accelnb.sweep(marks_then_waits, sys.argv[1:], cpu=True, max_concurrent=2)
"""


def test_sigterm_to_a_script_running_a_sweep_ends_every_trial_then_the_script(tmp_path: Path) -> None:
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_SCRIPT)
    marks = [tmp_path / "a", tmp_path / "b"]
    process = psutil.Popen([sys.executable, str(script), *map(str, marks)], cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    deadline = time.monotonic() + 120
    while not all(mark.exists() and mark.read_text() for mark in marks):  # both trials run
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    pids = [int(mark.read_text()) for mark in marks]
    process.send_signal(signal.SIGTERM)  # a pre-empted machine's
    assert process.wait(60) == -signal.SIGTERM  # it ends as SIGTERM meant, once every trial's ranks were
    assert [pid for pid in pids if _running(pid)] == []  # stopped: none outlives it, not even for a moment
