"""From what happened to what the user reads: failure records, and the one exception for a run.

The supervisor records each rank that did not finish as a :class:`~accelnb.errors.RankFailure`
(with the constructors here, so that every summary is worded in this one place) and returns a
:class:`~accelnb.kernel.run.call_outcome.CallOutcome`; :func:`exception_for` turns that into the
exception the cell shows, or None when every rank answered.

The earliest failure is the root cause and comes first; ranks that failed *because* of it (a peer
vanished mid-collective) or were stopped by accelnb are listed after it in one line each. The
exception raised in the kernel keeps the remote exception's type where possible: a ``ValueError``
on rank 1 is raised as a subclass of both :class:`~accelnb.errors.RankFailed` and ``ValueError``.

    >>> error = exception_for(outcome, show_output_of={0}, persistent=False)   # doctest: +SKIP
    >>> if error is not None: raise error                                      # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

from accelnb.errors import (
    LaunchFailed,
    LaunchTimeout,
    RankCrashed,
    RankFailed,
    RankFailure,
    RunInterrupted,
)
from accelnb.kernel.helper.process_exits import describe_exit_status, helper_died, signal_name
from accelnb.kernel.run.call_outcome import CallOutcome
from accelnb.kernel.stacks.faulthandler_dumps import clean_stack_dump
from accelnb.wire.events import CallError
from accelnb.wire.result_pickling import loads_in_kernel

# The exit status of a worker whose set-up failed before it could report why: worker/template/helper.py
# exits with 70 (os.EX_SOFTWARE) when anything before worker_main raises.
SETUP_FAILED_EXIT_CODE = 70
# The type a rank reports when the user typed `q` at its (Pdb) prompt (worker/interactive/rank_debugger.py).
QUIT_IN_DEBUGGER = "bdb.BdbQuit"



# ── failure records ─────────────────────────────────────────────────────────────────────────────
def exception_failure(rank: int, pid: int, event: CallError, output_tail: str) -> RankFailure:
    """A rank reported an exception: raised by the function, or by the set-up before it."""
    if event.type_name == QUIT_IN_DEBUGGER:
        summary = "quit in the debugger"
    else:
        summary = f"{event.type_name}: {event.message}" if event.message else event.type_name
    return RankFailure(rank=rank, pid=pid, kind="exception", summary=summary, traceback=event.traceback,
                       type_name=event.type_name, exception=event.exception, output_tail=output_tail,
                       timestamp=event.timestamp, in_setup=event.call_id is None)


def actor_lost_failure(rank: int, pid: int, node: str, reason: str, output_tail: str) -> RankFailure:
    """A rank's cluster actor died (killed, out of memory, its node lost) without reporting."""
    return RankFailure(rank, pid, "exit", f"its Ray actor on node {node} (pid {pid}) died: {reason}",
                       output_tail=output_tail)


def actor_fault_failure(rank: int, pid: int, node: str, cause: str, traceback: str, output_tail: str) -> RankFailure:
    """accelnb's own code in a rank's cluster actor raised (the user's exceptions are the call's
    answer): a bug of accelnb's, which the rank cannot be trusted after."""
    return RankFailure(rank, pid, "exit", f"accelnb's Ray actor on node {node} (pid {pid}) failed in accelnb's own "
                       f"code: {cause}. This is a bug in accelnb: please report it with this traceback",
                       traceback=traceback, output_tail=output_tail)


def exit_failure(rank: int, pid: int, exit_code: int, output_tail: str, timestamp: float, *,
                 joined: bool = True) -> RankFailure:
    """A rank that ended without reporting: by a signal (negative code) or a bare exit.

    ``joined``: it had joined the process group (so an exit code of 70 was the function's own).
    """
    if exit_code < 0:
        name = signal_name(-exit_code)
        return RankFailure(rank, pid, "signal", describe_exit_status(exit_code),
                           exit_code=exit_code, signal_name=name, output_tail=clean_stack_dump(output_tail),
                           timestamp=timestamp)
    if exit_code == SETUP_FAILED_EXIT_CODE and not joined:
        return RankFailure(rank, pid, "exit", f"accelnb's worker set-up failed (exit code {exit_code}) before "
                           "it could report why", exit_code=exit_code, output_tail=output_tail,
                           timestamp=timestamp, in_setup=True)
    if exit_code == 0:
        summary = "exited with code 0 before returning (sys.exit(0) or os._exit(0) inside the function?)"
    else:
        summary = f"exited with code {exit_code} without returning (os._exit() or a crash in native code)"
    return RankFailure(rank, pid, "exit", summary, exit_code=exit_code, output_tail=output_tail,
                       timestamp=timestamp)


# ── the exception for a call ────────────────────────────────────────────────────────────────────
def exception_for(outcome: CallOutcome, *, show_output_of: set[int],
                  persistent: bool) -> LaunchFailed | RunInterrupted | None:
    """What the cell raises for ``outcome``; None when every rank answered."""
    if outcome.ending == "answered":
        return None
    if outcome.ending == "interrupted":
        return run_interrupted(outcome, persistent=persistent)
    failed: LaunchFailed
    if outcome.ending == "helper_died":
        assert outcome.helper_exit is not None
        failed = helper_died(outcome.helper_exit, "during the run", persistent=persistent, failures=outcome.failures)
    elif outcome.ending == "timed_out":
        failed = timed_out(outcome.timeout, outcome.stacks, outcome.failures, ranks=outcome.ranks,
                           persistent=persistent)
    else:
        failed = build_exception(outcome.failures, outcome.stopped, show_output_of,
                                 session_ended=persistent and not outcome.workers_kept)
    failed.interrupted_while_stopping = outcome.interrupted_while_stopping
    return failed


def run_interrupted(outcome: CallOutcome, *, persistent: bool) -> RunInterrupted:
    """One short message: what the interrupt stopped, and what is left."""
    on_what = "on the Stop request" if outcome.stop_source == "stop_request" else "on the interrupt"
    if outcome.stop_asked_by is not None:  # the code was asked first (stop_requested()) and did not end in time
        on_what = (f"on the Stop request: they were asked to stop at their next stop_requested() check "
                   f"({outcome.stop_asked_by}) {outcome.stop_seconds or 0:.1f} s earlier and had not all returned "
                   "(a second press, or stop_grace= passed)")
    if outcome.workers_kept and outcome.phase == "unsent":
        return RunInterrupted("accelnb interrupted the cell before it reached the workers; the session and "
                              "its variables are kept.")
    if outcome.workers_kept:
        return RunInterrupted("accelnb interrupted the cell on every rank; the session and its variables "
                              "are kept." + _finished_apart(outcome))
    if persistent and outcome.phase == "sending":
        return RunInterrupted(f"accelnb stopped the run while sending it to the workers: every worker was "
                              f"ended {on_what}, and the session was closed (a half-sent call cannot be "
                              "taken back). Start a new one with Session.start() or %distributed start.")
    if persistent:
        return RunInterrupted(f"accelnb stopped the run: every worker was ended {on_what} (a rank did not "
                              "respond to the interrupt, so the session was closed).")
    return RunInterrupted(f"accelnb stopped the run: every worker was ended {on_what}.")


def _finished_apart(outcome: CallOutcome) -> str:
    """What an interrupted cell may have left apart: ranks that had finished it, and ranks it
    interrupted (the interrupt sweep of a real kernel's ``%%distributed`` cells left such ranks
    with different values of what the cell assigned)."""
    finished = sorted(outcome.values)
    stopped = sorted({failure.rank for failure in outcome.failures} - set(finished))
    if not finished or not stopped:
        return ""
    return (f" {_ranks(finished)} had finished the cell when the interrupt came, and {_ranks(stopped)} "
            f"{'were' if len(stopped) > 1 else 'was'} interrupted in it: the ranks' variables may differ.")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def start_interrupted() -> RunInterrupted:
    return RunInterrupted("accelnb stopped the launch while starting its workers; no worker is left.")


def interrupted_outside_call(*, persistent: bool, kept: bool = False) -> RunInterrupted:
    """An interrupt that landed around the call, before it went out or once it had ended (while
    the workers were ended after it answered, say). ``kept``: a session's workers were kept."""
    if kept:
        return RunInterrupted("accelnb stopped the cell on the interrupt, while no rank was running it; the "
                              "session and its variables are kept.")
    return RunInterrupted("accelnb stopped the run: every worker was ended on the interrupt"
                          + (", and the session was closed." if persistent else "."))


def timed_out(timeout: float | None, stacks: dict[int, str], failures: Sequence[RankFailure], *,
              ranks: Sequence[int] | None = None, persistent: bool = False) -> LaunchTimeout:
    """``ranks``: the ranks the call ran on, when it was not all of them (``Session.run(ranks=)``)."""
    lines = [f"The run did not finish within timeout={timeout:g} s; every rank was "
             "stopped. Each rank's Python stack at that moment:"]
    if ranks is not None:
        chosen = ", ".join(str(rank) for rank in ranks)
        lines[0:0] = [f"The call ran on rank{'s' if len(ranks) > 1 else ''} {chosen} only (ranks="
                      f"{list(ranks)}): a collective in it (all_reduce, barrier, a DDP step) waits for "
                      "ranks that are not running it, and never returns. Run such code on every rank."]
    for rank, stack in sorted(stacks.items()):
        lines.append("")
        lines.append(f"── rank {rank} ──")
        if ranks is not None and rank not in ranks:
            stack = "(not running this call: it waits for the next one)"  # in accelnb's frames alone
        lines.extend(_prefixed(stack.strip() or "(no stack: the rank was in native code or exited)", rank))
    lines.append("")
    if ranks is None:
        lines.append("A rank waiting in a collective (all_reduce, barrier) usually means another rank "
                     "skipped it or is stuck earlier. Raise timeout= if the work is just slow.")
    elif persistent:
        lines.append("The session was closed with its workers; start a new one with Session.start() or "
                     "%distributed start (or %distributed restart).")
    return LaunchTimeout("\n".join(lines), tuple(_root_cause_first(failures)))


def build_exception(failures: Sequence[RankFailure], stopped: Sequence[int], show_output_of: set[int],
                    session_ended: bool = False) -> LaunchFailed:
    """The exception for a run in which ranks failed, root cause first."""
    ordered = _root_cause_first(failures)
    root = ordered[0]
    if root.type_name == QUIT_IN_DEBUGGER:  # the user's decision, not a failure to explain
        lines = [f"The run stopped: quit in the debugger on rank {root.rank}."]
    else:
        lines = [f"Rank {root.rank} failed: {root.summary}"]
    if root.in_setup:
        lines.append("This happened while accelnb set the worker up (its environment, the process "
                     "group), before your function ran.")
    if root.traceback:
        lines.append("")
        lines.extend(_prefixed(root.traceback.rstrip(), root.rank))
    if root.output_tail and root.rank not in show_output_of:
        lines.append("")
        lines.append(f"Last output of rank {root.rank}:")
        lines.extend(_prefixed(root.output_tail, root.rank))
    for other in ordered[1:]:
        lines.append(f"Also rank {other.rank}: {other.summary}" +
                     (" (probably a consequence of the first failure)" if other.kind == "exception" else ""))
    if stopped:
        lines.append(f"Stopped by accelnb after the failure: rank {', '.join(map(str, sorted(stopped)))}.")
    if session_ended:
        lines.append("The persistent session was closed: not every rank could continue. "
                     "Start a new one with %distributed start.")
    message = "\n".join(lines)
    if root.kind != "exception":
        return RankCrashed(message, tuple(ordered))
    return RankFailed.like(_original_type(root), message, ordered)


def _root_cause_first(failures: Sequence[RankFailure]) -> list[RankFailure]:
    # A peer that lost its partner mid-collective often reports before the partner's death is
    # reaped; such echoes never count as the root cause while another rank crashed.
    crashed = any(f.kind in ("signal", "exit") for f in failures)
    return sorted(failures, key=lambda f: (crashed and is_peer_loss(f), f.timestamp))


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Read error",
              "remote process exited", "Socket closed", "Broken pipe")


def is_peer_loss(failure: RankFailure) -> bool:
    """Whether ``failure`` reads as the echo of a peer that vanished mid-collective (gloo's and
    NCCL's wording): its root cause is probably another rank's death, reported later."""
    return failure.kind == "exception" and any(marker in failure.summary + failure.traceback
                                               for marker in _PEER_LOSS)


def _prefixed(text: str, rank: int) -> list[str]:
    return [f"[rank {rank}] {line}" for line in text.splitlines()]


def _original_type(root: RankFailure) -> type[BaseException] | None:
    """The remote exception's type, unpickled the kernel-safe way (no CUDA in the kernel)."""
    if root.exception is None:
        return None
    try:
        exc = loads_in_kernel(root.exception)
    except Exception:  # its class may not import here, or its __reduce__ may not run here
        return None
    return type(exc) if isinstance(exc, BaseException) else None

