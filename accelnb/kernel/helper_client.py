"""The kernel's handle on the worker helper process (see ``worker/helper.py`` for the why).

One helper serves a kernel for its whole life; it is started on first use (or ahead of time by
:func:`prewarm`) and restarted if it died. Only the thread that launches talks to it.

    >>> helper = shared_helper()            # starts it, ~2-5 s the first time
    >>> pids = helper.spawn(specs, fds)     # ms: forks one worker per spec
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from accelnb.errors import WorkerStartError
from accelnb.wire.spec import WorkerSpec

START_TIMEOUT_S = 120.0


class WorkerHelper:
    """A running helper process and the exit codes it reported."""

    def __init__(self, preimports: Sequence[str] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The helper must import this very accelnb, wherever the kernel found it.
        package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        python_path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONPATH": python_path}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "accelnb.worker.helper", str(theirs.fileno()), *preimports],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # the notebook's interrupt must not reach the helper
            env=env,
        )
        theirs.close()
        self._sock = ours
        self._ready = False
        self._next_request = 0
        self.exit_codes: dict[int, int] = {}
        self.exit_times: dict[int, float] = {}
        self.pid = self._process.pid

    def wait_ready(self) -> None:
        if self._ready:
            return
        message = self._receive(timeout=START_TIMEOUT_S)
        if message is None or message[0] != "ready":
            self._process.kill()
            _, stderr = self._process.communicate(timeout=10)
            raise WorkerStartError(
                "accelnb's worker helper process could not start"
                + (f":\n{stderr.decode(errors='replace').strip()}" if stderr else ".")
                + "\nCheck that torch imports in a fresh `python -c 'import torch'`.")
        self._ready = True
        assert self._process.stderr is not None
        self._process.stderr.close()  # it points its stderr at /dev/null once ready

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def fileno(self) -> int:
        return self._sock.fileno()

    def spawn(self, specs: Sequence[WorkerSpec], fds: Sequence[int]) -> list[int]:
        """Fork one worker per spec; ``fds`` are their pipe ends in order (see worker/helper.py)."""
        self.wait_ready()
        self._next_request += 1
        request = self._next_request
        socket.send_fds(self._sock, [pickle.dumps(("spawn", request, list(specs)))], list(fds))
        while True:
            message = self._receive(timeout=60)
            if message is None:
                raise WorkerStartError("accelnb's worker helper process died while starting workers.")
            if message[0] == "spawned" and message[1] == request:
                pids: list[int] = message[2]
                return pids
            if message[0] == "spawn_failed" and message[1] == request:
                raise WorkerStartError(f"Starting the workers failed: {message[2]}")

    def collect(self) -> None:
        """Read every message that is waiting, without blocking."""
        while self._receive(timeout=0) is not None:
            pass

    def _receive(self, timeout: float) -> Any | None:
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            return None
        try:
            data = self._sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            return None
        message = pickle.loads(data)
        if message[0] == "exited":
            self.exit_codes[message[1]] = message[2]
            self.exit_times[message[1]] = message[3]
        return message

    def close(self) -> None:
        """Stop the helper; it kills any worker still running."""
        self._sock.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


_shared: WorkerHelper | None = None
_shared_lock = threading.Lock()


def shared_helper(wait: bool = True) -> WorkerHelper:
    """The kernel's helper process, started (or restarted after a crash) when needed."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive:
            if _shared is None:
                atexit.register(shutdown_helper)
            _shared = WorkerHelper()
    if wait:
        _shared.wait_ready()
    return _shared


def prewarm() -> None:
    """Start the helper now, so that the first launch does not wait for ``import torch``."""
    shared_helper(wait=False)


def shutdown_helper() -> None:
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.close()
            _shared = None
