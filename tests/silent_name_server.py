"""Run Python code in new network and mount namespaces whose name server takes every query and
answers none: the resolver waits 1 s for it (``timeout:1``, ``attempts:1``), then fails.

    done = run_beside_a_silent_name_server("print(socket.getnameinfo(...))", tmp_path)

Skips the test where namespaces cannot be made (root and ``unshare(1)`` are needed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

_SILENT = """
import socket, subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["mount", "--bind", sys.argv[1], "/etc/resolv.conf"], check=True)
silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
silent.bind(("127.0.0.1", 53))
"""


def run_beside_a_silent_name_server(code: str, tmp_path: Path,
                                    timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter inside the namespaces, from the repository; its output."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1), for a network and mount namespace of its own")
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    return subprocess.run(["unshare", "--net", "--mount", sys.executable, "-c", _SILENT + code, str(resolv)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
