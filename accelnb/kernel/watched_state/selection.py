"""The notebook-wide default device selection, set by the GPU pickers and read by launches.

The ipywidgets panel, the JupyterLab side panel and ``%distributed`` all write here; a launch
without ``gpus=``/``num_processes=`` reads here before falling back to "every visible GPU".
Listeners (the panels) are told about every change, whoever made it; one that raises is logged
and skipped, and the selection still holds (the policy of :mod:`accelnb.kernel.watched_state.observers`).

    >>> set_selection(gpus=[0, 2])
    >>> current_selection()
    Selection(gpus=(0, 2), num_processes=None)
    >>> clear_selection()

Module-level state: the kernel's one default selection (``_current``) and the pickers that watch
it (``_listeners``); one per kernel is what "default" means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from accelnb.errors import LaunchConfigError
from accelnb.kernel.watched_state.observers import Listeners


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
            return f"%%distributed --procs {self.num_processes} --cpu"
        return "%%distributed"


Listener = Callable[[Selection | None], None]
_current: Selection | None = None
_listeners = Listeners[[Selection | None]]("selection listener")


def current_selection() -> Selection | None:
    return _current


def set_selection(gpus: Sequence[int] | None = None, num_processes: int | None = None) -> Selection:
    """Make ``gpus`` (or ``num_processes`` CPU ranks) the default for the next launches.

    Whether those GPUs exist is checked when a launch plans with them (the inventory may change
    before then); here only the shape is: GPU indices are whole numbers, ranks at least one.

    Raises:
        LaunchConfigError: both are given, a GPU index is not a whole number, or
            ``num_processes`` is not a whole number of at least 1.
    """
    global _current
    if gpus is not None and num_processes is not None:
        raise LaunchConfigError("Select either gpus or num_processes, not both.")
    if num_processes is not None and (not _is_whole_number(num_processes) or num_processes < 1):
        raise LaunchConfigError(f"num_processes must be a whole number, at least 1; got {num_processes!r}.")
    if gpus is not None and not all(_is_whole_number(index) for index in gpus):
        raise LaunchConfigError(f"gpus must be GPU indices as nvidia-smi numbers them, e.g. [0, 2]; "
                                f"got {list(gpus)!r}.")
    _current = Selection(gpus=tuple(gpus) if gpus is not None else None, num_processes=num_processes)
    _notify()
    return _current


def clear_selection() -> None:
    global _current
    _current = None
    _notify()


def on_selection_change(listener: Listener) -> Callable[[], None]:
    """Call ``listener`` after every change; returns a function that unsubscribes it."""
    return _listeners.add(listener)


def listener_count() -> int:
    """How many selection listeners are subscribed (a closed or collected display leaves none)."""
    return len(_listeners)


def _notify() -> None:
    _listeners.notify(_current)


def _is_whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is not GPU 1
