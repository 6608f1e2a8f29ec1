"""Recorded GPU runs that ship with the course, so a learner without a GPU still sees real numbers.

Each file course/results/<machine>.json holds one machine's run:
{"machine", "device", "torch", "date", "chapters": {"01": {...figures...}, ...}}.
"""
from __future__ import annotations

import json
import pathlib

__all__ = ["RESULTS_DIR", "recorded"]

RESULTS_DIR = pathlib.Path(__file__).resolve().parent.parent / "course" / "results"


def recorded(chapter: str, *, results_dir: pathlib.Path | str | None = None) -> list[dict]:
    """The recorded runs that have figures for `chapter` ("01", "02", ...), one dict per machine:
    {"machine", "device", "torch", "date", "figures"}. Empty when none has been recorded yet."""
    folder = pathlib.Path(results_dir) if results_dir is not None else RESULTS_DIR
    runs = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        figures = record.get("chapters", {}).get(chapter)
        if figures:
            runs.append({key: record.get(key) for key in ("machine", "device", "torch", "date")}
                        | {"figures": figures})
    return runs
