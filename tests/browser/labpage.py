"""What a person does with a notebook in JupyterLab, through Playwright: open it, run its cells one
by one, read what each cell shows, look at its widgets, type into a cell, take a screenshot.

A whole notebook runs as a learner runs it, with JupyterLab's own "Run All" (which stops at the
first cell that raises: an exercise not done yet only shows a notice, so a fresh workbook runs to
the end). Single cells run with Shift+Enter (Ctrl+Enter on the last), waiting for each to finish.
What a cell produced is read from the notebook model (`window.jupyterapp`, exposed by
`--LabApp.expose_app_in_browser`); what it shows is read from the page.
"""
from __future__ import annotations

import pathlib
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

VIEWPORT = {"width": 1280, "height": 900}
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_PANEL = "window.jupyterapp.shell.currentWidget"
_OUTER = "document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer')"
_DONE_PROMPT = re.compile(r"^\[\d+\]:?$")


class LabPage:
    """One notebook open in JupyterLab in one browser tab."""

    def __init__(self, page: Page):
        self.page = page

    # ------------------------------------------------------------------ opening
    def open(self, url: str, *, timeout: float = 120.0) -> "LabPage":
        """Load JupyterLab on `url`, wait until every cell is on the page and the kernel is idle,
        and close the file browser so the notebook gets the width."""
        self.page.goto(url, timeout=timeout * 1000)
        self.page.wait_for_function(
            f"""() => {{
                if (!window.jupyterapp || !window.jupyterapp.shell) return false;
                const panel = {_PANEL};
                if (!panel || !panel.content || !panel.content.model) return false;
                const n = panel.content.model.cells.length;
                const kernel = panel.sessionContext.session?.kernel;
                return n > 0 && document.querySelectorAll('.jp-Notebook .jp-Cell').length === n
                       && kernel && kernel.status === 'idle';
            }}""", timeout=timeout * 1000)
        self.page.evaluate("""async () => {
            const app = window.jupyterapp;
            if (!app.shell.leftCollapsed)
                await app.commands.execute('application:toggle-left-area');
        }""")
        return self

    def command(self, name: str) -> None:
        """Run a JupyterLab command, as its menu item would."""
        self.page.evaluate("async name => { await window.jupyterapp.commands.execute(name); }",
                           name)

    # ------------------------------------------------------------------ cells
    def cells(self) -> list[dict]:
        """The notebook's cells as nbformat JSON, outputs included."""
        return self.page.evaluate(f"() => {_PANEL}.content.model.toJSON().cells")

    def cell(self, index: int) -> Locator:
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index)

    def select(self, index: int) -> None:
        """Make cell `index` the active cell, in command mode, with the focus in the notebook."""
        self.page.evaluate(f"i => {{ {_PANEL}.content.activeCellIndex = i; }}", index)
        self.cell(index).locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Escape")

    def run_cell(self, index: int, *, last: bool = False, timeout: float = 180.0) -> None:
        """Run cell `index` with the keyboard and wait until it has finished and the kernel is idle.

        Shift+Enter runs and moves to the next cell; on the last cell Ctrl+Enter runs in place
        (Shift+Enter there would add an empty cell)."""
        active = self.page.evaluate(f"() => {_PANEL}.content.activeCellIndex")
        if active != index:
            self.select(index)
        kind = self.page.evaluate(f"i => {_PANEL}.content.model.cells.get(i).type", index)
        prompt = self.cell(index).locator(".jp-InputPrompt")
        before = prompt.text_content().strip()     # "[ ]:" or, when run again, its last "[n]:"
        self.page.keyboard.press("Control+Enter" if last else "Shift+Enter")
        if kind != "code":
            return
        try:
            self.page.wait_for_function(
                """([el, pattern, before]) => {
                    const now = el.textContent.trim();
                    return now !== before && new RegExp(pattern).test(now);
                }""", arg=[prompt.element_handle(), _DONE_PROMPT.pattern, before],
                timeout=timeout * 1000)
            self.wait_idle(timeout=timeout)
        except Exception as e:
            source = self.cells()[index]["source"]
            raise AssertionError(f"cell {index} did not finish within {timeout:g} s "
                                 f"(prompt {prompt.text_content()!r}); it starts:\n"
                                 f"{source[:300]}") from e

    def run_all_one_by_one(self, *, stop_after: int | None = None, timeout: float = 180.0) -> None:
        """Clear the outputs, then run cells 0..stop_after (default: all) one at a time."""
        self.command("notebook:clear-all-cell-outputs")
        n = self.page.evaluate(f"() => {_PANEL}.content.model.cells.length")
        last = n - 1 if stop_after is None else stop_after
        self.select(0)
        for i in range(last + 1):
            self.run_cell(i, last=i == n - 1, timeout=timeout)

    def run_all(self, *, timeout: float = 900.0) -> list[int]:
        """Clear the outputs, then Run > Run All Cells; wait until the kernel is idle and no cell
        is queued or running. Returns the indices of code cells that did not run (after a cell
        that raised, Run All skips the rest)."""
        self.command("notebook:clear-all-cell-outputs")
        self.command("notebook:run-all-cells")
        try:
            self.page.wait_for_function(
                """() => {
                    const prompts = [...document.querySelectorAll('.jp-Notebook .jp-InputPrompt')];
                    const kernel = window.jupyterapp.shell.currentWidget
                                   .sessionContext.session?.kernel;
                    return kernel && kernel.status === 'idle'
                           && !prompts.some(p => p.textContent.includes('*'));
                }""", timeout=timeout * 1000, polling=500)
        except Exception as e:
            raise AssertionError(f"Run All did not finish within {timeout:g} s") from e
        return [i for i, cell in enumerate(self.cells())
                if cell["cell_type"] == "code" and cell["source"].strip()
                and cell.get("execution_count") is None]

    def wait_idle(self, *, timeout: float = 180.0) -> None:
        self.page.wait_for_function(
            f"() => {_PANEL}.sessionContext.session?.kernel?.status === 'idle'",
            timeout=timeout * 1000)

    def type_into(self, index: int, text: str) -> None:
        """Replace the source of cell `index` as a person would: click in it, select all, type.

        The text goes in as one insertion (like a paste), so the editor adds no indentation."""
        self.select(index)
        self.cell(index).locator(".cm-content").click()
        self.page.keyboard.press("Control+a")
        self.page.keyboard.insert_text(text)
        self.page.keyboard.press("Escape")

    # ------------------------------------------------------------------ outputs
    def output(self, index: int, k: int) -> Locator:
        """Output `k` of cell `index` as shown (outputs nested in an Output widget excluded)."""
        return self.cell(index).locator(
            ".jp-Cell-outputArea > .jp-OutputArea-child > .jp-OutputArea-output").nth(k)

    def widget_outputs(self, cells: list[dict] | None = None) -> list[tuple[int, int]]:
        """(cell, output) of every output that holds a widget view, from the notebook model."""
        cells = self.cells() if cells is None else cells
        return [(i, k) for i, cell in enumerate(cells)
                for k, out in enumerate(cell.get("outputs", []))
                if WIDGET_MIME in out.get("data", {})]

    # ------------------------------------------------------------------ pictures
    def screenshot(self, path: pathlib.Path, *, max_height: int = 16000) -> None:
        """A PNG of the whole notebook: the window is made as tall as the notebook, then put
        back."""
        size = self.page.viewport_size
        height = size["height"]
        for _ in range(4):          # a taller window makes the notebook a little taller: again
            client, scroll = self.page.evaluate(f"""() => {{
                const outer = {_OUTER};
                if (!outer) return [0, 0];
                outer.scrollTop = 0;
                return [outer.clientHeight, outer.scrollHeight];
            }}""")
            if scroll - client <= 1 or height >= max_height:    # fits; or too tall: its top part
                break
            grown = min(height + scroll - client, max_height)
            self.page.set_viewport_size({"width": size["width"], "height": grown})
            try:                    # until the notebook's panel has grown with the window
                self.page.wait_for_function(f"h => {_OUTER}.clientHeight >= h",
                                            arg=client + grown - height, timeout=10_000)
            except Exception:
                break
            height = grown
        try:
            self.page.screenshot(path=str(path))
        finally:
            self.page.set_viewport_size(size)
