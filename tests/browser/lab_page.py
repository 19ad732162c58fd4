"""What a user does in JupyterLab, as Playwright steps: open a notebook, run a cell, open the panel.

Each step waits for what a user would wait for (the kernel to read ``Idle``, an output to
appear); none sleeps.
"""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Locator, Page, expect

PANEL_ID = "accelnb-gpu-panel"
PICTURE_MARGIN = 8  # pixels around what a picture shows


class LabPage:
    def __init__(self, page: Page) -> None:
        self.page = page

    def open_notebook(self, url: str) -> None:
        """Open a notebook and wait until its kernel is connected and idle."""
        self.page.goto(url)
        expect(self.page.locator(".jp-NotebookPanel").first).to_be_visible()
        # Shift+Enter before the kernel is connected silently runs nothing.
        expect(self.page.locator(".jp-StatusBar-Widget", has_text="| Idle").first).to_be_visible()

    def cell(self, index: int) -> Locator:
        return self.page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell").nth(index)

    def run_cell(self, index: int) -> None:
        # Clicking into the editor takes the keyboard focus back from the side panel.
        self.cell(index).locator(".cm-content").click()
        self.page.keyboard.press("Shift+Enter")
        expect(self.cell(index).locator(".jp-InputPrompt")).not_to_have_text("[ ]:")

    def output(self, index: int) -> Locator:
        return self.cell(index).locator(".jp-OutputArea")

    def toolbar_item(self) -> Locator:
        """The notebook toolbar's accelnb item (the next launch's selection)."""
        return self.page.locator(".jp-NotebookPanel:visible .jp-NotebookPanel-toolbar .accelnb-GpuToolbarItem")

    def open_gpu_panel(self) -> Locator:
        """Show the GPUs panel (a click on its tab; none when a restored layout shows it already,
        where a click would close it)."""
        tab = self.page.locator(f'.jp-SideBar .lm-TabBar-tab[data-id="{PANEL_ID}"]')
        if tab.get_attribute("aria-selected") != "true":
            tab.click()
        panel = self.page.locator(f"#{PANEL_ID}")
        expect(panel).to_be_visible()
        return panel


def gpu_checkbox(panel: Locator, index: int) -> Locator:
    return panel.locator(f'tr[data-gpu="{index}"] input[type="checkbox"]')


def save_picture(page: Page, path: Path, *regions: Locator) -> None:
    """A screenshot of the smallest rectangle holding every one of ``regions`` (plus a margin):
    the README's pictures show the panel and the cell, not the whole window."""
    boxes = [box for box in (region.bounding_box() for region in regions) if box is not None]
    assert boxes, "none of the regions to picture is on the page"
    left = max(0.0, min(b["x"] for b in boxes) - PICTURE_MARGIN)
    top = max(0.0, min(b["y"] for b in boxes) - PICTURE_MARGIN)
    right = max(b["x"] + b["width"] for b in boxes) + PICTURE_MARGIN
    bottom = max(b["y"] + b["height"] for b in boxes) + PICTURE_MARGIN
    viewport = page.viewport_size or {"width": int(right), "height": int(bottom)}
    clip = {"x": left, "y": top, "width": min(right, viewport["width"]) - left,
            "height": min(bottom, viewport["height"]) - top}
    path.parent.mkdir(parents=True, exist_ok=True)
    page.mouse.move(0, viewport["height"] - 1)  # no row left highlighted by a hover
    page.screenshot(path=str(path), clip=clip)  # type: ignore[arg-type]


def assert_panel_fits(page: Page) -> None:
    """Nothing in the GPUs panel is wider than the panel (a clipped column, a table that scrolls)."""
    overflow = page.evaluate("""() => {
        const panel = document.getElementById('accelnb-gpu-panel');
        return panel.scrollWidth - panel.clientWidth;
    }""")
    assert overflow <= 0, f"the panel's content is {overflow}px wider than the panel"
