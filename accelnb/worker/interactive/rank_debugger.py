"""``breakpoint()`` and ``pdb.set_trace()`` in a rank: a ``(Pdb)`` session through the notebook.

:func:`attach` (worker set-up) makes ``sys.breakpointhook`` and ``pdb.Pdb`` give a
:class:`RankPdb`, whose prompt is asked for with :func:`accelnb.worker.interactive.rank_input.ask`: the
launching cell shows Jupyter's input box (``[rank N] (Pdb)`` for ranks other than 0). What the
debugger prints (the current line, ``p x``, ``where``) is gathered and sent with the next prompt,
so it reaches the cell before the prompt whether or not the rank's output is shown live.

    >>> def train():
    ...     x = 3
    ...     breakpoint()      # the cell shows "> <cell In[2]>(3)train()" and a (Pdb) box
    ...     return x

The stack shown stops at the user's code: accelnb's frames (the worker's call loop, the cell
runner) and cloudpickle's are left out of ``where``/``up``, and ``n``/``s`` never stop in them.
``q`` raises ``bdb.BdbQuit``, which the rank reports like any exception; the kernel words it
"quit in the debugger on rank N". End of input (a frontend that does not allow input, Ctrl-D)
quits too, as pdb does at a terminal. ``PYTHONBREAKPOINT=0`` still disables ``breakpoint()``,
and another debugger named there is used as is.
"""

from __future__ import annotations

import bdb
import os
import pdb
import sys
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import cloudpickle

from accelnb.worker.interactive import rank_input

# accelnb/ (this file is accelnb/worker/interactive/…) and cloudpickle/, with a trailing separator:
# frames in them are machinery, not the user's.
_MACHINERY_ROOTS = (
    str(Path(os.path.abspath(__file__)).parents[2]) + os.sep,
    os.path.dirname(os.path.abspath(cloudpickle.__file__)) + os.sep,
    "<frozen runpy>",
)
_MACHINERY_MODULES = ["accelnb.*", "cloudpickle.*", "runpy"]


class _DebuggerConsole:
    """A :class:`RankPdb`'s stdin and stdout: output is kept until the next prompt asks for a line."""

    def __init__(self, prompt_of: Any) -> None:
        self._prompt_of = prompt_of  # the debugger, whose prompt may change ("(Pdb) ", "(com) ")
        self._written: list[str] = []

    def write(self, text: str) -> int:
        self._written.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        shown = "".join(self._written)
        self._written.clear()
        prompt = str(self._prompt_of.prompt)
        if shown.endswith(prompt):  # cmd wrote the prompt just before reading: it goes in the box
            shown = shown[:-len(prompt)]
        try:
            return rank_input.ask(prompt, shown) + "\n"
        except EOFError:
            return ""  # cmd turns it into "EOF": the debugger quits


class RankPdb(pdb.Pdb):
    """A Pdb whose console is the notebook and whose stack is the user's frames only."""

    def __init__(self, completekey: str = "tab", stdin: Any = None, stdout: Any = None,
                 skip: Any = None, nosigint: bool = False, readrc: bool = True) -> None:
        console: Any = _DebuggerConsole(self)  # file-like enough for cmd and pdb
        # nosigint: a session's Ctrl-C must interrupt the cell, not re-enter the debugger.
        super().__init__(completekey, stdin or console, stdout or console,
                         skip=[*(skip or ()), *_MACHINERY_MODULES], nosigint=True, readrc=readrc)

    def _cmdloop(self) -> None:
        # pdb's own re-prompts on Ctrl-C. In a rank, SIGINT is the kernel interrupting a session's
        # cell (the Stop button): it must end the call, as anywhere else in the cell.
        self.allow_kbdint = True
        try:
            self.cmdloop()
        finally:
            self.allow_kbdint = False

    def get_stack(self, f: FrameType | None, t: TracebackType | None) -> tuple[list[tuple[FrameType, int]], int]:
        stack, index = super().get_stack(f, t)
        current = stack[index] if stack else None
        kept = [entry for entry in stack if entry is current or not _is_machinery(entry[0])]
        return kept, (kept.index(current) if current is not None else index)


# What ray.init() puts into PYTHONBREAKPOINT of every Ray worker and of the driver (the kernel),
# whatever the user chose: Ray's remote debugger, which waits for a client to attach. In a rank it
# means "nothing chosen", so breakpoint() prompts in the cell as it does without Ray.
RAYS_OWN_BREAKPOINTS = ("ray.util.rpdb.set_trace", "ray.util.rpdb._driver_set_trace")


def breakpoint_hook(*args: Any, **kwargs: Any) -> Any:
    """The rank's ``sys.breakpointhook``, honouring ``PYTHONBREAKPOINT`` as Python's own does
    (less Ray's own setting, see ``RAYS_OWN_BREAKPOINTS``)."""
    setting = os.environ.get("PYTHONBREAKPOINT", "")
    if setting == "0":
        return None
    if setting not in ("", "pdb.set_trace", *RAYS_OWN_BREAKPOINTS):
        return sys.__breakpointhook__(*args, **kwargs)
    RankPdb().set_trace(sys._getframe(1))
    return None


def attach() -> None:
    """Send this rank's ``breakpoint()`` and ``pdb.set_trace()`` through the notebook."""
    sys.breakpointhook = breakpoint_hook
    pdb.Pdb = RankPdb  # type: ignore[misc]  # pdb.set_trace() and post_mortem() make a Pdb()


def leave_debugger() -> None:
    """End a debugger the call left tracing (interrupted at its prompt): the next call of a
    session must not stop where the old one's ``n`` would have. Other tracers are left alone."""
    if isinstance(getattr(sys.gettrace(), "__self__", None), bdb.Bdb):
        sys.settrace(None)


def _is_machinery(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_MACHINERY_ROOTS)
