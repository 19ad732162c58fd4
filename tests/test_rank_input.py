"""``input()`` and ``breakpoint()`` on a rank, answered through Jupyter's own input box.

One real ipykernel (jupyter_client, stdin allowed) for the module. Each test executes a cell
that starts 2 CPU ranks, waits for the kernel's ``input_request`` on the stdin channel, checks
the prompt (``[rank 1]``-prefixed for rank 1) and what reached the cell before it, and answers
with an ``input_reply``, as the browser does. Covered: a round trip on rank 0 and on rank 1 (with
``timeout=`` not counting the time at the prompt), a ``%%distributed`` cell, a ``(Pdb)`` session
(``p``, ``where``, ``s``, ``n``, ``up``, ``c``), ``q`` in the debugger, the Stop button (an
interrupt of the kernel) during a prompt, and a client that does not allow input. After each
cell, no worker is left under the kernel's helper. A plain script, with its stdin piped, shows
the terminal path.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from tests.conftest import REAP_DEPARTED_IN_KERNEL, REPO, live_descendants, start_repo_kernel

Message = dict[str, Any]

SETUP = """
%load_ext accelnb
import json, os, accelnb
from accelnb import notebook_launcher
notebook_launcher(int, num_processes=2, cpu=True, quiet=True)  # warm: later timings are the runs' own
print(json.dumps({"kernel": os.getpid()}))
"""


class Kernel:
    """A kernel client that keeps IOPub messages per request and answers prompts."""

    def __init__(self, manager: KernelManager, client: BlockingKernelClient) -> None:
        self.manager = manager
        self.client = client
        self.iopub: list[Message] = []
        self.kernel_pid = 0

    def execute(self, code: str, allow_stdin: bool = True) -> str:
        return self.client.execute(code, allow_stdin=allow_stdin)

    def prompt(self, timeout: float = 60) -> str:
        """The next ``input_request``'s prompt."""
        try:
            message = self.client.get_stdin_msg(timeout=timeout)
        except queue.Empty:
            while True:  # say what the cell did instead
                try:
                    self.iopub.append(self.client.get_iopub_msg(timeout=0.5))
                except queue.Empty:
                    break
            raise AssertionError(f"no input request within {timeout} s; the kernel sent: "
                                 f"{[m['content'] for m in self.iopub[-5:]]}") from None
        assert message["header"]["msg_type"] == "input_request", message
        assert message["content"]["password"] is False
        return str(message["content"]["prompt"])

    def answer(self, line: str) -> None:
        self.client.input(line)

    def stdout_until(self, msg_id: str, wanted: Callable[[str], bool], timeout: float = 30) -> str:
        """Read IOPub until the request's stdout so far satisfies ``wanted``; returns it."""
        deadline = time.monotonic() + timeout
        while not wanted(text := self.stream(msg_id)):
            try:
                self.iopub.append(self.client.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"stdout of the cell never matched; it was:\n{text}") from None
        return text

    def finish(self, msg_id: str, timeout: float = 60) -> Message:
        """The request's execute_reply, once its IOPub went idle."""
        deadline = time.monotonic() + timeout
        while True:
            reply = self.client.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        while not any(m["header"]["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                      and m["parent_header"].get("msg_id") == msg_id for m in self.iopub):
            self.iopub.append(self.client.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic())))
        return reply

    def stream(self, msg_id: str, name: str = "stdout") -> str:
        return "".join(m["content"]["text"] for m in self.iopub
                       if m["header"]["msg_type"] == "stream" and m["content"]["name"] == name
                       and m["parent_header"].get("msg_id") == msg_id)

    def error(self, msg_id: str) -> Message:
        return next(m["content"] for m in self.iopub
                    if m["header"]["msg_type"] == "error" and m["parent_header"].get("msg_id") == msg_id)

    def result(self, msg_id: str) -> str:
        return next(m["content"]["data"]["text/plain"] for m in self.iopub
                    if m["header"]["msg_type"] == "execute_result" and m["parent_header"].get("msg_id") == msg_id)

    def workers(self) -> list[psutil.Process]:
        """Live processes under the kernel's helpers: a forked helper hands over to a spawned one
        (``kernel/helper/fork_or_spawn.py``), so whichever helper forked them, they are the kernel's
        grandchildren. Asked once the kernel's template reaped the ranks that departed (a launch
        need not wait for the OS to free them): only the kernel knows which those are."""
        msg_id = self.execute(REAP_DEPARTED_IN_KERNEL, allow_stdin=False)
        assert self.finish(msg_id)["content"]["status"] == "ok", self.error(msg_id)
        return [p for p in live_descendants(self.kernel_pid) if _parent(p) != self.kernel_pid]


def _parent(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.NoSuchProcess:
        return None


def _ready_kernel() -> Kernel:
    manager, client = start_repo_kernel(ACCELNB_SYNTHETIC_GPUS=None)
    session = Kernel(manager, client)
    msg_id = session.execute(SETUP)
    assert session.finish(msg_id, timeout=120)["content"]["status"] == "ok"
    session.kernel_pid = json.loads(session.stream(msg_id))["kernel"]
    return session


def _shut_down(session: Kernel) -> None:
    session.client.stop_channels()
    session.manager.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernels() -> Iterator[list[Kernel]]:
    """The module's kernel, in a list so that a test that failed can have it replaced."""
    held = [_ready_kernel()]
    try:
        yield held
    finally:
        _shut_down(held[0])


@pytest.fixture
def kernel(kernels: list[Kernel], request: pytest.FixtureRequest) -> Iterator[Kernel]:
    """One kernel for the module; after a failed test, a fresh one: the failed cell may still sit
    at a prompt, and every later test would wait out its timeout behind it."""
    yield kernels[0]
    report = getattr(request.node, "report_call", None)
    if report is None or report.failed:
        _shut_down(kernels[0])
        kernels[0] = _ready_kernel()


@pytest.fixture
def no_workers_after(kernel: Kernel) -> Iterator[None]:
    yield
    # The cell has ended: accelnb ended its workers before returning (no waiting here).
    assert kernel.workers() == []


ROUND_TRIP = """
def ask():
    import time, torch.distributed as dist
    rank = dist.get_rank()
    if rank == 0:
        for i in range(10):  # rank 0 works on while rank 1 is at its prompt
            print(f"tick {i}", flush=True)
            time.sleep(0.1)
        dist.barrier()  # then waits in a collective until rank 1 has its answer
    answer = input(f"name for {rank}? ")
    print(f"rank {rank} got {answer}")
    if rank == 1:
        dist.barrier()
    return answer
# A session: its workers have joined before the timed call, so timeout= bounds the call alone.
with accelnb.Session.start(num_processes=2, cpu=True) as session:
    session.run(int)
    asked = session.run(ask, timeout=1.0, collect="all")
    after = session.run(lambda: "inbox in step", collect="all")  # replies never desynchronise calls
print(sorted(asked.values.items()), sorted(after.values.items()))
"""


def test_input_round_trip_on_rank_0_and_rank_1(kernel: Kernel, no_workers_after: None) -> None:
    msg_id = kernel.execute(ROUND_TRIP)
    assert kernel.prompt() == "[rank 1] name for 1? "
    at_prompt = time.monotonic()
    # The other rank keeps running, and its output keeps reaching the cell, during the prompt.
    kernel.stdout_until(msg_id, lambda text: "tick 9" in text)
    # Longer than timeout=1 at the prompt: time at a prompt is not the run's (the waiting is
    # what is tested, not a synchronisation).
    time.sleep(max(0.0, 1.5 - (time.monotonic() - at_prompt)))
    kernel.answer("one")
    assert kernel.prompt() == "name for 0? "
    kernel.answer("zero")
    reply = kernel.finish(msg_id)
    assert reply["content"]["status"] == "ok", reply["content"]
    out = kernel.stream(msg_id)
    assert "[(0, 'zero'), (1, 'one')] [(0, 'inbox in step'), (1, 'inbox in step')]" in out
    assert "rank 0 got zero" in out
    assert "[rank 1] rank 1 got one" in out  # a rank that asked is shown from then on, prefixed


CELL = """%%distributed --procs 2 --cpu
base = 10 * (rank + 1)
answer = input(f"cell rank {rank}? ") if rank == 0 else "0"
base + int(answer)
"""


def test_input_in_a_distributed_cell(kernel: Kernel, no_workers_after: None) -> None:
    msg_id = kernel.execute(CELL)
    assert kernel.prompt() == "cell rank 0? "
    kernel.answer("5")
    reply = kernel.finish(msg_id)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert kernel.result(msg_id) == "15"  # the answer went to rank 0, and its value came back


DEBUGGED = """%%distributed --procs 2 --cpu
def double(v):
    w = v * 2
    return w
x = 40 + rank
if rank == 1:
    breakpoint()
    z = double(x)
    print("z is", z)
x
"""


def test_pdb_session_on_rank_1(kernel: Kernel, no_workers_after: None) -> None:
    msg_id = kernel.execute(DEBUGGED)
    steps = [  # (what to type, what must reach the cell before the next prompt)
        ("p x", "[rank 1] 41"),
        ("where", "<module>()"),
        ("s", "(2)double()"),
        ("n", "-> w = v * 2"),
        ("n", "-> return w"),
        ("p w", "[rank 1] 82"),
        ("up", "-> z = double(x)"),
        ("c", "[rank 1] z is 82"),
    ]
    assert kernel.prompt() == "[rank 1] (Pdb) "
    out = kernel.stdout_until(msg_id, lambda text: "-> z = double(x)" in text)
    assert "[rank 1] > <cell In[" in out and "(8)<module>()" in out  # the cell's own line numbers
    for typed, shown in steps:
        before = len(kernel.stream(msg_id))
        kernel.answer(typed)
        if typed != "c":
            assert kernel.prompt() == "[rank 1] (Pdb) "
        out = kernel.stdout_until(msg_id, lambda text, shown=shown, before=before: shown in text[before:])[before:]
        if typed == "where":
            assert "(8)<module>()" in out
            assert "accelnb" not in out and "cloudpickle" not in out  # the user's frames only
    reply = kernel.finish(msg_id)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert kernel.result(msg_id) == "40"  # rank 0's last value: it ran on while rank 1 was debugged


QUITS = """
def quits():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        breakpoint()
    dist.barrier()  # rank 0 waits here, as in training, while rank 1 is in the debugger
notebook_launcher(quits, num_processes=2, cpu=True, quiet=True)
"""


def test_q_in_the_debugger_stops_the_run(kernel: Kernel, no_workers_after: None) -> None:
    msg_id = kernel.execute(QUITS)
    assert kernel.prompt() == "[rank 1] (Pdb) "
    # The function was defined in a notebook cell: the rank shows its lines too.
    kernel.stdout_until(msg_id, lambda text: "[rank 1] -> dist.barrier()" in text)
    kernel.answer("q")
    reply = kernel.finish(msg_id)
    assert reply["content"]["status"] == "error"
    error = kernel.error(msg_id)
    text = "\n".join(error["traceback"])
    assert "quit in the debugger on rank 1" in text
    assert "BdbQuit" not in text and "bdb.py" not in text  # no traceback through the machinery
    assert "Stopped by accelnb after the failure: rank 0" in text


FAILS_MEANWHILE = """
def one_fails(signal_file):
    import os, time, torch.distributed as dist
    if dist.get_rank() == 0:
        while not os.path.exists(signal_file):  # until the test sees rank 1's prompt
            time.sleep(0.01)
        raise ValueError("rank 0 gave up")
    return input("still there? ")
notebook_launcher(one_fails, args=({signal_file!r},), num_processes=2, cpu=True, quiet=True)
"""


def test_a_failure_elsewhere_is_told_at_the_prompt(kernel: Kernel, no_workers_after: None,
                                                    tmp_path: Path) -> None:
    signal_file = tmp_path / "rank 1 is at its prompt"
    msg_id = kernel.execute(FAILS_MEANWHILE.replace("{signal_file!r}", repr(str(signal_file))))
    assert kernel.prompt() == "[rank 1] still there? "
    signal_file.touch()
    kernel.stdout_until(msg_id, lambda _: "rank 0 failed (ValueError: rank 0 gave up) while this prompt waits"
                        in kernel.stream(msg_id, "stderr"))
    kernel.answer("yes")
    kernel.finish(msg_id)
    assert "Rank 0 failed: ValueError: rank 0 gave up" in "\n".join(kernel.error(msg_id)["traceback"])


WAITS = """
def waits():
    return input("never answered? ")
notebook_launcher(waits, num_processes=2, cpu=True, quiet=True)
"""


def test_stop_during_a_prompt_ends_every_worker(kernel: Kernel, no_workers_after: None) -> None:
    msg_id = kernel.execute(WAITS)
    # Both ranks ask; one box at a time, so the other waits in the kernel's queue.
    assert kernel.prompt() in ("never answered? ", "[rank 1] never answered? ")
    kernel.manager.interrupt_kernel()  # the notebook's Stop button
    reply = kernel.finish(msg_id)
    assert reply["content"]["status"] == "error"
    error = kernel.error(msg_id)
    assert "accelnb stopped the run: every worker was ended on the interrupt." in "\n".join(error["traceback"])


IN_SESSION = """
def stops_in_debugger():
    import torch.distributed as dist
    x = dist.get_rank()
    breakpoint()
    return x
session = accelnb.Session.start(num_processes=2, cpu=True)
session.run(int)
session.run(stops_in_debugger)
"""

NEXT_CELL = """
def steps_off_the_end():
    import torch.distributed as dist
    if dist.get_rank() == 0:
        breakpoint()
    return 1
def plain():
    total = 0
    for i in range(3):
        total += i
    return total
try:
    session.run(steps_off_the_end)
    print("next call", sorted(session.run(plain, collect="all").values.items()))
finally:
    session.stop()
"""


def test_a_session_survives_its_debugger(kernel: Kernel, no_workers_after: None) -> None:
    msg_id = kernel.execute(IN_SESSION)
    assert kernel.prompt() in ("(Pdb) ", "[rank 1] (Pdb) ")
    kernel.manager.interrupt_kernel()
    kernel.finish(msg_id)
    assert "the session and its variables are kept" in "\n".join(kernel.error(msg_id)["traceback"])
    # `n` past the function's end leaves pdb stepping; a late answer to the interrupted prompt
    # is still on its way. Neither reaches the next call, which runs plainly.
    msg_id = kernel.execute(NEXT_CELL)
    for _ in range(2):
        assert kernel.prompt() == "(Pdb) "
        kernel.answer("n")
    reply = kernel.finish(msg_id, timeout=30)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "next call [(0, 3), (1, 3)]" in kernel.stream(msg_id)


def test_a_client_without_stdin_gets_end_of_input(kernel: Kernel, no_workers_after: None) -> None:
    msg_id = kernel.execute(WAITS, allow_stdin=False)
    reply = kernel.finish(msg_id)
    assert reply["content"]["status"] == "error"
    text = "\n".join(kernel.error(msg_id)["traceback"])
    assert "EOFError" in text and "does not accept input requests" in text


SCRIPT = """
import accelnb

def fn():
    import torch.distributed as dist
    rank = dist.get_rank()
    if rank == 0:
        print("rank 0 read", input("terminal? "))
    dist.barrier()  # the answers are piped in order: rank 0's first, then rank 1's debugger
    x = 7 * (rank + 1)
    if rank == 1:
        breakpoint()
    return x

if __name__ == "__main__":
    print("value", accelnb.notebook_launcher(fn, num_processes=2, cpu=True, quiet=True))
"""


@pytest.mark.parametrize("breakpoint_setting", [None, "ray.util.rpdb._driver_set_trace"],
                         ids=["plain", "after-ray-init"])
def test_a_script_reads_the_terminal(tmp_path: Path, breakpoint_setting: str | None) -> None:
    """``after-ray-init``: ray.init() sets PYTHONBREAKPOINT to Ray's remote debugger in the process
    that calls it, whose ranks inherit it; breakpoint() in a rank still prompts here."""
    script = tmp_path / "ask.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if breakpoint_setting is not None:
        env["PYTHONBREAKPOINT"] = breakpoint_setting
    done = subprocess.run([sys.executable, str(script)], input="typed\np x\nc\n", capture_output=True,
                          text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "terminal? " in out and "rank 0 read typed" in out
    assert "[rank 1] (Pdb) " in out and "[rank 1] 14" in out  # the debugger's p x, prefixed
    assert "value 7" in out
