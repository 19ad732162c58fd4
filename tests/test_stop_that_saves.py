"""A Stop that saves (issue 27): the first Stop of a run whose code checks ``stop_requested()``
asks every rank to stop at the same step; the code saves and returns; the next launch resumes.

Real ranks, real gloo, a DDP loop written as the tutorial writes one (``tests/stop_targets.py``).
The presses are the real ones: SIGINT to this process (the kernel's stop button, as the launch's
wait loop sees it), ``run_state.request_stop(PANEL_STOP)`` (what the panels' Stop calls), SIGTERM to a
script, ``timeout=``, and a real kernel's interrupt. A press waits for the run's own ``report()``
of a chosen step (the launch's metric sink), never for a time.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import accelnb
from accelnb import RunInterrupted, Session
from accelnb.kernel.run import run_state
from accelnb.kernel.run.group.stop_presses import PANEL_STOP, SAME_PRESS_S
from tests.conftest import start_repo_kernel
from tests.stop_targets import train_saving_every, train_until_stopped

HERE = Path(__file__).resolve().parent


class PressAtStep:
    """A launch's metric sink that presses Stop (``how``) once rank 0 reported step ``step``."""

    def __init__(self, step: int, how: str = "panel") -> None:
        self.step, self.how = step, how
        self.reached = threading.Event()
        self.pressed = 0
        threading.Thread(target=self._press, daemon=True).start()

    def __call__(self, batch: Any) -> None:
        if any(step is not None and step >= self.step for step, _, _ in batch.records):
            self.reached.set()

    def _press(self) -> None:
        if not self.reached.wait(120):
            return
        self.pressed += 1
        if self.how == "stop button":
            os.kill(os.getpid(), signal.SIGINT)  # what the kernel's stop button sends
        else:
            run_state.request_stop(PANEL_STOP)  # what a panel's Stop calls


def saved_step(checkpoints: Path) -> int:
    return int(torch.load(checkpoints / "checkpoint.pt")["step"])  # loads whole, or the test fails


# make test presses 6 times, alternating the two presses, each at a random step; the soak
# (`make soak`) presses 40 times, where a rare race between a press and a step shows.
@pytest.mark.parametrize("presses", [6, pytest.param(40, marks=pytest.mark.slow)])
@pytest.mark.usefixtures("no_leftovers")
def test_stops_at_random_steps_each_save_one_step_every_rank_agrees_on_and_resume(tmp_path: Path,
                                                                                 presses: int) -> None:
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    print(f"seed {seed}")
    resumed_from = 0
    for press in range(presses):
        how = "stop button" if press % 2 else "panel"
        presser = PressAtStep(resumed_from + chooser.randrange(2, 60), how)
        result = accelnb.launch(train_until_stopped, (str(tmp_path),), num_processes=2, cpu=True, quiet=True,
                                metric_sink=presser)
        assert result.stopped_by == ("the stop button" if how == "stop button" else "a panel's Stop"), (press, seed)
        (start0, stop0), (start1, stop1) = result.values[0], result.values[1]
        assert (start0, stop0) == (start1, stop1), (press, seed)  # every rank at the same step
        assert start0 == resumed_from, (press, seed)  # continues right after the saved step: no step lost
        assert stop0 >= presser.step, (press, seed)
        assert saved_step(tmp_path) == stop0  # the checkpoint is that step, whole
        assert {(tmp_path / f"rank{r}.step").read_text() for r in (0, 1)} == {str(stop0)}
        assert result.attempts[-1].ending == "stopped"
        resumed_from = stop0 + 1


@pytest.mark.usefixtures("no_leftovers")
def test_the_cell_says_a_stop_was_requested_then_that_the_ranks_returned(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    result = accelnb.launch(train_until_stopped, (str(tmp_path),), num_processes=2, cpu=True, quiet=True,
                            metric_sink=PressAtStep(5))
    err = capfd.readouterr().err
    assert ("accelnb: stop requested (a panel's Stop): ranks will stop at their next check "
            "(press Stop again to stop now)") in err
    assert "accelnb: stopped as asked (a panel's Stop): every rank returned" in err
    assert result.value[1] == saved_step(tmp_path)


@pytest.mark.usefixtures("no_leftovers")
def test_code_that_never_checks_is_stopped_at_once(tmp_path: Path) -> None:
    def train_without_checking(seconds: float) -> None:
        import time

        import accelnb

        step = 0
        while True:
            accelnb.report(step=step, x=1.0)
            step += 1
            time.sleep(0.01)

    presser = PressAtStep(3)
    started = time.monotonic()
    with pytest.raises(RunInterrupted, match="ended on the Stop request"):
        accelnb.launch(train_without_checking, (0.0,), num_processes=2, cpu=True, quiet=True, metric_sink=presser)
    assert time.monotonic() - started < 60


@pytest.mark.usefixtures("no_leftovers")
def test_a_second_press_stops_ranks_that_do_not_stop_at_once(tmp_path: Path) -> None:
    presser = PressAtStep(5)

    def press_again() -> None:  # once the panel says the ranks are saving
        presser.reached.wait(120)
        while (run := run_state.current_run()) is not None and not run.finished:
            if run.stop_pending is not None:
                time.sleep(SAME_PRESS_S)  # a person's second press, not the first click arriving twice
                run_state.request_stop(PANEL_STOP)
                return
            time.sleep(0.05)

    threading.Thread(target=press_again, daemon=True).start()
    with pytest.raises(RunInterrupted):
        accelnb.launch(train_until_stopped, (str(tmp_path), 10**9, True), num_processes=2, cpu=True, quiet=True,
                       metric_sink=presser)


@pytest.mark.usefixtures("no_leftovers")
def test_ranks_that_do_not_answer_within_stop_grace_are_stopped(tmp_path: Path) -> None:
    presser = PressAtStep(5)
    started = time.monotonic()
    with pytest.raises(RunInterrupted, match=r"ended on the Stop request: they were asked to stop at their next "
                       r"stop_requested\(\) check \(a panel's Stop\) \d+\.\d s earlier"):
        accelnb.launch(train_until_stopped, (str(tmp_path), 10**9, True), num_processes=2, cpu=True, quiet=True,
                       metric_sink=presser, stop_grace=1.0)
    assert time.monotonic() - started < 60


@pytest.mark.usefixtures("no_leftovers")
def test_timeout_is_a_stop_the_code_answers(tmp_path: Path) -> None:
    result = accelnb.launch(train_until_stopped, (str(tmp_path),), num_processes=2, cpu=True, quiet=True, timeout=3)
    assert result.stopped_by == "timeout= passed"
    assert result.values[0] == result.values[1] and result.values[0][1] == saved_step(tmp_path)


@pytest.mark.usefixtures("no_leftovers")
def test_one_rank_stops_too(tmp_path: Path) -> None:
    result = accelnb.launch(train_until_stopped, (str(tmp_path),), num_processes=1, cpu=True, quiet=True,
                            metric_sink=PressAtStep(5))
    assert result.stopped_by == "a panel's Stop" and result.value[1] == saved_step(tmp_path)


@pytest.mark.usefixtures("no_leftovers")
def test_a_session_stops_a_call_keeps_its_ranks_and_the_next_call_resumes(tmp_path: Path) -> None:
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        for _ in range(3):  # the ranks' agreement group is made once, and serves every call
            before = saved_step(tmp_path) + 1 if (tmp_path / "checkpoint.pt").exists() else 0
            result = _session_run_pressing(session, tmp_path, PressAtStep(before + 5))
            assert result.stopped_by == "a panel's Stop"
            assert result.values[0] == result.values[1] == (before, saved_step(tmp_path))
            assert session.alive


def _session_run_pressing(session: Session, checkpoints: Path, presser: PressAtStep) -> Any:
    return session.run(train_until_stopped, (str(checkpoints),), metric_sink=presser)


def check_then_clean_up(destroy: bool) -> bool:
    import torch.distributed as dist

    import accelnb

    answers = [accelnb.stop_requested() for _ in range(5)]
    if destroy:
        dist.destroy_process_group()  # the DDP tutorial's cleanup()
    return any(answers)


@pytest.mark.usefixtures("no_leftovers")
def test_a_session_call_that_destroys_the_group_leaves_the_next_calls_checks_working() -> None:
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        assert session.run(check_then_clean_up, (True,)).values == {0: False, 1: False}
        assert session.run(check_then_clean_up, (False,)).values == {0: False, 1: False}
        assert session.run(check_then_clean_up, (True,)).values == {0: False, 1: False}


@pytest.mark.usefixtures("no_leftovers")
def test_a_restart_resumes_from_the_checkpoint_by_the_same_code(tmp_path: Path) -> None:
    result = accelnb.launch(train_saving_every, (str(tmp_path), 30, 5, 12), num_processes=2, cpu=True, quiet=True,
                            max_restarts=1)
    assert [a.ending for a in result.attempts] == ["failed", "succeeded"]
    assert result.values[0] == result.values[1] == (10, 29)  # saved at step 9, resumed at 10


def test_sigterm_to_a_script_saves_then_the_script_ends_of_it(tmp_path: Path) -> None:
    script = subprocess.Popen([sys.executable, str(HERE / "stop_targets.py"), str(tmp_path)], cwd=HERE.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    assert script.stdout is not None
    seen = []
    for line in script.stdout:
        seen.append(line)
        if line.startswith("step 100"):
            break
    else:
        raise AssertionError("".join(seen))
    ranks = psutil.Process(script.pid).children(recursive=True)
    script.send_signal(signal.SIGTERM)  # what a pre-empted machine sends
    rest = script.stdout.read()
    assert script.wait(60) == -signal.SIGTERM, rest  # it ends as SIGTERM meant, after the save
    assert "stop requested (SIGTERM)" in rest and "stopped as asked (SIGTERM)" in rest, rest
    step = saved_step(tmp_path)
    assert {(tmp_path / f"rank{r}.step").read_text() for r in (0, 1)} == {str(step)}
    assert step >= 100
    _gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == []


def test_the_kernels_stop_button_saves_and_the_next_cell_resumes(tmp_path: Path) -> None:
    manager, client = start_repo_kernel()
    try:
        client.execute_interactive("import accelnb, sys; sys.path.insert(0, 'tests'); "
                                   "from stop_targets import train_until_stopped", timeout=60)
        cell = f"first, last = accelnb.notebook_launcher(train_until_stopped, ({str(tmp_path)!r},), 2, cpu=True)"
        outputs = _run_pressing(manager, client, cell, press_when="step 100")
        assert outputs["status"] == "ok", outputs
        assert "stop requested (the stop button)" in outputs["stderr"], outputs
        assert "stopped as asked (the stop button)" in outputs["stderr"], outputs
        step = saved_step(tmp_path)
        shown: list[str] = []
        client.execute_interactive("print(first, last)", timeout=30,
                                   output_hook=lambda m: shown.append(m["content"].get("text", "")))
        assert "".join(shown).split() == ["0", str(step)]
        outputs = _run_pressing(manager, client, cell, press_when=f"step {(step // 50 + 2) * 50}")
        assert outputs["status"] == "ok", outputs
        shown.clear()
        client.execute_interactive("print(first)", timeout=30,
                                   output_hook=lambda m: shown.append(m["content"].get("text", "")))
        assert "".join(shown).split() == [str(step + 1)]  # resumed right after the saved step
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_sigterm_to_the_kernel_saves_then_the_kernel_ends(tmp_path: Path) -> None:
    manager, client = start_repo_kernel()
    try:
        kernel = psutil.Process(manager.provisioner.pid)
        client.execute_interactive("import accelnb, sys; sys.path.insert(0, 'tests'); "
                                   "from stop_targets import train_until_stopped", timeout=60)
        ranks: list[psutil.Process] = []
        cell = f"accelnb.notebook_launcher(train_until_stopped, ({str(tmp_path)!r},), 2, cpu=True)"
        outputs = _run_pressing(manager, client, cell, press_when="step 100",
                                press=lambda: (ranks.extend(kernel.children(recursive=True)),
                                               kernel.send_signal(signal.SIGTERM)))
        assert "stop requested (SIGTERM)" in outputs["stderr"], outputs
        assert "stopped as asked (SIGTERM)" in outputs["stderr"], outputs
        step = saved_step(tmp_path)
        assert {(tmp_path / f"rank{r}.step").read_text() for r in (0, 1)} == {str(step)}
        assert manager.provisioner.process.wait(30) == -signal.SIGTERM  # then the kernel ends, as SIGTERM meant
        _gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert alive == []  # the ranks, the helper: nothing left
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _run_pressing(manager: Any, client: Any, code: str, press_when: str,
                  press: Callable[[], object] | None = None) -> dict[str, str]:
    """Run ``code`` in the kernel; press the stop button (interrupt; or ``press``) once rank 0
    printed ``press_when``. The status is "gone" when the kernel ended before it replied."""
    msg_id = client.execute(code)
    text = {"stdout": "", "stderr": ""}
    pressed = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            message = client.get_iopub_msg(timeout=1)
        except queue.Empty:
            if manager.is_alive():
                continue
            return {**text, "status": "gone"}  # the kernel ended (SIGTERM) without going idle
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "stream":
            text[message["content"]["name"]] += message["content"]["text"]
            if not pressed and press_when in text["stdout"]:
                pressed = True
                (press or manager.interrupt_kernel)()
        elif message["msg_type"] == "error":  # what the cell raised, for the assertion's message
            text["stderr"] += "\n".join(message["content"]["traceback"][-3:])
        elif message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            break
    try:
        reply = client.get_shell_msg(timeout=30 if press is None else 5)
    except queue.Empty:
        return {**text, "status": "gone"}
    return {**text, "status": reply["content"]["status"]}
