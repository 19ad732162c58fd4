"""Pickling what a worker sends back to the kernel: return values and exceptions alike.

Tensors travel on the CPU: unpickling a CUDA tensor would initialise CUDA in the kernel (which
then breaks every later fork-based launcher) and would land on the wrong device anyway, since each
worker numbers its GPUs from 0. Parameters stay parameters, so a returned ``nn.Module`` works.
Big buffers are set aside for shared memory (``wire/buffers.py``). Exceptions go the same way
(:func:`dumps_exception_for_kernel`), since their arguments can hold tensors too.

    >>> import torch
    >>> loads_in_kernel(dumps_for_kernel({"w": torch.ones(2)}))["w"].device.type
    'cpu'
    >>> type(loads_in_kernel(dumps_exception_for_kernel(ValueError("bad", torch.ones(1))))).__name__
    'ValueError'
"""

from __future__ import annotations

from typing import Any

from accelnb.wire import buffers
from accelnb.wire.buffers import Packed


def dumps_for_kernel(value: Any) -> Packed:
    """``value`` pickled for the kernel: tensors on the CPU, big buffers left out for shared memory."""
    return buffers.dump(value, to_cpu=True)


def loads_in_kernel(data: Packed) -> Any:
    """Rebuild a value of :func:`dumps_for_kernel`, over its buffers (a mapping: no copy)."""
    return buffers.load(data)


def dumps_exception_for_kernel(error: BaseException) -> Packed | None:
    """``error`` pickled like a return value, in a form the kernel can rebuild, or None.

    When the exception cannot travel as it is (an argument that does not pickle, such as a
    lock, or an ``__init__`` that unpickling cannot call), its type travels with its arguments
    as text, so that the kernel still raises that type (``except ValueError`` keeps working).
    """
    for candidate in (error, _ExceptionAsText(error)):
        try:
            data = dumps_for_kernel(candidate)
            loads_in_kernel(data)  # some exceptions pickle but cannot be rebuilt
        except Exception:
            continue
        return data
    return None


class _ExceptionAsText:
    """Pickles as ``type(error)`` holding its picklable arguments, and the others as their repr."""

    def __init__(self, error: BaseException) -> None:
        self.kind = type(error)
        self.args = tuple(_picklable_or_text(arg) for arg in error.args)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_exception, (self.kind, self.args)


def _rebuild_exception(kind: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    error = kind.__new__(kind, *args)  # not kind(*args): its __init__ may want other arguments
    error.args = args
    return error


def _picklable_or_text(value: Any) -> Any:
    try:
        dumps_for_kernel(value)
        return value
    except Exception:
        pass
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__qualname__} object>"
