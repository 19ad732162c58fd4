"""Route Accelerate's experiment tracking (``accelerator.log``) to accelnb's live view.

    from accelerate import Accelerator
    from accelnb import AccelerateTracker

    def train():
        accelerator = Accelerator(log_with=AccelerateTracker())
        accelerator.init_trackers("my-run", config={"lr": 1e-3})
        for step in range(1000):
            ...
            accelerator.log({"loss": loss.item(), "lr": lr}, step=step)   # → accelnb.report
        accelerator.end_training()

It is an ``accelerate.tracking.GeneralTracker``, so it combines with other trackers
(``log_with=["tensorboard", AccelerateTracker()]``). Accelerate logs on the main process only,
so the values are rank 0's. Numbers and one-element tensors are reported; nested dicts (what
TensorBoard's ``add_scalars`` takes) become ``"outer/inner"`` names; strings and other values
that are not scalars are skipped, as they cannot be charted. A logged ``"step"`` value is used as
the step when ``step=`` is not given; metrics named ``rank`` or ``time`` (the history's own
columns) are kept as ``rank_`` and ``time_`` (and ``attempt`` as ``attempt_``).

Importing this module does not import accelerate (accelnb works without it): the class becomes a
``GeneralTracker`` subclass the first time one is made, and making one without accelerate
installed raises an ``ImportError`` saying what to install.

Module-level state: ``_tracker_class``, the subclass of Accelerate's ``GeneralTracker`` made on
first use (Accelerate is imported only then); one class per process serves every tracker.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from accelnb.worker import report

_tracker_class: type | None = None


class AccelerateTracker:
    """An Accelerate tracker that reports to accelnb: ``Accelerator(log_with=AccelerateTracker())``."""

    name = "accelnb"
    requires_logging_directory = False
    main_process_only = True

    def __new__(cls, *args: Any, **kwargs: Any) -> AccelerateTracker:
        if cls is AccelerateTracker:  # become a GeneralTracker, which Accelerate checks for
            cls = _general_tracker_class()
        return super().__new__(cls)

    def __init__(self, run_name: str | None = None) -> None:
        self.run_name = run_name
        self.config: dict[str, Any] = {}

    @property
    def tracker(self) -> AccelerateTracker:
        return self

    def start(self) -> None:
        pass

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Keeps the run's hyperparameters on the tracker (``.config``); they are not metrics."""
        self.config.update(values)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        scalars: dict[str, Any] = {}
        _flatten(values, "", scalars)
        logged_step = scalars.pop("step", None)
        if step is None and logged_step is not None:  # log({"step": s, …}) means step=s
            step = int(logged_step)
        for reserved in ("rank", "attempt", "time"):  # the history's own columns
            if reserved in scalars:
                scalars[f"{reserved}_"] = scalars.pop(reserved)
        if scalars:
            report.report(scalars, step=step)

    def finish(self) -> None:
        report.flush()

    def __reduce__(self) -> tuple[Any, ...]:
        # The GeneralTracker subclass is made at run time, so pickle by the public class.
        return (AccelerateTracker, (self.run_name,), {"config": self.config})

    def __repr__(self) -> str:
        return f"AccelerateTracker(run_name={self.run_name!r})"


def _flatten(values: Mapping[str, Any], prefix: str, into: dict[str, Any]) -> None:
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(value, name + "/", into)
        elif _is_scalar(value):
            into[name] = value
        # strings, images, tables: nothing to chart


def _is_scalar(value: Any) -> bool:
    if isinstance(value, numbers.Number):
        return not isinstance(value, complex)
    if hasattr(value, "numel"):  # a tensor
        return bool(value.numel() == 1)
    return hasattr(value, "item") and getattr(value, "size", None) == 1  # a numpy scalar or array


def _general_tracker_class() -> type:
    global _tracker_class
    if _tracker_class is None:
        try:
            from accelerate.tracking import GeneralTracker
        except ImportError:
            raise ImportError("accelnb.AccelerateTracker needs Hugging Face Accelerate: "
                              "pip install accelerate") from None
        _tracker_class = type("AccelerateTracker", (AccelerateTracker, GeneralTracker),
                              {"__module__": __name__, "__doc__": AccelerateTracker.__doc__})
    return _tracker_class
