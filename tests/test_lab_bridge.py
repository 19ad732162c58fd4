"""The ``accelnb.gpus`` comm, driven the way JupyterLab drives it: a real kernel, real comm messages.

One ipykernel (with ``ACCELNB_SYNTHETIC_GPUS=4``) serves the module; each test opens its own comm
from a jupyter_client, as the GPUs panel does, and reads what comes back on IOPub. The last tests
run a :class:`PanelConnection` in this process with an injected inventory source and a comm
that records what is sent, to see on which thread the inventory is read.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from accelnb.kernel.planning.inventory import Inventory, synthetic_inventory
from accelnb.kernel.run import run_state
from accelnb.notebook.lab_bridge import PanelConnection
from tests.conftest import start_repo_kernel

TARGET = "accelnb.gpus"

Message = dict[str, Any]


class KernelSession:
    """A kernel client that keeps every IOPub message, so tests can wait for the one they want."""

    def __init__(self, client: BlockingKernelClient) -> None:
        self.client = client
        self.seen: list[Message] = []

    def execute(self, code: str, timeout: float = 30) -> str:
        """Run ``code``; return its stdout. Fails the test on an error."""
        msg_id = self.client.execute(code)
        reply = self.client.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.client.get_shell_msg(timeout=timeout)
        self.wait_for(lambda m: m["header"]["msg_type"] == "status"
                      and m["parent_header"].get("msg_id") == msg_id
                      and m["content"]["execution_state"] == "idle", timeout)
        outputs = [m for m in self.seen if m["parent_header"].get("msg_id") == msg_id]
        errors = [m["content"] for m in outputs if m["header"]["msg_type"] == "error"]
        assert reply["content"]["status"] == "ok", f"{code!r} failed in the kernel: {errors}"
        return "".join(m["content"]["text"] for m in outputs
                       if m["header"]["msg_type"] == "stream" and m["content"]["name"] == "stdout")

    def open_comm(self) -> str:
        comm_id = uuid.uuid4().hex
        self._send_shell("comm_open", {"comm_id": comm_id, "target_name": TARGET, "data": {}})
        return comm_id

    def send(self, comm_id: str, data: dict[str, Any]) -> None:
        self._send_shell("comm_msg", {"comm_id": comm_id, "data": data})

    def close_comm(self, comm_id: str) -> None:
        self._send_shell("comm_close", {"comm_id": comm_id, "data": {}})

    def comm_messages(self, comm_id: str, msg_type: str = "comm_msg") -> list[dict[str, Any]]:
        return [m["content"]["data"] for m in self.seen
                if m["header"]["msg_type"] == msg_type and m["content"].get("comm_id") == comm_id]

    def next_from(self, comm_id: str, after: int, kind: str = "state", timeout: float = 15) -> dict[str, Any]:
        """The first message of type ``kind`` on ``comm_id`` past the first ``after`` ones."""
        def found() -> dict[str, Any] | None:
            later = self.comm_messages(comm_id)[after:]
            return next((d for d in later if d.get("type") == kind), None)
        self.wait_for(lambda _m: found() is not None, timeout)
        result = found()
        assert result is not None
        return result

    def wait_for(self, predicate: Callable[[Message], bool], timeout: float = 15) -> Message:
        for message in self.seen:
            if predicate(message):
                return message
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.client.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(message)
            if predicate(message):
                return message
        raise AssertionError(f"no matching IOPub message within {timeout} s; last ones: {self.seen[-5:]}")

    def _send_shell(self, msg_type: str, content: dict[str, Any]) -> None:
        self.client.shell_channel.send(self.client.session.msg(msg_type, content))


def closes(comm_id: str) -> Callable[[Message], bool]:
    return lambda m: m["header"]["msg_type"] == "comm_close" and m["content"].get("comm_id") == comm_id


@pytest.fixture(scope="module")
def kernel() -> Iterator[KernelSession]:
    manager, client = start_repo_kernel(ACCELNB_SYNTHETIC_GPUS="4")
    try:
        session = KernelSession(client)
        session.execute("import accelnb.notebook.lab_bridge as bridge; bridge.register_comm_target(get_ipython())\n"
                        "from accelnb.kernel.watched_state import selection; from accelnb.kernel.run import run_state")
        yield session
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.fixture
def panel(kernel: KernelSession) -> Iterator[str]:
    """A fresh comm, opened like the GPUs panel opens it, with no selection set."""
    kernel.execute("selection.clear_selection()")
    comm_id = kernel.open_comm()
    kernel.next_from(comm_id, 0)
    yield comm_id
    kernel.close_comm(comm_id)


def test_open_answers_with_the_full_state(kernel: KernelSession, panel: str) -> None:
    state = kernel.comm_messages(panel)[0]
    assert state["type"] == "state"
    inventory = state["inventory"]
    assert inventory["synthetic"] is True and inventory["source"] == "synthetic"
    assert [g["index"] for g in inventory["gpus"]] == [0, 1, 2, 3]
    first = inventory["gpus"][0]
    assert first["uuid"].startswith("GPU-") and first["memory_total"] == 80 * 2**30 and first["visible"]
    assert state["selection"] == {"gpus": None, "num_processes": None, "magic_line": "%%distributed"}
    assert state["run"] is None
    assert kernel.execute("print(bridge.is_registered())").strip() == "True"


def test_select_sets_the_notebook_selection(kernel: KernelSession, panel: str) -> None:
    seen = len(kernel.comm_messages(panel))
    kernel.send(panel, {"type": "select", "gpus": [2, 0]})
    state = kernel.next_from(panel, seen)
    assert state["selection"] == {"gpus": [2, 0], "num_processes": None,
                                  "magic_line": "%%distributed --gpus 2,0"}
    assert "gpus=(2, 0)" in kernel.execute("print(selection.current_selection())")

    seen = len(kernel.comm_messages(panel))
    kernel.send(panel, {"type": "select", "num_processes": 3})
    assert kernel.next_from(panel, seen)["selection"]["magic_line"] == "%%distributed --procs 3 --cpu"

    seen = len(kernel.comm_messages(panel))
    kernel.send(panel, {"type": "select", "gpus": []})
    assert kernel.next_from(panel, seen)["selection"]["gpus"] is None
    assert kernel.execute("print(selection.current_selection())").strip() == "None"


@pytest.mark.parametrize(("request_data", "says"), [
    ({"type": "select", "gpus": [1, 9]}, "GPU 9 does not exist on this machine"),  # the planner's words
    ({"type": "select", "gpus": [1, 1]}, "GPU 1 is selected more than once"),
    ({"type": "select", "gpus": [True]}, "list of GPU indices"),
    ({"type": "select", "num_processes": 0}, "at least 1"),
    ({"type": "select", "gpus": [1], "num_processes": 2}, "not both"),
    ({"type": "launch"}, "Unknown panel message"),
])
def test_bad_requests_answer_an_error_and_change_nothing(
    kernel: KernelSession, panel: str, request_data: dict[str, Any], says: str
) -> None:
    seen = len(kernel.comm_messages(panel))
    kernel.send(panel, request_data)
    assert says in kernel.next_from(panel, seen, kind="error")["message"]
    assert kernel.next_from(panel, seen)["selection"]["gpus"] is None
    assert kernel.execute("print(selection.current_selection())").strip() == "None"


def test_stacks_without_a_run_say_there_is_none(kernel: KernelSession, panel: str) -> None:
    # (with a run: tests/browser/test_stacks_panel.py, during a blocking launch)
    kernel.execute("if run_state.current_run() is not None:\n    run_state.current_run().finished = True")
    seen = len(kernel.comm_messages(panel))
    kernel.send(panel, {"type": "stacks"})
    answer = kernel.next_from(panel, seen, kind="stacks")
    assert answer["ranks"] == [] and answer["error"] == "No run in progress: there are no stacks to show."


def test_changes_made_in_the_kernel_reach_the_panel(kernel: KernelSession, panel: str) -> None:
    seen = len(kernel.comm_messages(panel))
    kernel.execute("selection.set_selection(gpus=[3])")
    assert kernel.next_from(panel, seen)["selection"]["gpus"] == [3]

    seen = len(kernel.comm_messages(panel))
    kernel.execute("run = run_state.RunState(run_id=7, ranks=[run_state.RankState(0, 'cpu', 'running', 42),"
                   " run_state.RankState(1, 'cpu', 'failed', 43, 'ZeroDivisionError')])\n"
                   "run_state.begin_run(run)")
    run = kernel.next_from(panel, seen)["run"]
    assert run == {"run_id": 7, "finished": False, "stop_pending": None, "ranks": [
        {"rank": 0, "device": "cpu", "phase": "running", "pid": 42, "detail": "", "progress": ""},
        {"rank": 1, "device": "cpu", "phase": "failed", "pid": 43, "detail": "ZeroDivisionError", "progress": ""}]}

    seen = len(kernel.comm_messages(panel))
    kernel.send(panel, {"type": "stop"})
    kernel.next_from(panel, seen)
    assert kernel.execute("print(run.stop_pressed)").strip() == "True"

    seen = len(kernel.comm_messages(panel))  # the code checks stop_requested(): the ranks are saving
    kernel.execute("run.stop_pending = 'a panel\\'s Stop'; run_state.publish()")
    assert kernel.next_from(panel, seen)["run"]["stop_pending"] == "a panel's Stop"

    seen = len(kernel.comm_messages(panel))
    kernel.execute("run.finished = True; run.ranks[0].phase = 'stopped'; run_state.publish()")
    run = kernel.next_from(panel, seen)["run"]
    assert run["finished"] is True and run["ranks"][0]["phase"] == "stopped"


def test_a_closed_panel_hears_nothing_more(kernel: KernelSession) -> None:
    comm_id = kernel.open_comm()
    kernel.next_from(comm_id, 0)
    kernel.close_comm(comm_id)
    seen = len(kernel.comm_messages(comm_id))
    kernel.execute("selection.set_selection(gpus=[1])\nselection.clear_selection()")
    assert len(kernel.comm_messages(comm_id)) == seen


def test_without_the_target_the_kernel_closes_the_comm(kernel: KernelSession) -> None:
    open_panel = kernel.open_comm()
    kernel.next_from(open_panel, 0)
    kernel.execute("bridge.unregister_comm_target(get_ipython())")
    try:
        # The panel that was open is told to close, a new one is refused.
        kernel.wait_for(closes(open_panel))
        refused = kernel.open_comm()
        kernel.wait_for(closes(refused))
        assert kernel.comm_messages(refused) == []
        assert kernel.execute("print(bridge.is_registered())").strip() == "False"
    finally:
        kernel.execute("bridge.register_comm_target(get_ipython())")


# ── in this process: where the inventory is read ──────────────────────────────────────────
class RecordingComm:
    """The part of a comm a PanelConnection uses, keeping what it sends; waits without sleeping."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self.handlers: dict[str, Callable[[dict[str, Any]], None]] = {}

    def on_msg(self, handler: Callable[[dict[str, Any]], None]) -> None:
        self.handlers["msg"] = handler

    def on_close(self, handler: Callable[[dict[str, Any]], None]) -> None:
        self.handlers["close"] = handler

    def send(self, data: dict[str, Any]) -> None:
        with self._changed:
            self.sent.append(data)
            self._changed.notify_all()

    def close(self) -> None:
        pass

    def wait_for_state(self, accept: Callable[[dict[str, Any]], bool], timeout: float = 10) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((m for m in self.sent if m["type"] == "state" and accept(m)), None)
        with self._changed:
            assert self._changed.wait_for(lambda: found() is not None, timeout), f"no such state in {self.sent}"
            state = found()
        assert state is not None
        return state


def gpu_count(count: int) -> Callable[[dict[str, Any]], bool]:
    return lambda state: len(state["inventory"]["gpus"]) == count


def test_a_finished_run_is_published_without_reading_the_inventory_on_the_launch_thread() -> None:
    reads: list[threading.Thread] = []

    def counting_reader() -> Inventory:  # every read shows one more GPU, so states tell reads apart
        reads.append(threading.current_thread())
        return synthetic_inventory(len(reads))

    panel_comm = RecordingComm()
    connection = PanelConnection(panel_comm, counting_reader)  # type: ignore[arg-type]
    connection.start()
    try:
        panel_comm.wait_for_state(gpu_count(1))  # the first state comes once the first read is done
        run = run_state.RunState(run_id=run_state.next_run_id(), ranks=[run_state.RankState(0, "cpu", "done")])
        run_state.begin_run(run)
        run.finished = True
        run_state.publish()  # what WorkerGroup.close() does, on the launch's thread
        assert panel_comm.sent[-1]["run"]["finished"] is True  # the run's end is shown at once
        panel_comm.wait_for_state(gpu_count(2))  # and the inventory re-read follows
    finally:
        connection.close()
    assert len(reads) == 2
    assert threading.current_thread() not in reads, "the inventory was read on the publishing thread"


def test_a_select_is_checked_against_the_inventory_read_in_the_background() -> None:
    release = threading.Event()

    def slow_reader() -> Inventory:  # a slow NVML: the panel's first state waits for it
        release.wait(10)
        return synthetic_inventory(2)

    panel_comm = RecordingComm()
    connection = PanelConnection(panel_comm, slow_reader)  # type: ignore[arg-type]
    connection.start()
    try:
        assert panel_comm.sent == []  # no state before the GPUs are known
        release.set()
        panel_comm.wait_for_state(gpu_count(2))
        panel_comm.handlers["msg"]({"content": {"data": {"type": "select", "gpus": [3]}}})
        assert panel_comm.sent[-2] == {"type": "error", "message": panel_comm.sent[-2]["message"]}
        assert "GPU 3 does not exist on this machine" in panel_comm.sent[-2]["message"]
    finally:
        connection.close()
