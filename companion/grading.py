"""Grade learners' notebooks: run each in a fresh kernel, read every check's result, write scores.

    python -m companion grade workbook/01_gradient_descent.ipynb --out grades/

Each notebook runs on a copy in memory with a time limit per cell; errors do not stop the run, and a
cell that runs too long is interrupted so the cells after it still run. The notebook on disk is
never written. One row per notebook and exercise: passed, points, message.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import importlib
import json
import pathlib
import pkgutil
import re

import nbformat

from companion.checks.core import REGISTRY, RESULT_MIME

__all__ = ["Row", "run_copy", "grade_notebook", "grade", "write_reports", "format_table"]

_CALL = re.compile(r"^\s*(check_\w+)\s*\(", re.MULTILINE)
_FAILED = re.compile(r"^(check_\w+): ")


@dataclasses.dataclass
class Row:
    notebook: str
    exercise: str
    passed: bool
    points: int
    max_points: int
    message: str


def _max_points(name: str) -> int:
    if name not in REGISTRY:
        import companion.checks as package
        for info in pkgutil.iter_modules(package.__path__):
            if re.fullmatch(r"ch\d\d", info.name):
                importlib.import_module(f"companion.checks.{info.name}")
    return REGISTRY[name].points if name in REGISTRY else 1


def _result(cell, name: str) -> tuple[bool, str]:
    """Did `name`'s check pass in this executed cell, and what did it say?"""
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        record = data.get(RESULT_MIME)
        if isinstance(record, dict) and record.get("check") == name:
            message = str(record.get("message", ""))
            if record.get("passed") is True:
                return True, message or "passed"
            return False, message or "not done yet"
    for out in cell.get("outputs", []):
        if out.get("output_type") != "error":
            continue
        text = out.get("evalue") or ""
        match = _FAILED.match(text)
        if match is None:
            return False, f"{out.get('ename')}: {text}".strip()
        if match.group(1) == name:
            return False, text[match.end():]
    return False, "not run: an earlier line of its cell stopped it, or the cell never ran"


def run_copy(path: str | pathlib.Path, *, cell_timeout: int = 60):
    """Execute an in-memory copy of a notebook; return (executed notebook, note on a dead kernel)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    path = pathlib.Path(path)
    nb = copy.deepcopy(nbformat.read(path, as_version=4))
    client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=True,
                            kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    try:
        client.execute()
    except DeadKernelError as e:
        return nb, f"the kernel died ({e}); exercises after that point were not graded"
    return nb, ""


def grade_notebook(path: str | pathlib.Path, *, cell_timeout: int = 60) -> list[Row]:
    """Execute a copy of one notebook and return a Row per exercise check it calls."""
    nb, note = run_copy(path, cell_timeout=cell_timeout)
    rows = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for name in dict.fromkeys(_CALL.findall(cell.source)):
            passed, message = _result(cell, name)
            top = _max_points(name)
            rows.append(Row(str(path), name.removeprefix("check_"), passed,
                            top if passed else 0, top,
                            message if passed or not note else f"{message} ({note})"))
    return rows


def grade(paths, *, cell_timeout: int = 60) -> list[Row]:
    """Grade every notebook in `paths`, in order, carrying on past any failure."""
    rows: list[Row] = []
    for path in paths:
        rows += grade_notebook(path, cell_timeout=cell_timeout)
    return rows


def write_reports(rows: list[Row], out_dir: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Write grades.json and grades.csv into out_dir; return their paths."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [dataclasses.asdict(r) for r in rows]
    json_path, csv_path = out_dir / "grades.json", out_dir / "grades.csv"
    json_path.write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in dataclasses.fields(Row)])
        writer.writeheader()
        writer.writerows(records)
    return json_path, csv_path


def format_table(rows: list[Row]) -> str:
    """A short plain-text table: one line per exercise, a total per notebook."""
    lines, width = [], max([len(r.exercise) for r in rows] + [8])
    for notebook in dict.fromkeys(r.notebook for r in rows):
        mine = [r for r in rows if r.notebook == notebook]
        lines.append(f"{notebook}: {sum(r.points for r in mine)}/{sum(r.max_points for r in mine)}")
        for r in mine:
            mark = "pass" if r.passed else "FAIL"
            lines.append(f"  {mark}  {r.exercise:<{width}}  {r.points}/{r.max_points}  "
                         f"{r.message.splitlines()[0][:70] if r.message else ''}")
    return "\n".join(lines) if lines else "no exercises found"
