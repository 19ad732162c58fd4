"""Accelerate's examples as a notebook runs them, under accelnb and under Accelerate's own launcher.

    python benchmarks/bench_accelerate_examples.py [--repeats 2] [--write]

Issue 33's last target: the launch cell's time on Accelerate's examples, in notebooks whose first
cell imports torch, transformers, tqdm.auto and the launcher, median ≤ 1.0× Accelerate's
``notebook_launcher``. The examples themselves need the Hub and ``datasets`` (GLUE MRPC, a BERT
checkpoint), which this machine cannot reach, so each case here is written in their style on data
made in the function: a model built from a small config, ``Accelerator()`` and ``prepare``, AdamW
with a linear warm-up schedule, a ``tqdm.auto`` bar on the main process, evaluation through
``gather_for_metrics``, and the feature the example shows:

``nlp``            a BERT sequence classifier trained for an epoch and evaluated (nlp_example.py);
``checkpointing``  the same, ``save_state`` after the epoch and ``load_state`` back (checkpointing.py);
``accumulation``   ``Accelerator(gradient_accumulation_steps=2)`` and ``accumulate(model)``
                   (gradient_accumulation.py);
``early_stopping`` ``set_trigger``/``check_trigger`` when the loss falls under a bound (early_stopping.py);
``cv``             a small convolutional network on images (cv_example.py).

Each run is a fresh kernel (jupyter_client), cells in a notebook's order: imports, the function,
a 5 s pause (the user reading), then the launch, timed inside the cell. The cell's output is
searched, with the kernel's own log, for the lines a fork of the kernel prints (``attempted to send
message from fork``, ``--- Logging error ---``, ``<IPython.core.display``); the table counts them. Runs alternate
between the launchers. A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import IO, Any

import psutil
from jupyter_client.manager import start_new_kernel
from results_file import replace_section  # benchmarks/ is on sys.path when run as a script

SECTION_TITLE = "## Accelerate's examples in a notebook (issue 33)"
CELL_TIMEOUT_S = 180
NOISE = ("attempted to send message from fork", "--- Logging error ---", "<IPython.core.display")

IMPORTS = "import time, torch, transformers\nfrom tqdm.auto import tqdm\n"
LAUNCHERS = {
    "accelnb": ("import accelnb\n",
                "accelnb.notebook_launcher(training_function, (config,), num_processes=2, cpu=True)"),
    "Accelerate": ("from accelerate import notebook_launcher\n",
                   "notebook_launcher(training_function, (config,), num_processes=2)"),
}

# The pieces every case shares: data made in the function, a model from a small config, the loop.
COMMON = '''
def make_loaders(batch_size, images=False):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    generator = torch.Generator().manual_seed(0)
    if images:
        inputs = torch.randn(256, 3, 32, 32, generator=generator)
    else:
        inputs = torch.randint(1, 100, (256, 32), generator=generator)
    labels = torch.randint(0, 2, (256,), generator=generator)
    train = DataLoader(TensorDataset(inputs[:192], labels[:192]), shuffle=True, batch_size=batch_size)
    evaluation = DataLoader(TensorDataset(inputs[192:], labels[192:]), batch_size=batch_size)
    return train, evaluation


def make_model(images=False):
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    if images:
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
                                   torch.nn.Flatten(), torch.nn.Linear(128, 2))
    return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=64, num_labels=2))


def logits_of(model, inputs, images):
    return model(inputs) if images else model(input_ids=inputs).logits
'''

CASES = {
    "nlp": "{}",
    "checkpointing": '{"checkpoint": True}',
    "accumulation": '{"accumulate": 2}',
    "early_stopping": '{"stop_under": 0.0}',
    "cv": '{"images": True}',
}

FUNCTION = '''
def training_function(config):
    import os
    import tempfile

    import torch
    from accelerate import Accelerator
    from tqdm.auto import tqdm
    from transformers import get_linear_schedule_with_warmup

    images = config.get("images", False)
    accelerator = Accelerator(gradient_accumulation_steps=config.get("accumulate", 1))
    torch.manual_seed(42)
    train_loader, eval_loader = make_loaders(batch_size=16, images=images)
    model = make_model(images)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                num_training_steps=len(train_loader))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    model.train()
    for inputs, labels in tqdm(train_loader, disable=not accelerator.is_local_main_process):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(logits_of(model, inputs, images), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if "stop_under" in config and loss.item() < config["stop_under"]:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            break
    if config.get("checkpoint"):
        folder = os.path.join(tempfile.gettempdir(), "accelnb-bench-checkpoint")  # the same on every rank
        accelerator.save_state(folder)
        accelerator.wait_for_everyone()  # the main process wrote it; every rank reads it back
        accelerator.load_state(folder)
    model.eval()
    correct = total = 0
    for inputs, labels in eval_loader:
        with torch.no_grad():
            predictions = logits_of(model, inputs, images).argmax(dim=-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))
        correct += (predictions == labels).sum().item()
        total += labels.numel()
    accelerator.print(f"accuracy {correct / total:.3f}")
    accelerator.end_training()
'''

PAUSE = "time.sleep(5)  # the user reads the cell they wrote"


def cells(launcher: str, case: str) -> list[str]:
    imports, call = LAUNCHERS[launcher]
    timed = f"t0 = time.perf_counter()\n{call}\nprint('SECONDS', time.perf_counter() - t0)"
    return [IMPORTS + imports, COMMON + FUNCTION + f"config = {CASES[case]}", PAUSE, timed]


def run_in_fresh_kernel(code_cells: Sequence[str]) -> tuple[float, int, bool]:
    """(seconds the launch cell took, noise lines it and the kernel's log showed, whether it ran
    without an error). The kernel's own stderr is read too: ipykernel logs a fork's attempts to
    send there (the terminal that runs Jupyter), not into the cell."""
    with tempfile.TemporaryFile("w+") as log:
        printed, ok, finished = _run_cells(code_cells, log)
        log.seek(0)
        kernel_log = log.read()
    text = "\n".join(printed)  # one message a line: a display's HTML has no newline at its end
    noise = sum((text + kernel_log).count(marker) for marker in NOISE)
    seconds = next((float(line.split()[1]) for line in text.splitlines() if line.startswith("SECONDS")), math.nan)
    if not ok:
        print(f"  the cell failed: {text[-800:]}", file=sys.stderr)
    return (seconds if finished else math.nan), noise, ok


def _run_cells(code_cells: Sequence[str], log: IO[str]) -> tuple[list[str], bool, bool]:
    """What the cells printed, whether all ran without an error, whether none timed out."""
    manager, client = start_new_kernel(kernel_name="python3", stderr=log)
    printed: list[str] = []
    ok = True

    def keep(message: dict[str, Any]) -> None:
        content = message["content"]
        printed.append(content.get("text", "") + "".join(str(v) for v in content.get("data", {}).values())
                       + "\n".join(content.get("traceback", [])))

    try:
        for cell in code_cells:
            try:
                reply = client.execute_interactive(cell, timeout=CELL_TIMEOUT_S, output_hook=keep)
            except TimeoutError:
                for process in psutil.Process(manager.provisioner.pid).children(recursive=True):  # type: ignore[union-attr]
                    process.kill()
                return printed, False, False
            ok = ok and reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return printed, ok, True


def _median_of_finished(runs: list[float]) -> float:
    """The median of the runs that finished and printed their time (a failed run's is NaN)."""
    finished = [s for s in runs if not math.isnan(s)]
    return statistics.median(finished) if finished else math.nan


def _shown(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="fresh kernels per case and launcher")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--write", action="store_true", help="replace this section of benchmarks/RESULTS.md")
    opts = parser.parse_args(argv)
    chosen = opts.cases.split(",")
    load_before = os.getloadavg()[0]
    seconds: dict[tuple[str, str], list[float]] = {}
    noise: dict[tuple[str, str], int] = {}
    failed: dict[tuple[str, str], int] = {}
    for _ in range(opts.repeats):
        for case in chosen:
            for launcher in LAUNCHERS:  # alternating, so that a burst of load hits both
                taken, lines, ok = run_in_fresh_kernel(cells(launcher, case))
                seconds.setdefault((case, launcher), []).append(taken)
                noise[case, launcher] = noise.get((case, launcher), 0) + lines
                failed[case, launcher] = failed.get((case, launcher), 0) + (not ok)
                print(f"{case} {launcher}: {taken:.2f} s, {lines} noise lines{'' if ok else ', FAILED'}",
                      file=sys.stderr)
    rows = ["| case | accelnb s | Accelerate s | ratio | noise lines (accelnb, Accelerate) | failed runs |",
            "| --- | --: | --: | --: | --- | --- |"]
    ratios = []
    for case in chosen:
        ours, theirs = (_median_of_finished(seconds[case, name]) for name in LAUNCHERS)
        ratio = ours / theirs
        if not math.isnan(ratio):
            ratios.append(ratio)
        rows.append(f"| {case} | {_shown(ours)} | {_shown(theirs)} | {_shown(ratio)}× | {noise[case, 'accelnb']}, "
                    f"{noise[case, 'Accelerate']} | {failed[case, 'accelnb']}, {failed[case, 'Accelerate']} |")
    median_ratio = statistics.median(ratios) if ratios else math.nan
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = (f"{SECTION_TITLE}, {when}, {platform.node()}, {os.cpu_count()} CPUs\n\n"
            f"`python benchmarks/bench_accelerate_examples.py --repeats {opts.repeats}`: our own code in the style "
            f"of Accelerate's examples (data made in the function, models from small configs), fresh kernels, "
            f"cells in a notebook's order, 2 CPU ranks; medians of the runs that finished, of {opts.repeats} each; "
            f"load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end.\n\n" + "\n".join(rows) +
            f"\n\nMedian ratio over the cases: {median_ratio:.2f}× (target ≤ 1.0×: "
            f"{'meets' if median_ratio <= 1.0 else 'misses'}).\n")
    print(text)
    if opts.write:
        replace_section(SECTION_TITLE, text)


if __name__ == "__main__":
    main()
