"""How a check's verdict looks in JupyterLab, on a source notebook (solutions in place).

The reference answer gives one green line saying it passed; a wrong answer typed into the same
exercise cell gives a short red message with a hint, not a Python traceback. Screenshots of both go
to build/browser-screenshots/check-{passed,failed}.png.
"""
from __future__ import annotations

import re

import pytest

from labpage import VIEWPORT, LabPage

pytestmark = pytest.mark.browser

NOTEBOOK = "01_gradient_descent.ipynb"
EXERCISE = "def mse_gradient("
WRONG_ANSWER = '''def mse_gradient(X, y, w, b):
    r = X @ w + b - y
    m = X.shape[0]
    return 1 / m * (X.T @ r), 1 / m * r.sum()      # the factor 2 of d(r²)/dr forgotten

check_mse_gradient(mse_gradient)
'''


def _rgb(locator) -> tuple[int, ...]:
    colour = locator.evaluate("e => getComputedStyle(e).color")
    return tuple(int(v) for v in re.findall(r"\d+", colour)[:3])


@pytest.fixture
def source_page(lab, browser, source_copy):
    context = browser.new_context(viewport=VIEWPORT)
    try:
        yield LabPage(context.new_page()).open(lab.page_url(source_copy(NOTEBOOK)))
    finally:
        context.close()
        lab.shutdown_kernels()


def test_a_check_shows_pass_and_a_wrong_answer_a_short_red_hint(source_page, screenshots):
    page = source_page
    cells = page.cells()
    exercise = next(i for i, c in enumerate(cells)
                    if c["cell_type"] == "code" and EXERCISE in c["source"])
    page.run_all_one_by_one(stop_after=exercise)

    passed = page.cells()[exercise]["outputs"]
    assert [o["output_type"] for o in passed] == ["display_data"], passed
    shown = page.output(exercise, 0)
    assert shown.inner_text().startswith("✓ check_mse_gradient passed"), shown.inner_text()
    r, g, b = _rgb(shown.locator("div").first)
    assert g > r and g > b, f"the pass line should be green, it is rgb{(r, g, b)}"
    page.cell(exercise).screenshot(path=str(screenshots / "check-passed.png"))

    page.type_into(exercise, WRONG_ANSWER)
    page.run_cell(exercise, last=True)
    failed = page.cells()[exercise]["outputs"]
    kinds = [(o["output_type"], o.get("ename")) for o in failed]
    assert kinds == [("error", "CheckFailed")], failed
    shown = page.output(exercise, 0)
    text = shown.inner_text().strip()
    lines = text.splitlines()
    assert lines[0].startswith("✗ check_mse_gradient:"), text
    assert any(line.strip().startswith("hint:") for line in lines), f"no hint in:\n{text}"
    assert "Traceback" not in text and len(lines) <= 8, f"expected a short message, got:\n{text}"
    r, g, b = _rgb(shown.get_by_text("✗ check_mse_gradient", exact=False).first)
    assert r > g and r > b, f"the failure should be red, it is rgb{(r, g, b)}"
    page.cell(exercise).screenshot(path=str(screenshots / "check-failed.png"))
