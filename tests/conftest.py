"""Shared fixtures: leftover-process checks and a real Jupyter kernel runner; the versions resolved."""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import platform
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

from accelnb.kernel.helper.client import HELPER_MODULE
from accelnb.kernel.helper.template import running_helper_pid, take_departed_crashes, wait_for_departed_ranks
from accelnb.worker.template.standby_ranks import STANDBY_NAME
from tests.zmq_contexts import end_abandoned_contexts_off_the_collector

if TYPE_CHECKING:
    from jupyter_client.blocking.client import BlockingKernelClient
    from jupyter_client.manager import KernelManager

# nbformat, nbclient and jupyter_client are imported inside the functions that need them, never
# here: every test module imports this one, and a rank that runs a test module's function imports
# that module (functions of an importable module travel by reference). nbformat pulls in
# jsonschema, whose format checker builds a grammar at import: about 10 s on each rank of every
# such launch, which once made `make test` take 21 minutes instead of 12.

# The suite's own process imports some 4,400 modules (every library some test touches): a template
# following them takes ~15 s each time a test replaces it (there are dozens: helpers killed, files
# changed). So the suite's templates are bare (torch only, each rank imports what it uses), in
# this process and in the kernels it starts; the tests of following itself (test_template.py,
# test_clean_ranks.py) turn it on, as it is for users.
os.environ.setdefault("ACCELNB_TEMPLATE", "bare")
REPO = Path(__file__).resolve().parents[1]

# The interrupt tests press Ctrl-C by sending SIGINT to this process, as Jupyter's stop button
# does to a kernel (which always has Python's handler). A test run started in the background by
# a non-interactive shell (`make test &`, a CI runner) inherits SIGINT *ignored*, and Python then
# never installs the handler that raises KeyboardInterrupt: put it back, so every way of running
# the suite tests the same thing.
signal.signal(signal.SIGINT, signal.default_int_handler)

# Printed at the top of every run (``-q`` included), so that a failure can be traced to a release.
RESOLVED_PACKAGES = ("torch", "cloudpickle", "ipykernel", "ipython", "jupyter_client", "jupyterlab", "ipywidgets",
                     "nbclient", "nbval", "accelerate", "transformers", "lightning", "ray", "tensorboard", "wandb",
                     "playwright", "numpy", "pytest")


def pytest_sessionstart(session: pytest.Session) -> None:
    end_abandoned_contexts_off_the_collector()  # in each test process, never in a rank importing this
    versions = []
    for name in RESOLVED_PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"resolved: Python {platform.python_version()}, " + ", ".join(versions))


# `make test` runs files side by side (pytest-xdist, a file per worker, in collection order with
# --no-loadscope-reorder): the files that take minutes start first, so the short ones fill in
# beside them instead of one long file running alone at the end (measured in a full run's
# --durations; a file missing here only costs time).
LONGEST_FILES_FIRST = ("test_ray_cluster.py", "browser/test_gpu_panel.py", "test_template.py", "test_clean_ranks.py",
                       "test_one_gpu_machine.py", "test_install.py", "test_frameworks_inside.py",
                       "browser/test_gpu_figures.py", "test_stop_that_saves.py", "test_big_trainers.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def place(item: pytest.Item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONGEST_FILES_FIRST) if path.endswith(f"/tests/{name}")),
                    len(LONGEST_FILES_FIRST))

    items.sort(key=place)  # stable: each file's tests keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keeps the test's own outcome on the item (``item.report_call``), for fixtures that clean up
    differently after a failure."""
    report = yield
    if report.when == "call":
        item.report_call = report  # type: ignore[attr-defined]
    return report


def worker_processes() -> list[psutil.Process]:
    """Every live process below this process's helper (the workers and their children), once the
    helper reaped the ranks that departed (a launch need not wait for the OS to free them)."""
    assert wait_for_departed_ranks(), "a departed rank was not reaped within 10 s"
    crashes = take_departed_crashes()  # told once: the test that sees it fails, not every one after
    assert crashes == {}, f"departed ranks did not exit 0 (pid: code): {crashes}"
    helper_pid = running_helper_pid()
    return [] if helper_pid is None else live_descendants(helper_pid)


def is_standby(process: psutil.Process) -> bool:
    """A child the template forked ahead of a launch and that still waits (it has no rank yet).
    The template carries that name too while it forks one (so the child is born with it): only
    a template's child counts."""
    try:
        parent = process.parent()
        return (process.name() == STANDBY_NAME and parent is not None
                and HELPER_MODULE in " ".join(parent.cmdline()))
    except psutil.Error:
        return False


# Run in a kernel before counting its processes from outside: only the kernel knows which ranks
# departed (a launch need not wait for the OS to free them); they are reaped, each with exit code 0.
REAP_DEPARTED_IN_KERNEL = ("from accelnb.kernel.helper.template import take_departed_crashes, wait_for_departed_ranks\n"
                           "assert wait_for_departed_ranks()\n"
                           "crashes = take_departed_crashes()\n"
                           "assert crashes == {}, crashes")


def live_descendants(pid: int) -> list[psutil.Process]:
    """Every process below ``pid`` that still runs (zombies excluded), but a template's children
    that wait for a rank to become (``worker/template/standby_ranks.py``): they are the template's, not a
    launch's, and end with it."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [child for child in children if _running(child) and not is_standby(child)]


def kernel_manager(**traits: Any) -> KernelManager:
    """A kernel manager whose kernel listens on Unix sockets of its own, not on TCP ports.

    jupyter_client picks a kernel's five TCP ports by binding port 0 and closing it; the kernel
    binds them a moment later, and on a machine where other tests' ranks and stores open
    connections all the while, one of those can take the port first ("Address already in use",
    the kernel dies before it answers). Socket files in a folder of this process's own cannot
    be taken."""
    from jupyter_client.manager import KernelManager

    global _kernels_made
    _kernels_made += 1
    return KernelManager(transport="ipc", ip=os.path.join(_kernel_sockets(), f"k{_kernels_made}"), **traits)


def _kernel_sockets() -> str:
    global _kernel_socket_folder
    if _kernel_socket_folder is None:  # short: a socket's path may not pass 107 bytes
        _kernel_socket_folder = tempfile.mkdtemp(prefix="anb-kernels-", dir="/tmp")
        atexit.register(shutil.rmtree, _kernel_socket_folder, True)
    return _kernel_socket_folder


_kernels_made = 0
_kernel_socket_folder: str | None = None


def start_repo_kernel(**env: str | None) -> tuple[KernelManager, BlockingKernelClient]:
    """A real kernel importing this working tree's accelnb; ``env`` sets (or, with None, removes)
    variables of its environment."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    manager = kernel_manager(kernel_name="python3")
    manager.start_kernel(env=environ, cwd=str(REPO))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
    except RuntimeError:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        raise
    return manager, client


def cell_messages(client: BlockingKernelClient, msg_id: str, timeout: float = 180) -> list[dict[str, Any]]:
    """The IOPub messages of the cell ``msg_id`` (``client.execute``'s answer), until the kernel is idle again."""
    messages = []
    while True:
        message = client.get_iopub_msg(timeout=timeout)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(message)
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            return messages


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until_no_workers(bound_s: float) -> float:
    """Seconds until no worker remains; fails the test past ``bound_s``."""
    start = time.monotonic()
    while worker_processes():
        if time.monotonic() - start > bound_s:
            raise AssertionError(f"workers still alive after {bound_s} s: {worker_processes()}")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """After the test: no worker process is left (asserted by pid, not by message)."""
    yield
    wait_until_no_workers(5.0)


def run_notebook(cells: list[str], timeout: int = 180, env: dict[str, str] | None = None) -> list[Any]:
    """Execute ``cells`` in a fresh real kernel; returns each cell's outputs."""
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        nbclient.NotebookClient(nb, km=kernel_manager(kernel_name="python3"), timeout=timeout,
                                allow_errors=True).execute()
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return [cell.outputs for cell in nb.cells]


def run_named_cells(cells: dict[str, str], timeout: int = 180) -> dict[str, list[Any]]:
    """:func:`run_notebook` on named cells; returns each name's outputs."""
    return dict(zip(cells, run_notebook(list(cells.values()), timeout), strict=True))


def result_of(outputs: list[Any]) -> str | None:
    """The cell's ``Out[]`` as text, if it had one."""
    return next((o["data"]["text/plain"] for o in outputs if o["output_type"] == "execute_result"), None)


def stream_text(outputs: list[Any], name: str = "stdout") -> str:
    return "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == name)


def error_of(outputs: list[Any]) -> Any | None:
    return next((o for o in outputs if o["output_type"] == "error"), None)


@dataclass
class InterruptWhenRunning:
    """A display's wait hook that sends this process SIGINT once every rank runs (Ctrl-C)."""

    fired: bool = False

    def __call__(self) -> None:
        from accelnb.kernel.run import run_state

        run = run_state.current_run()
        if not self.fired and run is not None and all(r.phase == "running" for r in run.ranks):
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)
