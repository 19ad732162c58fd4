"""What a ``%%distributed`` cell sends to the ranks and what comes back: the kernel↔worker contract.

The magic (``notebook/magic.py``, in the kernel) builds a :class:`CellRequest` and launches
:data:`RUN_CELL` with it; every rank runs the cell (``worker/cell_runner.py``) and the reply rank
answers with a :class:`CellOutcome`. Both sides import these from here, so the kernel never
imports the worker's code and the worker never imports the notebook's: :data:`RUN_CELL` names
the worker's function, and the rank imports it when called.

    >>> request = CellRequest.read("x = rank", filename="<cell In[1]>", header="%%distributed",
    ...                            names={}, modules={}, return_names=None)
    >>> request.assigned_names, request.last_expression
    (('x',), None)
    >>> session.run(RUN_CELL, (request,))                     # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from accelnb.wire.buffers import Packed, plain_record
from accelnb.wire.cell_analysis import LastExpression, assigned_names, last_expression

# What a cell brings back unless --return-limit says otherwise (``worker/return_budget.py``).
DEFAULT_RETURN_LIMIT = 256 * 2**20


@plain_record
@dataclass(frozen=True)
class CellRequest:
    source: str  # the cell body, without the %%distributed line
    filename: str  # "<cell In[3]>", shown in tracebacks
    header: str  # the %%distributed line: line 1 of the cell as the notebook shows it
    names: dict[str, Any]  # notebook values the cell uses
    modules: dict[str, str]  # name → module to import, for notebook names that are modules
    return_names: list[str] | None  # None: every assigned name, within return_limit; []: none
    # What the kernel read in the source (``wire/cell_analysis.py``), so that no rank parses it:
    assigned_names: tuple[str, ...]  # bound at the cell's top level: what comes back unless return_names
    last_expression: LastExpression | None  # where the cell's value is, when it ends with an expression
    return_limit: int | None = DEFAULT_RETURN_LIMIT  # bytes; None: no budget
    reply_rank: int = 0  # the rank whose value and names come back (the first of --ranks)

    @classmethod
    def read(cls, source: str, *, filename: str, header: str, names: dict[str, Any], modules: dict[str, str],
             return_names: list[str] | None, return_limit: int | None = DEFAULT_RETURN_LIMIT,
             reply_rank: int = 0) -> CellRequest:
        """The request for ``source``, with what the kernel reads in it; raises ``SyntaxError``
        (its positions counted in ``source``) for a cell Python cannot parse."""
        return cls(source=source, filename=filename, header=header, names=names, modules=modules,
                   return_names=return_names, assigned_names=assigned_names(source),
                   last_expression=last_expression(source), return_limit=return_limit, reply_rank=reply_rank)


@plain_record
@dataclass
class CellOutcome:
    last_value: Packed | None = None  # pickled for the kernel; its buffers travel in shared memory
    last_value_repr: str | None = None  # when the value does not pickle
    returned: dict[str, Packed] = field(default_factory=dict)
    not_returned: dict[str, str] = field(default_factory=dict)  # name → why
    kept_for_size: dict[str, int] = field(default_factory=dict)  # name → estimated bytes, over the budget
    unwrapped: list[str] = field(default_factory=list)  # DDP models sent back as their .module


@plain_record
@dataclass(frozen=True)
class WorkerFunction:
    """A worker-side function named by its module and name: pickled as these two strings, it
    reaches the ranks without the kernel importing the module; the rank imports it when called."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)


RUN_CELL = WorkerFunction("accelnb.worker.cell_runner", "run_cell")
