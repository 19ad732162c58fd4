"""Which names a ``%%distributed`` cell brings back to the notebook, and which stay on the ranks.

Bringing back every name a cell assigns is what makes ``%%distributed`` feel like a normal cell,
until the cell holds a 7B model and its Adam state: ~100 GB pickled into the kernel. So names
come back while their total size stays under a budget (256 MiB unless ``--return-limit`` says
otherwise); past it the biggest stay on rank 0, and the notebook says, for each, its size and
how to get it. Names listed with ``--return`` always come back: the user asked for them.

Sizes are estimated *without pickling*: a tensor's or an array's size is known from its
storage, and containers, modules, optimizers and dataclasses are walked (each storage counted
once: an optimizer's parameters are the model's). Pickling a 10 GB model only to learn that it
is too big would cost what the budget is there to avoid.

Some objects make no sense in the kernel whatever their size, and are never brought back
unless named with ``--return``: a ``DataLoader`` (its workers and sampler belong to the rank), a
sampler (it splits data by the rank's place in the group), an FSDP-wrapped model (it holds one
rank's shard). A DDP wrapper comes back as its ``.module`` (``cell_runner``).

    >>> choose_returns({"x": 1, "big": bytearray(300_000_000)}, ["x", "big"], explicit=False,
    ...                limit=256_000_000).kept_for_size
    {'big': 300000000}
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# 256 MiB: a "256 MB" tensor as people make one (torch.zeros(64 * 2**20)) still comes back.
_MAX_OBJECTS_WALKED = 200_000  # a list of a million small objects is estimated from its first part


@dataclass
class ReturnChoice:
    """The names to send back, and why the others stay on the ranks."""

    send: list[str] = field(default_factory=list)
    kept_for_size: dict[str, int] = field(default_factory=dict)  # name → estimated bytes
    kept_for_kind: dict[str, str] = field(default_factory=dict)  # name → why it makes no sense here


def choose_returns(namespace: Mapping[str, Any], names: list[str], explicit: bool,
                   limit: int | None) -> ReturnChoice:
    """Pick the names (present in ``namespace``) that come back; smallest first, up to ``limit``.

    ``explicit``: the user listed ``names`` with ``--return``; they all come back.
    ``limit`` None: no budget.
    """
    choice = ReturnChoice()
    if explicit:
        choice.send = list(names)
        return choice
    sized = []
    for name in names:
        why = reason_to_keep_on_ranks(namespace[name])
        if why is not None:
            choice.kept_for_kind[name] = why
        else:
            sized.append((estimated_size(namespace[name]), name))
    total = 0
    for size, name in sorted(sized):
        if limit is None or total + size <= limit:
            total += size
            choice.send.append(name)
        else:
            choice.kept_for_size[name] = size
    choice.send.sort(key=names.index)  # the cell's order, as the notebook reads it
    return choice


def reason_to_keep_on_ranks(value: Any) -> str | None:
    """Why ``value`` makes no sense in the notebook, or None when it does."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    data = torch.utils.data
    if isinstance(value, data.DataLoader):
        return ("a DataLoader: its workers and sampler belong to this rank; build one in the notebook "
                "from the dataset instead")
    if isinstance(value, data.Sampler):
        return "a sampler: it splits the data by this rank's place in the process group"
    if _is_fsdp(value, torch):
        return ("an FSDP-wrapped model holds only this rank's shard; gather a full state_dict on "
                "rank 0 and return that")
    return None


def _is_fsdp(value: Any, torch: Any) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(value, torch.nn.Module):
        return False
    kinds = tuple(kind for kind in (getattr(fsdp, "FullyShardedDataParallel", None),
                                    getattr(fsdp, "FSDPModule", None)) if isinstance(kind, type))
    return isinstance(value, kinds)


def estimated_size(value: Any) -> int:
    """About how many bytes ``value`` pickles to, found without pickling it."""
    return _SizeWalk().total(value)


class _SizeWalk:
    def __init__(self) -> None:
        self.seen: set[object] = set()  # ids of objects, and (storage, data pointer, device) keys
        self.walked = 0

    def total(self, root: Any) -> int:
        size = 0
        pending = [root]
        while pending and self.walked < _MAX_OBJECTS_WALKED:
            value = pending.pop()
            if id(value) in self.seen:
                continue
            self.seen.add(id(value))
            self.walked += 1
            own, inside = self._measure(value)
            size += own
            pending.extend(inside)
        return size

    def _measure(self, value: Any) -> tuple[int, list[Any]]:
        """(bytes of ``value`` itself, the objects it holds)."""
        if value is None or isinstance(value, (bool, int, float, complex)):
            return 8, []
        if isinstance(value, (str, bytes, bytearray, memoryview)):
            return len(value) if not isinstance(value, memoryview) else value.nbytes, []
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            return self._storage_bytes(value), []
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(value, numpy.ndarray):
            return int(value.nbytes), []
        if isinstance(value, Mapping):
            return 16 * len(value), [*value.keys(), *value.values()]
        if isinstance(value, (list, tuple, set, frozenset)):
            return 8 * len(value), list(value)
        if isinstance(value, type) or (callable(value) and not hasattr(value, "__dict__")):
            return 64, []
        inside = list(vars(value).values()) if hasattr(value, "__dict__") else []
        inside += [getattr(value, slot) for slot in getattr(type(value), "__slots__", ())
                   if isinstance(slot, str) and hasattr(value, slot)]
        return 64, inside

    def _storage_bytes(self, tensor: Any) -> int:
        """The tensor's storage, once per storage: views and shared parameters cost nothing more."""
        try:
            storage = tensor.untyped_storage()
            key = ("storage", storage.data_ptr(), tensor.device.type)
            if key in self.seen:
                return 0
            self.seen.add(key)
            return int(storage.nbytes())
        except (RuntimeError, NotImplementedError):  # meta, sparse and other storage-less tensors
            return int(tensor.numel() * tensor.element_size())
