"""A payload the ranks inherit by fork: the call message carries a token, not the bytes.

When a launch's helper is forked from the kernel *after* the payload was packed
(``kernel/helper/payload_delivery.py``), the helper, and every worker it forks, already holds the
payload in its address space, copy-on-write: the tensors the function gets are the kernel's own
pages, and nothing is copied, which is what Accelerate's ``notebook_launcher`` gets by forking
the kernel. The kernel keeps the packed payload in a registry for as long as the launch runs and
sends an :class:`InheritedPayload` in its place; unpickled in a worker, it becomes that
worker's (inherited) copy of the registry's entry.

    >>> import pickle
    >>> packed = Packed(b"body", [])
    >>> with inherited(packed) as stand_in:
    ...     pickle.loads(pickle.dumps(stand_in, protocol=5)) is packed   # as a forked worker sees it
    True

A rank that writes into such an argument gets its own copy of the pages it writes (copy on
write), as with a memfd mapped privately: the other ranks and the kernel see nothing of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from accelnb.wire.buffers import Packed

_held: dict[int, Packed] = {}  # token -> payload, in the kernel while its launch runs
_tokens = itertools.count(1)


class InheritedPayload(Packed):
    """Stands in for a :class:`Packed` that the receiving process inherited by fork."""

    __slots__ = ("token",)

    def __init__(self, token: int, packed: Packed) -> None:
        super().__init__(packed.body, packed.buffers)
        self.token = token

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _inherited_payload, (self.token,)


@contextmanager
def inherited(packed: Packed) -> Iterator[InheritedPayload]:
    """Hold ``packed`` where a process forked from now on finds it; yields what to send instead."""
    token = next(_tokens)
    _held[token] = packed
    try:
        yield InheritedPayload(token, packed)
    finally:
        del _held[token]


def _inherited_payload(token: int) -> Packed:
    try:
        return _held[token]
    except KeyError:
        raise RuntimeError(
            f"accelnb bug: payload {token} was to be inherited, but this process was not forked from "
            "the kernel while the launch ran. Please report it; ACCELNB_HELPER_START=spawn avoids it."
        ) from None

