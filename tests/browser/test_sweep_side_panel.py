"""The GPUs side panel during ``accelnb.sweep``, in a real JupyterLab and a real Chromium (4 synthetic
GPUs): each busy GPU names its trial, the sweep's table says which trial waits, and the cell shows
the table of trials.

Run with ``pytest -m browser tests/browser``. Picture: ``sweep-table.png`` (the README's).
"""

from __future__ import annotations

import pytest
from lab_page import LabPage, assert_panel_fits, save_picture
from playwright.sync_api import Page, expect

from tests.browser.conftest import PICTURES, SYNTHETIC_GPUS, LabServer

pytestmark = pytest.mark.browser

SWEEP = """import accelnb
def trial(config):
    import os, time
    while not os.path.exists(config["release"]):   # the test says when the trials may end
        time.sleep(0.05)
    return config["n"]
release = "release-sweep"  # in the notebook's folder, where the trials run too
trials = accelnb.sweep(trial, [{"n": n, "release": release} for n in range(3)], gpus_per_trial=2)
print([t.state for t in trials])"""


def test_the_panel_names_the_trial_each_gpu_runs(page: Page, lab_server: LabServer) -> None:
    release = lab_server.root_dir / "release-sweep"
    release.unlink(missing_ok=True)
    path = lab_server.create_notebook("sweep.ipynb", ["%load_ext accelnb", SWEEP])
    page.set_viewport_size({"width": 1200, "height": 1000})  # the README's picture: panel and cell
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "sweep"))
    panel = lab.open_gpu_panel()
    lab.run_cell(0)
    expect(panel.locator("tr[data-gpu]")).to_have_count(SYNTHETIC_GPUS)  # connected before the cell blocks
    lab.run_cell(1)
    try:
        # two slots of two GPUs: trials 0 and 1 run, trial 2 waits for a slot
        expect(panel.locator('tr[data-gpu="0"]')).to_contain_text("trial 0", timeout=60_000)
        expect(panel.locator('tr[data-gpu="1"]')).to_contain_text("trial 0")
        expect(panel.locator('tr[data-gpu="3"]')).to_contain_text("trial 1")
        expect(panel.locator('.accelnb-GpuPanel-trials tr[data-trial="2"]')).to_contain_text("queued")
        expect(panel.locator(".accelnb-GpuPanel-sweep")).to_contain_text("Sweep: 2 running, 1 queued")
        expect(lab.output(1)).to_contain_text("accelnb sweep")  # the cell's table, live
        expect(panel.locator(".accelnb-GpuPanel-run .accelnb-GpuPanel-runTitle")).to_have_text("Run in progress")
        assert_panel_fits(page)  # the trials' configs are cut to the panel, not the panel widened
        save_picture(page, PICTURES / "sweep-table.png", panel, lab.cell(1))
    finally:
        release.write_text("")
    expect(lab.output(1)).to_contain_text("['done', 'done', 'done']", timeout=60_000)
    expect(panel.locator(".accelnb-GpuPanel-sweep")).to_contain_text("Last sweep: 3 trials")
    expect(panel.locator(".accelnb-GpuPanel-trial")).to_have_count(0)  # no GPU runs a trial any more
