"""In a rank: where each training step's time goes, measured on unchanged code.

DDP hides a slow rank: its all-reduce makes every rank wait for the last one, so every rank's
step takes as long as the slowest's, and step times all look alike. What differs is what each
rank does *before* it reaches the collective. A step is counted at every optimizer step (torch's
public global hook, ``register_optimizer_step_post_hook``: plain PyTorch, Accelerate, the HF
Trainer and Lightning all call ``optimizer.step()``), and the time since the previous one is
split at the DDP forward (``DistributedDataParallel.forward``, timed by a wrapper on the class):

- *data*: from the end of the last step to the start of the forward: fetching the batch;
- *forward*: the forward pass;
- the rest (backward, where DDP's all-reduce waits, and the optimizer).

The report flush (``worker/report.py``: every 50 ms, with a window at most every 0.25 s) sends
what the steps since the last window added up to, as one :class:`~accelnb.wire.events.StepWindow`;
the kernel compares ranks
(``kernel/display/straggler_watch.py``). A step costs two clock reads and a few additions
(``benchmarks/bench_rank_view.py`` measures it on the DDP loop). An inference loop (DDP forwards
under ``no_grad``/``inference_mode``) counts its forwards apart, as ``forward_steps``: the kernel
shows them only for a rank that takes no optimizer step, so a training run's evaluation does not
inflate its step count. Code without DDP gets step times but no split.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from accelnb.wire.events import StepWindow

# A window goes with the report flush at most this often (the flush runs every 50 ms): each is an
# event the kernel handles, and 4 a second per rank is plenty for a view redrawn once a second.
WINDOW_INTERVAL_S = 0.25
SWITCH_ENV = "ACCELNB_STEP_TIMING"  # "off": no step counting, no per-rank view, no straggler watch
_lock = threading.Lock()
_last_step_end: float | None = None
_forward_start: float | None = None
_forward_end: float | None = None
# Since the last flush: steps, and the sums of their durations, data and forward times.
_steps = 0
_step_s = 0.0
_data_s = 0.0
_forward_s = 0.0
_split_steps = 0  # how many of those steps had a DDP forward to split at
_untimed_steps = 0  # the first step: counted, but nothing marks where it began
_forward_steps = 0  # DDP forwards without autograd (inference), since the last flush
_installed = False
_last_window = -float("inf")  # monotonic time the last window was taken


def install() -> Callable[[], None] | None:
    """Count steps and time DDP's forward in this rank (once per process), unless
    ``ACCELNB_STEP_TIMING=off``. Returns what undoes it (``benchmarks/bench_rank_view.py`` measures
    the cost with and without, in one process), or None when nothing was installed."""
    global _installed
    if _installed or os.environ.get(SWITCH_ENV, "on").strip().lower() in ("off", "0", "no", "false"):
        return None
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook

    hook = register_optimizer_step_post_hook(_after_optimizer_step)
    original_forward = DistributedDataParallel.forward

    grad_enabled = torch.is_grad_enabled

    @functools.wraps(original_forward)
    def timed_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        global _forward_start, _forward_end, _forward_steps
        started = time.perf_counter()
        if not grad_enabled():  # an inference step (no optimizer step will follow it)
            with _lock:
                _forward_steps += 1
        if _forward_start is None:  # the first forward of the step (gradient accumulation: several)
            _forward_start = started
        try:
            return original_forward(self, *inputs, **kwargs)
        finally:
            _forward_end = time.perf_counter()

    DistributedDataParallel.forward = timed_forward  # type: ignore[method-assign]
    _installed = True

    def uninstall() -> None:
        global _installed
        hook.remove()
        DistributedDataParallel.forward = original_forward  # type: ignore[method-assign]
        _installed = False

    return uninstall


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _last_step_end, _forward_start, _forward_end, _steps, _step_s, _data_s, _forward_s, _split_steps
    global _untimed_steps
    now = time.perf_counter()
    with _lock:
        if _last_step_end is None:  # the first step has no start to measure from
            _untimed_steps += 1
        else:
            _steps += 1
            _step_s += now - _last_step_end
            if _forward_start is not None and _forward_end is not None and _forward_start >= _last_step_end:
                _split_steps += 1
                _data_s += _forward_start - _last_step_end
                _forward_s += _forward_end - _forward_start
        _last_step_end = now
        _forward_start = _forward_end = None


def take_window(rank: int, at_most_every: float = 0.0) -> StepWindow | None:
    """What the steps since the last window added up to, or None when there was no step (or the
    last window is younger than ``at_most_every`` seconds)."""
    global _steps, _step_s, _data_s, _forward_s, _split_steps, _untimed_steps, _forward_steps, _last_window
    now = time.monotonic()
    if now - _last_window < at_most_every:
        return None
    with _lock:
        forwards, _forward_steps = _forward_steps, 0
        if _steps == 0 and _untimed_steps == 0 and forwards == 0:
            return None
        window = StepWindow(rank, _steps, _step_s, _split_steps, _data_s, _forward_s, _untimed_steps, forwards)
        _last_window = now
        _steps, _step_s, _data_s, _forward_s, _split_steps, _untimed_steps = 0, 0.0, 0.0, 0.0, 0, 0
    return window
