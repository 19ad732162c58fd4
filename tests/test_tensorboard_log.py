"""``log_dir=``: rank 0's ``report()`` scalars as TensorBoard event files, read back with
TensorBoard's own reader (``EventAccumulator``). Real launches, 2 CPU ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import accelnb
from accelnb import LaunchConfigError, Session, launch
from tests.conftest import worker_processes
from tests.restart_targets import rank_1_dies_on_the_first_attempt, reports_kinds_of_scalars

pytestmark = pytest.mark.usefixtures("no_leftovers")


def read_run(directory: Path) -> EventAccumulator:
    run = EventAccumulator(str(directory))
    run.Reload()
    return run


def scalars(run: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in run.Scalars(tag)]


def test_rank_0_scalars_are_written_under_their_names_at_their_steps(tmp_path: Path) -> None:
    log_dir = tmp_path / "runs" / "exp1"  # created, parents included
    result = launch(reports_kinds_of_scalars, num_processes=2, cpu=True, quiet=True, log_dir=log_dir)
    run = read_run(log_dir)
    assert sorted(run.Tags()["scalars"]) == ["flag", "loss", "np_value", "tensor_value", "val/acc"]
    assert scalars(run, "loss") == [(step, pytest.approx(1.0 / (step + 1))) for step in range(5)]
    assert scalars(run, "val/acc") == [(4, pytest.approx(0.75))]
    assert scalars(run, "flag") == [(0, 1.0)]  # a bool is a 0/1 scalar
    assert scalars(run, "np_value") == [(1, 2.5)] and scalars(run, "tensor_value") == [(2, 3.0)]
    # rank 1 reported loss + 1000: it is in the launch's history, not in the event file
    assert result.metrics.series("loss", 1)[0] == (0, 1001.0)
    assert all(value < 1000 for _, value in scalars(run, "loss"))
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1


def test_each_launch_appends_an_event_file_and_a_report_without_step_gets_its_position(tmp_path: Path) -> None:
    launch(reports_kinds_of_scalars, num_processes=2, cpu=True, quiet=True, log_dir=str(tmp_path))
    launch(reports_kinds_of_scalars, kwargs={"with_steps": False}, num_processes=2, cpu=True, quiet=True,
           log_dir=tmp_path)
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    run = read_run(tmp_path)
    # The second launch began at step 0 with TensorBoard's restart marker: it replaces the first's points.
    assert [step for step, _ in scalars(run, "loss")] == [0, 1, 2, 3, 4]
    assert scalars(run, "val/acc") == [(5, pytest.approx(0.75))]  # its position among rank 0's reports


def test_a_restart_continues_the_curve_from_where_the_attempt_resumed(tmp_path: Path) -> None:
    result = launch(rank_1_dies_on_the_first_attempt, num_processes=2, cpu=True, quiet=True, max_restarts=1,
                    log_dir=tmp_path)
    assert [a.ending for a in result.attempts] == ["failed", "succeeded"]
    run = read_run(tmp_path)
    # Attempt 0 logged loss 0, 1, 2 at steps 0..2; attempt 1 started again at step 0 with 10, 11, 12.
    # TensorBoard drops the rewound points; the history keeps both attempts.
    assert scalars(run, "loss") == [(0, 10.0), (1, 11.0), (2, 12.0)]
    assert len(result.metrics.series("loss", 0)) == 6


def test_a_session_run_writes_its_own_log(tmp_path: Path) -> None:
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        session.run(reports_kinds_of_scalars, log_dir=tmp_path)
    assert scalars(read_run(tmp_path), "flag") == [(0, 1.0)]


def test_a_log_dir_that_cannot_be_written_fails_before_anything_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(LaunchConfigError, match=r"log_dir='.*a-file/run' cannot be written"):
        launch(print, num_processes=2, cpu=True, quiet=True, log_dir=blocker / "run")
    assert worker_processes() == []
    with pytest.raises(LaunchConfigError, match="log_dir must be a directory path"):
        launch(print, num_processes=2, cpu=True, quiet=True, log_dir=3)  # type: ignore[arg-type]


def test_without_tensorboard_log_dir_says_how_to_install_it_before_anything_starts(tmp_path: Path) -> None:
    # A fresh interpreter where `import tensorboard` fails, as where it is not installed.
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "import accelnb\n"
        "from accelnb.kernel.helper import template as helper_template\n"
        "try:\n"
        f"    accelnb.notebook_launcher(print, num_processes=2, cpu=True, log_dir={str(tmp_path / 'run')!r})\n"
        "except accelnb.LaunchConfigError as error:\n"
        "    print('refused:', error)\n"
        "print('helper started:', helper_template.running_helper_pid() is not None)\n"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parent.parent).stdout
    assert "refused: log_dir= writes TensorBoard event files, which needs the tensorboard package" in shown
    assert "pip install 'accelnb[tensorboard]'" in shown
    assert "helper started: False" in shown  # nothing started
    assert not (tmp_path / "run").exists()


def test_the_install_hint_names_the_extra_that_pyproject_declares() -> None:
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'tensorboard = ["tensorboard>=' in pyproject
    from accelnb.kernel.display.tensorboard_log import INSTALL_HINT

    assert INSTALL_HINT == "pip install 'accelnb[tensorboard]'"
    assert accelnb.restart_count() == 0
