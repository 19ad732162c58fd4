"""Run Python code in new network and mount namespaces whose name server takes every query and
answers none: the resolver waits 1 s for it (``timeout:1``, ``attempts:1``), then fails. Or one
that loses only the first query and answers every other at once, that no such name exists (as a
name server that drops a query now and then: the name lookup of a rank then waits its 1 s once).

    done = run_beside_a_silent_name_server("print(socket.getnameinfo(...))", tmp_path)
    done = run_beside_a_silent_name_server(code, tmp_path, answers_after_the_first=True)

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

# A DNS answer is the query's id, the flags of a response that found no such name (NXDOMAIN,
# recursion desired and available), one question and no records, then the query's question.
_ANSWERS_AFTER_THE_FIRST = """
import threading
def answer_all_but_the_first():
    first = True
    while True:
        query, sender = silent.recvfrom(512)
        if first:
            first = False
            continue
        end = 12
        while query[end]:
            end += query[end] + 1
        end += 5
        silent.sendto(query[:2] + bytes([0x81, 0x83, 0, 1, 0, 0, 0, 0, 0, 0]) + query[12:end], sender)
threading.Thread(target=answer_all_but_the_first, daemon=True).start()
"""


def run_beside_a_silent_name_server(code: str, tmp_path: Path, timeout: float = 240, *,
                                    answers_after_the_first: bool = False) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter inside the namespaces, from the repository; its output.
    ``answers_after_the_first``: the name server loses only its first query."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1), for a network and mount namespace of its own")
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    server = _SILENT + (_ANSWERS_AFTER_THE_FIRST if answers_after_the_first else "")
    return subprocess.run(["unshare", "--net", "--mount", sys.executable, "-c", server + code, str(resolv)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
