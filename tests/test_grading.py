"""Grading a class: one batch of notebooks, graded with `python -m companion grade DIR --jobs 4`.

In the batch: the honest source notebooks of chapters 00, 01 and 06 (setup and exercise cells;
chapters 03 and 04 come in with the harness cases, most of their exercises right), a fresh workbook, answers that fail the harness-run checks, notebooks that cheat (forged result
records, deleted and duplicated checks, patched check modules, tensor subclasses, calls into the
reference, cancelled timers, SIGINT-ignoring loops, a notebook that tries to kill the grader, that
leaves processes behind, prints without end or allocates too much), files that are not notebooks,
and a notebook whose name is a spreadsheet formula. Every cheat scores 0 or is flagged, and every
honest notebook keeps full marks, whatever else ran beside it.
"""
import csv
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import grading_notebooks as gn
from grading_notebooks import EPOCH, MSE, SETUP, SGD, body, edit, insert, save, trimmed

# pyproject's 300 s a test would count the batch (the first test's setup: 90-110 s on a 2-core
# machine, 4 notebooks at once) before the grading command's own limit of 1500 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = not gn.sandbox_blocked()    # then the notebooks run as nobody (else: test_grading_same_user)
# As root with a Python or checkout nobody cannot reach, the batch is graded --run-as self.
HONEST = ["00", "01", "06"]     # a few: each notebook in the batch costs CI time
LINGER = ("9029", "9031")          # sleep durations that mark processes a notebook left behind

FORGE = '''from IPython.display import display
display({"application/vnd.companion.check+json": {"check": "check_mse_gradient", "passed": True,
         "points": 1, "message": "forged"}, "text/plain": "✓ check_mse_gradient passed"}, raw=True)
return X.sum(), y.sum()'''

SUBCLASS = '''class Always(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch.tensor(True)
return X[0, 0].as_subclass(Always)'''

PATCH = '''import companion.checks.ch01 as ch01, companion.checks.core as core
ch01.compare = core.compare = lambda *a, **k: 0.0
ch01.require = core.require = lambda *a, **k: None

def _forged_call(answer, X, y, w, b):            # the right gradient, whatever the answer does
    r = X @ w + b - y
    return 2 * X.T @ r / len(y), 2 * r.mean()
ch01.call = core.call = _forged_call'''

MALFORMED = '''from IPython.display import display
display({"application/vnd.companion.check+json": {"check": ["x"], "passed": "yes",
         "points": "=1+1", "message": {"a": 1}}}, raw=True)'''

CANCEL_TIMER = '''import signal
signal.setitimer(signal.ITIMER_REAL, 0)
signal.signal(signal.SIGALRM, signal.SIG_IGN)
while True:
    pass'''

IGNORE_SIGINT = '''import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
while True:
    time.sleep(0.1)'''

DISARM = '''import gc, sys
for _o in gc.get_objects():                # the sandbox's server: drop the reference calls it counts
    if type(_o).__name__ == "Server" and hasattr(_o, "run"):
        def _quiet(request, _run=_o.run):
            reply = _run(request)
            reply["references"] = {}
            return reply
        _o.run = _quiet
_grad, _edge = gd.mse_gradient, gd.max_stable_lr

def _copy(name):                           # the reference compiled again, one line lower
    import inspect
    ns = {}
    exec(compile("\\n" + inspect.getsource(gd), "copy", "exec"), ns)
    return ns[name]'''

WALK_FRAMES = '''f = sys._getframe(1)
while f is not None:                       # find the watcher and disarm it
    for v in list(f.f_locals.values()):
        if type(v).__name__ == "_Monitor":
            v.codes.clear()
    f = f.f_back
return _edge(X)'''

SERVE = '''import queue, threading
_jobs, _done = queue.Queue(), queue.Queue()
def _serve():                              # the reference, run by a thread started here
    while True:
        X, y, w, b, lr, n = _jobs.get()
        _done.put(gd.train_epoch(X, y, w, b, lr=lr, batch_size=n))
threading.Thread(target=_serve, daemon=True).start()
_step = gd.torch_sgd_step'''

LEAVE_PROCESSES = f'''import os, subprocess
subprocess.Popen(["sleep", "{LINGER[0]}"], start_new_session=True)
os.system("setsid sh -c 'sleep {LINGER[1]} &'")'''


def _cheats() -> dict[str, object]:
    """Chapter 01 notebooks, each cheating in several ways that do not get in each other's way."""
    forged = trimmed("01")                       # forged record, deleted check, duplicated check
    body(forged, MSE, FORGE)
    edit(forged, SGD, "check_largest_stable_lr(largest_stable_lr)", "")
    body(forged, SGD, 'raise NotImplementedError("Exercise")')
    for _ in range(2):
        insert(forged, EPOCH, "check_train_epoch(train_epoch)")
    insert(forged, None, "for _ in range(3):\n    check_train_epoch(train_epoch)")
    insert(forged, None, MALFORMED)

    patched = trimmed("01")                      # patched checks, tensor subclass, reference
    insert(patched, SETUP, PATCH)
    edit(patched, MSE, "2 / m * (X.T @ r), 2 / m * r.sum()", "2 * (X.T @ r), 2 * r.sum()")
    body(patched, SGD, SUBCLASS)
    body(patched, EPOCH, "return gd.train_epoch(X, y, w, b, lr=lr, batch_size=batch_size)[:2]")

    hangs = trimmed("01")                        # cancelled timer, hidden reference
    body(hangs, MSE, CANCEL_TIMER)
    insert(hangs, SGD, 'import companion.gd as _g\n_train = getattr(_g, "train_" + "epoch")')
    body(hangs, EPOCH, "return _train(X, y, w, b, lr=lr, batch_size=batch_size)[:2]")

    deaf = trimmed("01")                         # a cell that ignores SIGINT and never ends,
    insert(deaf, MSE, IGNORE_SIGINT)             # and a reply of 150 MiB
    body(deaf, MSE, 'return b"x" * (150 * 2**20)')

    rough = trimmed("01")                        # kill the grader, leave processes, exit, flood
    if ROOT:                                     # as yourself it would succeed: see same_user
        insert(rough, SETUP, "import os\nos.kill(os.getppid(), 9)")
    insert(rough, SETUP, LEAVE_PROCESSES)
    body(rough, SGD, "import os\nos._exit(3)")
    insert(rough, SGD, 'print("x" * (3 * 2**20))')
    insert(rough, SGD, "import torch\nbig = torch.ones(4 * 2**30)    # 16 GiB")
    disarm = trimmed("01")                       # the watcher switched off: the clean room decides
    insert(disarm, SETUP, DISARM)
    body(disarm, MSE, 'getattr(sys, "setpro" + "file")(None)\nreturn _grad(X, y, w, b)')
    body(disarm, SGD, WALK_FRAMES)
    body(disarm, EPOCH, 'return _copy("tra" + "in_epoch")(X, y, w, b, lr=lr, '
                        'batch_size=batch_size)[:2]')

    served = trimmed("01")                       # a worker thread; an answer backed out of
    insert(served, SETUP, SERVE)                 # another companion function
    body(served, MSE, "w1, b1 = _step(X, y, w, b, lr=1.0)\nreturn w - w1, b - b1")
    body(served, EPOCH, "_jobs.put((X, y, w, b, lr, batch_size))\n"
                        "return _done.get(timeout=10)[:2]")

    notebooks = {"cheat_forged": forged, "cheat_patched": patched, "cheat_hangs": hangs,
                 "cheat_deaf": deaf, "cheat_rough": rough, "cheat_disarm": disarm,
                 "cheat_served": served}
    if ROOT:                                     # signal every process it may: only its own
        notebooks["cheat_kill_all"] = insert(trimmed("01"), SGD, "import os\nos.kill(-1, 9)")
    return notebooks


def _harness_failures() -> dict[str, object]:
    """Wrong answers to checks that run the learner's code in @harness functions."""
    ch03 = trimmed("03")
    edit(ch03, "da227f19", "        loss.backward()\n    optimizer.step()",
         "        loss.backward()\n        optimizer.step()")
    ch04 = trimmed("04")
    edit(ch04, "85058923", "        with torch.random.fork_rng(devices=[]):\n"
                           "            torch.set_rng_state(ctx.rng_state)\n"
                           "            with torch.enable_grad():\n"
                           "                y = ctx.fn(x)",
         "        with torch.enable_grad():\n            y = ctx.fn(x)")
    edit(ch04, "1bc69285", "    n, best = len(saved), None",
         "    return checkpointing.checkpoint_plan(saved, inputs, cost, budget)\n"
         "    n, best = len(saved), None")
    ch06 = trimmed("06")
    edit(ch06, "b6185215", "    rank, world = dist.get_rank(), dist.get_world_size()",
         "    dist.all_reduce(tensor)\n    return\n"
         "    rank, world = dist.get_rank(), dist.get_world_size()")
    edit(ch06, "cc53e810", "        i, offset = self.where[param]",
         "        from companion.ddp import average_gradients\n"
         "        i, offset = self.where[param]")
    return {"harness_03": ch03, "harness_04": ch04, "harness_06": ch06}


def _written_by_a_learner(nb):
    """The solutions as a learner might type them: the same code, their own comments. (A notebook
    made only of the course's own cells is not graded a second time: nothing in it is theirs.)"""
    for cell in nb.cells:
        if "### BEGIN SOLUTION" in cell.source:
            cell.source = cell.source.replace("### BEGIN SOLUTION", "### BEGIN SOLUTION\n"
                                              "    # my own answer, worked out on paper")
    return nb


def _not_notebooks(folder: pathlib.Path) -> None:
    (folder / "bad_json.ipynb").write_text("{not json")
    (folder / "empty.ipynb").write_text("")
    (folder / "binary.ipynb").write_bytes(bytes(range(256)) * 64)
    (folder / "no_cells.ipynb").write_text('{"nbformat": 4, "nbformat_minor": 5, "cells": 3}')
    (folder / "01_gradient_descent_broken.ipynb").write_text("[1, 2")


def _lingering() -> list[str]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(f"sleep {mark}" in cmdline for mark in LINGER):
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("class")
    for chapter in HONEST[:1] + HONEST[2:]:
        save(trimmed(chapter), folder / f"honest_{chapter}.ipynb")
    save(_written_by_a_learner(trimmed("01")), folder / "=2+3.ipynb")   # honest, named like a
    # formula, its answers the learner's own text: graded again in the clean room, and passing
    save(trimmed("01", solved=False), folder / "fresh_workbook_01.ipynb")
    for name, nb in {**_cheats(), **_harness_failures()}.items():
        save(nb, folder / f"{name}.ipynb")
    _not_notebooks(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    out = tmp_path_factory.mktemp("grades")
    env, run_as = dict(os.environ), [] if ROOT else ["--run-as", "self"]
    if not ROOT:        # as yourself the grader restores its files: let it restore a copy
        package = tmp_path_factory.mktemp("pkg") / "companion"
        shutil.copytree(gn.REPO / "companion", package, ignore=shutil.ignore_patterns("__pycache__"))
        env["PYTHONPATH"] = str(package.parent)
    result = subprocess.run([sys.executable, "-m", "companion", "grade", ".", "--out", str(out),
                             "--jobs", "4", "--cell-timeout", "45", "--exercise-timeout", "20",
                             "--output-cap", "64KiB", "--source", str(gn.COURSE), *run_as,
                             *gn.trust()],
                            cwd=folder, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "grades.json").read_text())
    return {"rows": rows, "out": out, "stdout": result.stdout, "folder": folder, "before": before,
            "by": {(r["notebook"], r["exercise"]): r for r in rows}}


def _rows(batch, notebook: str) -> dict[str, dict]:
    return {r["exercise"]: r for r in batch["rows"] if r["notebook"] == notebook}


def _flags(batch, notebook: str) -> str:
    return next(iter(_rows(batch, notebook).values()))["flags"]


# ---------------------------------------------------------------- honest notebooks

@pytest.mark.parametrize("chapter", HONEST)
def test_honest_notebooks_get_full_marks_beside_the_cheats(batch, chapter):
    name = "=2+3.ipynb" if chapter == "01" else f"honest_{chapter}.ipynb"
    rows = _rows(batch, name)
    assert rows and all(r["passed"] and r["points"] == r["max_points"] for r in rows.values()), \
        {k: (r["status"], r["message"][:200]) for k, r in rows.items()}
    ran = "ran as " if ROOT else "ran with your permissions"      # as nobody, or a uid of
    assert ran in _flags(batch, name) and "review" not in _flags(batch, name)   # its own


def test_a_fresh_workbook_scores_zero_with_not_done_yet(batch):
    rows = _rows(batch, "fresh_workbook_01.ipynb")
    assert len(rows) == 3 and all(r["points"] == 0 and r["status"] == "not done" and
                                  r["message"].startswith("not done yet") for r in rows.values())


def test_graded_notebooks_are_not_modified(batch):
    assert {p.name: p.read_bytes() for p in batch["folder"].iterdir()} == batch["before"]


# ---------------------------------------------------------------- cheats

def test_forged_records_deleted_and_duplicated_checks(batch):
    rows = _rows(batch, "cheat_forged.ipynb")
    assert rows["mse_gradient"]["points"] == 0 and rows["mse_gradient"]["status"] == "failed"
    assert rows["largest_stable_lr"]["status"] == "tampered" and "deleted" in rows["largest_stable_lr"]["message"]
    assert rows["train_epoch"]["points"] == 2 and "ignored" in rows["train_epoch"]["message"]
    assert sum(r["points"] for r in rows.values()) == 2
    assert "check-result record" in _flags(batch, "cheat_forged.ipynb")


def test_patched_checks_tensor_subclasses_and_the_reference_earn_nothing(batch):
    rows = _rows(batch, "cheat_patched.ipynb")
    assert "divide the sums by m" in rows["mse_gradient"]["message"]
    assert rows["largest_stable_lr"]["status"] == "failed" and "subclass" in rows["largest_stable_lr"]["message"]
    assert rows["train_epoch"]["status"] == "reference"
    assert "companion.gd.train_epoch" in rows["train_epoch"]["message"]
    assert sum(r["points"] for r in rows.values()) == 0
    assert "check or grading code" in _flags(batch, "cheat_patched.ipynb")


def test_cancelled_timers_and_ignored_interrupts_are_killed_and_the_rest_graded(batch):
    rows = _rows(batch, "cheat_hangs.ipynb")
    assert rows["mse_gradient"]["status"] == "failed"
    assert "did not finish" in rows["mse_gradient"]["message"]
    assert rows["largest_stable_lr"]["passed"], rows["largest_stable_lr"]["message"]       # after a restart
    assert rows["train_epoch"]["status"] == "reference"                  # seen while it ran
    flags = _flags(batch, "cheat_hangs.ipynb")
    assert "lost 1 time(s)" in flags and "timers or signal handlers" in flags
    deaf = _rows(batch, "cheat_deaf.ipynb")
    assert deaf["largest_stable_lr"]["passed"] and deaf["train_epoch"]["passed"], deaf
    assert "lost 2 time(s)" in _flags(batch, "cheat_deaf.ipynb")     # the cell, the reply


def test_a_notebook_cannot_kill_the_grader_or_leave_processes_behind(batch):
    rows = _rows(batch, "cheat_rough.ipynb")
    assert rows["mse_gradient"]["passed"] and rows["train_epoch"]["passed"]
    assert rows["largest_stable_lr"]["points"] == 0 and "ended while your code ran" in \
        rows["largest_stable_lr"]["message"]
    flags = _flags(batch, "cheat_rough.ipynb")
    assert re.search(r"printed 3\.\d MiB; the grader kept 0\.1 MiB", flags), flags
    assert "other processes" in flags or not ROOT
    assert _lingering() == []


@pytest.mark.skipif(not ROOT, reason="kill(-1) as yourself would end the tests too; "
                                     f"{gn.sandbox_blocked()}")
def test_notebooks_graded_together_run_as_different_users(batch):
    rows = _rows(batch, "cheat_kill_all.ipynb")          # kill(-1) spares the caller itself
    assert all(r["passed"] for r in rows.values()), rows
    assert "other processes" in _flags(batch, "cheat_kill_all.ipynb")
    users = {re.search(r"ran as [^;]*", r["flags"]).group() for r in batch["rows"]
             if r["status"] != "unreadable"}
    assert len(users) == 4, users                 # --jobs 4: nobody and three uids of their own


def test_a_watcher_switched_off_in_the_notebook_changes_nothing(batch):
    rows = _rows(batch, "cheat_disarm.ipynb")       # setprofile(None), frames walked, gc-patched
    for name in ("mse_gradient", "largest_stable_lr", "train_epoch"):      # server, exec of the source
        assert rows[name]["status"] == "reference" and "withholds" in rows[name]["message"], \
            (name, rows[name]["message"])
    flags = _flags(batch, "cheat_disarm.ipynb")
    for words in ("frames or the garbage collector", "runs code it builds", "names it computes"):
        assert words in flags, flags


def test_a_thread_an_equivalent_function_and_a_huge_reply_earn_nothing(batch):
    rows = _rows(batch, "cheat_served.ipynb")
    assert rows["mse_gradient"]["status"] == "reference"                  # torch_sgd_step
    assert "companion.gd.torch_sgd_step" in rows["mse_gradient"]["message"]
    assert rows["train_epoch"]["points"] == 0 and "on its own" in rows["train_epoch"]["message"]
    assert rows["largest_stable_lr"]["passed"]                                     # the rest keeps its grade
    assert "starts threads" in _flags(batch, "cheat_served.ipynb")
    big = _rows(batch, "cheat_deaf.ipynb")
    assert big["mse_gradient"]["status"] == "failed" and "refused" in \
        big["mse_gradient"]["message"] and "150.0 MiB" in big["mse_gradient"]["message"]
    assert big["largest_stable_lr"]["passed"] and big["train_epoch"]["passed"]


def test_harness_checks_fail_wrong_answers_with_their_hints(batch):
    ch03, ch04, ch06 = (_rows(batch, f"harness_{n}.ipynb") for n in ("03", "04", "06"))
    assert "optimizer.step() ran" in ch03["accumulation_step"]["message"]
    assert ch03["batch_size_search"]["passed"] and ch03["token_normalized_step"]["passed"]
    assert "same masks" in ch04["checkpoint_function"]["message"]
    assert ch04["checkpoint_plan"]["status"] == "reference"
    assert ch04["saved_bytes"]["passed"] and ch04["selective_policy"]["passed"]
    assert ch06["ring_all_reduce"]["status"] == "failed" and "collective" in \
        ch06["ring_all_reduce"]["message"]
    assert ch06["bucketed_hooks"]["status"] == "reference"


# ---------------------------------------------------------------- bad files and the reports

def test_files_that_are_not_notebooks_become_rows_with_the_reason(batch):
    for name, words in [("bad_json.ipynb", "not a readable notebook"), ("empty.ipynb", "empty"),
                        ("binary.ipynb", "not a readable notebook"),
                        ("no_cells.ipynb", "not a readable notebook")]:
        (row,) = _rows(batch, name).values()
        assert row["status"] == "unreadable" and words in row["message"], row
    rows = _rows(batch, "01_gradient_descent_broken.ipynb")     # its name says which chapter
    assert set(rows) == {"mse_gradient", "largest_stable_lr", "train_epoch"}
    assert all(r["status"] == "unreadable" and r["max_points"] > 0 for r in rows.values())


def test_reports_escape_formulas_and_carry_a_digest(batch):
    out = batch["out"]
    records = list(csv.DictReader((out / "grades.csv").open(newline="")))
    assert {r["notebook"] for r in records if "2+3" in r["notebook"]} == {"'=2+3.ipynb"}
    for line in (out / "grades.sha256").read_text().splitlines():
        digest, name = line.split("  ")
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
        assert line in batch["stdout"]


def test_a_missing_path_is_a_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "companion", "grade", str(tmp_path / "no.ipynb")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no such notebook" in result.stderr

