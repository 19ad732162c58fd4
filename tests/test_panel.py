"""``accelnb.Panel``, in this process (no kernel): inventory to rows, boxes to selection and back,
the CPU-ranks control, the live refresh thread, and the run section during real 2-rank CPU runs.

The GPU inventory is the one thing faked (this machine has no GPU): injected as the panel's
``inventory_source``. Runs are real: gloo ranks forked by the worker helper.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import comm
import ipywidgets as widgets
import pytest

from accelnb import launch
from accelnb.kernel.planning.inventory import GpuInfo, GpuProcess, Inventory, synthetic_inventory
from accelnb.kernel.run import run_state
from accelnb.kernel.watched_state import selection
from accelnb.kernel.watched_state.selection import Selection, clear_selection, current_selection, set_selection
from accelnb.notebook import kernel_messages
from accelnb.notebook.panel import Panel, show_panel
from tests.conftest import wait_until_no_workers, worker_processes

GIB = 2**30


@pytest.fixture(autouse=True)
def no_selection() -> Iterator[None]:
    clear_selection()
    yield
    clear_selection()


@pytest.fixture
def make_panel() -> Iterator[Callable[..., Panel]]:
    """Panels that are closed after the test, whatever happens."""
    made: list[Panel] = []

    def make(inventory: Inventory | Callable[[], Inventory], **kwargs: object) -> Panel:
        source = inventory if callable(inventory) else (lambda: inventory)
        kwargs.setdefault("refresh_interval", None)
        panel = Panel(inventory_source=source, **kwargs)  # type: ignore[arg-type]
        made.append(panel)
        return panel

    yield make
    for panel in made:
        panel.close()


def test_rows_show_each_gpu_as_nvidia_smi_numbers_it(make_panel: Callable[..., Panel]) -> None:
    gpus = (
        GpuInfo(0, "NVIDIA H100 80GB HBM3", "GPU-5b3c1f0e-aaaa-bbbb-cccc-0123456789ab", "00000000:18:00.0",
                80 * GIB, 12 * GIB, 37, (GpuProcess(4242, GIB), GpuProcess(4343, None))),
        GpuInfo(1, "NVIDIA H100 80GB HBM3", "GPU-9d00aa11-aaaa-bbbb-cccc-0123456789cd", "00000000:2A:00.0",
                80 * GIB, 0, None, (), visible=False),
    )
    panel = make_panel(Inventory(gpus=gpus, source="nvml"))

    assert sorted(panel.checkboxes) == [0, 1]
    first, second = panel.gpu_rows[0], panel.gpu_rows[1]
    assert first.checkbox.description == "GPU 0" and not first.checkbox.disabled
    assert first.name.value == "NVIDIA H100 80GB HBM3"
    assert first.memory.value == "12.0 / 80.0 GiB" and first.memory_bar.value == 12 * GIB
    assert first.utilization.value == "37 %"
    assert first.uuid.value == "GPU-5b3c1f0e…89ab" and first.uuid.tooltip == gpus[0].uuid
    assert first.processes.value == "2"
    # A GPU hidden by the kernel's CUDA_VISIBLE_DEVICES is listed but cannot be picked.
    assert second.checkbox.disabled and "CUDA_VISIBLE_DEVICES" in second.checkbox.tooltip
    assert second.utilization.value == "n/a"
    assert panel.banner.value == ""  # real hardware: no banner
    assert panel.cpu_box.layout.display == "none"
    assert "every visible GPU" in panel.magic_line.value


def test_a_synthetic_inventory_is_flagged(make_panel: Callable[..., Panel]) -> None:
    panel = make_panel(synthetic_inventory(4))
    assert sorted(panel.checkboxes) == [0, 1, 2, 3]
    assert "Synthetic GPUs" in panel.banner.value and "no such hardware" in panel.banner.value


def test_ticking_boxes_sets_the_selection_in_the_order_picked(make_panel: Callable[..., Panel]) -> None:
    panel = make_panel(synthetic_inventory(4))
    panel.checkboxes[2].value = True
    panel.checkboxes[0].value = True
    assert current_selection() == Selection(gpus=(2, 0))
    assert "<code>%%distributed --gpus 2,0</code>" in panel.magic_line.value

    panel.checkboxes[2].value = False
    assert current_selection() == Selection(gpus=(0,))
    panel.checkboxes[0].value = False
    assert current_selection() is None
    assert "<code>%%distributed</code>" in panel.magic_line.value


def test_selection_made_elsewhere_ticks_the_boxes(make_panel: Callable[..., Panel]) -> None:
    panel = make_panel(synthetic_inventory(4))
    other = make_panel(synthetic_inventory(4))  # e.g. the same panel shown twice

    set_selection(gpus=[3, 1])
    assert {i: b.value for i, b in panel.checkboxes.items()} == {0: False, 1: True, 2: False, 3: True}
    assert "--gpus 3,1" in panel.magic_line.value

    other.checkboxes[0].value = True  # ticked in the other panel: appended to the selection
    assert current_selection() == Selection(gpus=(3, 1, 0))
    assert panel.checkboxes[0].value

    clear_selection()
    assert not any(b.value for b in panel.checkboxes.values())
    assert not any(b.value for b in other.checkboxes.values())


def test_without_gpus_the_panel_offers_cpu_ranks(make_panel: Callable[..., Panel]) -> None:
    panel = make_panel(Inventory(source="none", note="no NVIDIA driver found"))
    assert panel.checkboxes == {}
    assert panel.gpu_table.layout.display == "none" and panel.cpu_box.layout.display is None
    assert "No GPU" in panel.banner.value and "no NVIDIA driver found" in panel.banner.value

    panel.use_cpu.value = True
    assert current_selection() == Selection(num_processes=2)
    panel.cpu_ranks.value = 3
    assert current_selection() == Selection(num_processes=3)
    assert "<code>%%distributed --procs 3 --cpu</code>" in panel.magic_line.value

    set_selection(num_processes=5)  # from elsewhere
    assert panel.use_cpu.value and panel.cpu_ranks.value == 5
    panel.use_cpu.value = False
    assert current_selection() is None


def test_memory_and_utilisation_refresh_in_the_background(make_panel: Callable[..., Panel]) -> None:
    reads = itertools.count()

    def changing() -> Inventory:
        n = next(reads)
        inventory = synthetic_inventory(1)
        gpu = replace(inventory.gpus[0], memory_used=n * GIB, utilization=n % 100)
        return replace(inventory, gpus=(gpu,))

    panel = make_panel(changing, refresh_interval=0.05)
    refresher = _the_refresh_thread()
    first = panel.gpu_rows[0].memory.value
    deadline = time.monotonic() + 5
    while panel.gpu_rows[0].memory.value == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert panel.gpu_rows[0].memory.value != first, "the refresh thread never updated the panel"
    assert panel.refreshed.value.startswith("live · updated ")

    panel.close()
    refresher.join(timeout=5)
    assert not refresher.is_alive(), "close() did not end the refresh thread"


def _the_refresh_thread() -> threading.Thread:
    """The one panel refresh thread running now (the panel that just started it)."""
    (refresher,) = [t for t in threading.enumerate() if t.name == "accelnb-panel-refresh" and t.is_alive()]
    return refresher


def _subscriptions() -> tuple[int, int, int]:
    return selection.listener_count(), run_state.run_listener_count(), run_state.wait_hook_count()


def _let_ipywidgets_forget(panel: Panel) -> None:
    """Drop ipywidgets' own hold on the panel's widgets, as a weak-reference build would.

    ipywidgets 8.1 keeps every widget in its registry (``Widget.widgets``) and each widget's comm
    keeps its message handler until the widget is closed, so no widget is ever collected before
    ``close()``; ipywidgets' weak-reference mode (jupyter-widgets/ipywidgets#3893) lifts both.
    Here the comms are closed as a frontend closes them (``CommManager.comm_close``) and the
    widgets are taken out of the registry, leaving only what accelnb holds.
    """
    tree: list[Any] = [panel]
    for widget in tree:
        tree.extend(getattr(widget, "children", ()))
    manager = comm.get_comm_manager()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Widget.widgets: the public, deprecated name
        registry = widgets.Widget.widgets
    for widget in tree:
        manager.comm_close(None, None, {"content": {"comm_id": widget.model_id, "data": {}}})
        registry.pop(widget.model_id, None)


def test_a_dropped_panel_is_collected_and_leaves_no_subscription_behind() -> None:
    before = _subscriptions()
    panel = Panel(refresh_interval=0.05, inventory_source=lambda: synthetic_inventory(2))
    refresher = _the_refresh_thread()
    assert _subscriptions() == (before[0] + 1, before[1] + 1, max(before[2], 1))
    collected = threading.Event()
    weakref.finalize(panel, collected.set)

    _let_ipywidgets_forget(panel)
    del panel
    gc.collect()

    assert collected.is_set(), "something still holds the panel"
    assert _subscriptions() == before
    refresher.join(timeout=5)
    assert not refresher.is_alive()
    set_selection(gpus=[1])  # nothing is left listening for it, and nothing breaks
    run_state.publish()


def test_a_bad_refresh_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="refresh_interval must be a positive number"):
        Panel(refresh_interval=0)


def _sleep_briefly() -> int:
    import time

    time.sleep(0.5)
    return 0


def _sleep_long() -> None:
    import time

    time.sleep(60)


def test_the_panel_follows_a_real_run(make_panel: Callable[..., Panel], no_leftovers: None) -> None:
    panel = make_panel(Inventory(source="none"))
    shown: dict[int, list[str]] = {}

    def record(run: run_state.RunState | None) -> None:  # subscribed after the panel: sees what it shows
        for rank, row in panel.rank_rows.items():
            phases = shown.setdefault(rank, [])
            if not phases or phases[-1] != row.phase.value:
                phases.append(row.phase.value)

    unsubscribe = run_state.on_run_change(record)
    try:
        launch(_sleep_briefly, num_processes=2, cpu=True, quiet=True)
    finally:
        unsubscribe()

    assert shown == {0: ["starting", "running", "done"], 1: ["starting", "running", "done"]}
    assert panel.run_box.layout.display is None
    assert panel.run_title.value.startswith("<b>Last run</b> · 2 ranks · 2 done")
    assert panel.stop_button.disabled
    pids = {r.rank: r.pid for r in run_state.current_run().ranks}  # type: ignore[union-attr]
    for rank, row in panel.rank_rows.items():
        assert f"pid {pids[rank]}" in [label.value for label in row.box.children]


def test_stop_ends_a_real_run_and_leaves_no_process(make_panel: Callable[..., Panel]) -> None:
    panel = make_panel(Inventory(source="none"))
    clicked: list[float] = []

    def click_when_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            run = run_state.current_run()
            if run and not run.finished and all(r.phase == "running" for r in run.ranks):
                break
            time.sleep(0.05)
        assert not panel.stop_button.disabled
        clicked.append(time.monotonic())
        panel.stop_button.click()  # what a browser click ends in

    clicker = threading.Thread(target=click_when_running)
    clicker.start()
    with pytest.raises(KeyboardInterrupt, match="accelnb stopped the run") as info:
        launch(_sleep_long, num_processes=2, cpu=True, quiet=True)
    stopped_after = time.monotonic() - clicked[0]
    clicker.join()

    assert stopped_after < 20, f"the run took {stopped_after:.1f} s to stop"  # not the sleep, nor the stop grace
    # The cell's traceback ends at the launcher, not deep in the supervisor's wait loop.
    assert [entry.path.name for entry in info.traceback][-1] == "launcher.py"
    assert wait_until_no_workers(5.0) < 5.0 and worker_processes() == []
    assert panel.stop_button.disabled and panel.run_title.value.startswith("<b>Last run</b>")
    # Ranks the Stop button ended were stopped, not failed: their SIGTERM exit is ours.
    assert [row.phase.value for row in panel.rank_rows.values()] == ["stopped", "stopped"]


def test_stop_asks_code_that_checks_to_save_then_offers_stop_now(make_panel: Callable[..., Panel], tmp_path: Path,
                                                                  no_leftovers: None) -> None:
    from tests.stop_targets import train_until_stopped

    panel = make_panel(Inventory(source="none"))
    seen: list[tuple[str, bool, str]] = []

    def record(run: run_state.RunState | None) -> None:  # subscribed after the panel: sees what it shows
        seen.append((panel.stop_button.description, panel.stop_button.disabled, panel.run_title.value))

    def click_at_step_5(batch: Any) -> None:  # the launch's metric sink: rank 0 reported step 5
        if not clicked and any(step is not None and step >= 5 for step, _, _ in batch.records):
            clicked.append(True)
            threading.Thread(target=panel.stop_button.click).start()  # a browser click, from the comm thread

    clicked: list[bool] = []
    unsubscribe = run_state.on_run_change(record)
    try:
        result = launch(train_until_stopped, (str(tmp_path),), num_processes=2, cpu=True, quiet=True,
                        metric_sink=click_at_step_5)
    finally:
        unsubscribe()
    assert result.stopped_by == "a panel's Stop"
    pending = [entry for entry in seen if entry[0] == "Stop now"]
    assert pending and not pending[0][1]  # the second press is offered, enabled
    assert "stop requested (a panel's Stop): ranks are saving" in pending[0][2]
    assert panel.stop_button.disabled and panel.run_title.value.startswith("<b>Last run</b>")
    assert [row.phase.value for row in panel.rank_rows.values()] == ["done", "done"]


def test_every_run_gets_a_new_id() -> None:
    """Displays tell runs apart by id; id() of a freed run would repeat, ours only grows."""
    ids = []
    for _ in range(3):
        launch(_sleep_briefly, num_processes=2, cpu=True, quiet=True)
        ids.append(run_state.current_run().run_id)  # type: ignore[union-attr]
    assert ids == sorted(set(ids)) and len(ids) == 3


def test_outside_a_kernel_the_comm_hook_does_nothing() -> None:
    assert not kernel_messages.running_in_kernel()
    assert not kernel_messages.comm_messages_supported()
    assert kernel_messages.process_comm_messages() == 0


def test_show_panel_returns_a_panel() -> None:
    panel = show_panel(refresh_interval=None, inventory_source=lambda: synthetic_inventory(2))
    try:
        assert isinstance(panel, Panel) and sorted(panel.checkboxes) == [0, 1]
    finally:
        panel.close()
