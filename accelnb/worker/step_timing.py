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

Module state, one of each per rank process: ``_step`` (the step in progress, the training thread's
alone), ``_sums`` (what the flush takes, under its lock) and ``_installed``.
"""

from __future__ import annotations

import functools
import os
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

from accelnb.wire.events import StepWindow

# A window goes with the report flush at most this often (the flush runs every 50 ms): each is an
# event the kernel handles, and 4 a second per rank is plenty for a view redrawn once a second.
WINDOW_INTERVAL_S = 0.25
SWITCH_ENV = "ACCELNB_STEP_TIMING"  # "off": no step counting, no per-rank view, no straggler watch


class _StepInProgress:
    """The step being taken: touched only by the thread that trains (the DDP forward and the
    optimizer step run there), so it needs no lock."""

    def __init__(self) -> None:
        self.last_end: float | None = None  # perf_counter at the end of the last step
        self.forward_start: float | None = None  # the step's first DDP forward (gradient accumulation: several)
        self.forward_end: float | None = None


class _Sums:
    """What the steps since the last window added up to: written by the training thread, taken by
    the report flush's thread, so only under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps = 0
        self.step_s = 0.0
        self.data_s = 0.0
        self.forward_s = 0.0
        self.split_steps = 0  # how many of those steps had a DDP forward to split at
        self.untimed_steps = 0  # the first step: counted, but nothing marks where it began
        self.forward_steps = 0  # DDP forwards without autograd (inference)
        self.last_window = -float("inf")  # monotonic time the last window was taken

    def reset(self) -> None:
        self.steps, self.step_s, self.data_s, self.forward_s = 0, 0.0, 0.0, 0.0
        self.split_steps, self.untimed_steps, self.forward_steps = 0, 0, 0


# A rank is one process that trains one run: one step in progress, one set of sums, installed once.
_step = _StepInProgress()
_sums = _Sums()
_installed = False


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
        started = time.perf_counter()
        if not grad_enabled():  # an inference step (no optimizer step will follow it)
            with _sums.lock:
                _sums.forward_steps += 1
        if _step.forward_start is None:  # the first forward of the step (gradient accumulation: several)
            _step.forward_start = started
        try:
            return original_forward(self, *inputs, **kwargs)
        finally:
            _step.forward_end = time.perf_counter()

    DistributedDataParallel.forward = timed_forward  # type: ignore[method-assign]
    _installed = True

    def uninstall() -> None:
        global _installed
        hook.remove()
        DistributedDataParallel.forward = original_forward  # type: ignore[method-assign]
        _installed = False

    return uninstall


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    now = time.perf_counter()
    step = _step
    with _sums.lock:
        if step.last_end is None:  # the first step has no start to measure from
            _sums.untimed_steps += 1
        else:
            _sums.steps += 1
            _sums.step_s += now - step.last_end
            if step.forward_start is not None and step.forward_end is not None and step.forward_start >= step.last_end:
                _sums.split_steps += 1
                _sums.data_s += step.forward_start - step.last_end
                _sums.forward_s += step.forward_end - step.forward_start
    step.last_end = now
    step.forward_start = step.forward_end = None


def take_window(rank: int, at_most_every: float = 0.0) -> StepWindow | None:
    """What the steps since the last window added up to, or None when there was no step (or the
    last window is younger than ``at_most_every`` seconds)."""
    now = time.monotonic()
    sums = _sums
    if now - sums.last_window < at_most_every:
        return None
    with sums.lock:
        if sums.steps == 0 and sums.untimed_steps == 0 and sums.forward_steps == 0:
            return None
        window = StepWindow(rank, sums.steps, sums.step_s, sums.split_steps, sums.data_s, sums.forward_s,
                            sums.untimed_steps, sums.forward_steps, peak_host_memory=_peak_resident_bytes())
        sums.last_window = now
        sums.reset()
    return window


def _peak_resident_bytes() -> int:
    """This process's peak resident memory (one ``getrusage``: a window is cut at most a few times
    a second, never per step). Linux gives kilobytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
