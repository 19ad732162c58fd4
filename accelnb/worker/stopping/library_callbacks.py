"""Callbacks that make the HF Trainer and Lightning's Trainer save and stop on accelnb's Stop.

Both ask :func:`~accelnb.worker.stopping.rank_stop.stop_requested` at the end of every optimizer
step, never between the batches of one accumulated step (every rank, the same number of times:
what the agreement needs) and, once it says True, use the library's own machinery to save and
stop at that step boundary, so the checkpoint is the library's usual one and the library's usual
resume reads it:

- :class:`TrainerSaveOnStop` sets the HF Trainer's ``control.should_save`` and
  ``control.should_training_stop``: the Trainer writes ``checkpoint-<step>`` into ``output_dir``
  and ends ``train()``; ``trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))``
  resumes. (Only the public ``TrainerCallback`` interface is used.)
- :class:`LightningSaveOnStop` calls ``trainer.save_checkpoint(path)`` (a collective the strategy
  handles: rank 0 writes) and sets ``trainer.should_stop``; ``trainer.fit(model,
  ckpt_path=callback.resume_path())`` resumes.

The libraries are imported when a class is first used (``accelnb.TrainerSaveOnStop``), never
before: a launch that uses neither pays nothing. tests/test_stop_libraries.py runs both with the
real libraries on 2 CPU ranks: Stop, the saved step on every rank, and the resume from it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from accelnb.worker.stopping.rank_stop import stop_requested


@functools.cache
def trainer_save_on_stop_class() -> type:
    """The HF ``TrainerCallback`` that saves and stops the Trainer on accelnb's Stop."""
    from transformers import TrainerCallback

    class TrainerSaveOnStop(TrainerCallback):  # type: ignore[misc]
        """Save a checkpoint and end ``Trainer.train()`` at the step Stop was pressed (accelnb).

        ``Trainer(..., callbacks=[accelnb.TrainerSaveOnStop()])``; resume with
        ``trainer.train(resume_from_checkpoint=transformers.trainer_utils.get_last_checkpoint(output_dir))``.
        """

        stopped_at: int | None = None  # the global step it stopped at, once it did

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if stop_requested():
                self.stopped_at = state.global_step
                control.should_save = True
                control.should_training_stop = True
            return control

    return TrainerSaveOnStop


@functools.cache
def lightning_save_on_stop_class() -> type:
    """The Lightning ``Callback`` that saves and stops the Trainer on accelnb's Stop."""
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the standalone package
        from pytorch_lightning import Callback  # type: ignore[assignment]

    class LightningSaveOnStop(Callback):  # type: ignore[misc]
        """Save ``dirpath/stopped.ckpt`` and stop ``Trainer.fit()`` at the step Stop was pressed.

        ``Trainer(callbacks=[stop := accelnb.LightningSaveOnStop("checkpoints")])``; resume with
        ``trainer.fit(model, ckpt_path=stop.resume_path())`` (None, a fresh start, when there is
        no checkpoint yet).
        """

        def __init__(self, dirpath: str | os.PathLike[str], filename: str = "stopped.ckpt") -> None:
            self.path = Path(dirpath) / filename
            self.stopped_at: int | None = None
            self._last_step: int | None = None  # the global step at the last check

        def resume_path(self) -> str | None:
            """The checkpoint a stopped run saved, or None when there is none."""
            return str(self.path) if self.path.exists() else None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._last_step = trainer.global_step  # a resumed run's restored step

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            # Lightning calls this after every batch, also after a batch whose gradients are only
            # accumulated (accumulate_grad_batches > 1): a checkpoint there drops those gradients,
            # and the resumed run's first optimizer step then has fewer batches than the others.
            # So check only after a batch that stepped the optimizer (global_step moved); every
            # DDP rank steps at the same batches, so the ranks still check equally often.
            if trainer.global_step == self._last_step:
                return
            self._last_step = trainer.global_step
            if stop_requested():
                self.stopped_at = trainer.global_step
                trainer.save_checkpoint(str(self.path))
                trainer.should_stop = True

    return LightningSaveOnStop


def __getattr__(name: str) -> type:
    """``TrainerSaveOnStop`` and ``LightningSaveOnStop``, made (and their library imported) on first use."""
    if name == "TrainerSaveOnStop":
        return trainer_save_on_stop_class()
    if name == "LightningSaveOnStop":
        return lightning_save_on_stop_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
