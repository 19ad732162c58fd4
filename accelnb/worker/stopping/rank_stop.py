"""The rank's side of Stop, whole: the kernel's request as this rank hears it, and
``stop_requested()``, where the ranks agree on when to honour it (the kernel's side is
``kernel/run/group/stop_presses.py``).

**Hearing the request.** The kernel sends :class:`~accelnb.wire.events.StopRequest` to every rank
of a call when Stop is pressed and the call's code has shown it checks
(:class:`~accelnb.wire.events.ChecksForStop`, sent at the code's first check of each call,
:func:`announce_checking`). The rank's receiver hands the request over at any moment
(:func:`deliver`: a local rank's control reader, a Ray actor's ``deliver``). Without a kernel to
tell (a rank started outside accelnb) nothing is sent and no request comes: the code runs as if
Stop were never pressed.

**Agreeing.** Ranks hear the request at different points of their step, so a rank cannot act on
what it heard alone: it would save a different step than the others, or leave them waiting in a
collective it never enters. The ranks agree through an all-reduce (MAX) of what each heard, on a
gloo group of accelnb's own (CPU tensors, whatever backend the default group has; made at the
first check, so that code that never checks pays nothing).

A collective every call would cost too much: on a loaded 2-core machine a gloo all-reduce of one
number costs the caller 200-350 µs, 10-17 % of a 2 ms step (benchmarks/bench_stop.py: 23 %). So
the all-reduce runs only at some calls, and asynchronously: at each such call (a "check point")
a rank waits for the all-reduce it started at the previous check point (long finished, in gloo's
own thread) and starts the next.
The check points are the same call numbers on every rank, because the all-reduce also carries
each rank's proposal for the gap to the next one (enough calls for about
:data:`CHECK_INTERVAL_S` of the rank's own pace) and every rank takes the same maximum. An
answer of True at call *n* therefore comes from the all-reduce every rank started at the same
earlier call: the same answer everywhere. A request is seen at most two gaps after it arrives,
about 0.5 s. Between check points a call costs a counter increment. Why 0.25 s: at 0.05 s a check
point cost 0.8-1.6 % of the loop's time on this 2-core machine (gloo's thread competes with the
step for the cores); a Stop does not need to be answered faster than a person notices.

Once True, the answer stays True until the call ends. The group lives as long as the process
(a session's next call reuses it), unless a call ends with an all-reduce that never finished
(the code checked a different number of times on different ranks): then the next check says so.

Module-level state, one per rank process (a rank has one channel to its kernel, and every rank of
a launch must make the same groups in the same order): the request's ``_heard`` (set from the
receiver's thread), ``_call_id`` (the call it is for), ``_announced`` (``ChecksForStop`` went
once this call), ``_writer`` and ``_rank`` (where to send it); the agreement's ``_group``,
``_world``, ``_groups_made``, ``_abandoned``, ``_poisoned`` (each commented where it is bound)
and ``_checks`` (the current call's checks).
"""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from typing import Any

from accelnb.wire.channel import MessageWriter
from accelnb.wire.events import ChecksForStop, StopRequest
from accelnb.worker.other_launchers import process_group

CHECK_INTERVAL_S = 0.25  # the ranks' pace decides how many calls that is
MAX_CALLS_BETWEEN_CHECKS = 100_000
GROUP_JOIN_TIMEOUT_S = 60.0  # a rank that never checks: say so instead of hanging
END_OF_CALL_WAIT_S = 10.0  # the last all-reduce of a call: every rank started it, so it finishes


class StopCheckMismatch(RuntimeError):
    """The ranks did not all call ``stop_requested()`` the same way."""


class _Checks:
    """One call's agreement: where the check points fall, and the all-reduce in flight."""

    def __init__(self) -> None:
        self.calls = 0
        self.next_check = 1
        self.agreed = False
        self.pending: tuple[Any, Any] | None = None  # (work, tensor) of the last check point
        self.last_check: tuple[int, float] | None = None  # (call number, time) of the last check point


_heard = threading.Event()
_call_id: int | None = None
_announced = False
_writer: MessageWriter | None = None
_rank = 0

_group: Any = None  # the gloo group, once made; None before the first check
_world: Any = None  # the default group it was made from (a destroyed and remade one needs a new group)
_groups_made = 0  # on every rank alike: names each group's arrival barrier
_abandoned: list[Any] = []  # groups let go with an all-reduce in flight, kept from the garbage collector
_poisoned = False  # a call ended with its last all-reduce unfinished
_checks = _Checks()


def stop_requested() -> bool:
    """True once a stop was asked for (Stop pressed, the kernel got SIGTERM, ``timeout=`` passed):
    save what you need and return. The same answer on every rank at the same call number, so
    call it on every rank, once per step at the same point, e.g. right after ``optimizer.step()``::

        for step in range(start, steps):
            train_one_step()
            if accelnb.stop_requested():
                save_checkpoint(step)
                return

    Cheap enough for every step (an all-reduce about every 0.25 s of the loop, asynchronously).
    Outside a launch it is always False. Once it answered True it stays True until the call ends.
    """
    checks = _checks
    if checks.agreed:
        return True
    checks.calls += 1
    if checks.calls < checks.next_check:
        return False
    return _check_point(checks)


def attach(writer: MessageWriter, rank: int) -> None:
    """Where to tell the kernel that the code checks (the rank's events channel)."""
    global _writer, _rank
    _writer, _rank = writer, rank


def begin_call(call_id: int) -> None:
    """A new call: no request heard, the kernel not yet told that this call's code checks, and
    the checks start from its first call (what the last call agreed is forgotten)."""
    global _call_id, _announced, _checks
    _call_id, _announced = call_id, False
    _heard.clear()
    _checks = _Checks()


def deliver(request: StopRequest) -> None:
    """The kernel's request (from the rank's receiver); one for an earlier call is dropped."""
    if request.call_id == _call_id:
        _heard.set()


def heard() -> bool:
    """Whether this rank has heard the kernel's request during the current call."""
    return _heard.is_set()


def announce_checking() -> None:
    """Tell the kernel, once per call, that the code checks: a Stop press becomes a request."""
    global _announced
    if _announced or _writer is None or _call_id is None:
        return
    _announced = True
    _writer.send(ChecksForStop(_rank, _call_id))


def end_call(returned: bool) -> None:
    """The call ended: wait for its last all-reduce, which every rank started (or note that one
    did not). A call that raised does not wait (the other ranks may be gone): its group is let go,
    and the next call makes another (every rank that raised alike does the same)."""
    global _poisoned, _group
    pending, _checks.pending = _checks.pending, None
    if pending is None:
        return
    import torch.distributed as dist

    # A call that raised, or whose code destroyed the groups (the tutorial's cleanup()): let the
    # group go, never destroyed (its destructor would wait for the unfinished all-reduce).
    if not returned or not dist.is_initialized() or dist.group.WORLD is not _world:
        _abandoned.append(_group)
        _group = None
        return
    try:
        pending[0].wait(timedelta(seconds=END_OF_CALL_WAIT_S))
    except Exception:  # any failure (a timeout, a broken peer) leaves the group unusable
        _poisoned = True


def _check_point(checks: _Checks) -> bool:
    import torch
    import torch.distributed as dist

    announce_checking()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        # One rank agrees with itself, at check points paced as a group's: every call here cost a
        # 1-rank loop 3-18 µs a step (benchmarks/bench_step_cost.py), a counter increment elsewhere.
        checks.agreed = heard()
        checks.next_check = checks.calls + _pace(checks)
        return checks.agreed
    group = _agreement_group(dist)
    calls_between = 1
    if checks.pending is not None:
        work, tensor = checks.pending
        work.wait()
        heard_anywhere, calls_between = (int(v) for v in tensor.tolist())
        if heard_anywhere:
            checks.pending = None
            checks.agreed = True
            return True
    tensor = torch.tensor([int(heard()), _pace(checks)], dtype=torch.int64)
    checks.pending = (dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True), tensor)
    checks.next_check = checks.calls + calls_between
    return False


def _pace(checks: _Checks) -> int:
    """This rank's proposal for the calls until the next check point: about
    :data:`CHECK_INTERVAL_S` at the pace since the last one (1 at the first)."""
    now = time.perf_counter()
    proposal = 1
    if checks.last_check is not None:
        seconds_per_call = (now - checks.last_check[1]) / max(1, checks.calls - checks.last_check[0])
        proposal = _calls_for(seconds_per_call)
    checks.last_check = (checks.calls, now)
    return proposal


def _calls_for(seconds_per_call: float) -> int:
    if seconds_per_call <= 0:
        return MAX_CALLS_BETWEEN_CHECKS
    return max(1, min(MAX_CALLS_BETWEEN_CHECKS, math.ceil(CHECK_INTERVAL_S / seconds_per_call)))


def _agreement_group(dist: Any) -> Any:
    global _group, _world, _groups_made
    if _poisoned:
        raise StopCheckMismatch(
            "stop_requested() was called a different number of times on different ranks in an earlier "
            "call of this session, so the ranks can no longer agree on when to stop. Call it on every "
            "rank at the same point of the loop, and restart the session (%distributed restart).")
    world = dist.group.WORLD
    if _group is not None and _world is world:
        return _group
    _groups_made += 1
    try:  # new_group would wait for a missing rank as long as the group's timeout (30 min)
        process_group.every_rank_arrives(f"stop-agreement-{_groups_made}", dist.get_world_size(),
                                         GROUP_JOIN_TIMEOUT_S)
    except TimeoutError as error:
        raise StopCheckMismatch(
            f"stop_requested() waited {GROUP_JOIN_TIMEOUT_S:.0f} s for the other ranks to call it too ({error}). "
            "The ranks agree on when to stop, so every rank must call it, at the same point of the loop: "
            "do not call it under `if rank == 0`.") from None
    _group = dist.new_group(backend="gloo")
    _world = world
    return _group
