"""JupyterLab's GPUs panel while it is shown: it sends ``watch``, and the kernel reads the GPUs
every ``WATCH_INTERVAL_S`` for their minute of history, on a thread of its own, until ``watch``
is off or the panel closes. ``PanelConnection`` runs here with a recording comm and a reader that
counts its reads; the browser test (tests/browser/test_gpu_figures.py) sees the history drawn."""

from __future__ import annotations

import threading
from typing import Any

from accelnb.kernel.planning.inventory import Inventory, synthetic_inventory
from accelnb.notebook.lab_bridge import WATCH_INTERVAL_S, PanelConnection
from tests.test_lab_bridge import RecordingComm

READER_THREAD = "accelnb-lab-inventory"


def history_of(state: dict[str, Any], index: int = 0) -> list[list[float]]:
    return state["inventory"]["gpus"][index]["history"]


def assert_reads_end() -> None:
    """The inventory reader thread ends within an interval (it exists only while there is reading to do)."""
    for thread in threading.enumerate():
        if thread.name == READER_THREAD:
            thread.join(WATCH_INTERVAL_S + 5)
            assert not thread.is_alive(), "the inventory is still read with no panel shown"


def test_a_shown_panel_gets_a_reading_every_interval_and_none_once_hidden() -> None:
    reads: list[threading.Thread] = []

    def counting_reader() -> Inventory:
        reads.append(threading.current_thread())
        return synthetic_inventory(1)

    panel_comm = RecordingComm()
    connection = PanelConnection(panel_comm, counting_reader)  # type: ignore[arg-type]
    connection.start()
    try:
        panel_comm.wait_for_state(lambda state: len(reads) == 1)  # the first read, when it connects
        assert_reads_end()  # not shown: no reading until asked
        panel_comm.handlers["msg"]({"content": {"data": {"type": "watch", "on": True}}})
        # A read at once, then one per interval: three reads take two intervals.
        panel_comm.wait_for_state(lambda state: len(reads) >= 4, timeout=3 * WATCH_INTERVAL_S + 5)
        panel_comm.handlers["msg"]({"content": {"data": {"type": "watch", "on": False}}})
        assert_reads_end()
    finally:
        connection.close()
    assert threading.current_thread() not in reads


def test_closing_a_watching_panel_ends_its_reads() -> None:
    panel_comm = RecordingComm()
    connection = PanelConnection(panel_comm, lambda: synthetic_inventory(1))  # type: ignore[arg-type]
    connection.start()
    panel_comm.wait_for_state(lambda state: True)
    panel_comm.handlers["msg"]({"content": {"data": {"type": "watch", "on": True}}})
    connection.close()
    assert_reads_end()


def test_every_state_carries_the_kernels_minute_of_utilisation() -> None:
    panel_comm = RecordingComm()
    connection = PanelConnection(panel_comm, lambda: synthetic_inventory(2))  # type: ignore[arg-type]
    connection.start()
    try:
        state = panel_comm.wait_for_state(lambda state: bool(history_of(state, 1)))
        seconds_ago, percent = history_of(state, 1)[-1]
        assert percent == 13 and 0 <= seconds_ago < 60  # synthetic GPU 1's utilisation, just read
        assert state["inventory"]["gpus"][1]["busy"] == "" and state["inventory"]["gpus"][1]["processes"] == []
    finally:
        connection.close()
