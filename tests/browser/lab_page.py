"""What a user does in JupyterLab, as Playwright steps: open a notebook, run a cell, open the panel.

Each step waits for what a user would wait for (the kernel to read ``Idle``, an output to
appear); none sleeps.
"""

from __future__ import annotations

from playwright.sync_api import Locator, Page, expect

PANEL_ID = "accelnb-gpu-panel"


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
        self.page.locator(f'.jp-SideBar .lm-TabBar-tab[data-id="{PANEL_ID}"]').click()
        panel = self.page.locator(f"#{PANEL_ID}")
        expect(panel).to_be_visible()
        return panel


def gpu_checkbox(panel: Locator, index: int) -> Locator:
    return panel.locator(f'tr[data-gpu="{index}"] input[type="checkbox"]')
