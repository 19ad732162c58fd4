"""One rank as a Ray actor: the worker's own set-up, calls and reports, over Ray's channels.

A rank on another machine cannot inherit pipes from the kernel, so this actor does what
``worker/main.py`` does with the same rank body, ``worker/rank_body.py`` (environment, join
barrier, running a call, cleaning the user's traceback, pickling values for the kernel), and sends what a
local worker writes to its pipes as events into a queue the kernel drains through
:meth:`RankActor.events`, a method Ray runs beside the call (``max_concurrency``). Everything that
crosses the network is a Ray task argument or return value: no socket of ours carries pickle.

    actor = ray.remote(RankActor).options(max_concurrency=6, ...).remote()
    facts = ray.get(actor.facts.remote())            # node address, interface, GPUs, pid
    port = ray.get(actor.reserve_port.remote(ip))    # rank 0 only: bound here, handed to its TCPStore
    actor.set_up.remote(spec)                        # joins the process group; errors become events
    actor.run.remote(call_id, payload, value_ranks)  # the payload: one object in Ray's store
    actor.deliver.remote(StopRequest(call_id))       # beside the call: a Stop press, or a prompt's answer
    ray.get(actor.events.remote(0.2))                # output, metrics, result or error

The function runs in the actor's call thread, not the process's main thread (Ray's own loop holds
that one): a call is interrupted with an asynchronous ``KeyboardInterrupt`` in that thread
(:meth:`interrupt`), and :meth:`stacks` reads every thread's stack with ``sys._current_frames``,
which needs no signal. What a local rank's control reader hands on (a stop request, the answer to an
``input()`` or ``(Pdb)`` prompt) arrives through :meth:`deliver`, also beside the call.
"""

from __future__ import annotations

import faulthandler
import fcntl
import os
import queue
import select
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelnb.wire import channel
from accelnb.wire.buffers import Packed
from accelnb.wire.events import (
    CallError,
    CallResult,
    InputReply,
    InputRequest,
    Joined,
    OutputChunk,
    RunCall,
    StopRequest,
)
from accelnb.wire.spec import WorkerSpec
from accelnb.worker.interactive import rank_input
from accelnb.worker.interactive.rank_interrupts import ThreadInterrupts
from accelnb.worker.rank_body import (
    attach_to_kernel,
    chdir_quietly,
    describe_error,
    flush_streams_and_metrics,
    install_streams,
    join_the_run,
    run_call,
    start_flusher,
)
from accelnb.worker.stopping import rank_stop

EVENTS_PER_POLL = 256  # one poll answer stays small under an output flood
OUTPUT_SYNC_LIMIT_S = 1.0
_SIOCGIFADDR = 0x8915
_FIONREAD = 0x541B
# Frames of accelnb and Ray above the user's code, left out of a stack shown to the user.
_MACHINERY = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, f"{os.sep}ray{os.sep}",
              f"{os.sep}threading.py", f"{os.sep}concurrent{os.sep}")


@dataclass(frozen=True)
class ActorFacts:
    """Where a rank's actor runs, as the kernel needs it to plan the ranks."""

    node_id: str
    address: str  # the node's Ray address
    interface: str | None  # the network interface carrying ``address`` (GLOO/NCCL_SOCKET_IFNAME)
    gpu_ids: tuple[str, ...]  # what Ray assigned this actor, as CUDA numbers them on the node
    pid: int
    hostname: str


class _EventQueue(channel.MessageWriter):
    """What ``worker/main.py`` sends on its events socket, put into this actor's queue instead.
    A result, an error or a prompt first waits for the output printed before it (``before_answer``)."""

    def __init__(self, before_answer: Callable[[], None]) -> None:  # no socket: the kernel polls
        self.queue: queue.Queue[Any] = queue.Queue()
        self._before_answer = before_answer
        self.answered: int | None = None  # the call id of the last result or error put

    def send(self, message: Any) -> None:
        if isinstance(message, (CallResult, CallError, InputRequest)):
            self._before_answer()
        self.queue.put(message)
        if isinstance(message, (CallResult, CallError)):
            self.answered = message.call_id


class RankActor:
    """One rank of a Ray launch; its methods are called by ``accelnb.cluster.ray_group``."""

    def __init__(self) -> None:
        self._readers: list[tuple[int, threading.Lock]] = []  # fds 1 and 2's pipes, and who reads them
        self._events = _EventQueue(before_answer=self._output_sent)
        self._store_socket: socket.socket | None = None
        self._ready = threading.Event()  # set-up finished, well or badly
        self._set_up_failed = False
        self._rank = -1
        self._interrupts = ThreadInterrupts()  # a call's, from the kernel's interrupt()
        self._set_up_thread: int | None = None

    def facts(self) -> ActorFacts:
        import ray

        address = ray.util.get_node_ip_address()
        return ActorFacts(node_id=ray.get_runtime_context().get_node_id(), address=address,
                          interface=interface_of(address), gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
                          pid=os.getpid(), hostname=socket.gethostname())

    def reserve_port(self, address: str) -> int:
        """Bind rank 0's rendezvous port on this node now, so that nothing can take it before
        the TCPStore listens on it (it gets this very socket)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, 0))
        sock.listen(1024)
        self._store_socket = sock
        return int(sock.getsockname()[1])

    def set_up(self, spec: WorkerSpec) -> None:
        """Take the rank's environment, capture its output, join the process group. A failure is
        reported as the local worker reports it: a :class:`CallError` with no call."""
        self._rank = spec.rank
        self._set_up_thread = threading.get_ident()
        try:
            self._set_up(spec)
            self._events.send(Joined(spec.rank))
        except BaseException as error:  # the kernel shows the cause
            self._set_up_failed = True
            flush_streams_and_metrics()
            self._events.send(describe_error(spec.rank, None, error))
        finally:
            if self._store_socket is not None:
                self._store_socket.close()  # the TCPStore holds its own copy of the fd
                self._store_socket = None
            self._set_up_thread = None
            self._ready.set()

    def _set_up(self, spec: WorkerSpec) -> None:
        os.environ.update(spec.env)
        chdir_quietly(spec.cwd)
        sys.path.extend(p for p in spec.sys_path if p not in sys.path and os.path.isdir(p))
        self._capture_output(spec.rank)
        install_streams()
        faulthandler.enable(file=2, all_threads=True)
        attach_to_kernel(self._events, spec.rank, spec.restart_count)
        start_flusher()
        join_the_run(spec, self._store_socket.fileno() if self._store_socket is not None else None)

    def _capture_output(self, rank: int) -> None:
        """Point fds 1 and 2 at pipes a thread reads: C and C++ output (gloo, NCCL) comes too,
        and nothing reaches Ray's log forwarding, which would print it into whatever cell runs."""
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            threading.Thread(target=self._forward, args=(read_end, rank, stream),
                             name=f"accelnb-{stream}", daemon=True).start()

    def _forward(self, read_end: int, rank: int, stream: str) -> None:
        lock = threading.Lock()
        self._readers.append((read_end, lock))
        while True:
            select.select([read_end], [], [])  # not under the lock: nothing may wait on an idle pipe
            with lock:
                data = os.read(read_end, 1 << 16)  # readable, and this thread is its only reader
                if not data:
                    return
                self._events.send(OutputChunk(rank, stream, data))

    def _output_sent(self) -> None:
        """Wait until what was written to fds 1 and 2 so far is in the events (at most 1 s):
        a result must not overtake the lines printed before it."""
        deadline = time.monotonic() + OUTPUT_SYNC_LIMIT_S
        for read_end, lock in self._readers:
            while _bytes_waiting(read_end) and time.monotonic() < deadline:
                time.sleep(0.001)
            with lock:  # a chunk read before the check is queued once its reader lets go
                pass

    def run(self, call_id: int, payload: Packed, value_ranks: frozenset[int]) -> None:
        """Run one call; its value or exception goes into the events, as ``worker/main.py`` sends it."""
        self._ready.wait()
        if self._set_up_failed:
            return  # the set-up's error is in the events already
        self._interrupts.begin()
        try:
            run_call(self._rank, RunCall(call_id, payload, value_ranks), self._events, self._interrupts)
        except KeyboardInterrupt as late:
            # Landed in the steps between the code's end and the answer, where an asynchronous
            # exception can only be taken back before it lands: the call was interrupted. Out of
            # here, Ray reported a cancelled task, and the session ended.
            self._interrupts.settle()
            if self._events.answered != call_id:
                self._events.send(describe_error(self._rank, call_id, late))
        finally:
            self._interrupts.end()

    def deliver(self, message: StopRequest | InputReply) -> None:
        """What a local rank's control reader hands on, sent beside the running call: a stop
        request (read by the code's next ``stop_requested()``) or the answer to a prompt."""
        if isinstance(message, StopRequest):
            rank_stop.deliver(message)
        else:
            rank_input.deliver(message)

    def events(self, wait: float) -> list[Any]:
        """What happened since the last poll; waits up to ``wait`` s for the first event."""
        try:
            found = [self._events.queue.get(timeout=wait)]
        except queue.Empty:
            return []
        while len(found) < EVENTS_PER_POLL:
            try:
                found.append(self._events.queue.get_nowait())
            except queue.Empty:
                break
        return found

    def interrupt(self) -> bool:
        """Interrupt the running call as a local rank's SIGINT does (``ThreadInterrupts``); False
        when no call runs."""
        return self._interrupts.interrupt()

    def stacks(self) -> str:
        """The running call's stack, innermost last, as text; during set-up the set-up's (where
        a rank that never joins the process group waits); empty between calls."""
        thread, what = self._interrupts.call_thread, "call"
        if thread is None:
            thread, what = self._set_up_thread, "set-up (joining the process group)"
        frame = sys._current_frames().get(thread) if thread is not None else None
        if frame is None:
            return ""
        if what != "call":
            return f"Still in accelnb's {what}:\n" + "".join(traceback.format_stack(frame)[-3:])
        frames = [f for f in traceback.extract_stack(frame) if not f.filename.startswith(_MACHINERY[0])
                  and not any(part in f.filename for part in _MACHINERY[1:])]
        return "Stack of the call (most recent call last):\n" + "".join(traceback.format_list(frames))


def _bytes_waiting(fd: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(fd, _FIONREAD, b"\0" * 4))[0])


def interface_of(address: str) -> str | None:
    """The name of the network interface whose IPv4 address is ``address`` ("lo" for loopback)."""
    if address.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this one
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None
