"""Grading: full marks for a source notebook, zero for a fresh workbook, hangs do not stop it,
and the graded notebook is never modified."""
import json
import pathlib
import subprocess
import sys

import nbformat
import pytest

from companion.grading import format_table, grade_notebook, run_copy, write_reports
from companion.notebooks import make_workbooks

REPO = pathlib.Path(__file__).resolve().parent.parent
CHAPTER = REPO / "course" / "01_gradient_descent.ipynb"


def test_source_notebook_gets_full_marks_and_is_not_modified(tmp_path):
    before = CHAPTER.read_bytes()
    result = subprocess.run([sys.executable, "-m", "companion", "grade", str(CHAPTER),
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert CHAPTER.read_bytes() == before
    rows = json.loads((tmp_path / "grades.json").read_text())
    assert len(rows) >= 3 and all(r["passed"] and r["points"] == r["max_points"] for r in rows)
    assert (tmp_path / "grades.csv").read_text().startswith("notebook,exercise,passed,points")
    assert "4/4" in result.stdout


def test_fresh_workbook_runs_to_the_end_and_scores_zero(tmp_path):
    make_workbooks(REPO / "course", tmp_path)
    workbook = tmp_path / CHAPTER.name
    before = workbook.read_bytes()
    nb, note = run_copy(workbook, cell_timeout=120)
    assert note == "" and workbook.read_bytes() == before
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, [f"{e.ename}: {e.evalue}" for e in errors]
    assert nb.cells[-2].outputs, "the last code cell did not run"
    rows = grade_notebook(workbook, cell_timeout=120)
    assert len(rows) >= 3 and all(r.points == 0 and not r.passed for r in rows)
    assert all(r.message.startswith("not done yet") for r in rows), [r.message for r in rows]


def _variant(tmp_path, *edits: tuple[str, str]) -> pathlib.Path:
    nb = nbformat.read(CHAPTER, as_version=4)
    for old, new in edits:
        hits = [c for c in nb.cells if old in c.source]
        assert len(hits) == 1
        hits[0].source = hits[0].source.replace(old, new)
    path = tmp_path / CHAPTER.name
    nbformat.write(nb, path)
    return path


def test_hangs_are_stopped_and_the_other_exercises_still_graded(tmp_path):
    path = _variant(tmp_path,
                    ("check_mse_gradient(mse_gradient)",                 # a cell that hangs
                     "import time\ntime.sleep(3600)\ncheck_mse_gradient(mse_gradient)"),
                    ("    return w - lr * dw, b - lr * db\n",             # an exercise that loops
                     "    while True:\n        pass\n"))
    rows = {r.exercise: r for r in grade_notebook(path, cell_timeout=8)}
    assert not rows["mse_gradient"].passed and "KeyboardInterrupt" in rows["mse_gradient"].message
    assert not rows["sgd_step"].passed and "did not finish" in rows["sgd_step"].message
    assert rows["train_epoch"].passed and rows["train_epoch"].points == 2


def test_wrong_answer_is_reported_with_its_hint(tmp_path):
    path = _variant(tmp_path, ("    return 2 / m * (X.T @ r), 2 / m * r.sum()",
                               "    return 2 * (X.T @ r), 2 * r.sum()"))
    rows = {r.exercise: r for r in grade_notebook(path)}
    assert not rows["mse_gradient"].passed and rows["mse_gradient"].points == 0
    assert "does not match" in rows["mse_gradient"].message and "divide" in rows["mse_gradient"].message
    assert rows["sgd_step"].passed


def test_reports_and_table(tmp_path):
    from companion.grading import Row
    rows = [Row("a.ipynb", "x", True, 2, 2, "ok"), Row("a.ipynb", "y", False, 0, 1, "not done")]
    json_path, csv_path = write_reports(rows, tmp_path)
    assert json.loads(json_path.read_text())[1]["message"] == "not done"
    assert len(csv_path.read_text().splitlines()) == 3
    assert "a.ipynb: 2/3" in format_table(rows)


def test_grade_missing_file_is_a_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "companion", "grade", str(tmp_path / "nope.ipynb")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no such notebook" in result.stderr
