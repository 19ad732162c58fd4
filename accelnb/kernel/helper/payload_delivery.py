"""How a one-shot launch's payload reaches its ranks: a memfd they all map, or a fork they inherit.

    >>> with payload_delivery(pack_call(train, (X,), {}), local_ranks=2) as delivery:  # doctest: +SKIP
    ...     run_attempts(group_starter(options, persistent=False, helpers=delivery.helpers),
    ...                  delivery.payload, ...)

**Shared memory** (``wire/shared_memory.py``) works everywhere: the kernel copies the big
buffers once into a memfd and every rank maps it. The copy is the cost, and it is dominated by
the kernel allocating and zeroing 4 KiB pages of shared memory: 1 GiB took 0.29 s idle (up to
1.5 s with other jobs running) on this project's 2-core machines, where Accelerate's
``notebook_launcher``, which forks the kernel per launch so that the ranks see the tensor for
free, took 0.16 s for the whole launch (issue 12's target is 1.5× that).

**Fork** does what Accelerate does, where that is safe (``fork_or_spawn.fork_is_safe``: torch
imported, CUDA not initialised; where it is not, Accelerate cannot launch at all) and the payload
is big: the launch gets a helper of its own, forked from the kernel *after* the payload was
packed. The workers it forks share the kernel's pages copy-on-write, and the call message
carries only a token (``wire/inherited_payload.py``). But every fork copies the page tables of
the whole kernel, once for the helper and once per worker, and the helper is made and ended per
launch. Whole launches of 2 ranks, medians of 7, idle machine (fork / memfd, ms):

    payload MiB (kernel 0.3 GiB)    8: 48 / 35    64: 48 / 55    128: 57 / 76    256: 59 / 129
    64 MiB payload, kernel of 2.3 GiB: 193 / 54;  of 4.4 GiB: 261 / 63

So a launch forks only where the cost model fitted to these (:func:`inherit_worth_it`) says the
memfd copy would cost more: from about 50 MiB in a small kernel, and only for a payload that is
a sizeable share of a big one (13 % of it for 2 ranks, 40 % for 8).

The launch's helper lives as long as the launch (its attempts included) and is ended with it:
a fork shares the kernel's pages as they were at the fork, so memory the kernel frees meanwhile
stays allocated until the fork ends. A session keeps its ranks between calls, so its calls
cannot inherit anything; they always use shared memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from accelnb.errors import WorkerStartError
from accelnb.kernel.helper.client import HelperSource, StepHook, WorkerHelper, shared_helper
from accelnb.kernel.helper.fork_or_spawn import fork_is_safe
from accelnb.wire.buffers import Packed
from accelnb.wire.inherited_payload import inherited

# What each way costs, measured in whole launches of 2 CPU ranks on an idle 2-core machine
# (see the module docstring): the memfd copy costs per byte of payload; the fork costs a fixed
# extra (a helper forked, made ready and ended per launch) plus a copy of the kernel's page
# tables per process forked (the helper, then each worker from it) per byte of the kernel.
MEMFD_SECONDS_PER_GIB = 0.38
FORK_EXTRA_SECONDS = 0.005
FORK_SECONDS_PER_GIB_OF_KERNEL = 0.017
GIB = 1 << 30


@dataclass(frozen=True)
class Delivery:
    """What a launch sends its ranks (``payload``), and where its workers come from (``helpers``)."""

    payload: Packed
    helpers: HelperSource


@contextmanager
def payload_delivery(payload: Packed, *, local_ranks: int | None) -> Iterator[Delivery]:
    """The way to deliver ``payload`` to a one-shot launch's ranks (see the module docstring).

    ``local_ranks``: how many ranks run on this machine; None for a cluster, whose ranks always
    get shared memory. Whatever the launch's ending, its own helper is ended when this exits.
    """
    if (local_ranks is None or not inherit_worth_it(payload.nbytes, kernel_resident_bytes(), local_ranks)
            or not fork_is_safe()):
        yield Delivery(payload, shared_helper)
        return
    helper = LaunchHelper()
    try:
        with inherited(payload) as stand_in:
            yield Delivery(stand_in, helper)
    finally:
        helper.close()


def inherit_worth_it(payload_bytes: int, kernel_bytes: int, ranks: int) -> bool:
    """Whether forking a kernel of ``kernel_bytes`` for ``ranks`` workers beats copying
    ``payload_bytes`` into a memfd (by the measured costs above)."""
    copy = payload_bytes / GIB * MEMFD_SECONDS_PER_GIB
    fork = FORK_EXTRA_SECONDS + (ranks + 1) * kernel_bytes / GIB * FORK_SECONDS_PER_GIB_OF_KERNEL
    return copy > fork


def kernel_resident_bytes() -> int:
    """This process's resident memory, whose page tables a fork copies."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class LaunchHelper:
    """A helper forked from the kernel for one launch; forked again if it died between attempts."""

    def __init__(self) -> None:
        self._helper: WorkerHelper | None = None

    def __call__(self, *, on_step: StepHook | None = None) -> WorkerHelper:
        if self._helper is not None and not self._helper.alive:
            self._helper.close()
            self._helper = None
        if self._helper is None:
            self._helper = WorkerHelper(method="fork")
        try:
            self._helper.wait_ready(on_step)
        except WorkerStartError:
            self.close()
            raise
        return self._helper

    def close(self) -> None:
        """End it (it kills any worker still running) and reap it. Idempotent."""
        if self._helper is not None:
            self._helper.close()
            self._helper = None
