"""``%%distributed --sweep NAME``: the cell runs once per config of the notebook's list ``NAME``,
each run a trial of :func:`accelnb.sweep` with ``config`` bound in the cell.

    configs = [{"lr": 1e-3}, {"lr": 1e-2}]

    %%distributed --sweep configs --best loss
    model = DDP(Net().to(device), device_ids=[device])
    loss = train(model, lr=config["lr"])       # report(loss=...) inside fills the table's metrics
    loss                                       # the trial's value

The magic (:mod:`accelnb.notebook.magic`) parses the line and builds the cell's request as for a
plain cell (the notebook names the cell reads, shipped; ``config`` never is); this module makes
one request per config and runs them as a sweep. A trial's value is the cell's last expression
on rank 0; the names a cell assigns stay on its ranks (a sweep has one cell run per config, and
the notebook one namespace). The trials are ``_sweep`` in the notebook, also after Stop or a
``--fail-fast`` failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from accelnb.kernel.sweep.trials import Trials
from accelnb.sweeper import run_sweep
from accelnb.wire.cell_contract import RUN_CELL, CellOutcome, CellRequest
from accelnb.wire.result_pickling import loads_in_kernel

CONFIG_NAME = "config"  # what the cell calls the config of its trial
# The line's flags of a sweep, as run_sweep's keywords (the magic adds them to its cell grammar).
SWEEP_FLAGS = ("sweep", "gpus_per_trial", "max_concurrent", "best", "mode", "fail_fast")


def run_cell_sweep(request: CellRequest, configs: Any, options: Mapping[str, Any], sweep: Mapping[str, Any],
                   namespace: dict[str, Any]) -> None:
    """Run the cell of ``request`` once per config (``sweep``: the line's sweep flags, its name
    removed; ``options``: its launch options), leaving the trials in ``namespace["_sweep"]``."""
    keywords = dict(options)
    gpus = keywords.pop("gpus", None)
    try:
        trials = run_sweep(RUN_CELL, configs, keywords, gpus=gpus, caller="%%distributed --sweep",
                           args_of=lambda config: (_bound(request, config),), value_of=cell_value, **sweep)
    except BaseException as error:
        kept = getattr(error, "trials", None)
        if isinstance(kept, Trials):
            namespace["_sweep"] = kept
        raise
    namespace["_sweep"] = trials


def _bound(request: CellRequest, config: Any) -> CellRequest:
    return replace(request, names={**request.names, CONFIG_NAME: config}, return_names=[])


def cell_value(outcome: CellOutcome | None) -> Any:
    """A cell run's value: its last expression on rank 0 (its repr, where it does not pickle)."""
    if outcome is None:
        return None
    if outcome.last_value is not None:
        return loads_in_kernel(outcome.last_value)
    return outcome.last_value_repr
