"""The GPUs panel's figures in a real JupyterLab and Chromium: bars with their numbers, a minute of
utilisation, who else holds a GPU, and the mark on a selected GPU that is busy; in the light and
the dark theme.

The machine is the synthetic one of 4 GPUs, with one thing changed through accelnb's inventory
source (the way its own tests inject a machine): GPU 2 is held by another user's training, a real
process that is not this kernel's (``other_train.py``), whose utilisation comes and goes.

Pictures: ``panel-selection.png`` and ``panel-selection-dark.png`` (the README's).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Iterator

import pytest
from lab_page import LabPage, assert_panel_fits, gpu_checkbox, save_picture
from playwright.sync_api import Page, expect

from tests.browser.conftest import DARK_THEME, LIGHT_THEME, PICTURES, SYNTHETIC_GPUS, LabServer

pytestmark = pytest.mark.browser

HALF_A_MINUTE_OR_MORE = re.compile(r"^(1[5-9]|[2-9]\d)$")  # readings of the history, one every 2 s

ANOTHER_USERS_GPU = """import math, pathlib, subprocess, sys, time
from dataclasses import replace
from accelnb.kernel.planning.inventory import GpuProcess, set_inventory_source, synthetic_inventory
pathlib.Path("other_train.py").write_text("import time\\ntime.sleep(300)\\n")
# Started through a shell that exits at once: the training is not a child of this kernel.
other = int(subprocess.run(f"{sys.executable} other_train.py >/dev/null 2>&1 & echo $!", shell=True,
                           capture_output=True, text=True).stdout)
print("other training", other)

def machine():
    gpus = list(synthetic_inventory(4).gpus)
    work = int(55 + 40 * math.sin(time.monotonic() / 2))
    gpus[2] = replace(gpus[2], memory_used=61 * 2**30, utilization=work,
                      processes=(GpuProcess(other, 60 * 2**30),))
    return replace(synthetic_inventory(4), gpus=tuple(gpus))

set_inventory_source(machine)
%load_ext accelnb"""


@pytest.fixture
def other_training() -> Iterator[list[int]]:
    """The pid the notebook's cell prints, ended after the test."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def test_gpu_rows_show_bars_history_and_who_holds_a_busy_selected_gpu(
    page: Page, lab_server: LabServer, other_training: list[int]
) -> None:
    path = lab_server.create_notebook("figures.ipynb", [ANOTHER_USERS_GPU])
    page.set_viewport_size({"width": 1100, "height": 760})  # the README's picture: the panel, not the window
    lab = LabPage(page)
    lab.open_notebook(lab_server.notebook_url(path, "figures"))
    panel = lab.open_gpu_panel()
    lab.run_cell(0)
    expect(lab.output(0)).to_contain_text("other training")
    other_training.append(int(re.findall(r"other training (\d+)", lab.output(0).inner_text())[0]))
    expect(panel.locator("tr[data-gpu]")).to_have_count(SYNTHETIC_GPUS)

    # Bars with their numbers: GPU 1 of the synthetic machine uses 3 GiB of 80 and 13 %.
    gpu1 = panel.locator('tr[data-gpu="1"]')
    expect(gpu1.locator(".accelnb-GpuPanel-memory")).to_have_text("3.0 / 80 GiB")
    expect(gpu1.locator(".accelnb-GpuPanel-util")).to_have_text("13%")
    expect(gpu1.locator(".accelnb-Bar-util")).to_have_attribute("aria-valuenow", "13")
    expect(gpu1.locator(".accelnb-Bar-mem")).to_have_attribute("aria-valuenow", "4")  # 3 of 80 GiB
    # Another user's process on GPU 2, named, with its pid and memory; none on the others.
    gpu2 = panel.locator('tr[data-gpu="2"]')
    holder = gpu2.locator(f'.accelnb-GpuPanel-processes li[data-pid="{other_training[0]}"]')
    expect(holder).to_have_text(re.compile(rf"python\S* other_train\.py · pid {other_training[0]} · 60\.0 GiB · \w+"))
    expect(panel.locator(".accelnb-GpuPanel-processes li")).to_have_count(1)
    # The panel, while shown, has the kernel read the GPUs every 2 s: the last minute fills in.
    expect(gpu2.locator(".accelnb-Sparkline")).to_have_attribute("data-points", HALF_A_MINUTE_OR_MORE,
                                                                  timeout=60_000)

    # Not busy until it is chosen; chosen, it is marked before any launch.
    expect(panel.locator(".accelnb-GpuPanel-busy")).to_have_count(0)
    gpu_checkbox(panel, 1).check()
    gpu_checkbox(panel, 2).check()
    expect(panel.locator(".accelnb-GpuPanel-magic")).to_have_text("%%distributed --gpus 1,2")
    expect(gpu2.locator(".accelnb-GpuPanel-busy")).to_have_text(
        f"⚠ busy: held by {_python_name()} other_train.py (pid {other_training[0]})")
    expect(gpu2).to_have_class(re.compile("accelnb-mod-busy"))
    expect(panel.locator(".accelnb-GpuPanel-busy")).to_have_count(1)  # GPU 1 is chosen and free
    expect(lab.toolbar_item()).to_have_text("GPUs 1,2 · 2 busy")  # the notebook's toolbar says so too
    assert_panel_fits(page)
    save_picture(page, PICTURES / "panel-selection.png", panel, lab.cell(0))

    # The dark theme: the same panel, every colour from the theme.
    lab_server.set_theme(DARK_THEME)
    try:
        lab.open_notebook(lab_server.notebook_url(path, "figures"))  # the same workspace: the panel stays open
        expect(page.locator("body[data-jp-theme-light='false']")).to_have_count(1)
        panel = lab.open_gpu_panel()
        expect(panel.locator('tr[data-gpu="2"] .accelnb-GpuPanel-busy')).to_be_visible()
        # The kernel kept the history while the page reloaded.
        expect(panel.locator('tr[data-gpu="2"] .accelnb-Sparkline')).to_have_attribute(
            "data-points", HALF_A_MINUTE_OR_MORE, timeout=5_000)
        _readable_in_the_dark(page)
        save_picture(page, PICTURES / "panel-selection-dark.png", panel, lab.cell(0))
    finally:
        lab_server.set_theme(LIGHT_THEME)


def _python_name() -> str:
    """The interpreter's base name, as ``/proc`` shows the other training's command line."""
    return os.path.basename(sys.executable)


def _readable_in_the_dark(page: Page) -> None:
    """Light text on a dark background everywhere it matters: a GPU's name, a busy GPU's row and
    mark, the synthetic banner (the panel uses the theme's colours, not fixed light ones)."""
    contrasts = page.evaluate("""() => {
        const panel = document.getElementById('accelnb-gpu-panel');
        // 0-255 grey level of a computed colour: rgb(...), rgba(...) or color(srgb 0-1 ...)
        const level = c => {
            const v = c.match(/[\\d.]+/g).map(Number).slice(0, 3);
            const scale = c.startsWith('color(') ? 255 : 1;
            return v.reduce((a, b) => a + b, 0) * scale / 3;
        };
        const opaque = c => !(c === 'transparent' || /rgba\\(.*, 0\\)$/.test(c));
        const background = el => {
            for (; el; el = el.parentElement) {
                const c = getComputedStyle(el).backgroundColor;
                if (opaque(c)) return c;
            }
            return 'rgb(255, 255, 255)';
        };
        const selectors = ['.accelnb-GpuPanel-name', 'tr.accelnb-mod-busy .accelnb-GpuPanel-name',
                           '.accelnb-GpuPanel-busy', '.accelnb-GpuPanel-synthetic', '.accelnb-GpuPanel-util'];
        return selectors.map(s => {
            const el = panel.querySelector(s);
            return [s, level(getComputedStyle(el).color), level(background(el))];
        });
    }""")
    for selector, text, background in contrasts:
        assert text > 150 and background < 100, f"{selector}: text {text:.0f}, background {background:.0f} (0-255)"
