"""The notebook-wide default device selection, set by the GPU pickers and read by launches.

The ipywidgets panel, the JupyterLab side panel and ``%distributed`` all write here; a launch
without ``gpus=``/``num_processes=`` reads here before falling back to "every visible GPU".
Listeners (the panels) are told about every change, whoever made it.

    >>> set_selection(gpus=[0, 2])
    >>> current_selection()
    Selection(gpus=(0, 2), num_processes=None)
    >>> clear_selection()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Selection:
    """Either a list of GPU indices (nvidia-smi numbering) or a number of CPU ranks."""

    gpus: tuple[int, ...] | None = None
    num_processes: int | None = None

    def as_magic_line(self) -> str:
        """The ``%%distributed`` line that makes the same choice explicitly."""
        if self.gpus:
            return "%%distributed --gpus " + ",".join(str(i) for i in self.gpus)
        if self.num_processes:
            return f"%%distributed --procs {self.num_processes}"
        return "%%distributed"


Listener = Callable[[Selection | None], None]
_current: Selection | None = None
_listeners: list[Listener] = []


def current_selection() -> Selection | None:
    return _current


def set_selection(gpus: Sequence[int] | None = None, num_processes: int | None = None) -> Selection:
    """Make ``gpus`` (or ``num_processes`` CPU ranks) the default for the next launches."""
    global _current
    if gpus is not None and num_processes is not None:
        raise ValueError("Select either gpus or num_processes, not both.")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes}.")
    _current = Selection(gpus=tuple(gpus) if gpus is not None else None, num_processes=num_processes)
    _notify()
    return _current


def clear_selection() -> None:
    global _current
    _current = None
    _notify()


def on_selection_change(listener: Listener) -> Callable[[], None]:
    """Call ``listener`` after every change; returns a function that unsubscribes it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def _notify() -> None:
    for listener in list(_listeners):
        listener(_current)
