"""A real Jupyter kernel driven through jupyter_client, as a notebook front end drives it.

    kernel = NotebookKernel.start()
    cell = kernel.run("import accelnb; accelnb.prewarm()")
    msg_id = kernel.submit("accelnb.launch(...)")     # run a cell without waiting
    kernel.km.interrupt_kernel()                       # the stop button
    cell = kernel.collect(msg_id)                      # its output and error, as the user saw them
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client.manager import KernelManager

from tests.conftest import kernel_manager

REPO = Path(__file__).resolve().parents[2]
FAULTS_DIR = Path(__file__).resolve().parent


@dataclass
class Cell:
    stdout: str = ""
    stderr: str = ""
    error: dict[str, Any] | None = None  # ename, evalue, traceback
    finished: bool = False

    @property
    def seen(self) -> str:
        """Everything the user saw in the cell, the error's traceback included."""
        traceback = "\n".join(self.error["traceback"]) if self.error else ""
        return self.stdout + self.stderr + traceback


@dataclass
class NotebookKernel:
    km: KernelManager
    kc: Any
    pid: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls) -> NotebookKernel:
        km = kernel_manager(kernel_name="python3")  # Unix sockets: no port another process can take
        paths = (str(REPO), str(FAULTS_DIR), os.environ.get("PYTHONPATH"))
        python_path = os.pathsep.join(p for p in paths if p)
        km.start_kernel(env={**os.environ, "PYTHONPATH": python_path}, cwd=str(REPO))
        kernel = cls(km, None)
        kernel._connect()
        return kernel

    def _connect(self) -> None:
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.pid = int(self.value("import os; print(os.getpid())"))

    def restart(self) -> None:
        """A fresh kernel (what Jupyter does after its kernel died)."""
        self.kc.stop_channels()
        self.km.restart_kernel(now=True)
        self._connect()

    def submit(self, code: str) -> str:
        msg_id: str = self.kc.execute(code, store_history=False)
        return msg_id

    def collect(self, msg_id: str, timeout: float = 120.0) -> Cell:
        """Gather the cell's output until the kernel is idle again (or ``timeout``)."""
        cell = Cell()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    cell.stdout += content["text"]
                else:
                    cell.stderr += content["text"]
            elif kind == "error":
                cell.error = {k: content[k] for k in ("ename", "evalue", "traceback")}
            elif kind == "status" and content["execution_state"] == "idle":
                cell.finished = True
                return cell
        return cell

    def run(self, code: str, timeout: float = 120.0) -> Cell:
        cell = self.collect(self.submit(code), timeout)
        assert cell.finished, f"cell did not finish in {timeout} s:\n{code}\n{cell.seen}"
        return cell

    def value(self, code: str) -> str:
        cell = self.run(code)
        assert cell.error is None, cell.seen
        return cell.stdout.strip()

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
