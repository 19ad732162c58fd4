"""The notebook GPU picker: ``accelnb.Panel()``, a plain ipywidgets box (no custom JavaScript).

    >>> panel = Panel()       # the last expression of a cell: the notebook shows it
    >>> panel.checkboxes[0].value = True          # what ticking "GPU 0" does
    >>> current_selection()
    Selection(gpus=(0,), num_processes=None)

It shows every GPU of the machine (index as nvidia-smi numbers it, name, memory, utilisation,
short UUID, processes), refreshed every few seconds by a background thread that only re-reads the
inventory and sets widget values (ipykernel sends widget updates from any thread), so the kernel is
never blocked. Ticking boxes sets the notebook-wide selection (:mod:`accelnb.kernel.watched_state.selection`) that
``%%distributed`` and ``notebook_launcher`` use when they are not told which GPUs; a change made
elsewhere (another panel, the JupyterLab side panel, ``set_selection``) ticks the boxes here. With
no GPU, a CPU-ranks control takes the table's place. A synthetic inventory is flagged in a banner.

While a run goes, each rank's state (starting, running, done, failed, stopped) is shown, with a
Stop button and a Stacks button. A click reaches the kernel while the cell is still blocked in the
launch because the panel registers :func:`accelnb.notebook.kernel_messages.process_comm_messages`
as a launcher wait hook. Stacks shows every rank's current Python stack in the panel and stops
nothing: the click only starts a thread that asks for the dumps (``RunState.collect_stacks``) and
returns, since the launching thread that runs the click's handler is the one that reads them off
the ranks' pipes; between cells of a session, the thread reads them itself.

``close()`` ends the refresh thread and the subscriptions. accelnb itself holds a panel only
weakly (its selection and run subscriptions, the refresh thread, the wait hook), so a panel
nothing else holds is collected, and collecting it ends all of those as ``close()`` would.
ipywidgets 8 keeps every open widget in a registry until it is closed, so there that happens
after ``close()`` or ``Widget.close_all()``; ipywidgets builds that hold widgets weakly collect an
unreferenced panel without either.
"""

from __future__ import annotations

import html
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets

from accelnb.kernel.display.byte_sizes import gpu_memory
from accelnb.kernel.planning.inventory import GpuInfo, Inventory, read_inventory
from accelnb.kernel.run import run_state
from accelnb.kernel.run.group.stop_presses import PANEL_STOP
from accelnb.kernel.run.live_stacks import DEFAULT_WAIT_S, StackDump
from accelnb.kernel.watched_state.selection import (
    Selection,
    clear_selection,
    current_selection,
    on_selection_change,
    set_selection,
)
from accelnb.notebook import kernel_messages

DEFAULT_REFRESH_S = 3.0
PHASE_COLORS = {"starting": "#8a6d00", "running": "#1a6fb5", "done": "#2e7d32",
                "failed": "#c62828", "stopped": "#6d4c41"}
COLUMNS = ("GPU", "Name", "Memory used / total", "Util", "UUID", "Processes")

_log = logging.getLogger(__name__)


@dataclass
class GpuRow:
    """The widgets of one GPU's line in the table."""

    checkbox: widgets.Checkbox
    name: widgets.Label
    memory_bar: widgets.FloatProgress
    memory: widgets.Label
    memory_cell: widgets.HBox  # the bar and the label side by side
    utilization: widgets.Label
    uuid: widgets.Label
    processes: widgets.Label

    @property
    def cells(self) -> list[widgets.Widget]:
        return [self.checkbox, self.name, self.memory_cell, self.utilization, self.uuid, self.processes]


@dataclass
class RankRow:
    """The widgets of one rank's line in the run section."""

    box: widgets.HBox
    phase: widgets.Label
    detail: widgets.Label


class Panel(widgets.VBox):
    """Pick the GPUs (or CPU ranks) of the next launches, and watch or stop the run in progress.

    Args:
        refresh_interval: seconds between inventory reads for the live memory and utilisation
            columns; ``None`` reads it once (call :meth:`refresh` to read it again).
        inventory_source: where the GPU list comes from; default :func:`read_inventory`, which
            honours ``ACCELNB_SYNTHETIC_GPUS`` and ``set_inventory_source``.
    """

    def __init__(self, refresh_interval: float | None = DEFAULT_REFRESH_S,
                 inventory_source: Callable[[], Inventory] | None = None, **kwargs: Any) -> None:
        if refresh_interval is not None and refresh_interval <= 0:
            raise ValueError(f"refresh_interval must be a positive number of seconds or None, "
                             f"got {refresh_interval!r}.")
        self._read = inventory_source or read_inventory
        self._lock = threading.RLock()  # the refresh thread and the kernel both update widgets
        self._syncing = False  # True while the boxes are set from the selection, not by a user
        self._inventory = Inventory()
        self._gpu_indices: tuple[int, ...] = ()
        self.checkboxes: dict[int, widgets.Checkbox] = {}
        self.gpu_rows: dict[int, GpuRow] = {}
        self.rank_rows: dict[int, RankRow] = {}
        self._shown_run_id: int | None = None

        self.banner = widgets.HTML()
        self.gpu_table = widgets.GridBox(layout=widgets.Layout(
            grid_template_columns="repeat(6, auto)", grid_gap="2px 14px", align_items="center"))
        self.use_cpu = widgets.Checkbox(description="Use CPU ranks", indent=False,
                                        layout=widgets.Layout(width="auto"))
        self.cpu_ranks = widgets.BoundedIntText(value=2, min=1, max=max(64, os.cpu_count() or 1),
                                                description="CPU ranks",
                                                layout=widgets.Layout(width="170px"))
        self.cpu_box = widgets.HBox([self.use_cpu, self.cpu_ranks])
        self.magic_line = widgets.HTML()
        self.refreshed = widgets.Label(style={"text_color": "#777"})
        self.run_title = widgets.HTML()
        self.rank_box = widgets.VBox()
        self.stop_button = widgets.Button(description="Stop run", icon="stop", button_style="danger",
                                          disabled=True, tooltip="Stop every rank of the run")
        self.stop_hint = widgets.HTML()
        self.stacks_button = widgets.Button(description="Stacks", icon="align-left", disabled=True,
                                            tooltip="Show every rank's current Python stack; nothing stops")
        self.stacks_view = widgets.HTML()
        self._reading_stacks = False
        self.run_box = widgets.VBox([self.run_title, self.rank_box,
                                     widgets.HBox([self.stop_button, self.stacks_button, self.stop_hint]),
                                     self.stacks_view],
                                    layout=widgets.Layout(display="none"))
        super().__init__([self.banner, self.gpu_table, self.cpu_box, self.magic_line, self.refreshed,
                          self.run_box], **kwargs)

        self.use_cpu.observe(self._on_cpu_change, names="value")
        self.cpu_ranks.observe(self._on_cpu_change, names="value")
        self.stop_button.on_click(self._on_stop_click)
        self.stacks_button.on_click(self._on_stacks_click)
        self.refresh()
        self._on_selection(current_selection())
        self._on_run(run_state.current_run())
        # Everything below refers to the panel weakly; the finalizer ends it all when the panel
        # is closed or collected, whichever comes first.
        stop_refreshing = threading.Event()
        releases = [on_selection_change(_weakly(self, Panel._on_selection)),
                    run_state.on_run_change(_weakly(self, Panel._on_run)),
                    kernel_messages.let_comm_messages_through_runs()]
        self._release = weakref.finalize(self, _release_all, stop_refreshing, releases)
        if refresh_interval is not None:
            threading.Thread(target=_refresh_loop, args=(weakref.ref(self), stop_refreshing, refresh_interval),
                             name="accelnb-panel-refresh", daemon=True).start()

    # ── the GPU table ───────────────────────────────────────────────────────────────────────
    def refresh(self) -> None:
        """Read the inventory again and show it (the refresh thread calls this)."""
        try:
            inventory = self._read()
        except Exception as error:  # a failing NVML read must not kill the panel
            self.refreshed.value = f"inventory read failed at {time.strftime('%H:%M:%S')}: {error}"
            return
        with self._lock:
            self._inventory = inventory
            indices = tuple(g.index for g in inventory.gpus)
            if indices != self._gpu_indices:
                self._build_table(inventory)
            for gpu in inventory.gpus:
                self._show_gpu(self.gpu_rows[gpu.index], gpu)
            self.banner.value = _banner(inventory)
            has_gpus = bool(inventory.visible)
            self.gpu_table.layout.display = None if inventory.gpus else "none"
            self.cpu_box.layout.display = "none" if has_gpus else None
            self.refreshed.value = f"live · updated {time.strftime('%H:%M:%S')}"

    def _build_table(self, inventory: Inventory) -> None:
        _close_tree(list(self.gpu_table.children))
        header = [widgets.Label(title, style={"font_weight": "bold"}) for title in COLUMNS]
        self.gpu_rows = {gpu.index: _new_row(gpu) for gpu in inventory.gpus}
        self.checkboxes = {index: row.checkbox for index, row in self.gpu_rows.items()}
        for box in self.checkboxes.values():
            box.observe(self._on_box_change, names="value")
        self.gpu_table.children = header + [cell for row in self.gpu_rows.values() for cell in row.cells]
        self._gpu_indices = tuple(self.gpu_rows)
        self._show_selection(current_selection())

    def _show_gpu(self, row: GpuRow, gpu: GpuInfo) -> None:
        row.memory_bar.max = max(gpu.memory_total, 1)
        row.memory_bar.value = min(gpu.memory_used, row.memory_bar.max)
        row.memory.value = gpu_memory(gpu.memory_used, gpu.memory_total)
        row.utilization.value = "n/a" if gpu.utilization is None else f"{gpu.utilization} %"
        run = run_state.current_run()
        ours = {r.pid for r in run.ranks} if run is not None and not run.finished else set()
        in_run = sum(1 for p in gpu.processes if p.pid in ours)
        row.processes.value = f"{len(gpu.processes)}" + (f" ({in_run} this run)" if in_run else "")

    # ── the selection ───────────────────────────────────────────────────────────────────────
    def _on_box_change(self, _change: dict[str, Any]) -> None:
        with self._lock:
            if self._syncing:
                return
            ticked = {index for index, box in self.checkboxes.items() if box.value}
            chosen = current_selection()
            kept = [i for i in (chosen.gpus or ()) if i in ticked] if chosen else []
            order = kept + sorted(ticked - set(kept))  # ranks follow the order GPUs were picked in
            if order:
                set_selection(gpus=order)
            else:
                clear_selection()

    def _on_cpu_change(self, _change: dict[str, Any]) -> None:
        with self._lock:
            if self._syncing:
                return
            if self.use_cpu.value:
                set_selection(num_processes=int(self.cpu_ranks.value))
            elif (chosen := current_selection()) is not None and chosen.num_processes:
                clear_selection()

    def _on_selection(self, chosen: Selection | None) -> None:
        with self._lock:
            self._show_selection(chosen)

    def _show_selection(self, chosen: Selection | None) -> None:
        self._syncing = True
        try:
            picked = set(chosen.gpus or ()) if chosen else set()
            for index, box in self.checkboxes.items():
                box.value = index in picked
            self.use_cpu.value = bool(chosen and chosen.num_processes)
            if chosen and chosen.num_processes:
                self.cpu_ranks.value = chosen.num_processes
        finally:
            self._syncing = False
        line = (chosen or Selection()).as_magic_line()
        self.magic_line.value = f"Next launch: <code>{line}</code>" + _selection_note(chosen, self._inventory)

    # ── the run ─────────────────────────────────────────────────────────────────────────────
    def _on_run(self, run: run_state.RunState | None) -> None:
        with self._lock:
            if run is None:
                self.run_box.layout.display = "none"
                return
            if run.run_id != self._shown_run_id:
                for row in self.rank_rows.values():
                    row.box.close()
                self.rank_rows = {r.rank: _new_rank_row(r) for r in run.ranks}
                self.rank_box.children = [row.box for row in self.rank_rows.values()]
                self._shown_run_id = run.run_id
                self.stop_button.description = "Stop run"
            for state in run.ranks:
                row = self.rank_rows[state.rank]
                row.phase.value = state.phase
                row.phase.style.text_color = PHASE_COLORS.get(state.phase, "#000")
                row.detail.value = state.detail
            self.run_box.layout.display = None
            self.run_title.value = _run_title(run)
            stopping = run.stop_pressed
            self.stop_button.disabled = run.finished or stopping
            self.stop_button.description = "Stopping…" if stopping and not run.finished else "Stop run"
            if run.stop_pending is not None and not run.finished and not stopping:  # the ranks are saving
                self.stop_button.description = "Stop now"
            self.stacks_button.disabled = run.finished or run.collect_stacks is None or self._reading_stacks
            unsupported = (kernel_messages.running_in_kernel()
                           and not kernel_messages.comm_messages_supported())
            self.stop_hint.value = ("<small>This kernel cannot take a click while the cell runs: use "
                                    "Kernel ▸ Interrupt.</small>" if unsupported and not run.finished else "")

    def _on_stop_click(self, _button: widgets.Button) -> None:
        if run_state.request_stop(PANEL_STOP):
            self.stop_button.disabled = True
            self.stop_button.description = "Stopping…"

    def _on_stacks_click(self, _button: widgets.Button) -> None:
        run = run_state.current_run()
        if run is None or run.finished or run.collect_stacks is None:
            self.stacks_view.value = "<small>No run in progress: there are no stacks to show.</small>"
            return
        with self._lock:
            self._reading_stacks = True
            self.stacks_button.disabled = True
            self.stacks_button.description = "Reading stacks…"
        threading.Thread(target=_read_stacks, args=(weakref.ref(self), run.collect_stacks),
                         name="accelnb-panel-stacks", daemon=True).start()

    def _show_stacks(self, text: str) -> None:
        with self._lock:
            self._reading_stacks = False
            self.stacks_view.value = (f"<b>Stacks at {time.strftime('%H:%M:%S')}</b> <small>(nothing was "
                                      f"stopped)</small><pre style='max-height:24em;overflow:auto;"
                                      f"font-size:90%'>{html.escape(text)}</pre>")
            self.stacks_button.description = "Stacks"
            run = run_state.current_run()
            self.stacks_button.disabled = run is None or run.finished

    # ── lifetime ────────────────────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Stop refreshing, stop listening, and close every widget of the panel."""
        release = getattr(self, "_release", None)  # absent when __init__ failed before it
        if release is not None:
            release()
        _close_tree(list(self.children))
        super().close()


def show_panel(**kwargs: Any) -> Panel:
    """A new :class:`Panel`, for ``%distributed panel``: return it from the magic to display it."""
    return Panel(**kwargs)


def _weakly(panel: Panel, method: Callable[[Panel, Any], None]) -> Callable[[Any], None]:
    """A listener that calls ``method`` on ``panel`` while the panel lives, holding it weakly."""
    panel_ref = weakref.ref(panel)

    def call(value: Any) -> None:
        alive = panel_ref()
        if alive is not None:
            method(alive, value)

    return call


def _release_all(stop_refreshing: threading.Event, releases: list[Callable[[], None]]) -> None:
    """End a panel's refresh thread and subscriptions (its finalizer: runs once)."""
    stop_refreshing.set()
    for release in releases:
        release()


def _refresh_loop(panel_ref: weakref.ref[Panel], stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        panel = panel_ref()
        if panel is None:
            return
        try:
            panel.refresh()
        except Exception:  # e.g. the kernel is shutting down; the next round may do better
            _log.debug("accelnb: panel refresh failed", exc_info=True)
        del panel  # hold no reference while sleeping


def _read_stacks(panel_ref: weakref.ref[Panel], collect: Callable[[float], dict[int, str]]) -> None:
    """Ask for the dumps off the kernel's main thread (which serves them), then show them."""
    try:
        text = str(StackDump(collect(DEFAULT_WAIT_S)))
    except Exception as error:  # the run ended under us, say; the panel must live on
        text = f"The stacks could not be read: {type(error).__name__}: {error}"
    panel = panel_ref()
    if panel is not None:
        panel._show_stacks(text)


def _new_row(gpu: GpuInfo) -> GpuRow:
    checkbox = widgets.Checkbox(description=f"GPU {gpu.index}", indent=False, disabled=not gpu.visible,
                                layout=widgets.Layout(width="auto"))
    if not gpu.visible:
        checkbox.tooltip = "Hidden from this kernel by its CUDA_VISIBLE_DEVICES"
    bare = gpu.uuid.removeprefix("GPU-")
    short = f"{bare[:8]}…{bare[-4:]}" if len(bare) > 12 else bare
    bar = widgets.FloatProgress(min=0, max=max(gpu.memory_total, 1), bar_style="info",
                                layout=widgets.Layout(width="90px"))
    memory = widgets.Label()
    return GpuRow(
        checkbox=checkbox,
        name=widgets.Label(gpu.name),
        memory_bar=bar,
        memory=memory,
        memory_cell=widgets.HBox([bar, memory], layout=widgets.Layout(align_items="center")),
        utilization=widgets.Label(),
        uuid=widgets.Label(f"GPU-{short}", tooltip=gpu.uuid),
        processes=widgets.Label(),
    )


def _new_rank_row(state: run_state.RankState) -> RankRow:
    pid = f"pid {state.pid}" if state.pid else ""
    phase = widgets.Label(state.phase, style={"font_weight": "bold"}, layout=widgets.Layout(width="70px"))
    detail = widgets.Label(style={"text_color": "#777"})
    labels = [widgets.Label(f"rank {state.rank}", layout=widgets.Layout(width="60px")),
              widgets.Label(state.device, layout=widgets.Layout(width="150px")),
              widgets.Label(pid, layout=widgets.Layout(width="90px")), phase, detail]
    return RankRow(widgets.HBox(labels), phase, detail)


def _banner(inventory: Inventory) -> str:
    if inventory.synthetic:
        return ("<div style='background:#fff3cd;border:1px solid #e0c060;padding:4px 8px'>"
                "<b>Synthetic GPUs</b>: this inventory is made up (ACCELNB_SYNTHETIC_GPUS or "
                "set_inventory_source); there is no such hardware, and ranks run on the CPU.</div>")
    if not inventory.visible:
        why = f" ({inventory.note})" if inventory.note else ""
        return ("<div style='background:#eef3f8;border:1px solid #9fb6cc;padding:4px 8px'>"
                f"<b>No GPU</b> is visible to this kernel{why}. Launches run CPU ranks on gloo: "
                "choose how many below.</div>")
    return ""


def _selection_note(chosen: Selection | None, inventory: Inventory) -> str:
    if chosen is not None and (chosen.gpus or chosen.num_processes):
        return ""
    if inventory.visible:
        return " <small>(nothing picked: every visible GPU)</small>"
    return " <small>(nothing picked: tick “Use CPU ranks”, or pass num_processes=)</small>"


def _run_title(run: run_state.RunState) -> str:
    phases = [r.phase for r in run.ranks]
    counts = ", ".join(f"{phases.count(p)} {p}" for p in dict.fromkeys(phases))
    when = "Last run" if run.finished else "Run in progress"
    saving = ""
    if run.stop_pending and not run.finished:
        saving = f" · stop requested ({run.stop_pending}): ranks are saving"
    return f"<b>{when}</b> · {len(phases)} ranks · {counts}{saving}"


def _close_tree(children: list[Any]) -> None:
    for child in children:
        _close_tree(list(getattr(child, "children", ())))
        child.close()
