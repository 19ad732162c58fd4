"""Pickling that leaves big buffers out of the pickle: the data plane's half of every value.

:func:`dump` cloudpickles a value with protocol 5 and sets every big buffer aside, without
copying it: a CPU torch tensor reduces to a rebuild from a :class:`pickle.PickleBuffer` over its
storage's bytes (plus dtype, shape, stride, offset, ``requires_grad``; a ``Parameter`` stays a
``Parameter``, views of one storage stay views of one storage), numpy arrays and anything else
with protocol-5 out-of-band buffers give theirs. Code objects keep their file name
(``wire/code_pickling.py``); the submodules a function reaches are found without reading all of
``sys.modules`` (``wire/submodule_scan.py``). The result, a :class:`Packed`, holds the pickle
and those buffers; pickled again inside a message by ``wire/channel.py``, its buffers are written
once into shared memory (``wire/shared_memory.py``) and every receiver maps the same pages.
:func:`load` rebuilds tensors and arrays *over* the buffers it is given (``torch.frombuffer``,
``numpy.frombuffer``): over a mapping, nothing is copied and the objects keep the mapping alive.

    >>> import torch
    >>> packed = dump({"w": torch.arange(4.0)})
    >>> load(packed)["w"].tolist(), len(packed.buffers)
    ([0.0, 1.0, 2.0, 3.0], 1)

A tensor on another device travels as a CPU copy (:func:`dump` with ``to_cpu=True``, the
default): unpickling a CUDA tensor in the kernel would initialise CUDA there, and it would land on
the wrong device anyway. Tensors of other layouts (sparse, quantized, nested) and tensor subclasses
other than ``Parameter`` go through torch's own pickling. A view ships its whole storage, as
torch's own pickling does.

Numbers (2-core VM shared with other jobs; benchmarks/bench_data.py and RESULTS.md, issue 12):
before this, a 256 MiB tensor went in through cloudpickle and each rank's inbox pipe in ~11 s
(Accelerate's fork: 0.35 s) and came back in ~5.7 s; now the kernel copies it once into a memfd
(about one memcpy) and the ranks map it. Where inline stops paying, one frame's round trip
(encode, send, receive, rebuild, read every byte; medians of 30, machine under load):

    buffers   inline     memfd
     64 KiB   0.22 ms    0.24 ms
    256 KiB   6.2 ms     7.2 ms
      1 MiB   10.3 ms    7.6 ms
      4 MiB   49 ms      28 ms
     16 MiB   203 ms     57 ms

hence ``channel.INLINE_LIMIT_BYTES`` = 1 MiB: below it a memfd (create, write, pass the fd, map,
unmap) costs more than the copy through the socket it saves.

A value made only of plain data (numbers, strings, bytes, their tuples, lists, sets and dicts,
and accelnb's own records of them, :func:`plain_record`) holds nothing cloudpickle or the tensor
reduction would treat differently: :func:`dump` hands it to the C pickler directly. The records
are the classes :func:`plain_record` registered (``_PLAIN_RECORDS``, one set per process, as
classes are, filled as their modules are imported). A session
cell's call and its answer are such values; cloudpickle's per-object hook made each 4 times
slower to pickle (11 µs against 2.7, and about three times that in a kernel between cells).
"""

from __future__ import annotations

import ctypes
import io
import pickle
import sys
import types
from typing import Any, TypeVar

import cloudpickle

from accelnb.wire import submodule_scan
from accelnb.wire.code_pickling import reduce_code

# cloudpickle's scan of sys.modules for a function's submodules cost 2.6 ms of every launch.
submodule_scan.install()


class Packed:
    """A value pickled by :func:`dump`: the pickle, and the buffers it leaves out, in order."""

    __slots__ = ("_keepalive", "body", "buffers")

    def __init__(self, body: bytes, buffers: list[Any], keepalive: list[Any] | None = None) -> None:
        self.body = body
        self.buffers = buffers  # PickleBuffers or contiguous memoryviews
        self._keepalive = keepalive or []  # the storages the buffers point into, while we send them

    @property
    def nbytes(self) -> int:
        return sum(memoryview(buffer).nbytes for buffer in self.buffers)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if protocol < 5:  # pickled by someone else (a RankFailure the user pickles): plain copies
            return _unpacked, (self.body, *(bytearray(_raw(b)) for b in self.buffers))
        # The buffers stay out of band in the message that carries us, too.
        return _unpacked, (self.body, *(pickle.PickleBuffer(b) for b in self.buffers))

    def __eq__(self, other: object) -> bool:
        """The same pickle and the same bytes (a pickled and unpickled copy is equal)."""
        if not isinstance(other, Packed):
            return NotImplemented
        return self.body == other.body and len(self.buffers) == len(other.buffers) and all(
            _raw(a) == _raw(b) for a, b in zip(self.buffers, other.buffers, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable buffers: not hashable


def _raw(buffer: Any) -> memoryview:
    """A buffer's bytes, flat (a PickleBuffer of a Fortran-ordered array included)."""
    return buffer.raw() if isinstance(buffer, pickle.PickleBuffer) else memoryview(buffer).cast("B")


def _unpacked(body: bytes, *buffers: Any) -> Packed:
    return Packed(body, list(buffers))


def dump(value: Any, to_cpu: bool = True) -> Packed:
    """``value`` pickled with its big buffers set aside (not copied); raises what pickling raises."""
    if _is_plain(value):
        return Packed(pickle.dumps(value, protocol=5), [])
    stream = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    pickler = _BufferPickler(stream, protocol=5, buffer_callback=buffers.append)
    pickler.to_cpu = to_cpu
    pickler.dump(value)
    return Packed(stream.getvalue(), list(buffers), pickler.keepalive)


def load(packed: Packed) -> Any:
    """The value of :func:`dump`, rebuilt over ``packed.buffers`` (no copy)."""
    return pickle.loads(packed.body, buffers=packed.buffers)


Record = TypeVar("Record", bound=type)

# Exactly these types (a subclass may pickle otherwise): what pickle writes as it is, by value.
_PLAIN_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_CONTAINERS = frozenset({tuple, list, set, frozenset})
_PLAIN_RECORDS: set[type] = set()
# Objects looked at, atoms included, before a value counts as too big to be worth the check (the
# pickling then takes longer than the look anyway): a list of ten million ints is not walked and
# copied before it is pickled. A cycle ends there too.
PLAIN_CHECK_LIMIT = 1024


def plain_record(kind: Record) -> Record:
    """Class decorator for accelnb's records that travel between kernel and ranks: a module-level
    class (pickled by reference on both sides) whose instances pickle as their attributes. An
    instance is plain data when every attribute is."""
    _PLAIN_RECORDS.add(kind)
    return kind


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data throughout (see the module docstring), within
    :data:`PLAIN_CHECK_LIMIT` objects."""
    pending = [value]
    looked_at = 1
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _PLAIN_ATOMS:
            continue
        if kind in _PLAIN_CONTAINERS or kind is dict:
            looked_at += len(item) * (2 if kind is dict else 1)  # before anything is copied
            if looked_at > PLAIN_CHECK_LIMIT:
                return False
            if kind is dict:
                pending.extend(item.keys())
                pending.extend(item.values())
            else:
                pending.extend(item)
        elif kind is Packed:  # without buffers: its pickle's bytes, and nothing out of band
            if item.buffers:
                return False
        elif kind in _PLAIN_RECORDS and hasattr(item, "__dict__"):
            attributes = vars(item)
            looked_at += len(attributes)
            if looked_at > PLAIN_CHECK_LIMIT:
                return False
            pending.extend(attributes.values())
        else:
            return False
    return True


class _BufferPickler(cloudpickle.Pickler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.to_cpu = True
        self.keepalive: list[Any] = []
        self._storages: dict[tuple[int, int], _StorageBytes] = {}

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:  # keeps its file name, which cloudpickle 3.1.3 drops
            reduced_code = reduce_code(obj)
            if reduced_code is not None:
                return reduced_code
        torch = sys.modules.get("torch")  # no tensor can exist before torch is imported
        if torch is not None and isinstance(obj, torch.Tensor):
            reduced = self._reduce_tensor(torch, obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def _reduce_tensor(self, torch: Any, obj: Any) -> Any:
        kind = type(obj)
        on_cpu = obj.device.type == "cpu"
        plain = (kind in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided
                 and not obj.is_quantized and not obj.is_nested and obj.device.type != "meta")
        if not plain:
            if on_cpu or not self.to_cpu:
                return None  # torch's own pickling
            if isinstance(obj, torch.nn.Parameter):
                return torch.nn.Parameter, (obj.detach().cpu(), obj.requires_grad)
            return _identity, (obj.detach().cpu().requires_grad_(obj.requires_grad),)
        if not on_cpu and not self.to_cpu:
            return None
        tensor = obj.detach().cpu().resolve_conj().resolve_neg()
        return _rebuild_tensor, (self._storage_bytes(tensor.untyped_storage()), tensor.dtype,
                                 tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
                                 obj.requires_grad, kind is torch.nn.Parameter)

    def _storage_bytes(self, storage: Any) -> _StorageBytes:
        """One holder per storage, so that pickle's memo keeps tensors sharing it sharing it."""
        key = (storage.data_ptr(), storage.nbytes())
        holder = self._storages.get(key)
        if holder is None:
            self.keepalive.append(storage)  # the ctypes view below does not own the memory
            raw = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr()) if storage.nbytes() else b""
            holder = self._storages[key] = _StorageBytes(pickle.PickleBuffer(raw))
        return holder


class _StorageBytes:
    def __init__(self, buffer: pickle.PickleBuffer) -> None:
        self.buffer = buffer

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _storage_from_buffer, (self.buffer,)


def _storage_from_buffer(buffer: Any) -> Any:
    import torch

    view = memoryview(buffer)
    if view.nbytes == 0:
        return torch.UntypedStorage(0)
    if view.readonly:  # loaded in-band from bytes: a tensor over it must be writable
        view = memoryview(bytearray(view))
    # frombuffer holds a reference to the view, so the mapping under it lives as long as the storage.
    return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


def _rebuild_tensor(storage: Any, dtype: Any, shape: tuple[int, ...], stride: tuple[int, ...], offset: int,
                    requires_grad: bool, is_parameter: bool) -> Any:
    import torch

    tensor = torch.empty((0,), dtype=dtype).set_(storage, offset, shape, stride)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _identity(value: Any) -> Any:
    return value
