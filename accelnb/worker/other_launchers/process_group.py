"""A rank's default process group: the one accelnb makes, and the one the code asks for.

A rank joins the default group before any code runs, so that code written for accelnb (or for
no launcher at all) finds ``dist.get_rank()`` and ``all_reduce`` ready. Code written for
torchrun, ``mp.spawn`` or the PyTorch tutorials calls ``dist.init_process_group(...)`` itself,
and torch allows one default group: the second call raised "trying to initialize the default
process group twice!". So the rank's ``init_process_group`` is accelnb's (:func:`install`),
which reconciles the two deliberately:

- the code asks for what the group already is (no backend, or the same one; no timeout, or the
  same one; no ``device_id``, or the rank's device): the group is adopted as it is, and nothing
  is torn down or reconnected;
- the code asks for something else (another backend, its own ``timeout``, ``pg_options``, a
  ``device_id``): accelnb's group is destroyed and the code's request is made, on the launch's
  own store (under a fresh key prefix), with the launch's rank and world size. The code's
  ``init_method``, ``store``, ``MASTER_ADDR`` and ``MASTER_PORT`` are not used: the tutorial's
  fixed port 12355 would collide between two launches, and the launch's store is already bound
  and private to it. What the code asks the group to *be* is honoured; where it rendezvous is
  accelnb's business;
- a ``rank`` or ``world_size`` that contradicts the launch is an error naming both numbers
  (the launch started N ranks; a group of another size would hang at its first collective);
- ``destroy_process_group()`` works as in torch; in a persistent session, the next call finds a
  group again (:func:`ensure_default_group`).

Why not create no group and let the code make it (as torchrun does, with
``TORCHELASTIC_USE_AGENT_STORE``)? Code that never calls ``init_process_group`` (every accelnb
example, ``%%distributed`` cells) would then find none. Why not make the group lazily, when the
code first touches it? torch has no public hook for that.

The group accelnb makes uses torch's default timeout for its backend (10 min for NCCL, 30 for
gloo), not a hidden one of ours.

Only the name ``init_process_group`` is replaced, in ``torch.distributed`` and in
``torch.distributed.distributed_c10d`` where torch defines it (a function pickled from the
notebook resolves to it), and only in the template and its ranks (:func:`route_through_accelnb`).
The template replaces it before it imports any of the kernel's modules, so a module's
``from torch.distributed import init_process_group`` binds accelnb's too (pytorch/examples'
DDP series does that at import); the original is called with its own signature
(``inspect.signature(...).bind``), so a new keyword in a torch release passes through.
``tests/test_process_group.py`` checks the names and parameters this relies on.

A rank forked ahead of its launch may have joined the launch's group already
(:func:`join_ahead`, ``wire/group_ahead.py``): then :func:`join_default_group` adopts that group
as accelnb's, with the store it was made on, and everything above holds for it unchanged.

Module-level state: ``_launched``, the launch this rank process joined (a process is one rank of
one launch at a time); ``_joined_ahead``, the group a waiting child joined before its launch.
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from accelnb.wire.group_ahead import is_join_variable
from accelnb.wire.spec import GROUP_TIMEOUT_ENV, LOOPBACK, WorkerSpec
from accelnb.worker.other_launchers.import_hooks import when_imported

# The rendezvous: how long a rank waits for the store and for its peers to join.
STORE_TIMEOUT_S = 300.0
# Keys of the join barrier in the launch's TCPStore (torch's own keys carry a "default_pg/" prefix).
_JOINED_KEY = "accelnb/joined"
_ALL_JOINED_KEY = "accelnb/all-joined"
_ACCELNBS = "_accelnb_routes_it"  # marks accelnb's init_process_group


@dataclass
class _Launched:
    """What the launch decided for this rank's group, and what the group is now."""

    spec: WorkerSpec
    store: Any  # the launch's TCPStore (rank 0 holds its listening socket)
    store_fd: int | None  # that listening socket, on rank 0
    device_id: Any  # torch.device for an NCCL rank on a GPU, else None
    original_init: Callable[..., None]
    generation: int = 0  # groups made so far on this store: each gets its own key prefix
    ours: bool = False  # the default group is the one accelnb made (not the code's own)
    timeout: timedelta | None = None  # accelnb's group's, where one was asked for; None: torch's default
    # Every default group made in this rank, kept alive until the rank exits (see _keep_alive).
    kept: list[Any] = field(default_factory=list)


_launched: _Launched | None = None


@dataclass(frozen=True)
class _JoinedAhead:
    rank: int
    world_size: int
    port: int
    store: Any
    store_fd: int | None  # rank 0's: the store listens on it
    timeout: timedelta | None


_joined_ahead: _JoinedAhead | None = None


def join_ahead(rank: int, world_size: int, port: int, listen_fd: int | None, prefix: str,
               join_env: Sequence[tuple[str, str]]) -> None:
    """In a child forked ahead of a launch (``worker/template/standby_ranks.py``): join that
    launch's group now, as ``rank`` of ``world_size``, on the store at ``port`` (rank 0 serves it
    on ``listen_fd``), under the key ``prefix``, with the environment the launch's ranks will have
    for joining (``join_env``: those variables, and no others of their kind)."""
    global _joined_ahead
    import torch.distributed as dist

    for name in [name for name in os.environ if is_join_variable(name)]:
        del os.environ[name]
    os.environ.update(join_env)
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                          wait_for_workers=False, master_listen_fd=listen_fd)
    timeout = _timeout_asked()
    group_store = dist.PrefixStore(prefix, store)
    _torchs_init_process_group(dist)("gloo", store=group_store, rank=rank, world_size=world_size,
                                     **({} if timeout is None else {"timeout": timeout}))
    _wait_until_every_rank_joined(group_store, world_size)
    _joined_ahead = _JoinedAhead(rank, world_size, port, store, listen_fd, timeout)


def joined_ahead() -> bool:
    """Whether this rank's group was joined before its launch (:func:`join_ahead`)."""
    return _launched is not None and _joined_ahead is not None


def join_default_group(spec: WorkerSpec, store_fd: int | None, torch: Any, dist: Any) -> None:
    """Connect to the launch's store, join the default group, wait until every rank has, and
    route the code's own ``init_process_group`` calls here (:func:`install`). A rank that joined
    its launch's group ahead (:func:`join_ahead`) adopts that group instead."""
    global _launched

    if _joined_ahead is not None:
        _adopt_group_joined_ahead(spec, store_fd, dist)
        return
    device_id = None
    if spec.device.startswith("cuda"):
        device_id = torch.device(spec.device)
        torch.cuda.set_device(device_id)
    store = dist.TCPStore(
        spec.master_addr,
        spec.master_port,
        spec.world_size,
        is_master=spec.rank == 0,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
        master_listen_fd=store_fd,
    )
    _launched = _Launched(spec, store, store_fd, device_id if spec.backend == "nccl" else None,
                          _torchs_init_process_group(dist))
    _make_accelnb_group(dist)
    route_through_accelnb(dist)  # the template did already; a no-op then


def _adopt_group_joined_ahead(spec: WorkerSpec, store_fd: int | None, dist: Any) -> None:
    global _launched
    ahead = _joined_ahead
    assert ahead is not None
    if (ahead.rank, ahead.world_size, ahead.port) != (spec.rank, spec.world_size, spec.master_port):
        raise RuntimeError(f"accelnb handed rank {spec.rank} of {spec.world_size} (port {spec.master_port}) to a "
                           f"process that joined rank {ahead.rank} of {ahead.world_size} (port {ahead.port}) ahead")
    if store_fd is not None and store_fd != ahead.store_fd:
        os.close(store_fd)  # the kernel's copy of the socket this rank's store already listens on
    _launched = _Launched(spec, ahead.store, ahead.store_fd, None, _torchs_init_process_group(dist), generation=0,
                          ours=True, timeout=ahead.timeout)
    _keep_alive(dist.group.WORLD)
    route_through_accelnb(dist)


def release_store_port() -> bool:
    """Stop listening on the launch's store port, as a rank that leaves does; True when no
    listening socket of the store is left in this process (ranks other than 0 hold none).

    Once every rank has answered and been told to leave, nobody connects to the store again, so
    rank 0 can free its port before it exits: a user who reruns the cell with that port as
    ``master_port`` finds it free at once, not in the ~20 ms the OS takes to end the process.
    Only torch's libuv store (the default since torch 2.4) lives through its listener being shut
    down; the older one aborts the process, so there the port is freed as the process ends.
    """
    if _launched is None or _launched.store_fd is None:
        return True
    if not getattr(_launched.store, "libuvBackend", False):
        return False
    try:
        listener = socket.socket(fileno=os.dup(_launched.store_fd))
    except OSError:
        return False
    with listener:
        try:
            if (not listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    or listener.getsockname()[1] != _launched.spec.master_port):
                return False  # not the store's socket any more (closed, its number reused)
            listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


def ensure_default_group() -> None:
    """Before a call of a persistent session: the code of an earlier call may have destroyed the
    default group; make accelnb's again, so that this call finds one (every rank runs this).

    Groups the earlier calls destroyed are let go here, between calls, where their destructor is
    safe: their worker threads have long finished (see :func:`_keep_alive`).
    """
    import torch.distributed as dist

    if _launched is None:
        return
    _launched.kept = [group for group in _launched.kept if group is dist.group.WORLD]
    if not dist.is_initialized():
        _make_accelnb_group(dist)


def every_rank_arrives(name: str, world_size: int, timeout_s: float) -> None:
    """Return once every rank of the launch called this with ``name`` (a store counter, no
    collective); raise ``TimeoutError`` after ``timeout_s``. Outside a launch, return at once."""
    if _launched is None:
        return
    arrived_key, all_key = f"accelnb/arrived/{name}", f"accelnb/all-arrived/{name}"
    if _launched.store.add(arrived_key, 1) == world_size:
        _launched.store.set(all_key, b"1")
    try:
        _launched.store.wait([all_key], timedelta(seconds=timeout_s))
    except Exception as error:  # torch raises DistStoreError (a RuntimeError) on timeout
        raise TimeoutError(f"{int(_launched.store.add(arrived_key, 0))} of {world_size} ranks arrived") from error


def _torchs_init_process_group(dist: Any) -> Callable[..., None]:
    """torch's own ``init_process_group``, below ours where :func:`route_through_accelnb` routed it."""
    found: Callable[..., None] = dist.init_process_group
    if getattr(found, _ACCELNBS, False):  # torch's has a __wrapped__ of its own: only ours is unwrapped
        found = found.__wrapped__  # type: ignore[attr-defined]
    return found


def route_through_accelnb(dist: Any) -> None:
    """Make ``init_process_group`` :func:`_init_process_group_in_a_launch` (torch's own until a
    launch joined this process to its group). Done in the template before it imports the kernel's
    modules, so that a name a module binds at import is this one; idempotent."""
    import torch.distributed.distributed_c10d as c10d

    if getattr(dist.init_process_group, _ACCELNBS, False):  # torch's has a __wrapped__ of its own
        return
    adopting = functools.wraps(dist.init_process_group)(_init_process_group_in_a_launch)
    setattr(adopting, _ACCELNBS, True)
    dist.init_process_group = adopting
    c10d.init_process_group = adopting  # type: ignore[assignment]
    when_imported("accelerate.state", _honour_accelerates_timeout)


def _honour_accelerates_timeout(state_module: Any) -> None:
    """Accelerate (and so the HF Trainer, whose ``ddp_timeout`` it passes) makes the group only
    where none exists, so the ``timeout`` of ``InitProcessGroupKwargs`` would be lost on accelnb's
    group. Its ``PartialState`` gets it first: :func:`adopt_timeout` remakes accelnb's group with
    that timeout when it differs (every rank builds its state with the same arguments)."""
    partial_state = state_module.PartialState
    original = partial_state.__init__

    @functools.wraps(original)
    def __init__(self: Any, cpu: bool = False, **kwargs: Any) -> None:
        if kwargs.get("timeout") is not None:
            adopt_timeout(kwargs["timeout"])
        original(self, cpu, **kwargs)

    partial_state.__init__ = __init__


def adopt_timeout(timeout: timedelta) -> None:
    """Give accelnb's default group ``timeout``, remaking it if it has another; a group the code
    made itself is left as the code made it."""
    import torch.distributed as dist

    if _launched is None or not _launched.ours or not dist.is_initialized() or timeout == _group_timeout():
        return
    dist.destroy_process_group()
    _make_accelnb_group(dist, timeout)


def _group_timeout() -> timedelta | None:
    """The timeout of accelnb's group: the one asked for, else torch's default for the backend
    (``torch.distributed.constants``, public; None for NCCL in a torch built without it)."""
    from torch.distributed import constants

    assert _launched is not None
    if _launched.timeout is not None:
        return _launched.timeout
    return constants.default_pg_nccl_timeout if _launched.spec.backend == "nccl" else constants.default_pg_timeout


def _make_accelnb_group(dist: Any, timeout: timedelta | None = None) -> None:
    assert _launched is not None
    spec = _launched.spec
    kwargs: dict[str, Any] = {}
    if _launched.device_id is not None:
        kwargs["device_id"] = _launched.device_id
    if timeout is None:  # group_timeout=; else torch's default for the backend
        timeout = _timeout_asked()
    if timeout is not None:
        kwargs["timeout"] = timeout
    _init_on_launch_store(dist, spec.backend, **kwargs)
    _launched.ours = True
    _launched.timeout = timeout


def _timeout_asked() -> timedelta | None:
    timeout_s = os.environ.get(GROUP_TIMEOUT_ENV)
    return timedelta(seconds=float(timeout_s)) if timeout_s else None


def _init_on_launch_store(dist: Any, backend: Any, **requested: Any) -> None:
    """The original ``init_process_group`` on the launch's store, then every rank waits for all.

    Every rank makes the same calls in the same order, so generation numbers agree across ranks
    and each group's keys have a prefix of their own on the shared store.
    """
    assert _launched is not None
    _launched.generation += 1
    prefix = f"accelnb/group-{_launched.generation}/"
    store = dist.PrefixStore(prefix, _launched.store)
    spec = _launched.spec
    _launched.original_init(backend, store=store, rank=spec.rank, world_size=spec.world_size, **requested)
    _keep_alive(dist.group.WORLD)
    _wait_until_every_rank_joined(store, spec.world_size)


def _keep_alive(group: Any) -> None:
    """Hold a reference to ``group`` until the rank exits, so that its C++ destructor never runs
    inside the code.

    Code written for the PyTorch DDP tutorial calls ``destroy_process_group()`` and returns; the
    DDP object dies with the frame, and with it the last reference to the group. The gloo group's
    destructor joins its worker threads while the main thread holds the GIL, and a worker thread
    that is still leaving its last collective (the backward pass's all-reduce) drops the Python
    state it captured, which needs the GIL: the rank hangs for good (about one tutorial run in
    six, here, with the rank's stack ending in ``~ProcessGroupGloo`` -> ``std::thread::join``).
    A destroyed group is out of torch's registry all the same, so the code can make a new one; a
    rank leaves with ``os._exit``, where no destructor runs, and the OS closes the sockets.
    """
    assert _launched is not None
    _launched.kept.append(group)


def _wait_until_every_rank_joined(store: Any, world_size: int) -> None:
    """Return only once every rank's ``init_process_group`` has returned.

    ``init_process_group`` can return on one rank while a peer is still finishing its side of the
    connections (gloo's ``connectFullMesh``): this rank is connected, the peer still reads the
    handshake. A function that tears the group down at once (Accelerate's ``end_training()``
    calls ``destroy_process_group()``) then closes the socket under the peer, whose set-up fails
    with "Connection closed by peer" (seen in about 1 launch in 70 under CPU load). So no rank
    runs user code before all have joined. A store counter, not ``dist.barrier()``: no collective
    on the device (NCCL would allocate), and not torch's ``TORCH_DIST_INIT_BARRIER``, which polls.
    """
    if store.add(_JOINED_KEY, 1) == world_size:
        store.set(_ALL_JOINED_KEY, b"1")
    store.wait([_ALL_JOINED_KEY])


def _init_process_group_in_a_launch(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` inside an accelnb launch (see the module docstring)."""
    import torch.distributed as dist

    if _launched is None:  # not in a launch's rank (the template, or a rank that never joined): torch's
        _torchs_init_process_group(dist)(*args, **kwargs)
        return
    asked = inspect.signature(_launched.original_init).bind(*args, **kwargs).arguments
    _refuse_other_numbers(asked)
    requested = {name: asked[name] for name in ("timeout", "pg_options", "device_id", "group_name")
                 if asked.get(name) not in (None, "")}
    backend = asked.get("backend")
    if dist.is_initialized():
        if not _launched.ours:  # the code's own second call: torch's own error
            _launched.original_init(*args, **kwargs)
            return
        if _adoptable(dist, backend, requested):
            return
        dist.destroy_process_group()
        _launched.ours = False
    _init_on_launch_store(dist, backend if backend is not None else _launched.spec.backend, **requested)


def _refuse_other_numbers(asked: dict[str, Any]) -> None:
    assert _launched is not None
    spec = _launched.spec
    for name, launched in (("world_size", spec.world_size), ("rank", spec.rank)):
        given = asked.get(name, -1)
        if given not in (-1, None) and int(given) != launched:
            raise ValueError(
                f"init_process_group({name}={given}) on rank {spec.rank}, but this launch gave this "
                f"process {name} {launched} ({spec.world_size} ranks in all). Leave {name} out (the "
                f"launch's is used), or launch with num_processes={given if name == 'world_size' else 'N'}.")


def _adoptable(dist: Any, backend: Any, requested: dict[str, Any]) -> bool:
    """Whether the group accelnb made already is what the code asks for."""
    assert _launched is not None
    if "timeout" in requested and requested["timeout"] != _group_timeout():
        return False  # its own timeout: make the group it describes
    if set(requested) - {"device_id", "group_name", "timeout"}:
        return False  # its own options: make the group it describes
    device_id = requested.get("device_id")
    if device_id is not None and _launched.device_id is None:
        return False  # NCCL bound to a device (eager init): ours was not
    if device_id is not None and _device_index(device_id) != _device_index(_launched.device_id):
        return False
    return backend is None or str(backend).lower() == str(dist.get_backend()).lower()


def _device_index(device: Any) -> int | None:
    return device if isinstance(device, int) else getattr(device, "index", None)
