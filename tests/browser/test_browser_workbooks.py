"""Every workbook notebook, run in JupyterLab as a learner runs it.

For each chapter in course/ (found at collection time, so new chapters are covered without edits):
open the learner's fresh workbook, press Run All, then check that it reached the last cell with no
error (each exercise not done yet shows a notice instead), that every widget rendered as widget DOM
(not the text fallback), and that using one widget changes what it displays (see
widget_interactions.py).
A screenshot of each notebook after the run goes to build/browser-screenshots/NN_name.png, and
one of the widget used, before and after, to NN_name-widget-{before,after}.png.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import time

import pytest

from labdriver import course_notebooks
from labpage import VIEWPORT, LabPage
from widget_interactions import DISPLAY_JS, FALLBACK, INTERACTIONS

# pyproject's 300 s a test would count a notebook's Run All (the first test's setup: 105 s for
# 06_data_parallel on a busy 2-core machine) before run_all's own limit of 900 s
pytestmark = [pytest.mark.browser, pytest.mark.timeout(1200)]

STUB = 'raise NotImplementedError("Exercise:'
CHECK_CALL = re.compile(r"^check_\w+\(", re.MULTILINE)
CONTROLS = "input, select, button, .noUi-handle"      # what a person can use in a widget


@dataclasses.dataclass
class Ran:
    name: str
    page: LabPage
    cells: list[dict]           # nbformat cells with their outputs, read after the run
    shots: pathlib.Path
    not_run: list[int]          # code cells that Run All never reached

    @property
    def stem(self) -> str:
        return self.name.removesuffix(".ipynb")


@pytest.fixture(scope="module", params=course_notebooks(), ids=lambda n: n.removesuffix(".ipynb"))
def ran(request, lab, browser, screenshots):
    """The workbook `request.param`, opened in a fresh browser context and run cell by cell."""
    name = request.param
    stem = name.removesuffix(".ipynb")
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = LabPage(context.new_page())
        try:
            page.open(lab.page_url(f"workbook/{name}"))
            not_run = page.run_all()
        finally:
            page.screenshot(screenshots / f"{stem}.png")     # also of a run that failed
        yield Ran(name, page, page.cells(), screenshots, not_run)
    finally:
        context.close()
        lab.shutdown_kernels()


def _settled(page: LabPage, view, *, quiet: float = 2.0, timeout: float = 60.0) -> str:
    """What `view` displays once the kernel is idle and the display has not changed for `quiet`
    seconds (a dragged slider sends several values; the last redraw comes last)."""
    deadline = time.monotonic() + timeout
    shown = view.evaluate(DISPLAY_JS)
    while time.monotonic() < deadline:
        page.wait_idle()
        page.page.wait_for_timeout(quiet * 1000)
        now = view.evaluate(DISPLAY_JS)
        if now == shown:
            return now
        shown = now
    raise AssertionError(f"the widget kept changing for {timeout:g} s")


def _head(cell: dict, n: int = 120) -> str:
    return "".join(cell["source"])[:n].replace("\n", " | ")


def test_run_all_reaches_the_end_with_every_exercise_not_done(ran):
    """Run All runs every cell; no cell fails; each stub's check shows a short "not done yet"
    notice (not an error, not a traceback)."""
    errors = [f"cell {i} ({_head(cell)}): {out['ename']}: {out['evalue']}"
              for i, cell in enumerate(ran.cells) for out in cell.get("outputs", [])
              if out["output_type"] == "error"]
    assert not errors, "cells failed in JupyterLab:\n" + "\n".join(errors)
    assert not ran.not_run, f"Run All stopped before cells {ran.not_run}"
    assert any(c["cell_type"] == "code" and STUB in c["source"] for c in ran.cells), "no stubs"
    checks = [i for i, c in enumerate(ran.cells)
              if c["cell_type"] == "code" and CHECK_CALL.search(c["source"])]
    notices = {i: k for i, cell in enumerate(ran.cells)
               for k, out in enumerate(cell.get("outputs", []))
               if "not done yet" in "".join(out.get("data", {}).get("text/plain", ""))}
    assert checks and sorted(notices) == checks, (
        f"cells {checks} call a check, but cells {sorted(notices)} say 'not done yet'")
    for i, k in notices.items():
        shown = ran.page.output(i, k).inner_text().strip()
        assert shown.startswith("…") and "not done yet" in shown and "point" in shown, (
            f"cell {i} shows {shown!r}")
        assert "Traceback" not in shown and len(shown.splitlines()) <= 4, (
            f"cell {i}: the notice should be short, not a traceback:\n{shown}")


def test_every_widget_renders(ran):
    """Each widget view is widget DOM with a size, not the text fallback or a widget error."""
    problems = []
    for i, k in ran.page.widget_outputs(ran.cells):
        out = ran.page.output(i, k)
        views = out.locator(":scope > .jupyter-widgets")
        box = out.bounding_box()
        if views.count() == 0:
            problems.append(f"cell {i} output {k}: no widget DOM, it shows "
                            f"{out.inner_text()[:200]!r}")
        elif out.locator(".jupyter-widgets-error-widget").count() or \
                "Error displaying widget" in out.inner_text():
            problems.append(f"cell {i} output {k}: widget error: {out.inner_text()[:300]!r}")
        elif not box or box["height"] < 10:
            problems.append(f"cell {i} output {k}: the widget has no size on the page ({box})")
    assert not problems, f"{ran.name}:\n" + "\n".join(problems)


def test_using_a_widget_changes_its_display(ran):
    """One interaction per widget notebook (see widget_interactions.py) changes what the widget
    shows."""
    outputs = ran.page.widget_outputs(ran.cells)
    if not outputs:
        pytest.skip(f"{ran.name} shows no widgets")
    interaction = INTERACTIONS.get(ran.stem, FALLBACK)
    target = None
    for i, k in outputs:
        view = ran.page.output(i, k)
        control = interaction.control(view)
        if control.count():
            target = (view, control.first)
            break
    if target is None and ran.stem not in INTERACTIONS and not any(
            ran.page.output(i, k).locator(CONTROLS).count() for i, k in outputs):
        pytest.skip(f"{ran.name} shows only widgets without controls (progress bars)")
    assert target, (f"{ran.name}: no widget has the control for '{interaction.what}'; "
                    "update INTERACTIONS in tests/browser/widget_interactions.py")
    view, control = target
    view.scroll_into_view_if_needed()
    before = view.evaluate(DISPLAY_JS)
    view.screenshot(path=str(ran.shots / f"{ran.stem}-widget-before.png"))
    interaction.act(control)
    try:
        ran.page.page.wait_for_function("([view, before, js]) => (0, eval)(js)(view) !== before",
                                        arg=[view.element_handle(), before, DISPLAY_JS],
                                        timeout=60_000)
    except Exception as e:
        raise AssertionError(f"{ran.name}: '{interaction.what}' did not change what the widget "
                             f"displays; it still shows:\n{before[:500]}") from e
    after = _settled(ran.page, view)
    view.screenshot(path=str(ran.shots / f"{ran.stem}-widget-after.png"))
    assert "Traceback" not in after, f"{ran.name}: the widget shows an error:\n{after[:1000]}"
