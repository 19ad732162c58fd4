"""Ctrl-C at exactly one point of the kernel's side of a launch, one point after another.

A timer cannot land a Ctrl-C on a moment of microseconds, every run alike; a profile hook can.
:class:`InterruptAfterCall` raises SIGINT in this (the main) thread right after the ``at``-th
call into C that its filter counts, returns (Python runs the handler at the caller's next
instruction). Counting calls into C from accelnb's own frames gives every point where CPython
checks for signals after a system call: reading a template's report, opening or closing an fd,
writing a call to a rank. :func:`sweep` moves that point through a whole launch.

    >>> report = sweep(lambda: accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True),
    ...                after_each=check_nothing_left, stride=1)      # doctest: +SKIP
    >>> report.points, report.interrupted, report.problems          # doctest: +SKIP
    (760, 757, [])

Each point's count is a call's position in that run; the next run's calls differ by a few (the
template's reports come as they come), so a point is a place in the launch, give or take a few.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Self

import accelnb

ACCELNB_ROOT = os.path.dirname(os.path.abspath(accelnb.__file__)) + os.sep
CallFilter = Callable[[FrameType, Any], bool]  # (the calling frame, the C function): counted?


def from_accelnb(frame: FrameType, function: Any) -> bool:
    """Every call into C made by accelnb's own code."""
    return frame.f_code.co_filename.startswith(ACCELNB_ROOT)


class ProfileHook:
    """Within the block, :meth:`_on_event` sees this thread's calls and returns (``sys.setprofile``)."""

    def __enter__(self) -> Self:
        sys.setprofile(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _on_event(self, frame: FrameType, event: str, arg: Any) -> None:
        raise NotImplementedError


class InterruptAfterCall(ProfileHook):
    """Within the block: SIGINT right after the ``at``-th counted call into C returns (0: never).
    ``calls`` counts them all, so that a test notices when none is counted any more, rather
    than passing without a Ctrl-C; ``where`` names the point once it came, ``raised_at`` its
    wall time (``time.time()``, as accelnb's attempts are timed)."""

    def __init__(self, at: int, counted: CallFilter = from_accelnb) -> None:
        self.at, self.counted = at, counted
        self.calls = 0
        self.where: str | None = None
        self.raised_at: float | None = None

    def _on_event(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "c_return" or not self.counted(frame, arg):
            return
        self.calls += 1
        if self.calls == self.at:
            place = os.path.relpath(frame.f_code.co_filename, ACCELNB_ROOT)
            self.where = f"{place}:{frame.f_lineno}, after {getattr(arg, '__qualname__', arg)}"
            self.raised_at = time.time()
            signal.raise_signal(signal.SIGINT)


@dataclass
class SweepReport:
    """What a sweep saw: how many points it covered, and at how many the run was interrupted."""

    points: int = 0
    interrupted: int = 0
    returned: list[str] = field(default_factory=list)  # "at N (where)" of each run that returned
    problems: list[str] = field(default_factory=list)  # "at N (where): what went wrong"


def count_calls(run: Callable[[], object], counted: CallFilter = from_accelnb) -> int:
    """How many counted calls into C one ``run`` makes, undisturbed."""
    with InterruptAfterCall(0, counted) as counting:
        run()
    return counting.calls


def sweep(run: Callable[[], object], after_each: Callable[[InterruptAfterCall], str | None], *,
          stride: int = 1, counted: CallFilter = from_accelnb, bound_s: float = 5.0) -> SweepReport:
    """Run ``run`` once per point, with a Ctrl-C after counted call 1, 1 + stride, ... up to
    the last that a run made; ``after_each(point)`` checks what the Ctrl-C left (None: nothing
    wrong, or what is). Only KeyboardInterrupt (accelnb's RunInterrupted is one) or a normal
    return, within ``bound_s`` of the Ctrl-C, is an acceptable end of ``run``: a run that takes
    longer waited for something the Ctrl-C lost (a worker's exit, once)."""
    last = count_calls(run, counted)
    report = SweepReport()
    for at in range(1, last + 1, stride):
        point = InterruptAfterCall(at, counted)
        ended = "returned"
        try:
            with point:
                run()
        except KeyboardInterrupt:
            ended = "interrupted"
        except Exception as error:
            report.problems.append(f"at {at} ({point.where}): {type(error).__name__}: {error}")
            ended = "failed"
        ended_at = time.time()
        if point.where is None:
            continue  # this run made fewer calls: the point was not reached
        report.points += 1
        assert point.raised_at is not None
        if ended_at - point.raised_at > bound_s:
            report.problems.append(f"at {at} ({point.where}): the run ended {ended_at - point.raised_at:.1f} s "
                                   f"after the Ctrl-C (bound {bound_s:g} s)")
        report.interrupted += ended == "interrupted"
        if ended == "returned":
            report.returned.append(f"at {at} ({point.where})")
        wrong = after_each(point)
        if wrong is not None:
            report.problems.append(f"at {at} ({point.where}): {wrong}")
    return report
