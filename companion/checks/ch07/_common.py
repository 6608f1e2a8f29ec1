"""Helpers chapter 07's checks share: a whole-value comparison whose failure names the
fields that differ."""
from __future__ import annotations

import re

from companion.checks.core import CheckFailed, compare

__all__ = ["_compare_whole", "_differs"]


def _compare_whole(got, expected, *, name: str, fields: tuple[str, ...] = (), items: str = "",
                   **options) -> None:
    """compare() with rtol = atol = 0, but a failure shows the whole expected and got values and
    names the fields that differ, instead of an index path such as [0][2]; `items` names what a
    list holds ("pieces"), so that a list of the wrong length reads "expected 6 pieces, got 1"."""
    try:
        compare(got, expected, rtol=0, atol=0, name=name, **options)
    except CheckFailed as failure:
        reason = re.sub(r"^(\[\d+\])+", "", failure.summary[len(name):])   # drop "[0][2]"
        if reason.startswith(" does not match"):
            reason = ": not what the reference returns"
        if fields and isinstance(got, (tuple, list)) and len(got) == len(fields):
            wrong = [f for f, g, e in zip(fields, got, expected) if _differs(g, e)]
            reason = f": the {' and the '.join(wrong)} differ" if wrong else reason
        if items and isinstance(got, (tuple, list)) and len(got) != len(expected) and \
                all(isinstance(g, (tuple, list)) for g in got):
            reason = f": expected {len(expected)} {items}, got {len(got)}"
        failure.summary = name + reason
        failure.expected, failure.got, failure.max_diff = expected, got, None
        raise


def _differs(got, expected) -> bool:
    try:
        compare(got, expected, rtol=0, atol=0)
    except (CheckFailed, TypeError, RuntimeError, ValueError):
        return True
    return False
