"""How the helper starts in a kernel: forked from it when that is safe, else spawned.

Real kernels (nbclient). A kernel that imported torch, with CUDA untouched, forks its helper (the
first launch then does not wait for ``import torch``); the fork sheds the kernel's sockets and
session, and a spawned successor replaces it once it has served a launch. Without torch, or
when the user asks for spawn, the helper is a fresh interpreter as before.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import pytest

from accelnb.kernel.helper.fork_or_spawn import start_method
from tests.conftest import error_of, result_of, run_notebook, stream_text

SET_UP = """
import json, os, psutil, torch, accelnb
from accelnb.kernel.helper import client as hc
def f():
    import torch.distributed as dist
    t = torch.ones(1); dist.all_reduce(t); return t.item()
def helper_facts():
    h = hc._shared
    p = psutil.Process(h.pid)
    return {"method": h.method, "pid": h.pid, "parent": p.ppid(), "kernel": os.getpid(),
            "cmdline": " ".join(p.cmdline()), "same_session": os.getsid(h.pid) == os.getsid(0),
            "inet": len(p.net_connections(kind="inet")), "value": value}
"""
FACTS = "value = accelnb.notebook_launcher(f, num_processes=2, quiet=True)\nprint(json.dumps(helper_facts()))"


def facts_of(outputs: list[Any]) -> dict[str, Any]:
    assert error_of(outputs) is None, error_of(outputs)
    return json.loads(stream_text(outputs).strip().splitlines()[-1])


def test_a_kernel_that_imported_torch_forks_its_helper_and_later_hands_over_to_a_spawned_one() -> None:
    outputs = run_notebook([
        SET_UP,
        FACTS,  # the bridge: a fork of this kernel
        FACTS,  # still the bridge; its successor starts
        "hc._successor.wait_ready(); bridge = hc._shared.pid",
        FACTS,  # the successor took over
        "print(json.dumps({'bridge_alive': psutil.pid_exists(bridge) and "
        "psutil.Process(bridge).status() != psutil.STATUS_ZOMBIE}))",
    ])
    first, second, third = facts_of(outputs[1]), facts_of(outputs[2]), facts_of(outputs[4])
    assert first["method"] == "fork" and first["parent"] == first["kernel"]
    assert "ipykernel" in first["cmdline"]  # the kernel's own command line: a fork, not a new program
    assert not first["same_session"], "the kernel's interrupt would reach its helper"
    assert first["inet"] == 0, "the fork kept the kernel's zmq sockets open"
    assert first["value"] == second["value"] == third["value"] == 2.0
    assert second["pid"] == first["pid"]
    assert third["method"] == "spawn" and "accelnb.worker.helper" in third["cmdline"]
    assert facts_of(outputs[5]) == {"bridge_alive": False}


def test_a_kernel_without_torch_or_asking_for_spawn_spawns_its_helper() -> None:
    without_torch = run_notebook([
        "import accelnb, sys\nfrom accelnb.kernel.helper.fork_or_spawn import start_method\n"
        "print(start_method(), 'torch' in sys.modules)"])
    assert error_of(without_torch[0]) is None
    assert stream_text(without_torch[0]).split() == ["spawn", "False"]
    asked = run_notebook([SET_UP, FACTS], env={"ACCELNB_HELPER_START": "spawn"})
    facts = facts_of(asked[1])
    assert facts["method"] == "spawn" and "accelnb.worker.helper" in facts["cmdline"]
    assert facts["value"] == 2.0


def test_a_killed_bridge_is_reported_and_the_next_launch_forks_a_new_one() -> None:
    outputs = run_notebook([
        SET_UP,
        "import signal\nsession = accelnb.Session.start(num_processes=2, quiet=True)\n"
        "bridge = hc._shared.pid\nprint(hc._shared.method)\nos.kill(bridge, signal.SIGKILL)\n"
        "try:\n    session.run(f)\nexcept Exception as e:\n    print(type(e).__name__, e)",
        "print(session.alive)",
        FACTS + "\nprint(json.dumps({'bridge': bridge}))",
    ])
    said = stream_text(outputs[1])
    assert said.startswith("fork\n") and "HelperDied" in said and "SIGKILL" in said, said
    assert stream_text(outputs[2]).strip() == "False"
    again = json.loads(stream_text(outputs[3]).strip().splitlines()[-2])
    bridge = json.loads(stream_text(outputs[3]).strip().splitlines()[-1])["bridge"]
    assert again["method"] == "fork" and again["pid"] != bridge and again["value"] == 2.0


def test_a_kernel_whose_cuda_is_initialised_never_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The only fake here: this machine has no GPU, so CUDA's state is injected as torch reports it.
    cuda = types.SimpleNamespace(is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setenv("ACCELNB_HELPER_START", "fork")
    assert start_method() == "spawn"
    cuda.is_initialized = lambda: False
    assert start_method() == "fork"
    monkeypatch.setenv("ACCELNB_HELPER_START", "auto")
    assert start_method() == "spawn"  # not in a kernel: a script pays for import torch anyway


def test_a_kernel_that_ran_a_parallel_op_forks_a_helper_whose_ranks_can_use_threads() -> None:
    """libgomp's pool of the kernel is ended before the fork (``openmp_pool``): without that, a
    rank's first matmul with two threads waited forever for the pool's threads."""
    outputs = run_notebook([
        "import torch, accelnb\ntorch.set_num_threads(2)\na = torch.randn(1000, 1000)\n(a @ a).sum().item() != 0",
        ("def matmul_with_two_threads():\n    import torch\n    torch.set_num_threads(2)\n"
         "    b = torch.ones(1000, 1000)\n    return (b @ b)[0, 0].item(), torch.get_num_threads()\n"
         "accelnb.notebook_launcher(matmul_with_two_threads, num_processes=1, quiet=True, timeout=60)"),
        "from accelnb.kernel.helper import client as hc\nhc._shared.method, (a @ a).sum().item() != 0",
    ])
    assert result_of(outputs[1]) == "(1000.0, 2)", outputs[1]
    assert result_of(outputs[2]) == "('fork', True)", outputs[2]  # a bridge, and the kernel's ops still run
