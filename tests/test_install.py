"""A wheel built from this checkout installs into an environment that already has torch, leaves
torch as it was, and works there (README, "Into an environment you already have").

The module builds the wheel with ``make wheel`` (what ``make dist`` runs) while it makes a fresh
virtual environment and installs into it the torch this test suite runs on; it notes every file
of that torch, installs the wheel, and checks that no torch file was replaced. Then a real Jupyter
kernel of that environment, started away from this checkout (another working directory, no
``PYTHONPATH``), runs a 2-rank ``notebook_launcher`` of a function defined in a cell and a
``%%distributed`` cell.

The module takes a minute on a 2-core machine (two on a busy one), most of it pip unpacking torch
and accelnb's dependencies from its cache; each step prints its seconds (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
import torch
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from tests.conftest import REPO, error_of, kernel_manager, live_descendants, result_of, stream_text
from tests.test_packaging import EXTENSION, GPUS_TOOLBAR_ITEM, toolbar_items

# The first test carries the installs and the last the removal of the environment: a minute
# together on an idle 2-core machine, four when a whole test suite runs beside it.
pytestmark = pytest.mark.timeout(600)

KERNEL_NAME = "accelnb-installed"
# As scripts/setup does: the CPU build of torch comes from PyTorch's CPU index where pip has no
# local copy of it.
TORCH_CPU_INDEX = os.environ.get("TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")

# Prints, from the installed environment, where torch's installed files are and which exact files
# they are: a reinstall, even of the same version, gives each file a new inode and mtime. Reads
# the metadata only (importing torch would take seconds).
TORCH_FILES_SCRIPT = """
import importlib.metadata, json, os
torch = importlib.metadata.distribution("torch")
files = {}
for name in torch.files or ():
    status = os.stat(torch.locate_file(name))
    files[str(name)] = [status.st_ino, status.st_mtime_ns, status.st_size]
print(json.dumps({"version": torch.version, "init": str(torch.locate_file("torch/__init__.py")), "files": files}))
"""


@dataclass(frozen=True)
class TorchFiles:
    """An installed torch: its version, its ``torch/__init__.py`` and each file's identity."""

    version: str
    init: str
    files: dict[str, list[int]]  # path in its RECORD → [inode, mtime_ns, size]


@dataclass(frozen=True)
class InstalledEnvironment:
    """The virtual environment the wheel went into, and its torch before and after."""

    prefix: Path
    python: Path
    torch_before: TorchFiles
    torch_after: TorchFiles


@contextmanager
def timed(step: str) -> Iterator[None]:
    """Prints how many seconds ``step`` took."""
    start = time.monotonic()
    try:
        yield
    finally:
        print(f"test_install: {step}: {time.monotonic() - start:.1f} s")


def run(command: list[str], **details: Any) -> subprocess.CompletedProcess[str]:
    """Runs ``command``; a failure shows its output."""
    done = subprocess.run(command, capture_output=True, text=True, **details)
    assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def pip_into(python: Path) -> list[str]:
    """This test's pip, installing into the environment of ``python``. The environment is made
    without pip of its own (ensurepip would add seconds and test nothing accelnb controls), and
    ``--no-compile`` skips writing bytecode for torch's thousands of modules, which only speeds
    up later imports."""
    return [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-compile"]


def install_torch(python: Path, version: str) -> None:
    """``pip install torch==version`` into the environment, as a user who has torch already did."""
    command = [*pip_into(python), f"torch=={version}"]
    first = subprocess.run(command, capture_output=True, text=True)
    if first.returncode != 0 and "+cpu" in version:  # no local copy: PyTorch's CPU index, as scripts/setup
        run([*command, "--index-url", TORCH_CPU_INDEX])
    else:
        assert first.returncode == 0, f"installing torch=={version} failed:\n{first.stdout}\n{first.stderr}"


def torch_files(python: Path) -> TorchFiles:
    return TorchFiles(**json.loads(run([str(python), "-c", TORCH_FILES_SCRIPT]).stdout))


def build_wheel(dist: Path) -> Path:
    """The wheel of this checkout, built into ``dist`` by ``make wheel``, which ``make dist`` runs."""
    with timed("make wheel"):
        run(["make", "--no-print-directory", "wheel", f"PY={sys.executable}", f"DIST={dist}"], cwd=REPO)
    (wheel,) = dist.glob("accelnb-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InstalledEnvironment]:
    """A fresh environment with this suite's torch, then the wheel of this checkout. Removed
    afterwards: it holds about 1 GB."""
    root = tmp_path_factory.mktemp("install")
    prefix = root / "env"
    python = prefix / "bin" / "python"
    try:
        # The wheel builds beside the torch install: each takes tens of seconds, mostly waiting.
        with ThreadPoolExecutor(max_workers=1) as background:
            wheel_built = background.submit(build_wheel, root / "dist")
            with timed("python -m venv"):
                run([sys.executable, "-m", "venv", "--without-pip", str(prefix)])
            with timed(f"pip install torch=={torch.__version__}"):
                install_torch(python, str(torch.__version__))
            with timed("torch's files before"):
                before = torch_files(python)
            wheel = wheel_built.result()
        with timed(f"pip install {wheel.name}"):
            run([*pip_into(python), str(wheel)])
        with timed("torch's files after"):
            after = torch_files(python)
        yield InstalledEnvironment(prefix, python, before, after)
    finally:
        with timed("remove the environment"):
            shutil.rmtree(prefix, ignore_errors=True)


def test_installing_the_wheel_leaves_torch_untouched(installed: InstalledEnvironment) -> None:
    before, after = installed.torch_before, installed.torch_after
    assert before.version == after.version == str(torch.__version__)
    assert before.init == after.init
    assert Path(before.init).is_relative_to(installed.prefix)
    assert len(before.files) > 1000  # torch's RECORD was read: the comparison below means something
    replaced = sorted(name for name in before.files.keys() | after.files.keys()
                      if before.files.get(name) != after.files.get(name))
    assert replaced == [], f"installing accelnb replaced torch files: {replaced[:10]}"


def test_the_wheel_installs_the_jupyterlab_extension(installed: InstalledEnvironment) -> None:
    # Where JupyterLab looks for prebuilt extensions in an environment: the wheel's shared data.
    extension_dir = installed.prefix / "share" / "jupyter" / "labextensions" / EXTENSION
    assert (extension_dir / "static" / "style.js").is_file()
    assert GPUS_TOOLBAR_ITEM in toolbar_items(extension_dir)


# ── a kernel of the installed environment ─────────────────────────────────────────────────────
@dataclass
class InstalledKernel:
    """A running kernel of the installed environment, and a way to run cells in it."""

    manager: KernelManager
    client: BlockingKernelClient

    def run_cell(self, code: str, timeout: float = 120) -> list[Any]:
        """Executes ``code``; returns its outputs as a notebook would store them."""
        outputs: list[Any] = []

        def keep(message: dict[str, Any]) -> None:
            if message["header"]["msg_type"] in {"stream", "display_data", "execute_result", "error"}:
                outputs.append(nbformat.v4.output_from_msg(message))

        self.client.execute_interactive(code, timeout=timeout, output_hook=keep, allow_stdin=False)
        return outputs


# What would lead the kernel to this checkout or to this suite's virtual environment; synthetic
# GPUs (the kernel sees this machine); and PYTHONDONTWRITEBYTECODE: the environment was installed
# without bytecode, and what the kernel compiles once spares the helper it spawns seconds of it.
NOT_FOR_THE_KERNEL = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "ACCELNB_SYNTHETIC_GPUS", "PYTHONDONTWRITEBYTECODE"}


def kernel_environment(installed: InstalledEnvironment) -> dict[str, str]:
    """This process's environment, less :data:`NOT_FOR_THE_KERNEL`, with the installed
    environment's ``bin`` first on ``PATH``, as activating it would put it."""
    environ = {name: value for name, value in os.environ.items() if name not in NOT_FOR_THE_KERNEL}
    environ["PATH"] = os.pathsep.join([str(installed.prefix / "bin"), environ.get("PATH", "")])
    return environ


def processes_of(kernel_python: Path) -> list[psutil.Process]:
    """The kernels this process started with ``kernel_python``, and every live process below them."""
    kernels = []
    for child in psutil.Process().children():
        try:
            if child.cmdline()[:1] == [str(kernel_python)]:
                kernels.append(child)
        except psutil.Error:  # ended meanwhile
            continue
    return kernels + [below for each in kernels for below in live_descendants(each.pid)]


@pytest.fixture(scope="module")
def kernel(installed: InstalledEnvironment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InstalledKernel]:
    """A kernel started from a kernel spec of the installed environment, as ``python -m ipykernel
    install`` would write it, in a working directory outside this checkout. Afterwards it and
    every process below it (accelnb's helper, its ranks) are gone."""
    spec_dir = tmp_path_factory.mktemp("kernels") / KERNEL_NAME
    spec_dir.mkdir()
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(installed.python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (accelnb installed)", "language": "python"}))
    manager = kernel_manager(kernel_name=KERNEL_NAME,
                             kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]))
    with timed("kernel start"):
        manager.start_kernel(env=kernel_environment(installed), cwd=str(tmp_path_factory.mktemp("cwd")))
        client = manager.client()
        try:
            client.start_channels()
            client.wait_for_ready(timeout=120)
        except BaseException:
            manager.shutdown_kernel(now=True)
            raise
    try:
        yield InstalledKernel(manager, client)
    finally:
        started = processes_of(installed.python)  # looked up before the kernel goes: then they are re-parented
        with timed("kernel shutdown"):
            client.stop_channels()
            manager.shutdown_kernel()
            # A helper spawned to replace the forked one may still be importing torch (more so
            # without bytecode on a busy machine); it sees the kernel's end once that is done.
            _, outliving = psutil.wait_procs(started, timeout=30)
        for process in outliving:
            process.kill()
    assert started, "no kernel of the installed environment was found below this process"
    assert outliving == [], f"processes outlived the installed environment's kernel: {outliving}"


def test_the_kernel_imports_accelnb_and_torch_from_the_installed_environment(
        kernel: InstalledKernel, installed: InstalledEnvironment) -> None:
    with timed("import accelnb, torch"):
        outputs = kernel.run_cell("import json, sys, accelnb, torch\n"
                                  "print(json.dumps([accelnb.__file__, torch.__file__, torch.__version__, sys.path]))")
    assert error_of(outputs) is None, outputs
    accelnb_file, torch_file, torch_version, sys_path = json.loads(stream_text(outputs))
    assert Path(accelnb_file).is_relative_to(installed.prefix)
    assert (torch_file, torch_version) == (installed.torch_after.init, installed.torch_after.version)
    assert [entry for entry in sys_path if entry and Path(entry).resolve().is_relative_to(REPO)] == []


def test_a_two_rank_launch_of_a_cell_function(kernel: InstalledKernel) -> None:
    defined = kernel.run_cell("import torch, torch.distributed as dist\n"
                              "from accelnb import notebook_launcher\n"
                              "def summed(scale):\n"
                              "    total = torch.tensor([float(scale * (dist.get_rank() + 1))])\n"
                              "    dist.all_reduce(total)\n"
                              "    return dist.get_rank(), dist.get_world_size(), dist.get_backend(), total.item()")
    assert error_of(defined) is None, defined
    with timed("notebook_launcher, 2 ranks"):
        launched = kernel.run_cell("notebook_launcher(summed, args=(3,), num_processes=2, cpu=True)")
    assert error_of(launched) is None, launched
    assert result_of(launched) == "(0, 2, 'gloo', 9.0)"  # 3 × 1 from rank 0 plus 3 × 2 from rank 1


def test_a_distributed_cell(kernel: InstalledKernel) -> None:
    assert error_of(kernel.run_cell("%load_ext accelnb")) is None
    with timed("%%distributed --procs 2 --cpu"):
        outputs = kernel.run_cell("%%distributed --procs 2 --cpu\n"
                                  "import torch, torch.distributed as dist\n"
                                  "total = torch.tensor([float(rank + 1)])\n"
                                  "dist.all_reduce(total)\n"
                                  "print(f'rank {rank} of {world_size} on {device}: {total.item()}')\n"
                                  "total.item() * 2")
    assert error_of(outputs) is None, outputs
    text = stream_text(outputs)
    assert "rank 0 of 2 on cpu: 3.0" in text
    assert "accelnb: brought back from rank 0: total" in text
    assert result_of(outputs) == "6.0"
    assert stream_text(kernel.run_cell("print(total.item())")).strip() == "3.0"
