"""The panel's Stop button works while the cell that launched the run is still blocked.

A real ipykernel runs a cell that shows ``accelnb.Panel()`` and a cell that launches a 60 s
2-rank CPU run. While that cell blocks, this test (standing in for the browser) sends the exact
message a click on the Stop button sends: a ``comm_msg`` ``{"method": "custom", "content":
{"event": "click"}}`` to the button's comm. The cell must end with KeyboardInterrupt within
seconds, leave no worker process, and keep its own output in its own cell; the cell queued
behind it must wait for it (and then be aborted, as behind any cell that raised). On the way,
the panel's updates (rank states, and memory figures from its refresh thread) must reach IOPub
while the kernel is busy.

A control shows the hook is what makes it work: a plain Button wired to ``request_stop``, with no
panel open, is not heard until the run has ended by itself.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from tests.conftest import live_descendants, start_repo_kernel

Message = dict[str, Any]

SETUP = """
import itertools, json
from dataclasses import replace
from accelnb import notebook_launcher
from accelnb.kernel.planning.inventory import set_inventory_source, synthetic_inventory
from accelnb.notebook.kernel_messages import comm_messages_supported
from accelnb.notebook.panel import Panel
from accelnb.kernel.helper.template import shared_helper

_reads = itertools.count()
def _moving_memory():  # every read shows different memory use, so every refresh sends an update
    inventory = synthetic_inventory(2)
    n = next(_reads) % 40
    return replace(inventory, gpus=tuple(replace(g, memory_used=n * 2**30) for g in inventory.gpus))

set_inventory_source(_moving_memory)
panel = Panel(refresh_interval=0.25)
display(panel)
print(json.dumps({"stop": panel.stop_button.model_id, "memory": panel.gpu_rows[0].memory.model_id,
                  "helper": shared_helper().pid, "supported": comm_messages_supported()}))
"""

LONG_RUN = """
import time
def sleep_a_minute():
    import time
    time.sleep(60)
started = time.time()
try:
    notebook_launcher(sleep_a_minute, num_processes=2, cpu=True, quiet=True)
finally:
    print(f"launch cell ended after {time.time() - started:.1f} s")
"""


class Kernel:
    """A client that keeps every IOPub message, so the test can look back at what it saw."""

    def __init__(self, client: BlockingKernelClient) -> None:
        self.client = client
        self.seen: list[tuple[float, Message]] = []  # (arrival time, message)
        self.helper_pid: int | None = None  # the kernel's worker helper, once a test learns it

    def run(self, code: str, timeout: float = 60) -> str:
        """Execute ``code`` to the end; returns its stdout. Fails on an error."""
        msg_id = self.client.execute(code)
        _, reply = self.reply_to(msg_id, timeout)
        assert reply["content"]["status"] == "ok", reply["content"]
        self.wait_for(is_status(msg_id, "idle"), timeout=10)
        return self.stdout_of(msg_id)

    def wait_for(self, predicate: Callable[[Message], bool], timeout: float) -> Message:
        for _, message in self.seen:
            if predicate(message):
                return message
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.client.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append((time.monotonic(), message))
            if predicate(message):
                return message
        raise AssertionError(f"no such IOPub message within {timeout} s; last: {self.seen[-3:]}")

    def collect(self, seconds: float) -> None:
        """Keep reading IOPub for ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                message = self.client.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                continue
            self.seen.append((time.monotonic(), message))

    def reply_to(self, msg_id: str, timeout: float) -> tuple[float, Message]:
        """(arrival time, execute_reply) of the request ``msg_id``."""
        deadline = time.monotonic() + timeout
        while True:
            reply = self.client.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return time.monotonic(), reply

    def stdout_of(self, msg_id: str) -> str:
        return "".join(m["content"]["text"] for _, m in self.seen
                       if m["header"]["msg_type"] == "stream" and m["content"]["name"] == "stdout"
                       and m["parent_header"].get("msg_id") == msg_id)

    def widget_updates(self, model_id: str, since: float = 0.0) -> list[dict[str, Any]]:
        return [m["content"]["data"]["state"] for t, m in self.seen
                if t >= since and m["header"]["msg_type"] == "comm_msg"
                and m["content"]["comm_id"] == model_id and m["content"]["data"].get("method") == "update"]

    def click(self, model_id: str) -> None:
        """What the browser sends when a Button is clicked."""
        data = {"method": "custom", "content": {"event": "click"}}
        message = self.client.session.msg("comm_msg", {"comm_id": model_id, "data": data})
        self.client.shell_channel.send(message)


def is_status(msg_id: str, state: str) -> Callable[[Message], bool]:
    return lambda m: (m["header"]["msg_type"] == "status" and m["parent_header"].get("msg_id") == msg_id
                      and m["content"]["execution_state"] == state)


def shows_running(message: Message) -> bool:
    """A widget update that sets a value to "running" (a rank's phase label)."""
    return (message["header"]["msg_type"] == "comm_msg"
            and message["content"]["data"].get("state", {}).get("value") == "running")


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    manager, client = start_repo_kernel(ACCELNB_SYNTHETIC_GPUS=None)
    session = Kernel(client)
    kernel_pid = manager.provisioner.pid if manager.provisioner is not None else None
    below_kernel: list[psutil.Process] = []
    try:
        yield session
    finally:
        # Whatever runs below the kernel now (its helper, a forked bridge's spawned successor)
        # must go with it: looked up before the kernel dies and its children are re-parented.
        below_kernel = live_descendants(kernel_pid) if kernel_pid is not None else []
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    if session.helper_pid is not None:  # it launched: its shared helper runs until the kernel goes
        assert below_kernel, "no helper found below the kernel"
    deadline = time.monotonic() + 10
    while any(_alive(p.pid) for p in below_kernel) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in below_kernel if _alive(p.pid)], "a process of accelnb's outlived its kernel"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_click_ends_a_blocked_run(kernel: Kernel) -> None:
    ids = json.loads(kernel.run(SETUP, timeout=120))
    assert ids["supported"] is True, "ipykernel layout not recognised: comm messages would wait for the cell"
    kernel.helper_pid = ids["helper"]

    run_id = kernel.client.execute(LONG_RUN)
    kernel.wait_for(is_status(run_id, "busy"), timeout=10)
    busy_since = time.monotonic()
    # The panel shows both ranks running: its updates reach the browser while the cell blocks.
    kernel.wait_for(lambda m: shows_running(m) and sum(shows_running(x) for _, x in kernel.seen) >= 2,
                    timeout=60)
    workers = live_descendants(ids["helper"])
    assert len(workers) == 2, f"expected 2 workers below the helper, found {workers}"
    later_id = kernel.client.execute("print('the queued cell ran')")  # must wait for the run cell
    kernel.collect(1.0)  # the refresh thread sends memory updates while the kernel is busy
    refreshed_while_busy = kernel.widget_updates(ids["memory"], since=busy_since)

    clicked = time.monotonic()
    kernel.click(ids["stop"])
    ended, run_reply = kernel.reply_to(run_id, timeout=30)

    assert ended - clicked < 30, f"the cell ended {ended - clicked:.1f} s after the click"  # not the minute's sleep
    assert run_reply["content"]["status"] == "error"
    # accelnb's RunInterrupted is a KeyboardInterrupt that renders as one short message
    assert run_reply["content"]["ename"] in ("RunInterrupted", "KeyboardInterrupt")
    assert "accelnb stopped the run" in run_reply["content"]["evalue"]
    deadline = time.monotonic() + 5
    while live_descendants(ids["helper"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_descendants(ids["helper"]) == [], "a worker outlived the stop"
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)

    # The cell queued behind the run was not run during it; like any cell queued behind a cell
    # that raised, it is aborted (stop_on_error, as JupyterLab's Run All sends), and the kernel
    # then takes new cells as usual.
    later_at, later_reply = kernel.reply_to(later_id, timeout=30)
    assert later_at >= ended and later_reply["content"]["status"] == "aborted"
    assert kernel.stdout_of(later_id) == ""
    assert kernel.run("print('the next cell ran')") == "the next cell ran\n"
    # The run cell's own output stayed in the run cell, though the click was handled inside it.
    assert "launch cell ended after" in kernel.stdout_of(run_id)
    assert len(refreshed_while_busy) >= 2, "the refresh thread's updates did not reach IOPub during the run"
    print(f"click → cell ended: {ended - clicked:.2f} s; "
          f"memory updates while busy: {len(refreshed_while_busy)}")


CONTROL_SETUP = """
import ipywidgets, json
from accelnb import notebook_launcher
from accelnb.kernel.run import run_state
if "panel" in globals():
    panel.close()  # the last panel closed: the launcher no longer lets comm messages through
bare_stop = ipywidgets.Button(description="Stop")
bare_stop.on_click(lambda _button: print("click handled; stop accepted:", run_state.request_stop("a panel's Stop")))
print(json.dumps({"stop": bare_stop.model_id}))
"""

SHORT_RUN = """
def sleep_three_seconds():
    import time
    time.sleep(3)
notebook_launcher(sleep_three_seconds, num_processes=2, cpu=True, quiet=True)
"""


def test_without_the_panel_a_click_waits_for_the_run(kernel: Kernel) -> None:
    stop_id = json.loads(kernel.run(CONTROL_SETUP))["stop"]

    run_id = kernel.client.execute(SHORT_RUN)
    kernel.wait_for(is_status(run_id, "busy"), timeout=10)
    kernel.collect(1.0)
    kernel.click(stop_id)
    _, run_reply = kernel.reply_to(run_id, timeout=60)
    assert run_reply["content"]["status"] == "ok", "the click stopped a run it should not have reached"
    handled = kernel.wait_for(lambda m: m["header"]["msg_type"] == "stream"
                              and "click handled" in m["content"].get("text", ""), timeout=10)
    assert "stop accepted: False" in handled["content"]["text"]  # handled only after the run had ended
