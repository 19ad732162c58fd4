"""Packing the user's function and arguments for the trip to the workers, with precise errors.

cloudpickle carries functions, lambdas, closures and classes defined in notebook cells by value;
tensors and arrays are left out of the pickle, to be written once into shared memory for every
rank (``wire/buffers.py``); a CUDA tensor travels as a CPU copy. When something cannot travel,
the error names exactly which argument (or which global the
function uses) is at fault and what type it is, before any process starts.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from accelnb.errors import LaunchConfigError, UnpicklableError
from accelnb.kernel.display.output import notebook_sink
from accelnb.wire.buffers import Packed, dump

BIG_PICKLE_BYTES = 100 * 2**20

_HINT = ("Create it inside the function instead (workers are separate processes), or pass "
         "something that can be pickled, such as a file path or a config dict.")


def pack_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Packed:
    """Pack ``(fn, args, kwargs)`` (no copy of big buffers) or raise :class:`UnpicklableError` naming the culprit."""
    if not callable(fn):
        raise LaunchConfigError(
            f"The function to launch must be callable, got {type(fn).__name__} {fn!r}. "
            "Pass the function itself (notebook_launcher(train)), not its result (train()).")
    if not isinstance(args, (tuple, list)):
        raise LaunchConfigError(
            f"args must be a tuple of positional arguments, got {type(args).__name__}. "
            "For one argument write args=(value,).")
    started = time.perf_counter()
    try:
        packed = dump((fn, tuple(args), dict(kwargs)))
    except Exception as error:
        raise _find_culprit(fn, args, kwargs, error) from None
    if len(packed.body) > BIG_PICKLE_BYTES:
        notebook_sink("stderr", big_pickle_note(len(packed.body), time.perf_counter() - started))
    return packed


def big_pickle_note(size: int, seconds: float) -> str:
    """What the cell says of a call whose pickle is ``size`` bytes (see the module docstring)."""
    return (f"accelnb: the function and its arguments pickle to {size / 2**20:.0f} MiB ({seconds:.1f} s to pickle, "
            "and each rank unpickles them again). Tensors and numpy arrays travel without pickling, through "
            "shared memory; for other big data, load it inside the function (pass a file path), or start an "
            "accelnb.Session and keep it on the ranks between calls.\n")


def check_picklable(what: str, value: Any, hint: str = _HINT) -> None:
    try:
        dump(value)
    except Exception as error:
        raise UnpicklableError(what, value, _reason(error), hint) from None


def _find_culprit(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                  error: Exception) -> UnpicklableError:
    for index, value in enumerate(args):
        try:
            dump(value)
        except Exception as inner:
            return UnpicklableError(f"Argument {index} (args[{index}])", value, _reason(inner), _HINT)
    for name, value in kwargs.items():
        try:
            dump(value)
        except Exception as inner:
            return UnpicklableError(f"Keyword argument {name!r}", value, _reason(inner), _HINT)
    for name, value in _referenced_names(fn).items():
        try:
            dump(value)
        except Exception as inner:
            return UnpicklableError(
                f"The name {name!r}, which {getattr(fn, '__name__', 'the function')} uses,",
                value, _reason(inner), _HINT)
    return UnpicklableError("The function", fn, _reason(error), _HINT)


def _referenced_names(fn: Callable[..., Any]) -> dict[str, Any]:
    """Globals and closure variables the function reads (what cloudpickle must carry)."""
    try:
        closure = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return {}
    return {**closure.nonlocals, **closure.globals}


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
