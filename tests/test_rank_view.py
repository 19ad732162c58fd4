"""The live per-rank view of a launch (issue 26, part 1): every rank's step, speed, waits, GPU and
host memory, in the cell while it runs and in ``LaunchResult.ranks`` afterwards.

The figures are counted on unchanged DDP code (a ``DistributedDataParallel`` model, ``backward()``,
``optimizer.step()``, nothing of accelnb's), in real launches of 2 CPU ranks; the GPU figures come
from the synthetic inventory (the injection the picker tests use), read on the kernel side like
NVML's. The cell test reads the kernel's own IOPub messages, so it sees every live update, not
only the last one.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import accelnb
from accelnb import launch
from accelnb.kernel.display.rank_activity import RankActivity
from accelnb.kernel.planning.inventory import synthetic_inventory
from accelnb.notebook import rank_table
from accelnb.wire.events import MetricBatch, StepWindow
from accelnb.worker.rank_body import PIECES_OFF_ENV


# ── the figures, from windows as the ranks send them ──────────────────────────────────────────
def activity_of_two_ranks(now: list[float], rank_1_data_s: float) -> RankActivity:
    inventory = synthetic_inventory(2)
    activity = RankActivity(clock=lambda: now[0], inventory=lambda: inventory,
                            host_memory=lambda pid: 2**30 if pid == 11 else None)
    activity.watch({0: 11, 1: 12}, {0: inventory.gpus[0], 1: inventory.gpus[1]})
    for _ in range(10):
        now[0] += 0.25
        activity.add_window(StepWindow(0, 1, 0.25, 1, 0.01, 0.02))
        activity.add_window(StepWindow(1, 1, 0.25, 1, rank_1_data_s, 0.02))
    return activity


def test_each_rank_shows_its_steps_speed_waiting_gpu_and_host_memory() -> None:
    now = [100.0]
    activity = activity_of_two_ranks(now, rank_1_data_s=0.21)
    activity.sample()
    zero, one = activity.rows()
    assert (zero.steps, one.steps) == (10, 10)
    assert zero.steps_per_s == pytest.approx(4.0) and zero.step_s == pytest.approx(0.25)
    # DDP makes both steps 0.25 s; rank 0 reaches the all-reduce 0.2 s sooner and waits there.
    assert zero.waiting_share == pytest.approx(0.8) and one.waiting_share == 0
    assert one.slowest and not zero.slowest
    gpu = synthetic_inventory(2).gpus[0]
    assert zero.gpu is not None and zero.gpu.synthetic
    assert (zero.gpu.gpu, zero.gpu.utilization, zero.gpu.memory_used, zero.gpu.power_w) == (
        0, gpu.utilization, gpu.memory_used, gpu.power_w)
    assert zero.host_memory == 2**30 and one.host_memory is None
    text = rank_table.render_text(activity.rows(), final=False)
    assert "rank 1: step 10, 4.0 steps/s, 0.250 s/step, waiting 0%" in text and "slowest to reach" in text, text
    assert "GPU 0 (synthetic)" in text and f"{gpu.power_w:.0f} W" in text, text
    # GPU memory in GiB, as both panels and nvidia-smi count it: an 80 GiB card is not "85.9 GB" here.
    memory = f"{gpu.memory_used / 2**30:.1f} / {gpu.memory_total / 2**30:.1f} GiB"
    assert memory in text and memory in rank_table.render_html(activity.rows(), final=False), text
    assert memory in zero.describe() and " GB " not in zero.describe().split("host")[0], zero.describe()


def test_a_balanced_run_marks_nobody_and_a_quiet_rank_says_so() -> None:
    now = [100.0]
    activity = activity_of_two_ranks(now, rank_1_data_s=0.012)
    assert not any(row.slowest for row in activity.rows())
    now[0] += 30  # no window for 30 s: a 0.25 s step has not come for 120 steps
    html = rank_table.render_html(activity.rows(), final=False)
    assert "no step for 30 s" in html
    assert "no step for" not in rank_table.render_html(activity.rows(), final=True)  # ended, not stalled


def test_gpu_and_host_memory_are_read_at_most_once_a_second() -> None:
    now = [100.0]
    activity = activity_of_two_ranks(now, rank_1_data_s=0.01)
    activity.sample()
    activity.sample()
    assert len(activity.summary()[0].gpu_samples) == 1
    now[0] += 1.0
    activity.sample()
    assert len(activity.summary()[0].gpu_samples) == 2


def test_a_rank_on_another_node_has_the_peak_memory_its_windows_bring() -> None:
    activity = RankActivity(clock=lambda: 5.0, host_memory=lambda pid: None)
    activity.watch({0: None}, {0: None})  # another node: no pid to read from here
    activity.add_window(StepWindow(0, 2, 0.2, 0, 0.0, 0.0, peak_host_memory=300 * 2**20))
    activity.add_window(StepWindow(0, 2, 0.2, 0, 0.0, 0.0, peak_host_memory=200 * 2**20))  # a peak never falls
    activity.sample()
    assert activity.summary()[0].host_memory_peak == 300 * 2**20


def test_the_first_step_counts_and_report_steps_count_where_there_is_no_optimizer() -> None:
    activity = RankActivity(clock=lambda: 5.0)
    activity.add_window(StepWindow(0, 0, 0.0, 0, 0.0, 0.0, untimed_steps=1))
    assert activity.rows()[0].steps == 1 and activity.rows()[0].step_s is None
    activity.add_reports(MetricBatch(1, [(41, 1.0, {"loss": 0.5}), (42, 1.1, {"loss": 0.4})]))
    assert activity.rows()[1].steps == 42 and activity.counting


# ── real launches ─────────────────────────────────────────────────────────────────────────────
def ddp_training(steps: int, slow_rank: int | None) -> int:
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        if dist.get_rank() == slow_rank:
            time.sleep(0.05)  # a slow batch on this rank
        inputs, targets = torch.randn(16, 32), torch.randn(16, 4)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return steps


@pytest.mark.usefixtures("no_leftovers")
def test_the_result_keeps_every_ranks_steps_times_and_waits() -> None:
    result = launch(ddp_training, args=(30, 1), num_processes=2, cpu=True, quiet=True, timeout=120)
    assert sorted(result.ranks) == [0, 1]
    for rank, summary in result.ranks.items():
        assert summary.steps == 30 and sum(w.steps for w in summary.windows) == 30, (rank, summary)
        assert len(summary.step_times) >= 1 and len(summary.waits) >= 1
        assert summary.host_memory_peak is not None and summary.host_memory_peak > 10 * 2**20
    # rank 1 sleeps before its forward; rank 0 does not (its first steps may wait on rank 1's start)
    assert statistics.median(result.ranks[1].waits) >= 0.04 > statistics.median(result.ranks[0].waits)


@pytest.mark.usefixtures("no_leftovers")
def test_the_benchmarks_switch_leaves_the_step_counting_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/bench_features.py measures each piece by turning it off: the switch must work.
    monkeypatch.setenv(PIECES_OFF_ENV, "step_timing")
    result = launch(ddp_training, args=(5, 1), num_processes=2, cpu=True, quiet=True, timeout=120)
    assert {rank: s.steps for rank, s in result.ranks.items()} in ({}, {0: 0, 1: 0}), result.ranks


def reports_without_an_optimizer() -> None:
    for step in range(5):
        accelnb.report(step=step, loss=1.0 / (step + 1))


@pytest.mark.usefixtures("no_leftovers")
def test_code_that_only_reports_steps_counts_its_report_steps() -> None:
    result = launch(reports_without_an_optimizer, num_processes=2, cpu=True, quiet=True, timeout=120)
    assert {rank: s.steps for rank, s in result.ranks.items()} == {0: 4, 1: 4}


# ── in a real kernel: the cell's live view ────────────────────────────────────────────────────
CELL = """
import time, torch, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
import accelnb

def train(steps):
    model = DDP(nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        time.sleep(0.05)
        optimizer.zero_grad()
        model(torch.randn(8, 32)).sum().backward()
        optimizer.step()
    return steps

started = time.monotonic()
result = accelnb.launch(train, args=(60,), gpus="0,1", quiet=True)
print("took", time.monotonic() - started, "steps", {r: s.steps for r, s in result.ranks.items()})
"""


def run_cell_collecting_iopub(code: str, **env: str) -> list[dict[str, Any]]:
    from tests.conftest import cell_messages, start_repo_kernel

    manager, client = start_repo_kernel(**env)
    try:
        return cell_messages(client, client.execute(code))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.usefixtures("no_leftovers")
def test_the_cell_shows_every_ranks_figures_live_at_most_once_a_second_and_keeps_a_summary() -> None:
    messages = run_cell_collecting_iopub(CELL, ACCELNB_SYNTHETIC_GPUS="2")
    printed = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    errors = [m["content"] for m in messages if m["msg_type"] == "error"]
    assert not errors and "steps {0: 60, 1: 60}" in printed, (errors, printed)
    took = float(printed.split("took ")[1].split()[0])
    shown = [m for m in messages if m["msg_type"] in ("display_data", "update_display_data")]
    assert shown and shown[0]["msg_type"] == "display_data", [m["msg_type"] for m in messages]
    assert len({m["content"]["transient"]["display_id"] for m in shown}) == 1  # one view, updated in place
    live = [m for m in shown if "accelnb ranks (live)" in m["content"]["data"]["text/plain"]]
    assert len(live) <= took + 1, (len(live), took)  # at most once a second
    final = shown[-1]["content"]["data"]
    assert "accelnb ranks (final)" in final["text/plain"], final["text/plain"]
    for rank in (0, 1):
        assert f"rank {rank}: step 60" in final["text/plain"], final["text/plain"]
        assert f"GPU {rank} (synthetic)" in final["text/plain"], final["text/plain"]
    assert 'class="accelnb-ranks"' in final["text/html"] and "host memory" in final["text/html"]


# ── a total the code already knows: rank 0's tqdm bar ─────────────────────────────────────────
def tqdm_loop() -> None:
    from tqdm.auto import tqdm

    for _ in tqdm(range(30), desc="train"):
        time.sleep(0.01)


def hf_trainer_with_its_progress_bar(output_dir: str) -> int:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    tokens = torch.arange(1, 9)
    data = [{"input_ids": tokens, "labels": tokens} for _ in range(32)]
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, max_steps=6, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no")  # the Trainer's own tqdm bar stays on
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer.state.global_step


def lightning_trainer_with_its_progress_bar() -> int:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)  # its default TQDMProgressBar stays on
    trainer.fit(Regression(), data)
    return trainer.global_step


@pytest.mark.usefixtures("no_leftovers")
def test_rank_0s_tqdm_bar_is_the_cells_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    launch(tqdm_loop, num_processes=2, cpu=True, quiet=True, timeout=120)
    assert "  train: 100% 30/30 [" in capsys.readouterr().out  # the view's summary, outside a notebook


@pytest.mark.usefixtures("no_leftovers")
def test_the_hf_trainers_max_steps_is_the_bars_total(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    assert launch(hf_trainer_with_its_progress_bar, args=(str(tmp_path),), num_processes=2, cpu=True, quiet=True,
                  timeout=120).value == 6
    shown = capsys.readouterr().out
    assert "100% 6/6 [" in shown and "accelnb ranks (final)" in shown, shown


@pytest.mark.usefixtures("no_leftovers")
def test_lightnings_progress_bar_total_is_the_bars_total(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lightning")
    assert launch(lightning_trainer_with_its_progress_bar, num_processes=2, cpu=True, quiet=True,
                  timeout=120).value == 4
    shown = capsys.readouterr().out
    assert "Epoch 0/0: 100% 4/4 [" in shown, shown  # 64 samples, batches of 8, split over 2 ranks: 4 steps


def reports_with_a_total() -> None:
    for step in range(20):
        accelnb.report(step=step, total=20, loss=1.0 / (step + 1))


@pytest.mark.usefixtures("no_leftovers")
def test_report_total_makes_the_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    result = launch(reports_with_a_total, num_processes=2, cpu=True, quiet=True, timeout=120)
    assert "  steps: 100% 20/20 [" in capsys.readouterr().out
    assert [value for _, value in result.metrics.series("loss")][-1] == pytest.approx(0.05)  # metrics as before


def reports_a_float_total() -> None:
    accelnb.report(step=1, total=2.5)


@pytest.mark.usefixtures("no_leftovers")
def test_a_total_that_is_not_a_number_of_steps_says_how_to_report_a_metric_called_total() -> None:
    with pytest.raises(accelnb.RankFailed) as failed:
        launch(reports_a_float_total, num_processes=1, cpu=True, quiet=True, timeout=120)
    assert "total= is how many steps the run takes" in str(failed.value)
    assert "report({'total': value})" in str(failed.value)


def ddp_inference_then_training(inference_steps: int, training_steps: int) -> None:
    model = DDP(nn.Linear(16, 4))
    with torch.no_grad():  # an evaluation or inference loop: forwards only
        for _ in range(inference_steps):
            model(torch.randn(8, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(training_steps):
        optimizer.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        with torch.no_grad():  # evaluation between steps must not count as steps
            model(torch.randn(8, 16))


@pytest.mark.usefixtures("no_leftovers")
def test_an_inference_loop_counts_its_forwards_and_training_counts_only_optimizer_steps() -> None:
    inference = launch(ddp_inference_then_training, args=(25, 0), num_processes=2, cpu=True, quiet=True, timeout=120)
    assert {rank: s.steps for rank, s in inference.ranks.items()} == {0: 25, 1: 25}
    training = launch(ddp_inference_then_training, args=(5, 12), num_processes=2, cpu=True, quiet=True, timeout=120)
    assert {rank: s.steps for rank, s in training.ranks.items()} == {0: 12, 1: 12}
