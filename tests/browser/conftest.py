"""The browser suite: the course in JupyterLab, driven headless in Debian's Chromium by Playwright.

One JupyterLab server and one browser serve the whole session. The server's root is a fresh folder
holding the learner's workbook (`python -m companion workbook --dest ...`) and, for the tests that
need them, copies of source notebooks. Screenshots go to build/browser-screenshots/, printed at the
end of the run. Without /usr/bin/chromium or the playwright package every test here is skipped,
with the reason.
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

from labdriver import CHROMIUM, COURSE, REPO, Chromium, LabServer

SCREENSHOTS = REPO / "build" / "browser-screenshots"
def unavailable() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not CHROMIUM.exists():
        return (f"no Chromium at {CHROMIUM}: install it (Debian: apt-get install -y chromium) to "
                "run the browser tests; .ci/run does")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing: pip install -e '.[dev]'"
    return None


def pytest_collection_modifyitems(config, items):
    reason = unavailable()
    if reason:
        for item in items:
            if item.get_closest_marker("browser"):
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config):
    """Empty the screenshot folder once, in the main process, before any worker writes to it."""
    if not hasattr(config, "workerinput"):
        shutil.rmtree(SCREENSHOTS, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, config):
    if SCREENSHOTS.is_dir() and any(SCREENSHOTS.iterdir()):
        terminalreporter.write_line(f"browser screenshots: {SCREENSHOTS}")


@pytest.fixture(scope="session")
def lab_root(tmp_path_factory) -> pathlib.Path:
    """A fresh folder with the learner's workbook in workbook/ and an empty source/."""
    root = tmp_path_factory.mktemp("lab")
    subprocess.run([sys.executable, "-m", "companion", "workbook", "--source", str(COURSE),
                    "--dest", str(root / "workbook")], check=True, capture_output=True, cwd=REPO)
    (root / "source").mkdir()
    return root


@pytest.fixture(scope="session")
def lab(lab_root, tmp_path_factory):
    """JupyterLab on 127.0.0.1:<free port> with a token, serving `lab_root`; stopped by pid."""
    with LabServer(lab_root, tmp_path_factory.mktemp("jupyter")) as server:
        yield server


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    """Headless system Chromium with a fresh profile, attached to by Playwright; stopped by pid."""
    from playwright.sync_api import sync_playwright

    with Chromium(tmp_path_factory.mktemp("chromium") / "profile") as chrome, \
            sync_playwright() as playwright:
        attached = playwright.chromium.connect_over_cdp(chrome.endpoint)
        try:
            yield attached
        finally:
            attached.close()


@pytest.fixture(scope="session")
def screenshots(pytestconfig) -> pathlib.Path:
    """build/browser-screenshots/ (emptied at the start of the run, see pytest_configure)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser screenshots go to {SCREENSHOTS}")
    return SCREENSHOTS


@pytest.fixture
def source_copy(lab_root):
    """Copy a source notebook (with its solutions) into the server's source/ folder."""
    def copy(name: str) -> str:
        shutil.copy(COURSE / name, lab_root / "source" / name)
        return f"source/{name}"
    return copy
