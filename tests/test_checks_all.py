"""Every registered check, whatever garbage it is given, raises CheckFailed, and quickly; and every
check given an exercise not written yet says so without raising, so "Run All" goes on."""
import importlib
import pkgutil
import re
import time

import pytest
import torch

import companion.checks as checks_package
from companion.checks.core import REGISTRY, CheckFailed

MODULES = [importlib.import_module(f"companion.checks.{m.name}")
           for m in pkgutil.iter_modules(checks_package.__path__) if re.fullmatch(r"ch\d\d", m.name)]
CHECKS = {name: getattr(module, name) for module in MODULES for name in module.__all__}


def _raises(*args, **kwargs):
    raise ValueError("boom")


def _loops(*args, **kwargs):
    while True:
        pass


def _not_written(*args, **kwargs):
    """What a workbook's stub does (module level, so gloo workers can import it)."""
    raise NotImplementedError("Exercise: replace this line with your code (about 3 lines in the "
                              "reference solution).")


GARBAGE = {
    "None": None,
    "a string": "my answer",
    "a list": [1, 2, 3],
    "raises": _raises,
    "returns None": lambda *a, **k: None,
    "returns NaN": lambda *a, **k: torch.tensor(float("nan")),
    "returns a string": lambda *a, **k: "42",
    "loops forever": _loops,
}


def test_every_chapter_check_is_registered_once():
    assert set(CHECKS) <= set(REGISTRY)
    assert len(CHECKS) >= 15


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_garbage_fails_cleanly(name, garbage):
    start = time.monotonic()
    with pytest.raises(CheckFailed):
        CHECKS[name](GARBAGE[garbage], timeout=1.5)
    assert time.monotonic() - start < 1.5 + 10, "the check ran past its time limit"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_an_exercise_not_written_yet_is_a_notice_not_an_error(name, capsys):
    assert CHECKS[name](_not_written) is None
    shown = capsys.readouterr().out
    points = REGISTRY[name].points
    assert shown.startswith(f"… {name}: not done yet"), shown
    assert f"({points} point" in shown and "cells below run" in shown, shown
    assert "NotImplementedError" not in shown and len(shown) < 160, shown     # short
