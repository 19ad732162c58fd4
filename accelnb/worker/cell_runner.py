"""The worker half of ``%%distributed``: execute a notebook cell's source on one rank.

The kernel sends a ``CellRequest`` (``wire/cell_contract.py``: source, the notebook names the
cell uses, modules to import); every rank executes it in a namespace that lives as long as the worker (so a persistent
session keeps variables between cells), with ``rank``, ``local_rank``, ``world_size`` and
``device`` predefined. ``device`` is the rank's planned device, read from ``ACCELNB_DEVICE`` and
never re-derived here: a synthetic inventory on a GPU host plans cpu, and the cell gets cpu. The
source is registered with ``linecache`` under the cell's own file name, so tracebacks show the
cell's line numbers and lines. Rank 0 (the first of ``--ranks``) sends back the value of the last
expression and the names the cell assigned (tensors on the CPU), within a size budget
(``worker/return_budget.py``).

    >>> run_cell(CellRequest.read("x = rank\nx + 1", filename="<cell In[1]>",
    ...                           header="%%distributed", names={}, modules={}, return_names=None))
    ... # doctest: +SKIP  (inside a rank)

The rank compiles the source as it is: the kernel read it already (``wire/cell_analysis.py``) and
the request says which names the cell assigns and where its last expression is, so no rank builds
a syntax tree (for a 26-line cell, 360 µs a rank against 170 for compiling the text alone).

The notebook's names that the cell uses come with it (``request.names``), but never over a name
that a cell bound on this rank: the rank's own value wins, as the kernel, which ships no name an
earlier cell of the session assigned, means it to. The kernel knows only what cells that
succeeded assigned; a cell that failed or was interrupted half-way bound some names here, and the
notebook's value of one of them (its own ``model``) must not replace the rank's. A name holds
what was shipped as long as it holds that very object; a cell that binds it to another object
makes it the rank's. The object is known by a weak reference, or, for the builtin types that take
none (numbers, strings, lists, dicts), by its id: keeping it would keep alive what a cell lets go
of (``del data; torch.cuda.empty_cache()``). Such an object, freed by the cell, whose address a new
one of the same name takes, looks shipped: the notebook's value comes back, as it always did.

Module-level state: ``_namespace``, the rank's ``__main__`` namespace for cells; a session's rank
runs the cells of one notebook, which share one namespace as the kernel's cells do.
``_shipped``: for each name the notebook shipped, the object it was set to (:func:`_mark`).
``_identity``: ``rank``, ``local_rank``, ``world_size`` and ``device``, read from the rank's
environment at its first cell (a process is one rank for its whole life), set again before each.
"""

from __future__ import annotations

import importlib
import linecache
import os
import weakref
from typing import Any

from accelnb.wire.cell_analysis import runnable_parts
from accelnb.wire.cell_contract import CellOutcome, CellRequest
from accelnb.wire.result_pickling import dumps_for_kernel
from accelnb.worker.return_budget import choose_returns

_namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
_shipped: dict[str, weakref.ref[Any] | int] = {}
_identity: dict[str, Any] = {}
# Set by the planner (accelnb.kernel.planning.rank_plan.DEVICE_ENV) in every rank's environment; the worker
# side may not import the kernel's modules, and tests/test_planning.py pins the two names equal.
DEVICE_ENV = "ACCELNB_DEVICE"


def run_cell(request: CellRequest) -> CellOutcome | None:
    """Execute the cell on this rank; the reply rank (0) returns what goes back to the notebook."""
    import torch

    namespace = _namespace
    for name, module in request.modules.items():
        namespace[name] = importlib.import_module(module)
    for name, value in request.names.items():
        if name in namespace and not _holds_what_was_shipped(name, namespace[name]):
            continue  # a cell bound it here (one that failed, or ran on some ranks only): the rank's
        namespace[name] = value
        _shipped[name] = _mark(value)
    if not _identity:
        _identity.update(rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                         world_size=int(os.environ["WORLD_SIZE"]), device=torch.device(os.environ[DEVICE_ENV]))
    namespace.update(_identity)  # a cell may have rebound one
    rank = _identity["rank"]

    # Line numbers count from the magic line, as the notebook shows the cell.
    lines = [request.header + "\n", *request.source.splitlines(keepends=True)]
    linecache.cache[request.filename] = (sum(map(len, lines)), None, lines, request.filename)
    statements, expression = runnable_parts(request.source, request.last_expression, lines_before=1)
    exec(compile(statements, request.filename, "exec"), namespace)
    value = eval(compile(expression, request.filename, "eval"), namespace) if expression is not None else None
    if rank != request.reply_rank:
        return None

    outcome = CellOutcome()
    if value is not None:
        try:
            outcome.last_value = dumps_for_kernel(value)
        except Exception:
            outcome.last_value_repr = repr(value)
    explicit = request.return_names is not None
    wanted = request.return_names if request.return_names is not None else request.assigned_names
    for name in wanted:
        if name not in namespace:
            outcome.not_returned[name] = f"not defined on rank {rank}"
    present = [name for name in wanted if name in namespace]
    choice = choose_returns(namespace, present, explicit=explicit, limit=request.return_limit)
    outcome.not_returned.update(choice.kept_for_kind)
    outcome.kept_for_size = choice.kept_for_size
    for name in choice.send:
        value = namespace[name]
        if isinstance(value, torch.nn.parallel.DistributedDataParallel):
            # The wrapper only works inside a process group; the notebook gets the model itself.
            value = value.module
            outcome.unwrapped.append(name)
        try:
            outcome.returned[name] = dumps_for_kernel(value)
        except Exception as error:
            outcome.not_returned[name] = f"{type(namespace[name]).__name__} cannot be pickled ({error})"
    return outcome


def _mark(value: Any) -> weakref.ref[Any] | int:
    """What knows ``value`` again without keeping it alive: a weak reference, else its id."""
    try:
        return weakref.ref(value)
    except TypeError:
        return id(value)


def _holds_what_was_shipped(name: str, held: Any) -> bool:
    mark = _shipped.get(name)
    if isinstance(mark, weakref.ref):
        return mark() is held
    return mark == id(held)
