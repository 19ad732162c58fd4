"""Restarts: a loop above the worker group, "start every rank, run, stop every rank", repeated.

With ``max_restarts=N`` a launch whose rank fails (raises, crashes, is killed; or accelnb's
helper process dies) is not over: once every rank of that attempt is stopped, as without
restarts, a fresh group is started, up to N times. The group never restarts itself; this loop
does, so each attempt is a whole launch with the same guarantees (nothing outlives it) and a
record (:class:`~accelnb.kernel.run.launch_result.Attempt`).

    >>> result = run_attempts(start, payload, CallSettings(), metrics=MetricRoute(), max_restarts=2,
    ...                       restart_delay=0.0)                                         # doctest: +SKIP
    >>> [a.ending for a in result.attempts]                                              # doctest: +SKIP
    ['failed', 'succeeded']

What ends the loop, whatever restarts are left:

- every rank answered: the result is that attempt's values and output; ``metrics`` spans all
  attempts (each record says which) and ``attempts`` lists them;
- the last attempt failed: its exception is raised, the earlier attempts' root causes listed
  after its message;
- ``timeout=`` covers every attempt, the waits between them included: it expiring, or running
  out before a restart, ends the launch;
- an interrupt (Ctrl-C, a panel's Stop) during an attempt or during ``restart_delay``: no
  further attempt.

Each failed attempt that is followed by another prints one line in the cell (rank, root cause,
how long the attempt ran); the next attempt then streams live as the first did. Resuming is the
function's business: it reads its attempt from ``accelnb.restart_count()`` (or
``TORCHELASTIC_RESTART_COUNT``) and loads its last checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from accelnb.errors import LaunchFailed, LaunchTimeout, RunInterrupted
from accelnb.kernel.display.output import notebook_sink
from accelnb.kernel.run import engine
from accelnb.kernel.run.call_settings import CallSettings
from accelnb.kernel.run.engine import MetricRoute, run_on_group
from accelnb.kernel.run.launch_result import Attempt, LaunchResult
from accelnb.kernel.run.rank_group import RankGroup
from accelnb.wire.buffers import Packed

GroupStarter = Callable[[int], RankGroup]  # restart_count -> a started group
Notice = Callable[[str], None]


def print_notice(text: str) -> None:
    """The cell's one line per failed attempt (stdout, in order with rank 0's live output)."""
    notebook_sink("stdout", text + "\n")


def run_attempts(start: GroupStarter, payload: Packed, settings: CallSettings, *, metrics: MetricRoute,
                 max_restarts: int, restart_delay: float, notice: Notice = print_notice) -> LaunchResult:
    """Run ``payload`` on a group from ``start``; on a rank's failure start a fresh one, up to
    ``max_restarts`` times. Every group is closed before this returns or raises."""
    timeout = settings.timeout
    began = time.monotonic()
    deadline = None if timeout is None else began + timeout
    attempts: list[Attempt] = []
    for index in range(max_restarts + 1):
        metrics.attempt = index
        started = time.time()
        before = engine.last_result()
        group: RankGroup | None = None
        result: LaunchResult | None = None
        try:  # from before the group exists: an interrupt right after start returns is covered
            group = start(index)
            result = run_on_group(group, payload, settings, metrics=metrics, time_left=_time_left(deadline))
        except (LaunchFailed, KeyboardInterrupt) as error:
            attempts.append(Attempt.ended_by(index, started, error))
            _remember_attempts(before, attempts, began)
            last = isinstance(error, (KeyboardInterrupt, LaunchTimeout)) or index == max_restarts
            why_not = "" if last else _why_no_restart(error, restart_delay, deadline, timeout)
            if last or why_not:
                raise _listing_earlier(error, attempts, why_not).with_traceback(None) from None
            notice(_failed_attempt_line(attempts[-1], max_restarts, restart_delay))
        finally:
            if group is not None:
                group.close()
        if result is None:  # this attempt failed, and another one follows
            _wait_before_restart(restart_delay, attempts)
            continue
        final = replace(result, seconds=time.monotonic() - began, attempts=attempts + result.attempts)
        engine.remember(final)
        return final
    raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover


def _time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def _why_no_restart(error: BaseException, restart_delay: float, deadline: float | None, timeout: float | None) -> str:
    """Why no attempt follows one that failed with restarts left ("" when one does)."""
    if isinstance(error, LaunchFailed) and error.interrupted_while_stopping:
        return "No restart: an interrupt (Ctrl-C) came while accelnb ended this attempt's ranks."
    if deadline is not None and time.monotonic() + restart_delay >= deadline:
        return (f"No restart: timeout={timeout:g} s, which covers every attempt and the waits between "
                f"them (restart_delay={restart_delay:g} s), would run out first.")
    return ""


def _failed_attempt_line(attempt: Attempt, max_restarts: int, restart_delay: float) -> str:
    cause = attempt.root_cause
    what = f"rank {cause.rank} failed: {cause.summary}" if cause is not None else attempt.ending.replace("_", " ")
    when = f" in {restart_delay:g} s" if restart_delay > 0 else ""
    return (f"accelnb: attempt {attempt.index + 1} of {max_restarts + 1} ended after {attempt.seconds:.1f} s, "
            f"{what}. Restarting every rank{when} (restart_count() = {attempt.index + 1}).")


def _wait_before_restart(restart_delay: float, attempts: Sequence[Attempt]) -> None:
    if restart_delay <= 0:
        return
    try:
        time.sleep(restart_delay)
    except KeyboardInterrupt:
        raise RunInterrupted(f"accelnb stopped the launch while it waited to restart it (after attempt "
                             f"{len(attempts)} failed); no worker is left, and no further attempt "
                             "is made.") from None


def _listing_earlier(error: BaseException, attempts: Sequence[Attempt], note: str = "") -> BaseException:
    """``error`` (the last attempt's) with the earlier attempts' root causes after its message."""
    earlier = attempts[:-1]
    if not earlier and not note:
        return error
    lines = [note] if note else []
    if earlier:
        lines.append("Earlier attempts of this launch:")
        lines += [f"  attempt {a.index + 1}, after {a.seconds:.1f} s: " + (
            f"rank {a.root_cause.rank}: {a.root_cause.summary}" if a.root_cause else a.ending.replace("_", " "))
            for a in earlier]
    extra = "\n".join(lines)
    if isinstance(error, LaunchFailed):
        error.message = f"{error.message}\n{extra}"
        error.args = (error.message,)
    elif isinstance(error, RunInterrupted):
        error.message = f"{error.message} {extra}"
        error.args = (error.message,)
    return error


def _remember_attempts(before: LaunchResult | None, attempts: list[Attempt], began: float) -> None:
    """``last_result()`` after a failed attempt: its output and the metrics so far, every attempt."""
    latest = engine.last_result()
    if latest is not None and latest is not before:  # the attempt got as far as running
        engine.remember(replace(latest, seconds=time.monotonic() - began, attempts=list(attempts)))
