"""How `python3 tasks.py test` spreads its work over pytest-xdist workers (`--dist loadgroup`).

Every collected item gets an xdist group: a notebook's cells run in order on one worker (nbval
keeps one kernel per notebook), one browser notebook's tests run together (they share its run in
JupyterLab), and each test file stays on one worker (its module fixtures are built once).
"""
import pathlib

import pytest
import torch._dynamo  # noqa: F401  (imported here, whole: a check's time limit that interrupts
                      # its first import, in some test, would leave it half-built for the rest)

REPO = pathlib.Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)          # before xdist reads the groups in its own hook
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))


def _group(item) -> str:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "ran" in params:                              # tests/browser: one group per notebook run
        return f"browser:{params['ran']}"
    return str(pathlib.Path(str(item.fspath)).resolve().relative_to(REPO))
