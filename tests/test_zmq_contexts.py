"""The suite's guard against pyzmq's deadlock in the garbage collector (``tests/zmq_contexts.py``).

Each case runs in a fresh interpreter, which drops a context and a socket in a reference cycle, as
an unclosed jupyter_client kernel client leaves them (a message still queued for a peer that never
answers, and jupyter_client's linger of 1 s). Without the guard the collection never ends: if a
pyzmq release stops that, the first test fails and the guard can go.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

HANG_BOUND_S = 5.0  # the collection with the guard takes the sockets' linger (1 s) at most

ABANDON = """
import gc, os, sys, zmq
gc.disable()  # collected where the test says, not at an allocation of its own choosing
if sys.argv[1] == "guarded":
    from tests.zmq_contexts import collect_garbage, end_abandoned_contexts_off_the_collector
    end_abandoned_contexts_off_the_collector()

class Client:  # the cycle a kernel client and its channels make
    pass

fds_before = len(os.listdir("/proc/self/fd"))
def abandon():
    client = Client()
    client.context = zmq.Context()
    client.socket = client.context.socket(zmq.DEALER)
    client.socket.linger = 1000  # jupyter_client's
    client.socket.connect("tcp://127.0.0.1:9")  # nobody listens: the message stays queued
    client.socket.send(b"execute_request")
    client.itself = client
abandon()
if sys.argv[1] == "guarded":
    collect_garbage()
else:
    gc.collect()
print("collected; fds left over:", len(os.listdir("/proc/self/fd")) - fds_before)
"""


def run_abandoning(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "ignore", "-c", ABANDON, mode], cwd=REPO, capture_output=True,
                          text=True, timeout=HANG_BOUND_S * 4)


def test_without_the_guard_collecting_an_abandoned_context_never_ends() -> None:
    try:
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", ABANDON, "plain"], cwd=REPO,
                              capture_output=True, text=True, timeout=HANG_BOUND_S)
    except subprocess.TimeoutExpired:
        return
    raise AssertionError("pyzmq no longer deadlocks here: tests/zmq_contexts.py can go. "
                         f"Output: {done.stdout}{done.stderr}")


def test_with_the_guard_the_collection_ends_and_closes_every_fd_of_the_context() -> None:
    done = run_abandoning("guarded")
    assert done.returncode == 0, done.stderr
    assert "collected; fds left over: 0" in done.stdout, done.stdout + done.stderr
