"""The GPUs side panel's Stacks button, in a real JupyterLab and Chromium, during a blocking run.

Run with ``pytest -m browser tests/browser``. Screenshot: ``test-artifacts/gpu-panel-stacks.png``.
"""

from __future__ import annotations

import pytest
from lab_page import LabPage
from playwright.sync_api import Page, expect

from tests.browser.conftest import ARTIFACTS, LabServer

pytestmark = pytest.mark.browser

WAITING_CELL = """%%distributed --procs 2
import time
def train_step_waiting_here():
    print(f"rank {rank} waiting", flush=True)
    time.sleep(300)
train_step_waiting_here()"""


def test_stacks_shows_every_ranks_frames_while_the_cell_runs(page: Page, lab_server: LabServer) -> None:
    path = lab_server.create_notebook("stacks.ipynb", ["%load_ext accelnb", WAITING_CELL])
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "stacks"))
    panel = lab.open_gpu_panel()
    lab.run_cell(0)
    # The panel connects once the kernel is idle after %load_ext; a busy kernel answers no probe.
    expect(panel.locator(".accelnb-GpuPanel-status")).to_have_attribute("data-connection", "connected")
    lab.run_cell(1)
    expect(lab.output(1)).to_contain_text("rank 0 waiting", timeout=90_000)
    expect(panel.locator('.accelnb-GpuPanel-ranks tr[data-phase="running"]')).to_have_count(2)

    panel.locator(".accelnb-GpuPanel-stacksButton").click()
    for rank in (0, 1):
        stack = panel.locator(f'.accelnb-GpuPanel-rankStack[data-rank="{rank}"] pre')
        expect(stack).to_contain_text("in train_step_waiting_here")
        expect(stack).to_contain_text("<cell In[2]>")
    expect(panel.locator(".accelnb-GpuPanel-stacksTitle")).to_contain_text("nothing was stopped")
    # Nothing stopped: the cell still runs, both ranks still run, no stack leaked into the cell.
    expect(panel.locator('.accelnb-GpuPanel-ranks tr[data-phase="running"]')).to_have_count(2)
    expect(page.locator(".jp-StatusBar-Widget", has_text="| Busy").first).to_be_visible()
    expect(lab.output(1)).not_to_contain_text("most recent call first")
    page.screenshot(path=str(ARTIFACTS / "gpu-panel-stacks.png"))

    panel.locator(".accelnb-GpuPanel-stop").click()
    expect(lab.output(1)).to_contain_text("KeyboardInterrupt")
    expect(page.locator(".jp-StatusBar-Widget", has_text="| Idle").first).to_be_visible()
