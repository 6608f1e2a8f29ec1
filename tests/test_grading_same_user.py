"""Grading with the grader's own permissions (`--run-as self`), where a notebook's code can write
the grader's files and signal its processes: the grader notices, restores and carries on.

The grader runs here on a copy of the companion package (PYTHONPATH), so that the notebooks below
edit the copy, never the checkout others are working in.
"""
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from grading_notebooks import REPO, SETUP, insert, save, trimmed

pytestmark = pytest.mark.slow

EDIT_INSTALLED = '''import pathlib
import companion.checks.core as core
path = pathlib.Path(core.__file__)
path.write_text(path.read_text() + """
def call(answer, *args, **kwargs):          # forged: mse_gradient's result for anyone
    X, y, w, b = args
    r = X @ w + b - y
    return 2 * X.T @ r / len(y), 2 * r.mean()
""")'''

KILL_GRADER = '''import os, pathlib, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import pathlib, sys, time; time.sleep(15); "
                  "pathlib.Path(sys.argv[1]).write_text('[]')  # rewrite-after-exit",
                  "{report}"], start_new_session=True)
os.kill(os.getppid(), 9)'''


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("same_user")
    package = root / "pkg" / "companion"
    shutil.copytree(REPO / "companion", package, ignore=shutil.ignore_patterns("__pycache__"))
    original = {p: p.read_bytes() for p in package.rglob("*.py")}
    folder, out = root / "class", root / "grades"
    folder.mkdir()
    edit = trimmed("01", solved=False)
    save(insert(edit, SETUP, EDIT_INSTALLED), folder / "a_edits_installed_files.ipynb")
    kill = trimmed("01")
    save(insert(kill, SETUP, KILL_GRADER.format(report=out / "grades.json")),
         folder / "b_kills_its_grader.ipynb")
    save(trimmed("01", solved=False), folder / "c_fresh_workbook.ipynb")
    save(trimmed("01"), folder / "d_honest.ipynb")
    env = dict(os.environ, PYTHONPATH=str(package.parent))
    result = subprocess.run([sys.executable, "-m", "companion", "grade", str(folder), "--out",
                             str(out), "--run-as", "self", "--jobs", "1", "--source",
                             str(REPO / "course"), "--exercise-timeout", "20"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    for r in json.loads((out / "grades.json").read_text()):
        rows.setdefault(pathlib.Path(r["notebook"]).stem, {})[r["exercise"]] = r
    return {"rows": rows, "out": out, "stdout": result.stdout, "package": package,
            "original": original}


def test_a_notebook_that_edits_installed_files_is_flagged_and_the_files_restored(graded):
    rows = graded["rows"]["a_edits_installed_files"]
    assert all(r["status"] == "tampered" and r["points"] == 0 for r in rows.values())
    assert "changed the grader's files: companion/checks/core.py" in rows["mse_gradient"]["flags"]
    assert {p: p.read_bytes() for p in graded["package"].rglob("*.py")} == graded["original"]
    fresh = graded["rows"]["c_fresh_workbook"]              # graded after it, with the files back
    assert all(r["status"] == "not done" for r in fresh.values()), fresh


def test_a_notebook_that_kills_its_grader_costs_only_itself(graded):
    rows = graded["rows"]["b_kills_its_grader"]
    assert all(r["status"] == "not graded" and "killed by signal 9" in r["message"]
               for r in rows.values()), rows
    assert all(r["passed"] for r in graded["rows"]["d_honest"].values())
    assert "ran with your permissions" in graded["rows"]["d_honest"]["mse_gradient"]["flags"]


def test_a_process_left_to_rewrite_the_report_was_ended(graded):
    out = graded["out"]
    assert json.loads((out / "grades.json").read_text()) != []
    for line in (out / "grades.sha256").read_text().splitlines():
        digest, name = line.split("  ")
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
        assert line in graded["stdout"]
    left = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if b"rewrite-after-exit" in (entry / "cmdline").read_bytes():
                left.append(entry.name)
        except OSError:
            continue
    assert left == []
