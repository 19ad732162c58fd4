"""The small vocabulary workers and the kernel speak, one dataclass per message.

Kernel → worker (the worker's inbox socket): :class:`RunCall`, :class:`Shutdown`,
:class:`InputReply`, :class:`StopRequest`.
Worker → kernel (the worker's events socket): :class:`Joined`, :class:`CallResult`,
:class:`CallError`, :class:`Departing`, :class:`MetricBatch` (and its subclass :class:`ProgressBatch`),
:class:`InputRequest` (a rank's ``input()`` or debugger prompt, answered through the kernel's own
``input()``: Jupyter's input box, or the terminal), :class:`StepWindow`, :class:`ChecksForStop`.
Output does not travel as events: it is the worker's real stdout/stderr file descriptors. A rank
on another machine (a Ray actor, ``worker/ray_rank.py``) has no pipe to the kernel, so there its
fds 1 and 2 are read by a thread of its own and sent as :class:`OutputChunk` events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accelnb.wire.buffers import Packed


@dataclass(frozen=True)
class RunCall:
    """Run a packed ``(fn, args, kwargs)``; the ranks in ``value_ranks`` send back the value.

    One frame for every rank (hence the set of ranks, not a flag): its buffers are written once.
    """

    call_id: int
    payload: Packed  # ``wire/buffers.dump`` of (fn, args, kwargs)
    value_ranks: frozenset[int]
    # Sources the rank cannot read from disk (notebook cells): filename → text, for its
    # debugger's and tracebacks' lines (``kernel/helper/cell_sources.py``).
    sources: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Shutdown:
    """Leave: the kernel is done with this worker (every rank answered, or the session ends).

    The worker exits with ``os._exit`` without tearing down the process group: the OS closes its
    sockets. What the rank started is ended by accelnb's helper process once the worker is gone.
    """


@dataclass(frozen=True)
class Departing:
    """The worker leaves nothing behind: no process it started is left, it never used CUDA, and it
    has closed its output and events. It exits now; the OS frees a torch-sized process in about
    20 ms, which a launch need not wait for (``kernel/run/supervisor.py`` says when it does)."""

    rank: int


@dataclass(frozen=True)
class Joined:
    """The worker joined the default process group and waits for calls."""

    rank: int


@dataclass(frozen=True)
class CallResult:
    """The call returned on this rank."""

    rank: int
    call_id: int
    value: Packed | None  # the return value (``result_pickling.dumps_for_kernel``), None when not wanted


@dataclass(frozen=True)
class CallError:
    """The user's code (or the set-up before it) raised on this rank, or its value cannot travel."""

    rank: int
    call_id: int | None  # None: failed while setting up, before any call
    type_name: str  # "ValueError", "torch.distributed.DistBackendError"
    message: str
    traceback: str  # formatted, without accelnb's frames; "" when no user code is to blame
    exception: Packed | None  # ``result_pickling.dumps_exception_for_kernel``; None if it cannot travel
    timestamp: float


@dataclass(frozen=True)
class OutputChunk:
    """Bytes a rank wrote to its stdout or stderr (ranks without a pipe to the kernel)."""

    rank: int
    stream: str  # "stdout" or "stderr"
    data: bytes


@dataclass(frozen=True)
class MetricBatch:
    """Scalars reported with ``accelnb.report`` since the last batch."""

    rank: int
    records: list[tuple[int | None, float, dict[str, float]]] = field(default_factory=list)
    # each record: (step, wall time, {name: value})


@dataclass(frozen=True)
class ProgressState:
    """The state of one ``accelnb.progress`` bar on rank 0 at one moment."""

    bar_id: int
    position: int  # nesting depth when it opened (0: outermost); a newer bar takes over its line
    desc: str | None
    n: int
    total: int | None
    started: float  # wall time the bar opened
    time: float  # wall time of this state
    closed: bool = False


@dataclass(frozen=True)
class ProgressBatch(MetricBatch):
    """A metric batch that also carries progress-bar states changed since the last batch.

    A subclass, so that everything routing :class:`MetricBatch` events (the supervisor's
    ``isinstance`` dispatch, the launcher's metric sink) carries progress to the live view with
    no change; :class:`~accelnb.kernel.display.metrics_history.MetricHistory` reads only ``records``.
    """

    bars: list[ProgressState] = field(default_factory=list)



@dataclass(frozen=True)
class StepWindow:
    """A rank's training steps since its last window, and where their time went
    (``worker/step_timing.py``): sums in seconds; the split only over steps with a DDP forward."""

    rank: int
    steps: int
    step_s: float
    split_steps: int  # steps whose time is split into data and forward below
    data_s: float  # end of the previous step to the DDP forward
    forward_s: float
    # Steps counted without a duration (a rank's first: nothing marks where it began), in none of
    # the sums above; ``steps + untimed_steps`` is how many optimizer steps the rank took.
    untimed_steps: int = 0
    # DDP forwards under no_grad/inference_mode: an inference loop's steps, for code that has no
    # optimizer step (the kernel counts them only while the rank counts no optimizer step).
    forward_steps: int = 0
    # The rank's peak resident memory so far, in bytes, read where the rank runs: the kernel cannot
    # read the memory of a rank on another node. None: not read.
    peak_host_memory: int | None = None


@dataclass(frozen=True)
class InputRequest:
    """A rank waits for a line of input: ``input()``, ``sys.stdin.readline()``, or its debugger.

    ``shown_first`` is what the rank's debugger printed since its last prompt (the current line,
    ``p x``'s value): it travels with the request, so that it reaches the cell before the prompt
    whatever the rank's output mode. The worker's own stdout was flushed before this was sent.
    """

    rank: int
    request_id: int  # unique per rank; the reply carries it back
    prompt: str
    shown_first: str = ""


@dataclass(frozen=True)
class InputReply:
    """The kernel's answer to an :class:`InputRequest`, sent on the rank's inbox.

    ``line`` None means end of input: the rank's ``input()`` raises ``EOFError(eof_reason)``.
    A reply whose ``request_id`` the rank no longer waits for (it was interrupted) is dropped, so
    replies can never be taken for calls, nor for the answer to a later prompt.
    """

    request_id: int
    line: str | None
    eof_reason: str = ""


@dataclass(frozen=True)
class StopRequest:
    """Stop the call at your next ``stop_requested()`` check: the user pressed Stop (or the
    kernel got SIGTERM, or ``timeout=`` passed) while the call's code checks for it.

    A request for another call than the running one (it crossed the call's end) is dropped."""

    call_id: int


@dataclass(frozen=True)
class ChecksForStop:
    """The call's code called ``stop_requested()`` on this rank (sent once per call): from now on
    a Stop press is a request the code answers, not a kill (``worker/stopping/``)."""

    rank: int
    call_id: int
