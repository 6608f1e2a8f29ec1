"""Grading with the grader's own permissions (`--run-as self`) and without the kernel sandbox
(`--trusted`), where a notebook's code can write the grader's files and signal its processes: the grader notices, restores and carries on, one
notebook cannot change how the next is graded, and a run whose grader was killed resumes.

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

PATCH_PRIVATE = '''import os, pathlib
private = pathlib.Path(os.readlink(f"/proc/{os.getppid()}/cwd"))     # the grading process's folder
core = private / "companion" / "checks" / "core.py"
core.write_text(core.read_text() + """
def evaluate(name, answer, *args, timeout=None, **kwargs):   # every later check passes
    return "forged"
""")'''

KILL_BATCH = '''import os
stat = open(f"/proc/{os.getppid()}/stat").read()
os.kill(int(stat.rsplit(")", 1)[1].split()[1]), 9)      # the grading process's parent: the batch'''


def _grade(root, package, folder, out, *extra):
    env = dict(os.environ, PYTHONPATH=str(package.parent))
    return subprocess.run([sys.executable, "-m", "companion", "grade", str(folder), "--out",
                           str(out), "--run-as", "self", "--jobs", "1", "--source",
                           str(REPO / "course"), "--exercise-timeout", "20", "--trusted",
                           *extra],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("same_user")
    package = root / "pkg" / "companion"
    shutil.copytree(REPO / "companion", package, ignore=shutil.ignore_patterns("__pycache__"))
    original = {p: p.read_bytes() for p in package.rglob("*.py")}
    folder, out = root / "class", root / "grades"
    folder.mkdir()
    save(insert(trimmed("01", solved=False), SETUP, EDIT_INSTALLED),
         folder / "a_edits_installed_files.ipynb")
    save(insert(trimmed("01"), SETUP, KILL_GRADER.format(report=out / "grades.json")),
         folder / "b_kills_its_grading_process.ipynb")
    save(insert(trimmed("01", solved=False), SETUP, PATCH_PRIVATE),
         folder / "c_patches_the_private_checks.ipynb")
    save(trimmed("01", solved=False), folder / "d_fresh_workbook.ipynb")
    save(insert(trimmed("01"), SETUP, KILL_BATCH), folder / "e_kills_the_batch.ipynb")
    save(trimmed("01"), folder / "f_honest.ipynb")
    first = _grade(root, package, folder, out)
    after_first = json.loads((out / "grades.json").read_text())
    state = json.loads((out / "grades.state.json").read_text())
    again = _grade(root, package, folder, out, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    rows = {}
    for r in json.loads((out / "grades.json").read_text()):
        rows.setdefault(pathlib.Path(r["notebook"]).stem, {})[r["exercise"]] = r
    return {"rows": rows, "out": out, "stdout": again.stdout, "package": package,
            "original": original, "first": first, "after_first": after_first, "state": state}


def test_a_notebook_that_edits_installed_files_is_flagged_and_the_files_restored(graded):
    rows = graded["rows"]["a_edits_installed_files"]
    assert all(r["status"] == "tampered" and r["points"] == 0 for r in rows.values())
    assert "changed the grader's files: companion/checks/core.py" in rows["mse_gradient"]["flags"]
    assert {p: p.read_bytes() for p in graded["package"].rglob("*.py")} == graded["original"]


def test_a_notebook_that_kills_its_grading_process_costs_only_itself(graded):
    rows = graded["rows"]["b_kills_its_grading_process"]
    assert all(r["status"] == "not graded" and "killed by signal 9" in r["message"]
               for r in rows.values()), rows


def test_a_notebook_cannot_change_the_checks_later_notebooks_are_graded_with(graded):
    rows = graded["rows"]["c_patches_the_private_checks"]
    assert all(r["status"] == "tampered" for r in rows.values()), rows
    assert "companion/checks/core.py" in rows["mse_gradient"]["flags"]
    fresh = graded["rows"]["d_fresh_workbook"]              # graded after it, with the files back
    assert all(r["status"] == "not done" and r["points"] == 0 for r in fresh.values()), fresh


def test_a_killed_grader_resumes_where_it_stopped(graded):
    assert graded["first"].returncode == -9                 # the batch itself was killed
    assert {pathlib.Path(r["notebook"]).stem for r in graded["after_first"]} == {
        "a_edits_installed_files", "b_kills_its_grading_process",
        "c_patches_the_private_checks", "d_fresh_workbook"}
    running = [k for k, v in graded["state"]["notebooks"].items() if v["state"] == "running"]
    assert [pathlib.Path(k).stem for k in running] == ["e_kills_the_batch"]
    killed = graded["rows"]["e_kills_the_batch"]
    assert all(r["status"] == "not graded" and "the grader was killed while it ran" in r["message"]
               for r in killed.values()), killed
    honest = graded["rows"]["f_honest"]
    assert all(r["passed"] for r in honest.values()), honest
    assert "ran with your permissions" in honest["mse_gradient"]["flags"]
    assert "kept " in graded["stdout"] and "d_fresh_workbook.ipynb from the earlier run" in \
        graded["stdout"]
    before = {(r["notebook"], r["exercise"]): r for r in graded["after_first"]}
    for stem in ("a_edits_installed_files", "d_fresh_workbook"):     # kept, not graded again
        for name, r in graded["rows"][stem].items():
            assert r == before[(r["notebook"], name)]


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
