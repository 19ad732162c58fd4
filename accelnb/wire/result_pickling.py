"""Pickling values for the trip from a worker back to the kernel.

Tensors travel on the CPU: unpickling a CUDA tensor would initialise CUDA in the kernel (which
then breaks every later fork-based launcher) and would land on the wrong device anyway, since each
worker numbers its GPUs from 0. Parameters stay parameters, so a returned ``nn.Module`` works.

    >>> import torch
    >>> loads_in_kernel(dumps_for_kernel({"w": torch.ones(2)}))["w"].device.type
    'cpu'
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle


class _CpuTensorPickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = _torch_if_loaded()
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            if isinstance(obj, torch.nn.Parameter):
                return torch.nn.Parameter, (obj.detach().cpu(), obj.requires_grad)
            return _identity, (obj.detach().cpu().requires_grad_(obj.requires_grad),)
        return super().reducer_override(obj)


def _identity(value: Any) -> Any:
    return value


def _torch_if_loaded() -> Any:
    import sys

    return sys.modules.get("torch")


def dumps_for_kernel(value: Any) -> bytes:
    buffer = io.BytesIO()
    _CpuTensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def loads_in_kernel(data: bytes) -> Any:
    return cloudpickle.loads(data)
