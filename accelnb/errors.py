"""Every exception accelnb raises, in one tree.

::

    AccelnbError
    ├── LaunchConfigError (ValueError)      bad input, raised before any process starts
    │   ├── CellSyntaxError                 a %%distributed cell Python cannot parse
    │   ├── GpuSelectionError               unknown, duplicate, invisible or empty GPU selection
    │   ├── PortInUseError                  an explicit master_port= is taken
    │   └── UnpicklableError (TypeError)    an argument or notebook name cannot travel to workers
    ├── WorkerStartError (RuntimeError)     accelnb's helper process could not start or fork workers
    │   └── HelperDied                      (below)
    └── LaunchFailed (RuntimeError)         a run started and ended badly
        ├── RankFailed                      a rank raised; also an instance of the original type
        ├── RankCrashed                     a rank died by a signal or exited without a result
        ├── LaunchTimeout (TimeoutError)    ``timeout=`` expired; carries every rank's stacks
        └── HelperDied                      accelnb's helper process died (OOM killer, ``kill``),
                                            at start-up or mid-run: every worker died with it

    KeyboardInterrupt
    └── RunInterrupted                      the user stopped the run (Ctrl-C, a panel's Stop);
                                            raised once every worker that had to go is gone

``HelperDied`` is both a ``WorkerStartError`` and a ``LaunchFailed``: the helper can die at any
moment, and code catching either for "the launch did not work" catches it. ``RunInterrupted`` is
not an ``AccelnbError``: ``except Exception`` must never swallow a Ctrl-C.
Every message says what happened, the likely cause, and how to fix it.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from accelnb.kernel.display.metrics_history import MetricHistory
    from accelnb.wire.buffers import Packed


FailureKind = Literal["exception", "signal", "exit", "stopped", "timeout"]


@dataclass(frozen=True)
class RankFailure:
    """Why one rank did not finish."""

    rank: int
    pid: int | None
    kind: FailureKind
    summary: str  # one line: "ValueError: bad input", "killed by SIGSEGV"
    traceback: str = ""  # the remote traceback, launcher frames removed
    exit_code: int | None = None
    signal_name: str | None = None
    type_name: str | None = None
    exception: Packed | None = field(default=None, repr=False)
    output_tail: str = ""
    timestamp: float = field(default_factory=time.time)
    in_setup: bool = False  # failed in accelnb's set-up of the worker, before the function ran


class AccelnbError(Exception):
    """Base of every accelnb exception."""


class LaunchConfigError(AccelnbError, ValueError):
    """The launch request is invalid; nothing was started."""


class LaunchInsideLaunchError(LaunchConfigError):
    """A launcher (accelnb's, ``mp.spawn``, Accelerate's, Lightning's) was called inside a rank
    and would start processes again; nothing was started. The message says what to write instead."""


class CellSyntaxError(LaunchConfigError):
    """A ``%%distributed`` cell that Python cannot parse: no rank ran any of it.

    The notebook shows it as it shows a plain cell's syntax error (the cell's line, the caret, the
    reason), not as a traceback through accelnb's and IPython's frames, which explain nothing.
    """

    @classmethod
    def of(cls, error: SyntaxError) -> CellSyntaxError:
        """Python's report of ``error``, from parsing the cell as the notebook shows it (its lines,
        and the lines its message names, counted from the magic's line)."""
        message = "".join(traceback.format_exception_only(type(error), error)).rstrip("\n")
        if (error.text or "").lstrip().startswith(("!", "%")):
            message += ("\nA %%distributed cell runs as plain Python on every rank, where IPython's `!command` "
                        "and `%magic` lines do not exist: use subprocess.run([...]) or os.system(...) for a "
                        "command, or run the magic in a cell of its own.")
        return cls(message)

    def _render_traceback_(self) -> list[str]:
        return str(self).splitlines()


class ScriptExited(AccelnbError):
    """A script run on the ranks (``%torchrun``, :func:`accelnb.torchrun`) ended with a non-zero
    exit code (``sys.exit(code)``); the rank's traceback shows the line that exited."""

    def __init__(self, script: str, code: object) -> None:
        super().__init__(f"{script} exited with code {code}")
        self.script = script
        self.code = code

    def __reduce__(self) -> tuple[type, tuple[str, object]]:
        return type(self), (self.script, self.code)


class GpuSelectionError(LaunchConfigError):
    """The GPU selection names GPUs that do not exist, repeat, or cannot be used."""


class PortInUseError(LaunchConfigError):
    """An explicitly requested ``master_port`` is already bound by another process."""

    def __init__(self, port: int) -> None:
        self.port = port
        super().__init__(
            f"master_port={port} is already in use on 127.0.0.1 by another process. "
            "Leave master_port unset to let accelnb pick a free port, or choose another one."
        )


class UnpicklableError(LaunchConfigError, TypeError):
    """Something that has to travel to the workers cannot be pickled."""

    def __init__(self, what: str, value: object, reason: str, hint: str) -> None:
        self.what = what
        self.type_name = f"{type(value).__module__}.{type(value).__qualname__}"
        super().__init__(
            f"{what} of type {self.type_name} cannot be sent to the worker processes: {reason}. "
            f"{hint}"
        )


class WorkerStartError(AccelnbError, RuntimeError):
    """The clean helper process that forks workers could not be started."""


@dataclass(eq=False)
class LaunchFailed(AccelnbError, RuntimeError):
    """A distributed run started and at least one rank did not finish.

    ``failures`` holds one record per failed rank, root cause (the earliest failure) first.
    ``interrupted_while_stopping``: a Ctrl-C came while accelnb ended the ranks after the
    failure; it hurried their end, and no restart (``max_restarts``) followed it.
    """

    message: str
    failures: Sequence[RankFailure] = field(default_factory=tuple)
    metrics: MetricHistory | None = None  # the MetricHistory reported before the failure, set by the launcher
    interrupted_while_stopping: bool = False

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)

    def __str__(self) -> str:
        return self.message

    @property
    def root_cause(self) -> RankFailure | None:
        return self.failures[0] if self.failures else None

    def _render_traceback_(self) -> list[str]:
        """IPython hook: show the workers' tracebacks, not the launcher's frames."""
        return self.message.splitlines()


class RankFailed(LaunchFailed):
    """A rank raised an exception. Instances also subclass the original exception type
    where that is possible, so ``except ValueError`` catches a remote ``ValueError``.

    Build one with :meth:`like`; every failure of one original type shares one class, and the
    instances pickle (the class is re-made from the original type on the other side).
    """

    original_type: ClassVar[type[Exception] | None] = None

    @classmethod
    def like(cls, original: type[BaseException] | None, message: str,
             failures: Sequence[RankFailure] = ()) -> RankFailed:
        """A ``RankFailed`` that is also an ``original`` where the two types can be combined."""
        typed = _rank_failed_class_like(original)
        error = typed.__new__(typed)  # the original's __init__ may want other arguments
        RankFailed.__init__(error, message, tuple(failures))
        return error

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_rank_failed, (self.original_type, self.message, tuple(self.failures), self.metrics,
                                       self.interrupted_while_stopping))


class RankCrashed(LaunchFailed):
    """A rank exited without reporting a result: killed by a signal or ``os._exit``."""


class LaunchTimeout(LaunchFailed, TimeoutError):
    """The run exceeded ``timeout=`` seconds; the message carries every rank's Python stack."""


@dataclass(eq=False)
class HelperDied(LaunchFailed, WorkerStartError):
    """accelnb's helper process (the clean process that forks workers) died.

    ``exit_code`` is its exit status, negative for the signal that killed it (``-9``: SIGKILL,
    usually the kernel's OOM killer), None when it could not be read. Every worker died with it;
    the next launch starts a new helper.
    """

    helper_pid: int | None = None
    exit_code: int | None = None


class RunInterrupted(KeyboardInterrupt):
    """The user stopped the run; the message says what was stopped and what is left.

    In IPython the cell shows just that message, not a traceback through accelnb's frames.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self.message}"]


# One class per original exception type: ``type(a) is type(b)`` for two remote ValueErrors, and
# a kernel that fails a thousand times does not mint a thousand classes.
_RANK_FAILED_LIKE: dict[type[BaseException], type[RankFailed]] = {}


def _rank_failed_class_like(original: type[BaseException] | None) -> type[RankFailed]:
    if original is None or not issubclass(original, Exception) or issubclass(original, LaunchFailed):
        return RankFailed
    cached = _RANK_FAILED_LIKE.get(original)
    if cached is not None:
        return cached
    try:
        typed: type[RankFailed] = type(original.__name__, (RankFailed, original), {
            "__module__": __name__,
            "__qualname__": f"RankFailed[{original.__qualname__}]",
            "original_type": original,
        })
        typed.__new__(typed)  # OSError's family combines, then refuses to be made by RuntimeError's __new__
    except TypeError:  # incompatible instance layouts or constructors (some C exception types, e.g. OSError)
        typed = RankFailed
    _RANK_FAILED_LIKE[original] = typed
    return typed


def _rebuild_rank_failed(original: type[BaseException] | None, message: str, failures: tuple[RankFailure, ...],
                         metrics: MetricHistory | None, interrupted_while_stopping: bool = False) -> RankFailed:
    error = RankFailed.like(original, message, failures)
    error.metrics, error.interrupted_while_stopping = metrics, interrupted_while_stopping
    return error
