"""Live metrics and progress: real workers (gloo, 2 CPU ranks) and a real Jupyter kernel.

In-process launches check the returned history; one notebook, executed by nbclient in a real
kernel, checks what the cell shows and keeps (the chart's points, the Accelerate route, the
progress bar) and how many display messages a report storm costs.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accelnb import LaunchFailed, launch
from accelnb.kernel.display.metrics_history import MetricHistory
from accelnb.notebook.metrics_view import LiveMetricsView, TextSurface
from accelnb.wire.events import MetricBatch, ProgressBatch, ProgressState

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("no_leftovers")


# ── the history a launch returns ────────────────────────────────────────────────────────────
def report_three_ways() -> int:
    import torch
    import torch.distributed as dist

    import accelnb

    rank = dist.get_rank()
    for step in range(150):
        accelnb.report(step=step, loss=1.0 / (step + 1) + rank, lr=torch.tensor(0.1 * rank + step))
    accelnb.report({"val/acc": 0.5 + rank, "epoch": 1}, step=149)  # the dict form, with int values
    accelnb.report(note=torch.tensor([[2.5]]))  # a one-element tensor, no step
    return rank


def test_returned_history_equals_what_each_rank_reported() -> None:
    history = launch(report_three_ways, num_processes=2, cpu=True, quiet=True).metrics
    assert len(history) == 2 * 152
    assert history.ranks == [0, 1]
    assert history.names == ["loss", "lr", "val/acc", "epoch", "note"]
    for rank in (0, 1):
        assert history.series("loss", rank) == [(s, 1.0 / (s + 1) + rank) for s in range(150)]
        lr = history.series("lr", rank)
        assert [s for s, _ in lr] == list(range(150))
        assert [v for _, v in lr] == pytest.approx([0.1 * rank + s for s in range(150)])  # float32
        assert history.series("val/acc", rank) == [(149, 0.5 + rank)]
        assert history.series("epoch", rank) == [(149, 1.0)]
        assert history.series("note", rank) == [(None, 2.5)]
        assert history.latest("loss", rank) == 1.0 / 150 + rank
    records = [r for r in history.records if r["rank"] == 1]
    assert records[0].keys() == {"rank", "attempt", "step", "time", "loss", "lr"}
    assert records[-1] == {"rank": 1, "attempt": 0, "step": None, "time": records[-1]["time"], "note": 2.5}
    assert "304 records from ranks 0, 1" in repr(history)


def test_history_to_pandas() -> None:
    import pandas

    history = MetricHistory()
    history.add(MetricBatch(0, [(0, 1.0, {"loss": 2.0}), (None, 2.0, {"acc": 0.5})]))
    frame = history.to_pandas()
    assert list(frame.columns) == ["rank", "attempt", "step", "time", "loss", "acc"]
    assert frame["step"].isna().tolist() == [False, True]
    assert frame["loss"].iloc[0] == 2.0 and pandas.isna(frame["loss"].iloc[1])


def test_history_to_pandas_without_pandas_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # what an environment without pandas imports
    history = MetricHistory()
    history.add(MetricBatch(0, [(0, 1.0, {"loss": 2.0})]))
    with pytest.raises(ImportError, match=r"needs pandas: pip install pandas \(or use \.records"):
        history.to_pandas()
    assert history.records == [{"rank": 0, "attempt": 0, "step": 0, "time": 1.0, "loss": 2.0}]


def report_until_rank_1_raises(steps_file: str) -> None:
    import os
    import time

    import torch.distributed as dist

    import accelnb

    for step in range(40):
        accelnb.report(step=step, loss=float(step))
    dist.barrier()  # both ranks reported
    if dist.get_rank() == 1:
        raise ValueError("diverged")  # its own reports are flushed before its error is sent
    # Rank 0 reports until the kernel stops it with SIGTERM, writing each step to a file as it goes
    # (unbuffered, so the file shows how far it got). Reports made since its flusher's last 50 ms
    # round can reach the kernel only through the worker's flush on SIGTERM.
    steps = os.open(steps_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for step in range(40, 10**9):
        accelnb.report(step=step, loss=float(step))
        os.write(steps, f"{step}\n".encode())
        time.sleep(0.001)  # a training loop's pace, not a wait for anything


def test_metrics_survive_a_failure(tmp_path: Path) -> None:
    steps_file = tmp_path / "rank0-steps"
    with pytest.raises(LaunchFailed) as caught:
        launch(report_until_rank_1_raises, args=(str(steps_file),), num_processes=2, cpu=True, quiet=True)
    history = caught.value.metrics
    assert history.series("loss", 1) == [(s, float(s)) for s in range(40)]
    rank_0 = history.series("loss", 0)
    assert rank_0 == [(s, float(s)) for s in range(len(rank_0))]  # in order, none missing
    written = steps_file.read_text().split() if steps_file.exists() else []
    last_written = int(written[-1]) if written else 39
    assert rank_0[-1][0] >= last_written, (
        f"rank 0 reported step {last_written} before it was stopped; the kernel got up to {rank_0[-1][0]}")
    assert [f.rank for f in caught.value.failures] == [1]  # rank 0 was stopped, it did not fail


REPORT_OUTSIDE_A_LAUNCH = """\
import json, tracemalloc, warnings
import accelnb

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    accelnb.report(step=0, loss=1.0)  # line 6: the warning points here
    tracemalloc.start()
    for step in range(1, 50_000):
        accelnb.report(step=step, loss=1.0 / step)
    grown, _ = tracemalloc.get_traced_memory()
print(json.dumps({"warnings": [[str(w.message), w.filename, w.lineno] for w in caught], "grown": grown}))
"""


def test_report_outside_a_launch_warns_once_and_does_nothing(tmp_path: Path) -> None:
    """In a fresh interpreter, as a script that never launches would call it."""
    script = tmp_path / "outside.py"
    script.write_text(REPORT_OUTSIDE_A_LAUNCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)

    (message, filename, lineno), = seen["warnings"]  # 50,000 calls, one warning
    assert "outside a distributed launch" in message
    assert (filename, lineno) == (str(script), 6)  # it points at the caller
    assert seen["grown"] < 2**20, f"reports outside a launch were kept: {seen['grown']:,} bytes"


def test_bad_values_say_what_to_do() -> None:
    def bad(**kwargs: Any) -> None:
        import accelnb

        accelnb.report(**kwargs)

    with pytest.raises(LaunchFailed, match=r"must be a single number, got a tensor of shape \(3,\)"):
        launch(_report_vector, num_processes=2, cpu=True, quiet=True)
    for reserved in ("time", "attempt"):
        with pytest.raises(LaunchFailed, match="reserved"):
            launch(bad, kwargs={reserved: 1.0}, num_processes=2, cpu=True, quiet=True)


def _report_vector() -> None:
    import torch

    import accelnb

    accelnb.report(loss=torch.ones(3))


def nested_progress() -> int:
    from accelnb.worker.progress import progress

    seen = 0
    for _ in progress(range(3), desc="epoch"):
        for _ in progress(range(10), desc="batch"):  # a new inner bar per epoch, on one line
            seen += 1
    with progress(total=5, desc="manual") as bar:  # takes over the outer line
        for _ in range(5):
            bar.update()
    for _ in progress(iter(range(4))):  # no len(), no desc
        seen += 1
    return seen


def test_progress_bars_iterate_on_every_rank_and_rank_0_is_shown(capsys: pytest.CaptureFixture[str]) -> None:
    from accelnb.worker.progress import progress

    assert launch(nested_progress, num_processes=2, cpu=True, quiet=True).values == {0: 34, 1: 34}
    shown = capsys.readouterr().out.splitlines()
    assert [line.split(" [")[0] for line in shown] == ["  4 it", "  batch: 100% 10/10"]
    assert list(progress([1, 2, 3], desc="outside a launch")) == [1, 2, 3]


# ── the view, fed directly ──────────────────────────────────────────────────────────────────
class RecordingSurface:
    def __init__(self) -> None:
        self.draws: list[tuple[dict[str, str], bool]] = []

    def draw(self, bundle: dict[str, str], final: bool) -> None:
        self.draws.append((bundle, final))


def test_view_throttles_thins_and_draws_nothing_without_metrics() -> None:
    now = [0.0]
    surface = RecordingSurface()
    view = LiveMetricsView(all_ranks=False, surface=surface, clock=lambda: now[0], points_per_chart=100)
    for second in range(10):  # 10 s at 20,000 reports a second, in 50 ms batches
        for tick in range(20):
            base = (second * 20 + tick) * 1000
            view.add(MetricBatch(0, [(base + i, 0.0, {"loss": 1.0}) for i in range(1000)]))
            view.add(MetricBatch(1, [(base + i, 0.0, {"loss": 9.0}) for i in range(1000)]))  # not shown
            now[0] += 0.05
    view.close()
    assert 30 <= len(surface.draws) <= 45  # 4 a second, plus the first and the final
    html = surface.draws[-1][0]["text/html"]
    assert surface.draws[-1][1] is True
    assert 'data-reported="200000"' in html
    points = int(re.search(r'data-points="(\d+)"', html)[1])  # type: ignore[index]
    assert 100 <= points <= 201

    empty = RecordingSurface()
    idle = LiveMetricsView(all_ranks=False, surface=empty)
    idle.add(MetricBatch(0, []))
    idle.close()
    assert empty.draws == []


class BrokenSurface:
    def __init__(self) -> None:
        self.tries = 0

    def draw(self, bundle: dict[str, str], final: bool) -> None:
        self.tries += 1
        raise RuntimeError("the output area is gone")


def test_a_broken_display_is_logged_once_and_the_view_stops_drawing(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    surface = BrokenSurface()
    view = LiveMetricsView(all_ranks=False, surface=surface, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="accelnb"):
        for step in range(20):  # what the launch feeds it: none of this may raise
            view.add(MetricBatch(0, [(step, 0.0, {"loss": 1.0})]))
            now[0] += 1.0
        view.close()
    assert surface.tries == 1
    failures = [r for r in caplog.records if r.exc_info]
    assert [str(r.exc_info[1]) for r in failures] == ["the output area is gone"]  # type: ignore[index]
    assert "metric history still has everything" in failures[0].getMessage()


def test_text_summary_outside_a_kernel() -> None:
    out = io.StringIO()
    view = LiveMetricsView(all_ranks=False, surface=TextSurface(out))
    view.add(MetricBatch(0, [(s, 0.0, {"loss": 1.0 / (s + 1)}) for s in range(10)]))
    bar = ProgressState(1, 0, "train", 10, 10, started=0.0, time=2.0, closed=True)
    view.add(ProgressBatch(0, [], [bar]))
    assert out.getvalue() == ""  # nothing until the end
    view.close()
    assert out.getvalue() == (
        "accelnb metrics (rank 0, 10 reports):\n"
        "  loss  last 0.1 at step 9  min 0.1  max 1  (10 reports)\n"
        "  train: 100% 10/10 [00:02<00:00, 5.0 it/s]\n")


# ── a real notebook ─────────────────────────────────────────────────────────────────────────
SETUP = """
import time
import accelnb
from accelnb.worker.progress import progress
from accelnb.worker.accelerate_tracker import AccelerateTracker
"""

REPORT = """
def train():
    for step in range(200):
        accelnb.report(step=step, loss=1.0 / (step + 1))
result = accelnb.launch(train, num_processes=2, cpu=True, quiet=True)
print(len(result.metrics.series("loss")))
"""

ACCELERATE = """
def train_with_accelerate():
    from accelerate import Accelerator
    accelerator = Accelerator(log_with=AccelerateTracker(), cpu=True)
    accelerator.init_trackers("test", config={"lr": 0.1})
    for step in range(200):
        accelerator.log({"loss": 1.0 / (step + 1), "eval": {"acc": step / 200}, "note": "text"}, step=step)
    accelerator.end_training()
result = accelnb.launch(train_with_accelerate, num_processes=2, cpu=True, quiet=True)
print(len(result.metrics.series("loss")))
"""

STORM = """
def storm():
    for step in range(50_000):
        accelnb.report(step=step, loss=step % 7)
        if step % 1000 == 999:
            time.sleep(0.04)          # 50,000 reports over about 2 s
result = accelnb.launch(storm, num_processes=2, cpu=True, quiet=True)
print(len(result.metrics.series("loss")))
"""

PROGRESS = """
def loop():
    for _ in progress(range(30), desc="epoch"):
        time.sleep(0.01)
accelnb.launch(loop, num_processes=2, cpu=True, quiet=True)
"""

TQDM = """
def with_tqdm():
    from tqdm import tqdm
    for _ in tqdm(range(100), desc="tq", mininterval=0):
        time.sleep(0.003)
accelnb.launch(with_tqdm, num_processes=2, cpu=True, quiet=True)
"""

NOTHING = """
accelnb.launch(lambda: None, num_processes=2, cpu=True, quiet=True)
"""


@pytest.fixture(scope="module")
def notebook(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], dict[int, int]]:
    # Imported here, not at the top: the ranks of this module's launches import the module, and
    # nbformat costs each of them seconds (see conftest.py).
    import nbclient
    import nbformat

    class CountingClient(nbclient.NotebookClient):
        """Counts the display messages each cell received (updates are merged in the outputs)."""

        display_messages: dict[int, int]

        def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
            if msg["msg_type"] in ("display_data", "update_display_data"):
                self.display_messages[cell_index] = self.display_messages.get(cell_index, 0) + 1
            return super().process_message(msg, cell, cell_index)

    cells = [SETUP, REPORT, ACCELERATE, STORM, PROGRESS, TQDM, NOTHING]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = CountingClient(nb, kernel_name="python3", timeout=120,
                            resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}})
    client.display_messages = {}
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    client.execute(env={**os.environ, "PYTHONPATH": path})  # the kernel imports this checkout
    for cell in nb.cells:
        errors = [o for o in cell.outputs if o["output_type"] == "error"]
        assert not errors, "\n".join(errors[0]["traceback"])
    return [cell.outputs for cell in nb.cells], client.display_messages


def final_html(outputs: list[Any]) -> str:
    displays = [o for o in outputs if o["output_type"] == "display_data"]
    assert len(displays) == 1, outputs
    assert "text/plain" in displays[0]["data"]
    return str(displays[0]["data"]["text/html"])


def chart_svg(html: str, metric: str) -> str:
    image = r'<img src="data:image/svg\+xml;base64,([^"]+)"'
    found = re.search(rf'data-metric="{re.escape(metric)}"[^>]*>{image}', html)
    assert found, html[:500]
    return base64.b64decode(found[1]).decode()


def stdout(outputs: list[Any]) -> str:
    return "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == "stdout")


def test_the_cell_keeps_the_final_chart_with_every_point(notebook: Any) -> None:
    outputs, _ = notebook
    html = final_html(outputs[1])
    assert 'data-metric="loss" data-points="200" data-reported="200"' in html
    svg = chart_svg(html, "loss")
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg"')
    assert re.findall(r'data-points="(\d+)"', svg) == ["200"]
    assert "final" in html
    assert stdout(outputs[1]).strip() == "200"


def test_the_accelerate_tracker_route_shows_the_same(notebook: Any) -> None:
    outputs, _ = notebook
    html = final_html(outputs[2])
    assert 'data-metric="loss" data-points="200" data-reported="200"' in html
    assert 'data-metric="eval/acc" data-points="200"' in html  # nested dicts are flattened
    assert "note" not in html  # strings are not charted
    assert stdout(outputs[2]).strip() == "200"


def test_a_report_storm_costs_a_bounded_number_of_display_messages(notebook: Any) -> None:
    outputs, messages = notebook
    assert 1 <= messages[3] < 40, messages
    html = final_html(outputs[3])
    assert 'data-reported="50000"' in html
    assert int(re.search(r'data-points="(\d+)"', html)[1]) <= 301  # type: ignore[index]
    assert stdout(outputs[3]).strip() == "50000"


def test_progress_bar_in_the_cell(notebook: Any) -> None:
    outputs, _ = notebook
    html = final_html(outputs[4])
    assert 'class="accelnb-bar" data-n="30" data-total="30"' in html
    assert "epoch" in html and "100%" in html and "it/s" in html
    assert "accelnb-chart" not in html  # no metrics, no charts


def test_tqdm_in_rank_0_stays_a_text_bar_and_is_mirrored_as_the_cells_bar(notebook: Any) -> None:
    outputs, messages = notebook
    text = "".join(o["text"] for o in outputs[5] if o["output_type"] == "stream" and o["name"] == "stderr")
    assert "tq: 100%" in text.split("\r")[-1] and "100/100" in text
    assert text.count("\r") < 60  # coalesced: not one update per iteration
    # Its total makes the live view's bar (worker/library_progress.py), drawn a few times, not per iteration.
    assert 'class="accelnb-bar" data-n="100" data-total="100"' in final_html(outputs[5])
    assert 1 <= messages[5] < 20, messages


def test_no_display_without_metrics(notebook: Any) -> None:
    outputs, messages = notebook
    assert not [o for o in outputs[6] if o["output_type"] == "display_data"]
    assert 6 not in messages
