"""The GPUs side panel in a real JupyterLab and a real Chromium, with 4 synthetic GPUs.

Run with ``pytest -m browser tests/browser``. Screenshots: ``test-artifacts/gpu-panel*.png``.
"""

from __future__ import annotations

import re

import pytest
from lab_page import LabPage, assert_panel_fits, gpu_checkbox, save_picture
from playwright.sync_api import Page, expect

from tests.browser.conftest import ARTIFACTS, PICTURES, SYNTHETIC_GPUS, LabServer

pytestmark = pytest.mark.browser

LOAD_ACCELNB = "%load_ext accelnb"


def test_panel_lists_gpus_and_selects_for_the_notebook(page: Page, lab_server: LabServer) -> None:
    path = lab_server.create_notebook("panel.ipynb", [
        LOAD_ACCELNB,
        "from accelnb.kernel.watched_state.selection import current_selection; print(current_selection())",
    ])
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "panel"))
    panel = lab.open_gpu_panel()

    # Before accelnb is loaded the panel says what to do, and the toolbar shows nothing...
    expect(panel.locator(".accelnb-GpuPanel-status")).to_contain_text("%load_ext accelnb")
    expect(lab.toolbar_item()).to_be_hidden()
    # ...and both fill in once the user does it, without a reload.
    lab.run_cell(0)
    expect(panel.locator("tr[data-gpu]")).to_have_count(SYNTHETIC_GPUS)
    expect(lab.toolbar_item()).to_have_text(f"all {SYNTHETIC_GPUS} GPUs")
    expect(panel.locator(".accelnb-GpuPanel-synthetic")).to_contain_text("no real GPUs")
    expect(panel.locator(".accelnb-GpuPanel-magic")).to_have_text("%%distributed")
    expect(panel.locator('tr[data-gpu="1"] .accelnb-GpuPanel-memory')).to_have_text("3.0 / 80 GiB")
    expect(panel.locator('tr[data-gpu="1"] .accelnb-GpuPanel-util')).to_have_text("13%")

    gpu_checkbox(panel, 1).check()
    gpu_checkbox(panel, 3).check()
    expect(panel.locator(".accelnb-GpuPanel-magic")).to_have_text("%%distributed --gpus 1,3")
    expect(lab.toolbar_item()).to_have_text("GPUs 1,3")
    expect(gpu_checkbox(panel, 1)).to_be_checked()
    expect(gpu_checkbox(panel, 0)).not_to_be_checked()

    lab.run_cell(1)
    expect(lab.output(1)).to_contain_text("gpus=(1, 3)")
    page.screenshot(path=str(ARTIFACTS / "gpu-panel.png"))


def test_without_gpus_the_panel_asks_for_cpu_ranks(page: Page, lab_server: LabServer) -> None:
    path = lab_server.create_notebook("cpu.ipynb", [
        # A machine without an NVIDIA driver, injected the way accelnb's own tests do it.
        "from accelnb.kernel.planning.inventory import Inventory, set_inventory_source\n"
        "set_inventory_source(lambda: Inventory(source='none', note='no NVIDIA driver found'))\n"
        + LOAD_ACCELNB,
        "from accelnb.kernel.watched_state.selection import current_selection; print(current_selection())",
    ])
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "cpu"))
    lab.run_cell(0)
    # The notebook's toolbar says what the next launch lacks, and opens the panel.
    expect(lab.toolbar_item()).to_have_text("no GPU: choose CPU ranks")
    lab.toolbar_item().click()
    panel = page.locator("#accelnb-gpu-panel")
    expect(panel).to_be_visible()
    expect(panel.locator(".accelnb-GpuPanel-noGpu")).to_contain_text("No GPU found (no NVIDIA driver found)")
    expect(panel.locator(".accelnb-GpuPanel-synthetic")).to_have_count(0)
    ranks = panel.locator(".accelnb-GpuPanel-procs input")
    ranks.fill("3")
    ranks.press("Enter")
    expect(panel.locator(".accelnb-GpuPanel-magic")).to_have_text("%%distributed --procs 3 --cpu")
    expect(lab.toolbar_item()).to_have_text("3 CPU ranks")
    lab.run_cell(1)
    expect(lab.output(1)).to_contain_text("num_processes=3")


def test_distributed_cell_runs_on_the_selection_and_panel_shows_ranks(
    page: Page, lab_server: LabServer
) -> None:
    path = lab_server.create_notebook("run.ipynb", [
        LOAD_ACCELNB,
        '%%distributed\nprint(f"hello from rank {rank} of {world_size}")',
    ])
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "run"))
    panel = lab.open_gpu_panel()
    lab.run_cell(0)
    gpu_checkbox(panel, 0).check()
    gpu_checkbox(panel, 2).check()
    expect(panel.locator(".accelnb-GpuPanel-magic")).to_have_text("%%distributed --gpus 0,2")

    lab.run_cell(1)
    expect(lab.output(1)).to_contain_text("hello from rank 0 of 2", timeout=90_000)
    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_have_text("Last run: finished")
    expect(panel.locator('.accelnb-GpuPanel-ranks tr[data-phase="done"]')).to_have_count(2)
    expect(panel.locator(".accelnb-GpuPanel-stop")).to_have_count(0)
    page.screenshot(path=str(ARTIFACTS / "gpu-panel-run.png"))


def test_stop_button_interrupts_a_running_cell(page: Page, lab_server: LabServer) -> None:
    path = lab_server.create_notebook("stop.ipynb", [
        LOAD_ACCELNB,
        '%%distributed\nimport time\nprint(f"rank {rank} sleeping", flush=True)\ntime.sleep(300)',
    ])
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "stop"))
    panel = lab.open_gpu_panel()
    lab.run_cell(0)
    gpu_checkbox(panel, 0).check()
    gpu_checkbox(panel, 1).check()
    expect(panel.locator(".accelnb-GpuPanel-magic")).to_have_text("%%distributed --gpus 0,1")

    lab.run_cell(1)
    expect(lab.output(1)).to_contain_text("rank 0 sleeping", timeout=90_000)
    # The kernel is busy in the cell, yet the panel follows the run...
    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_have_text("Run in progress")
    expect(panel.locator('.accelnb-GpuPanel-ranks tr[data-phase="running"]')).to_have_count(2)
    expect(lab.toolbar_item()).to_have_text("GPUs 0,1 · running")
    # ...and its Stop button reaches the kernel (an interrupt, not a queued comm message).
    panel.locator(".accelnb-GpuPanel-stop").click()
    expect(lab.output(1)).to_contain_text("KeyboardInterrupt")
    expect(page.locator(".jp-StatusBar-Widget", has_text="| Idle").first).to_be_visible()
    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_have_text("Last run: finished")
    expect(panel.locator('.accelnb-GpuPanel-ranks tr[data-phase="running"]')).to_have_count(0)
    expect(lab.toolbar_item()).to_have_text("GPUs 0,1")
    page.screenshot(path=str(ARTIFACTS / "gpu-panel-stop.png"))


TRAINING_CELL = """%%distributed --gpus 0,1
import time, torch
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(200):
    time.sleep(0.05)
    optimizer.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
"""


def test_a_training_cell_shows_every_ranks_progress_in_the_cell_and_the_panel(
    page: Page, lab_server: LabServer
) -> None:
    path = lab_server.create_notebook("progress.ipynb", [LOAD_ACCELNB, TRAINING_CELL])
    page.set_viewport_size({"width": 1200, "height": 800})  # the README's picture: panel and cell
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "progress"))
    panel = lab.open_gpu_panel()
    lab.run_cell(0)
    # The panel connects once the kernel has loaded accelnb and is free (a queued cell comes first).
    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_have_text("No run yet.", timeout=60_000)
    lab.run_cell(1)
    # The start table: one line per rank, the UUIDs and bus ids in a detail that starts closed.
    start = lab.output(1).locator("pre.accelnb-start")
    expect(start).to_have_text(re.compile(
        r"^accelnb: 2 rank\(s\), backend gloo \(synthetic.*\)\n"
        r"  rank 0 → cpu, simulating GPU 0 \(Synthetic GPU \(no hardware\)\)  \(pid \d+\)\n"
        r"  rank 1 → cpu, simulating GPU 1 \(Synthetic GPU \(no hardware\)\)  \(pid \d+\)$"), timeout=90_000)
    detail = lab.output(1).locator("details.accelnb-start-detail")
    uuid = detail.get_by_text("GPU-00000000-0000-4000-8000-000000000001, bus 00000000:19:00.0", exact=False)
    expect(uuid).to_be_hidden()
    # While it runs: the cell's per-rank table, and each rank's line in the side panel.
    expect(lab.output(1).locator("table.accelnb-ranks tr")).to_have_count(3, timeout=90_000)  # a head, 2 ranks
    lines = panel.locator("tr.accelnb-GpuPanel-rankLine")
    expect(lines).to_have_count(2)
    expect(lines.first.locator("td").nth(2)).to_have_text(re.compile(r"^\d+\.\d+$"), timeout=30_000)  # steps/s
    expect(lines.first.locator(".accelnb-Bar-util")).to_have_attribute("aria-valuenow", "0")  # synthetic GPU 0
    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_have_text("Run in progress", timeout=1)  # still live
    _rank_lines_fit(page)
    save_picture(page, PICTURES / "rank-view-live.png", panel, lab.cell(1))
    # The detail is one click away, and one more click closes it.
    lines.first.click()
    expect(panel.locator('tr[data-detail-of="0"]')).to_contain_text(re.compile(r"cpu · pid \d+ · running"))
    expect(panel.locator('tr[data-detail-of="0"] .accelnb-GpuPanel-progress')).to_contain_text("steps/s")
    page.screenshot(path=str(ARTIFACTS / "rank-view-detail.png"))
    lines.first.click()
    expect(panel.locator("tr.accelnb-GpuPanel-rankDetail")).to_have_count(0)

    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_have_text("Last run: finished", timeout=90_000)
    final = lab.output(1).locator("table.accelnb-ranks")
    expect(final.locator("tr").nth(1).locator("td").nth(1)).to_have_text("200")  # rank 0's steps, all of them
    expect(lines.first.locator("td").nth(1)).to_have_text("200")  # the panel keeps the last figures
    expect(final).to_contain_text("(synthetic)")  # the GPU columns, from the synthetic inventory
    detail.locator("summary").click()
    expect(uuid).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "rank-view-final.png"))


def _rank_lines_fit(page: Page) -> None:
    """The run table fits the side panel at its default width, one line per rank."""
    sizes = page.evaluate("""() => {
        const panel = document.getElementById('accelnb-gpu-panel');
        const table = panel.querySelector('.accelnb-GpuPanel-ranks');
        const head = table.querySelector('thead tr').getBoundingClientRect().height;
        const lines = [...table.querySelectorAll('tr.accelnb-GpuPanel-rankLine')]
            .map(row => row.getBoundingClientRect().height);
        return {panel: panel.clientWidth, table: table.scrollWidth, head, lines};
    }""")
    assert_panel_fits(page)
    assert sizes["table"] <= sizes["panel"], sizes
    assert all(height <= sizes["head"] + 2 for height in sizes["lines"]), sizes  # as tall as the header's one line


SAVING_CELL = """%%distributed --gpus 0,1
import time, torch, accelnb
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(100_000):
    time.sleep(0.01)
    optimizer.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
    if step == 20 and rank == 0:
        print("training", flush=True)
    if accelnb.stop_requested():
        time.sleep(3)  # a big checkpoint takes a while to write: the panel says the ranks are saving
        print(f"rank {rank} saved step {step}", flush=True)
        break
"""


def test_the_panels_stop_lets_code_that_checks_save_and_offers_stop_now(page: Page, lab_server: LabServer) -> None:
    path = lab_server.create_notebook("saving.ipynb", [LOAD_ACCELNB, SAVING_CELL])
    page.set_viewport_size({"width": 1200, "height": 1000})  # the README's picture: panel and cell
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "saving"))
    panel = lab.open_gpu_panel()
    lab.run_cell(0)
    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_have_text("No run yet.", timeout=60_000)
    lab.run_cell(1)
    expect(lab.output(1)).to_contain_text("training", timeout=90_000)
    # One click sends a comm message and interrupts the kernel: the kernel takes both as one press.
    # This click's press and release straddle changes of the panel's figures: the panel has the
    # kernel read the GPUs every 2 s, and the cell's table, changed three times (about once a
    # second), shows that time went by. A redraw under the press once left the click on no
    # button at all: the Stop did nothing.
    stop_box = panel.locator(".accelnb-GpuPanel-stop").bounding_box()
    assert stop_box is not None
    page.mouse.move(stop_box["x"] + stop_box["width"] / 2, stop_box["y"] + stop_box["height"] / 2)
    page.mouse.down()
    for _ in range(3):
        expect(lab.output(1)).not_to_have_text(lab.output(1).inner_text(), timeout=10_000)
    page.mouse.up()
    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_contain_text("stop requested", timeout=10_000)
    expect(panel.locator(".accelnb-GpuPanel-stop")).to_have_text("Stop now")
    expect(lab.output(1)).to_contain_text("stop requested")  # the cell says so too
    assert_panel_fits(page)
    save_picture(page, PICTURES / "stop-saving.png", panel, lab.cell(1))
    expect(lab.output(1)).to_contain_text("stopped as asked", timeout=30_000)
    expect(lab.output(1)).to_contain_text(re.compile(r"rank 0 saved step \d+"))
    expect(lab.output(1)).not_to_contain_text("KeyboardInterrupt")
    expect(panel.locator(".accelnb-GpuPanel-runTitle")).to_have_text("Last run: finished")
    expect(panel.locator('.accelnb-GpuPanel-ranks tr[data-phase="done"]')).to_have_count(2)
