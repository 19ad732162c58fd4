"""What the kernel tells its template: imports to follow, cell sources (``worker/template/helper.py``'s protocol).

The template (accelnb's helper process, the clean interpreter every rank is forked from) imports
what the kernel has imported, so that a rank finds its libraries loaded without being a fork of
the kernel. The kernel sends a :class:`FollowImports` after a cell or before a launch; the
template takes the kernel's ``sys.path``, working directory and environment as they are in it,
imports each module, and answers ``("followed", request_id, failed)`` once all were tried, or
``("unsafe", request_id, module, reason)`` when an import left it unfit to fork (a thread started,
CUDA initialised): it then forks nothing more, and the kernel starts another without that module.

A spawn request also carries the notebook's cell sources the template does not have yet, in a
file of their own (:func:`sources_file`) whose fd goes with it: the first launch of a long
notebook has a megabyte of them, past what one message on the socket may carry.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

# Asked for ahead of the kernel's own modules: what training touches first and a kernel may not
# have imported yet (an optimizer's first step imports torch._dynamo: ~1.1 s idle, ~3 s under load).
# The template imports one name per turn of its loop, and a launch that comes during an import
# waits for it to end: so torch._dynamo's biggest dependencies from outside its package come
# first, each a turn of its own, leaving torch._dynamo's own modules as the longest wait (measured
# under load: 2.6 s in one turn before; now at most 1.0). Each is a module torch._dynamo imports
# anyway, and each imports cleanly in this order: a module taken out of its natural order can meet
# a circular import (tests/test_template.py checks both against the installed torch). Inside one
# package nothing can be split off, since a submodule's import runs its package's __init__ first.
TORCH_DYNAMO_IN_TURNS = ("mpmath", "sympy", "torch.fx.experimental.symbolic_shapes", "torch.distributed.tensor",
                         "torch.distributed.fsdp", "torch._dynamo")
TRAINING_PREIMPORTS: tuple[str, ...] = (*TORCH_DYNAMO_IN_TURNS, "accelerate")


@dataclass(frozen=True)
class FollowImports:
    """Import ``modules`` (dotted names, in order) in the kernel's ``sys_path``, ``cwd`` and ``env``.

    ``urgent``: a launch waits for the answer, so the template imports even while ranks it forked
    run (otherwise it imports only while it has none: an import delays reporting their exits).
    ``optional``: only while nothing else waits; a launch forks without waiting for these
    (``TRAINING_PREIMPORTS``: a rank that needs one before the template has it imports it itself).
    """

    request_id: int
    modules: tuple[str, ...]
    sys_path: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    urgent: bool = False
    optional: bool = False


def sources_file(sources: tuple[tuple[str, str], ...]) -> int:
    """A file in memory holding ``sources`` ((filename, text), as ``kernel/helper/cell_sources.py``
    finds them), read from its start: its fd goes with a spawn request."""
    fd = os.memfd_create("accelnb-cell-sources", os.MFD_CLOEXEC)
    try:
        data = pickle.dumps(sources, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_sources_file(fd: int) -> tuple[tuple[str, str], ...]:
    """What :func:`sources_file` wrote; closes ``fd``."""
    with os.fdopen(fd, "rb") as file:
        sources: tuple[tuple[str, str], ...] = pickle.load(file)
    return sources
