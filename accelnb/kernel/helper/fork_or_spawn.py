"""How the helper process comes to life: a fresh interpreter, or a fork of the kernel.

    >>> way = start_method()                     # "fork" in a kernel that imported torch, CUDA untouched
    >>> process = fork_helper(sock_fd) if way == "fork" else spawn_helper(sock_fd, preimports)

**Spawn** (``python -m accelnb.worker.helper``) is always safe and gives a clean process, but it
imports torch first: 1.1–1.9 s on this project's machines, which every first launch and every
``%distributed start`` right after ``%load_ext`` used to wait for (issue 12 measured 1.4–2.1 s
against Accelerate's 0.3 s, which forks the kernel).

**Fork** copies a kernel that has already imported torch, so the helper is ready in
milliseconds. It is only chosen when it is safe:

- CUDA is not initialised in the kernel (a forked CUDA context is unusable: "Cannot
  re-initialize CUDA in forked subprocess"), and GNU OpenMP's thread pool can be ended right
  before the fork (a copied pool has no threads, and the ranks' parallel ops would wait for
  them forever: ``openmp_pool``). The helper is forked before any worker exists, and
  once forked it never needs the kernel again, so a kernel that initialises CUDA *later* is fine;
- we run inside an IPython kernel, where the wait is felt (a script pays for ``import torch``
  itself anyway), and the user has not asked otherwise (``ACCELNB_HELPER_START=spawn``).

The child must not touch anything of the kernel's but its own socket: right after the fork it
leaves the kernel's session (so an interrupt of the kernel does not reach it), resets the signal
handlers and wake-up fd the kernel's event loop installed, points fds 0–2 and ``sys.std*`` at
/dev/null and a fresh stderr pipe (ipykernel's streams would write to the kernel's zmq sockets,
which are not fork-safe), closes every other fd it inherited (the kernel's sockets, the user's
files), and only then runs the helper's ``main``; it always ends in ``os._exit``, so no atexit
hook or finaliser of the kernel's runs in it.

A forked helper shares the kernel's memory pages as they were at the fork, copy-on-write. Memory
the kernel frees afterwards stays allocated for as long as the fork lives, so the fork is only a
bridge: ``helper_client.shared_helper`` replaces it by a spawned helper, started in the
background once the bridge has served its first launch, as soon as that one is ready and the
bridge has no worker left.

The same fork serves a second purpose: a launch whose arguments are big forks a helper of its
own, right after packing them, so that its ranks inherit them instead of reading a copy
(``payload_delivery``). ``fork_is_safe`` is the condition both share.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import subprocess
import sys
import traceback
import warnings
from typing import IO, Literal, NoReturn

from accelnb.errors import WorkerStartError
from accelnb.kernel.helper import openmp_pool

StartMethod = Literal["fork", "spawn"]
START_METHOD_VARIABLE = "ACCELNB_HELPER_START"  # "fork", "spawn" or "auto" (the default)
HELPER_MODULE = "accelnb.worker.helper"  # named, not imported: it runs on the worker side
CHILD_FAILED_EXIT_CODE = 70
# Handlers a kernel (its event loop, ipykernel, a test runner) may have set; the helper wants the
# defaults. SIGINT is ignored by the helper's own main, SIGPIPE stays ignored as Python sets it.
_RESET_SIGNALS = ("SIGTERM", "SIGCHLD", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGQUIT")


def start_method() -> StartMethod:
    """"fork" where forking the kernel is safe and worth it (see the module docstring), else "spawn"."""
    if not fork_is_safe():
        return "spawn"
    if os.environ.get(START_METHOD_VARIABLE, "auto").strip().lower() == "fork":
        return "fork"
    return "fork" if _in_ipython_kernel() else "spawn"


def fork_is_safe() -> bool:
    """Whether a helper may be forked from this process: torch is imported (without it a fork
    saves nothing), CUDA is not initialised (a forked CUDA context is unusable), and the user
    has not ruled forks out (``ACCELNB_HELPER_START=spawn``)."""
    if os.environ.get(START_METHOD_VARIABLE, "auto").strip().lower() == "spawn" or not hasattr(os, "fork"):
        return False
    torch = sys.modules.get("torch")
    # An OpenMP pool that cannot be ended before the fork would hang the ranks' parallel regions.
    return torch is not None and not torch.cuda.is_initialized() and openmp_pool.releasable()


def _in_ipython_kernel() -> bool:
    shell_module = sys.modules.get("IPython")
    get_ipython = getattr(shell_module, "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def spawn_helper(sock_fd: int, preimports: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A fresh interpreter running the helper, with ``sock_fd`` as its end of the socket."""
    return subprocess.Popen(
        [sys.executable, "-m", HELPER_MODULE, str(sock_fd), *preimports],
        pass_fds=(sock_fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # the notebook's interrupt must not reach the helper
        env=env,
    )


class ForkedHelper:
    """A helper forked from this process: the parts of ``subprocess.Popen`` the client uses."""

    def __init__(self, sock_fd: int) -> None:
        if not openmp_pool.release():  # the pool's threads would not exist in the child
            raise WorkerStartError(
                "accelnb could not end this kernel's OpenMP threads before forking its helper, and a "
                "forked rank would hang in its first parallel op. Set ACCELNB_HELPER_START=spawn.")
        stderr_r, stderr_w = os.pipe()
        with warnings.catch_warnings():  # Python 3.12+ warns that forking a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)  # may deadlock; see _become_helper
            pid = os.fork()
        if pid == 0:
            _become_helper(sock_fd, stderr_w)
        os.close(stderr_w)
        self.pid = pid
        self.returncode: int | None = None
        self.stderr: IO[bytes] | None = open(stderr_r, "rb")  # noqa: SIM115 (closed by the client)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (a SIGCHLD handler): status unknown
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once it ended; raises ``subprocess.TimeoutExpired`` after ``timeout``."""
        pidfd = os.pidfd_open(self.pid) if self.poll() is None else None
        if pidfd is not None:
            try:  # a pidfd is readable once the child exited: no polling loop
                readable, _, _ = select.select([pidfd], [], [], timeout)
            finally:
                os.close(pidfd)
            if not readable:
                raise subprocess.TimeoutExpired(HELPER_MODULE, timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _become_helper(sock_fd: int, stderr_w: int) -> NoReturn:
    """In the forked child: shed the kernel (see the module docstring), then be the helper."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for name in _RESET_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(stderr_w, 2)
        os.closerange(3, sock_fd)
        os.closerange(sock_fd + 1, os.sysconf("SC_OPEN_MAX"))
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (lives as long as we do)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        helper = importlib.import_module(HELPER_MODULE)
        # Preimports named, so no idle imports: a bridge serves the next launch at once, and an
        # import of torch._dynamo or accelerate in progress would hold it up for seconds. Its
        # spawned successor does them.
        helper.main([str(sock_fd), *helper.DEFAULT_PREIMPORTS])
    except BaseException:  # whatever it was, the kernel reads it from our stderr
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(CHILD_FAILED_EXIT_CODE)
    os._exit(0)
