"""The clean helper process that forks workers: fork speed without fork's dangers.

Forking the kernel is fast but breaks as soon as the notebook touched CUDA; spawning fresh
interpreters is safe but pays ``import torch`` (1–2 s) and torch's lazy imports on every launch.
This helper is a fresh interpreter, started once per kernel by ``helper_client.py``, that imports
torch (and what training touches first, such as ``torch._dynamo``) and then never touches CUDA
nor starts a thread. Each worker is a fork of it: milliseconds, with everything pre-imported.

Protocol, over one private ``AF_UNIX``/``SOCK_SEQPACKET`` socketpair inherited from the kernel
(no listening socket exists, so nobody else can reach it):

- helper → kernel ``("ready", pid)`` once imports are done;
- kernel → helper ``("spawn", request_id, [WorkerSpec…])`` with each worker's fds attached
  (stdout, stderr, events, inbox, and for rank 0 the TCPStore's listening socket);
- helper → kernel ``("spawned", request_id, [pid…])`` or ``("spawn_failed", request_id, text)``;
- helper → kernel ``("exited", pid, returncode)`` for every worker, negative for a signal.

When the kernel's end closes (the kernel died or shut us down), every worker's process group is
killed and the helper exits. Workers also get ``PR_SET_PDEATHSIG`` so they die with the helper.

Run as ``python -m accelnb.worker.helper CONTROL_FD [MODULE …]``.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import select
import signal
import socket
import sys
import time
from typing import Any

PR_SET_PDEATHSIG = 1
MAX_FDS_PER_MESSAGE = 250  # SCM_RIGHTS limit is 253
DEFAULT_PREIMPORTS = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo",
                      "torch.utils.data", "accelnb.worker.main")
OPTIONAL_PREIMPORTS = ("accelerate",)


def send(sock: socket.socket, message: Any) -> None:
    sock.send(pickle.dumps(message))


def preimport(modules: list[str]) -> None:
    # Ask NVML, not the CUDA runtime, whether CUDA exists: the runtime would make forks unsafe.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    for name in modules:
        importlib.import_module(name)
    for name in OPTIONAL_PREIMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # optional: not installed, or broken in a way the user will see later
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("a pre-imported module initialised CUDA; workers could not use CUDA")


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        _reap(sock, children)
        if sock.fileno() in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 20, MAX_FDS_PER_MESSAGE)
            except OSError:
                data, fds = b"", []
            if not data:
                _kill_all(children)
                return
            message = pickle.loads(data)
            if message[0] == "spawn":
                _spawn(sock, message[1], message[2], fds, children, (wake_r, wake_w))


def _spawn(sock: socket.socket, request_id: int, specs: list[Any], fds: list[int],
           children: set[int], own_fds: tuple[int, int]) -> None:
    pids: list[int] = []
    try:
        position = 0
        for spec in specs:
            count = 5 if spec.holds_store else 4
            mine = fds[position:position + count]
            position += count
            pid = os.fork()
            if pid == 0:
                # The other ranks' fds must not live on in this worker (the store socket would
                # stay bound, and pipes would not see end of file).
                for fd in fds:
                    if fd not in mine:
                        os.close(fd)
                _become_worker(spec, mine, sock, own_fds)  # never returns
            children.add(pid)
            pids.append(pid)
        send(sock, ("spawned", request_id, pids))
    except Exception as error:
        for pid in pids:
            _kill_group(pid)
        send(sock, ("spawn_failed", request_id, f"{type(error).__name__}: {error}"))
    finally:
        for fd in fds:
            os.close(fd)


def _become_worker(spec: Any, fds: list[int], sock: socket.socket, own_fds: tuple[int, int]) -> None:
    code = 70
    try:
        parent = os.getppid()
        os.setsid()  # out of the kernel's group: a notebook interrupt must not reach us directly
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the helper died between fork and prctl
            os._exit(code)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sock.close()
        for fd in own_fds:
            os.close(fd)
        stdout_fd, stderr_fd, events_fd, inbox_fd = fds[:4]
        store_fd = fds[4] if len(fds) > 4 else None
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        os.close(stdout_fd)
        os.close(stderr_fd)
        from accelnb.worker.main import worker_main

        code = worker_main(spec, inbox_fd, events_fd, store_fd)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        send(sock, ("exited", pid, os.waitstatus_to_exitcode(status), time.time()))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all(children: set[int]) -> None:
    for pid in children:
        _kill_group(pid)
    for pid in list(children):
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    preimport(argv[1:] or list(DEFAULT_PREIMPORTS))
    send(sock, ("ready", os.getpid()))
    # From now on nothing of ours should print; workers get their own fds.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    serve(sock)
    os._exit(0)  # skip interpreter teardown with torch loaded: the workers are already gone


if __name__ == "__main__":
    main(sys.argv[1:])
