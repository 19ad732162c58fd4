"""The kernel side of JupyterLab's "GPUs" panel: the ``accelnb.gpus`` comm target.

``%load_ext accelnb`` calls :func:`register_comm_target`; from then on the panel (the
``accelnb-labextension`` JupyterLab extension) can open a comm to this kernel, show its GPUs,
write the notebook-wide selection (:mod:`accelnb.kernel.watched_state.selection`) and follow the run in progress
(:mod:`accelnb.kernel.run.run_state`). This module only translates messages; it decides nothing.

    >>> register_comm_target(get_ipython())      # what %load_ext accelnb does
    >>> is_registered()
    True

The protocol (every message is the ``data`` of a Jupyter comm message, a JSON object)::

    panel                                         kernel
      comm_open  target "accelnb.gpus", {}  ──►
                                            ◄──  {"type": "state", ...}          at once
      {"type": "select", "gpus": [0, 2]}    ──►  set_selection(gpus=[0, 2])
      {"type": "select", "num_processes": 2} ─►  set_selection(num_processes=2)
      {"type": "select", "gpus": []}        ──►  clear_selection()  (so does a select with neither)
      {"type": "refresh"}                   ──►  read the inventory again, answer with a state
      {"type": "watch", "on": true}         ──►  read it every WATCH_INTERVAL_S while the panel is
                                                 shown (its utilisation history); false: stop
      {"type": "stop"}                      ──►  run_state.request_stop()
      {"type": "stacks"}                    ──►  every rank's stack, read on a thread; nothing stops
                                            ◄──  {"type": "stacks", "taken_at": "HH:MM:SS",
                                                  "ranks": [{"rank", "stack"}], "error": str}
                                            ◄──  {"type": "state", ...}          after every
                                                 selection change and run change, whoever made it
                                            ◄──  {"type": "error", "message": "..."}  a request
                                                 was refused (unknown GPU, bad number...), then a
                                                 state so the panel shows what really holds
      comm_close                            ──►  unsubscribe this panel

A state message::

    {"type": "state",
     "inventory": {"gpus": [{"index", "name", "uuid", "pci_bus_id", "memory_total",
                             "memory_used", "utilization", "power_w", "visible",   # bytes, percent
                             "processes": [{"pid", "memory_used", "name", "user", "ours"}],
                             "history": [[seconds_ago, percent]],   # the last minute, oldest first
                             "busy": str}],   # why a selected GPU is taken by others, or ""
                   "synthetic": bool, "source": "nvml" | "none" | "synthetic", "note": str},
     "selection": {"gpus": [int] | null, "num_processes": int | null, "magic_line": str},
     "run": null | {"run_id": int, "finished": bool, "stop_pending": null | str,
                    "ranks": [{"rank", "device", "phase", "pid", "detail", "progress",
                               "figures"?: {"steps", "steps_per_s", "gpu_utilization",
                                            "gpu_memory_used", "gpu_memory_total"}}]},
     "sweep": null | {"sweep_id": int, "finished": bool,
                      "trials": [{"index", "label", "gpus": [int], "state"}]}}

During a sweep (``accelnb.sweep``) several launches run at once: ``run`` is the latest to start,
and ``sweep`` says which trial each GPU runs (a trial's ``gpus`` while its ``state`` is
``"running"``); it is sent when a trial starts or ends.

A rank's ``figures`` are absent until its first step. GPU rows are made by
:func:`accelnb.notebook.gpu_watch.gpu_rows`: processes named from ``/proc``, this kernel's own
(its ranks) marked ``ours`` and the run's ranks named "rank N", and ``busy`` set only for a
selected GPU.

Each open comm is one panel with its own subscriptions; closing the comm ends them. The
inventory is read when a panel connects, on ``refresh``, when a run finishes and, while the
panel is shown (``watch``), every :data:`WATCH_INTERVAL_S`; not on every run change (NVML is not
free and runs publish often), and never on the thread that asked: a finished run is published
from inside the launch (``WorkerGroup.close``), and a comm message may be handled inside a
launch's wait loop (:mod:`accelnb.notebook.kernel_messages`), so an NVML init and shutdown there
would delay every launch while a panel is open. Each panel has an :class:`InventoryReads`: one
background thread that reads when asked and then sends a state; until its first read, the panel
is sent nothing. Each read adds to the kernel's
:class:`~accelnb.notebook.gpu_watch.UtilizationHistory`, which every panel shows. Run changes
arrive from the launcher's threads: ipykernel sends comm messages from any thread through its
IOPub thread, so states reach the panel while a launch blocks the cell. Messages *from* the
panel get through a launch that blocks the cell too: while a panel is connected,
:func:`accelnb.notebook.kernel_messages.let_comm_messages_through_runs` dispatches them from the
launch's wait loop (the panel's Stop button still also interrupts the kernel, which works in
kernels where that hook cannot). So a ``stacks`` request is answered during the run; it is
served on a thread of its own, because the launch's thread, which handles the message, is the
one that reads the dumps off the ranks' pipes.

GPU choices are checked by the planner's own rules (:func:`accelnb.kernel.planning.rank_plan.plan`), so the
panel's refusals read exactly as a launch's would.

If the target is not registered (accelnb not loaded), ipykernel closes the panel's comm at
once. The panel avoids that by asking first with a silent ``user_expressions`` probe that
calls :func:`is_registered`.

Module-level state: ``_panels``, the side panels connected to this kernel, and ``_history``, the
GPUs' utilization over time, which every panel of the kernel shows alike (one machine, one history).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import comm

from accelnb.kernel.planning.inventory import Inventory, InventorySource, read_inventory
from accelnb.kernel.planning.rank_plan import plan
from accelnb.kernel.run import run_state
from accelnb.kernel.run.group.stop_presses import PANEL_STOP
from accelnb.kernel.run.live_stacks import DEFAULT_WAIT_S, NO_DUMP
from accelnb.kernel.sweep import sweep_state
from accelnb.kernel.watched_state import selection
from accelnb.notebook.gpu_watch import UtilizationHistory, gpu_rows, kernel_pids
from accelnb.notebook.kernel_messages import let_comm_messages_through_runs

if TYPE_CHECKING:
    from comm.base_comm import BaseComm
    from IPython.core.interactiveshell import InteractiveShell

TARGET_NAME = "accelnb.gpus"

FIRST_READ_WAIT_S = 10.0  # how long a selection waits for a panel's first inventory read
WATCH_INTERVAL_S = 2.0  # inventory reads while a panel is shown: 30 points a minute of history

_log = logging.getLogger(__name__)
_panels: list[PanelConnection] = []
# One history for the kernel, not one per panel: a panel opened again (a page reload) shows the
# last minute at once.
_history = UtilizationHistory()


def register_comm_target(shell: InteractiveShell | None = None,
                         inventory_source: InventorySource = read_inventory) -> None:
    """Let JupyterLab's GPUs panel connect to this kernel (called by ``%load_ext accelnb``).

    Calling it again is harmless. ``shell`` is accepted for the extension loader's sake; the
    comm manager is the kernel's, found through the ``comm`` package. ``inventory_source`` is
    where panels read the GPUs from (default :func:`read_inventory`).
    """
    def open_panel(panel_comm: BaseComm, open_msg: dict[str, Any]) -> None:
        PanelConnection(panel_comm, inventory_source).start()

    comm.get_comm_manager().register_target(TARGET_NAME, open_panel)


def unregister_comm_target(shell: InteractiveShell | None = None) -> None:
    """Undo :func:`register_comm_target` and close the open panels' comms (``%unload_ext accelnb``)."""
    manager = comm.get_comm_manager()
    if TARGET_NAME in manager.targets:
        manager.unregister_target(TARGET_NAME, manager.targets[TARGET_NAME])
    for panel in list(_panels):
        panel.close()


def is_registered() -> bool:
    """Whether the panel can connect, i.e. the comm target is registered in this kernel."""
    return TARGET_NAME in comm.get_comm_manager().targets


class InventoryReads:
    """Reads the inventory on a background thread, never on the thread that asks.

    :meth:`request` returns at once; the thread reads (once for any number of requests made
    while it was reading, then again if more came) and hands each result to ``on_read``
    together with the error text of a failed read ("" when it worked). :meth:`repeat` has it read
    every ``interval_s`` as well, until ``repeat(None)`` or :meth:`close`. The thread exists only
    while there is reading to do.
    """

    def __init__(self, source: InventorySource, on_read: Callable[[Inventory, str], None]) -> None:
        self._source = source
        self._on_read = on_read
        self._wake = threading.Condition()
        self._wanted = False
        self._interval_s: float | None = None
        self._closed = False
        self._reader: threading.Thread | None = None
        self.first_read = threading.Event()

    def request(self) -> None:
        with self._wake:
            self._wanted = True
            self._wake.notify_all()
            self._ensure_reader()

    def repeat(self, interval_s: float | None) -> None:
        """Read every ``interval_s`` seconds from now on (starting now); ``None``: only on request."""
        with self._wake:
            self._interval_s = interval_s
            if interval_s is not None and not self._closed:
                self._wanted = True
                self._ensure_reader()
            self._wake.notify_all()

    def close(self) -> None:
        """No more reads; a read under way still hands its result over."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()

    def _ensure_reader(self) -> None:
        if self._reader is None and not self._closed:
            self._reader = threading.Thread(target=self._read_while_wanted, name="accelnb-lab-inventory",
                                            daemon=True)
            self._reader.start()

    def _next_read_due(self) -> bool:
        """Wait for the next read (a request, or the interval); False: no more reading to do."""
        with self._wake:
            interval = self._interval_s
            if not self._wanted and interval is not None and not self._closed:
                self._wake.wait_for(lambda: self._wanted or self._closed or self._interval_s != interval,
                                    timeout=interval)
                self._wanted = self._wanted or self._interval_s == interval  # the interval passed
            if self._closed or not self._wanted:
                self._reader = None
                return False
            self._wanted = False
            return True

    def _read_while_wanted(self) -> None:
        while self._next_read_due():
            try:
                inventory, error = self._source(), ""
            except Exception as failure:  # a bad ACCELNB_SYNTHETIC_GPUS, a broken driver
                inventory, error = Inventory(source="none", note=str(failure)), str(failure)
            try:
                self._on_read(inventory, error)
            except Exception:  # a panel that cannot take it must not end the reads of the others
                _log.warning("accelnb: the GPUs panel could not take an inventory", exc_info=True)
            self.first_read.set()


class PanelConnection:
    """One panel: its comm, its subscriptions, and the inventory it was last shown."""

    def __init__(self, panel_comm: BaseComm, inventory_source: InventorySource = read_inventory) -> None:
        self._comm = panel_comm
        self._inventory = Inventory()
        self._inventory_error = ""
        self._inventory_known = False  # set by the first read
        self._inventory_run_id: int | None = None  # the finished run we last re-read after
        self._reads = InventoryReads(inventory_source, self._on_inventory)
        self._unsubscribe: list[Callable[[], None]] = []
        self._closed = False
        # States come from the shell thread (panel requests), launcher threads (run changes)
        # and the inventory reader; one at a time keeps them in order.
        self._send_lock = threading.Lock()

    def start(self) -> None:
        self._comm.on_msg(self._on_msg)
        self._comm.on_close(self._on_close)
        self._unsubscribe = [
            selection.on_selection_change(lambda _selection: self.send_state()),
            run_state.on_run_change(self._on_run_change),
            sweep_state.on_sweep_change(lambda _sweep: self.send_state()),
            let_comm_messages_through_runs(),
        ]
        _panels.append(self)
        self._reads.request()  # the first state goes out once the GPUs are known

    def close(self) -> None:
        self._end()
        try:
            self._comm.close()
        except Exception:  # the kernel is shutting down; nothing to tell
            _log.debug("closing the accelnb.gpus comm failed", exc_info=True)

    # -- messages from the panel -------------------------------------------------------------

    def _on_msg(self, msg: dict[str, Any]) -> None:
        data = msg.get("content", {}).get("data") or {}
        kind = data.get("type")
        try:
            if kind == "select":
                self._select(data)
            elif kind == "refresh":
                self._reads.request()  # a state follows the read
            elif kind == "watch":
                self._reads.repeat(WATCH_INTERVAL_S if data.get("on") else None)
            elif kind == "stop":
                run_state.request_stop(PANEL_STOP)
                self.send_state()
            elif kind == "stacks":
                threading.Thread(target=self._send_stacks, name="accelnb-lab-stacks", daemon=True).start()
            else:
                raise ValueError(f"Unknown panel message type {kind!r}; expected select, refresh, watch, "
                                 "stop or stacks.")
        except ValueError as error:  # LaunchConfigError included: the planner's and selection's words
            self._send({"type": "error", "message": str(error)})
            self.send_state()

    def _select(self, data: dict[str, Any]) -> None:
        gpus = data.get("gpus")
        count = data.get("num_processes")
        if gpus:
            gpus = self._planned_gpus(gpus)
        if gpus or count is not None:
            selection.set_selection(gpus=gpus or None, num_processes=count)
        else:
            selection.clear_selection()

    def _planned_gpus(self, gpus: Any) -> list[int]:
        """The GPU indices the panel sent, in order, if a launch could plan with every one of them."""
        if not isinstance(gpus, list) or not all(_is_int(i) for i in gpus):
            raise ValueError(f"gpus must be a list of GPU indices, got {gpus!r}.")
        # A select before the first state is rare (the panel lists GPUs from a state); wait for
        # the read rather than judge against an empty inventory.
        self._reads.first_read.wait(FIRST_READ_WAIT_S)
        planned = plan(gpus=gpus, inventory=self._inventory)
        return [rank.gpu.index for rank in planned.ranks if rank.gpu is not None]

    def _send_stacks(self) -> None:
        run = run_state.current_run()
        message: dict[str, Any] = {"type": "stacks", "taken_at": time.strftime("%H:%M:%S"), "ranks": [],
                                   "error": ""}
        if run is None or run.finished or run.collect_stacks is None:
            message["error"] = "No run in progress: there are no stacks to show."
        else:
            try:
                dumps = run.collect_stacks(DEFAULT_WAIT_S)
                message["ranks"] = [{"rank": rank, "stack": text or NO_DUMP} for rank, text in sorted(dumps.items())]
            except Exception as error:  # the run ended under us, say
                message["error"] = f"The stacks could not be read: {type(error).__name__}: {error}"
        self._send(message)

    def _on_close(self, msg: dict[str, Any]) -> None:
        self._end()

    def _end(self) -> None:
        self._closed = True
        self._reads.close()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        if self in _panels:
            _panels.remove(self)

    # -- state to the panel ------------------------------------------------------------------

    def _on_run_change(self, run: run_state.RunState | None) -> None:
        if run is not None and run.finished and self._inventory_run_id != run.run_id:
            # Memory and utilisation moved during the run; show them as they are now (read in
            # the background: this is the launch's own thread).
            self._inventory_run_id = run.run_id
            self._reads.request()
        self.send_state()

    def _on_inventory(self, inventory: Inventory, error: str) -> None:
        _history.add(inventory, time.monotonic())
        self._inventory, self._inventory_error = inventory, error
        self._inventory_known = True
        self.send_state()

    def send_state(self) -> None:
        if not self._inventory_known:
            return  # the first read sends the first state, with the GPUs in it
        if self._inventory_error:
            self._send({"type": "error", "message": self._inventory_error})
        self._send(state_message(self._inventory, selection.current_selection(), run_state.current_run(),
                                 sweep_state.current_sweep(), _history))

    def _send(self, data: dict[str, Any]) -> None:
        with self._send_lock:
            if self._closed:
                return
            try:
                self._comm.send(data)
            except Exception:  # a display must never break a launch or a selection
                _log.warning("could not send to the GPUs panel", exc_info=True)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not GPU 1


def state_message(
    inventory: Inventory, chosen: selection.Selection | None, run: run_state.RunState | None,
    sweep: sweep_state.SweepState | None = None, history: UtilizationHistory | None = None,
) -> dict[str, Any]:
    """The ``state`` message for this inventory, selection, run and sweep (plain JSON types)."""
    chosen = chosen or selection.Selection()
    held = any(gpu.processes for gpu in inventory.gpus)  # whose processes they are, only if there are any
    ranks = {rank.pid: f"rank {rank.rank}" for rank in run.ranks if rank.pid is not None} if run else {}
    return {
        "type": "state",
        "inventory": {
            "gpus": gpu_rows(inventory, history or UtilizationHistory(), kernel_pids() if held else set(),
                             chosen.gpus, time.monotonic(), ranks),
            "synthetic": inventory.synthetic,
            "source": inventory.source,
            "note": inventory.note,
        },
        "selection": {
            "gpus": list(chosen.gpus) if chosen.gpus is not None else None,
            "num_processes": chosen.num_processes,
            "magic_line": chosen.as_magic_line(),
        },
        "run": None if run is None else {
            "run_id": run.run_id,
            "finished": run.finished,
            "stop_pending": run.stop_pending,  # the ranks are saving after a Stop: the next press stops now
            "ranks": [_rank_message(rank) for rank in list(run.ranks)],
        },
        "sweep": None if sweep is None else {
            "sweep_id": sweep.sweep_id,
            "finished": sweep.finished,
            "trials": [{"index": row.index, "label": row.label, "gpus": list(row.gpus), "state": row.state}
                       for row in sweep.trials],
        },
    }


def _rank_message(rank: run_state.RankState) -> dict[str, Any]:
    """A rank of the run message; ``figures`` only once it has some (a panel of an older
    extension, or a rank before its first step, reads the progress line alone)."""
    message = dataclasses.asdict(rank)
    if message["figures"] is None:
        del message["figures"]
    return message
