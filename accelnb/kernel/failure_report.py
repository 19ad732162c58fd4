"""Failure records of ranks, and the one exception the user sees for a failed run.

Each failed rank becomes a :class:`RankFailure`. The earliest one is the root cause and comes
first; ranks that failed *because* of it (a peer vanished mid-collective) or were stopped by
accelnb are listed after it in one line each. The exception raised in the kernel keeps the
remote exception's type where possible: a ``ValueError`` on rank 1 is raised as a subclass of both
:class:`~accelnb.errors.RankFailed` and ``ValueError``.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

import cloudpickle

from accelnb.errors import LaunchFailed, LaunchTimeout, RankCrashed, RankFailed, RankFailure
from accelnb.kernel.stacks import clean_stack_dump


def signal_failure(rank: int, pid: int, exit_code: int, output_tail: str) -> RankFailure:
    """A rank that ended without reporting: by a signal (negative code) or a bare exit."""
    if exit_code < 0:
        name = _signal_name(-exit_code)
        hint = {
            "SIGKILL": " (sent by the kernel's OOM killer when memory runs out, or by `kill -9`)",
            "SIGSEGV": " (a segmentation fault in native code)",
            "SIGABRT": " (native code aborted, e.g. a failed CUDA/NCCL assertion)",
            "SIGBUS": " (bad memory access; on Docker often a too-small /dev/shm)",
        }.get(name, "")
        return RankFailure(rank, pid, "signal", f"killed by {name}{hint}", exit_code=exit_code,
                           signal_name=name, output_tail=clean_stack_dump(output_tail))
    return RankFailure(rank, pid, "exit", f"exited with code {exit_code} without returning "
                       "(os._exit() or a crash in native code)", exit_code=exit_code,
                       output_tail=output_tail)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def build_exception(failures: Sequence[RankFailure], stopped: Sequence[int],
                    show_output_of: set[int], timed_out_after: float | None = None,
                    stacks: dict[int, str] | None = None, session_ended: bool = False) -> LaunchFailed:
    """The exception for a failed run, root cause first."""
    # A peer that lost its partner mid-collective often reports before the partner's death is
    # reaped; such echoes never count as the root cause while another rank crashed.
    crashed = any(f.kind in ("signal", "exit") for f in failures)
    ordered = sorted(failures, key=lambda f: (crashed and _is_peer_loss(f), f.timestamp))
    lines: list[str] = []
    if timed_out_after is not None:
        lines.append(f"The run did not finish within timeout={timed_out_after:g} s; every rank was "
                     "stopped. Each rank's Python stack at that moment:")
        for rank, stack in sorted((stacks or {}).items()):
            lines.append("")
            lines.append(f"── rank {rank} ──")
            lines.extend(_prefixed(stack.strip() or "(no stack: the rank was in native code or exited)", rank))
        lines.append("")
        lines.append("A rank waiting in a collective (all_reduce, barrier) usually means another rank "
                     "skipped it or is stuck earlier. Raise timeout= if the work is just slow.")
        return LaunchTimeout("\n".join(lines), tuple(ordered))

    root = ordered[0]
    lines.append(f"Rank {root.rank} failed: {root.summary}")
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
    return _typed_rank_failed(message, tuple(ordered), root)


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Read error",
              "remote process exited", "Socket closed", "Broken pipe")


def _is_peer_loss(failure: RankFailure) -> bool:
    return failure.kind == "exception" and any(marker in failure.summary + failure.traceback
                                               for marker in _PEER_LOSS)


def _prefixed(text: str, rank: int) -> list[str]:
    return [f"[rank {rank}] {line}" for line in text.splitlines()]


def _typed_rank_failed(message: str, failures: tuple[RankFailure, ...], root: RankFailure) -> LaunchFailed:
    original = _original_type(root)
    if original is not None and issubclass(original, Exception) and not issubclass(original, LaunchFailed):
        try:
            cls: type[RankFailed] = type(original.__name__, (RankFailed, original),
                                         {"__module__": "accelnb.remote"})
            error = cls.__new__(cls)
            RankFailed.__init__(error, message, failures)
            return error
        except TypeError:  # incompatible layouts (rare C exception types)
            pass
    return RankFailed(message, failures)


def _original_type(root: RankFailure) -> type | None:
    if root.exception is None:
        return None
    try:
        exc = cloudpickle.loads(root.exception)
    except Exception:
        return None
    return type(exc) if isinstance(exc, BaseException) else None
