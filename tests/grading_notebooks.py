"""Notebooks for the grading tests, built from the course's source notebooks.

`trimmed(chapter)` keeps the setup cell and the exercise cells (the demos are left out: the
grader needs neither, and the tests run in seconds instead of minutes), each solution with one line
of the learner's own (`own`): the course's solutions as they are, copied, score `reference`
(`trimmed(chapter, verbatim=True)`). `edit` changes one cell,
found by its id, the way a learner would in JupyterLab.
"""
import functools
import os
import pathlib
import pwd

import nbformat

from companion.grader.expected import read_chapter
from companion.notebooks import strip_solutions

REPO = pathlib.Path(__file__).resolve().parent.parent
COURSE = REPO / "course"

# chapter 01's cells: setup, then the three exercises (function and check line in one cell)
SETUP, MSE, SGD, EPOCH = "6604fae2", "2708ca2b", "ba777239", "d86cb309"


def source(chapter: str) -> pathlib.Path:
    return next(COURSE.glob(f"{chapter}_*.ipynb"))


OWN = "_ = None  # my own answer, worked out on paper"


def own(nb) -> nbformat.NotebookNode:
    """The solutions as a learner might type them: the course's code with a line of their own in
    each (a statement, not a comment: a copy is told apart as parsed code, comments aside)."""
    for cell in nb.cells:
        lines = cell.source.split("\n")
        for i in reversed(range(len(lines))):
            if "### BEGIN SOLUTION" in lines[i]:
                indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
                lines.insert(i + 1, indent + OWN)
        cell.source = "\n".join(lines)
    return nb


def trimmed(chapter: str, *, solved: bool = True, verbatim: bool = False) -> nbformat.NotebookNode:
    """The chapter's setup cell and exercise cells, with solutions written as a learner's own
    (the course's own with `verbatim`), or as a fresh workbook."""
    path = source(chapter)
    exercises = read_chapter(path).exercises
    keep = {e.cell_id for e in exercises} | {e.solution_cell_id for e in exercises}
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    nb.cells = [code[0]] + [c for c in code[1:] if c.get("id") in keep]
    nb = strip_solutions(nb) if not solved else nb if verbatim else own(nb)
    for cell in nb.cells:
        cell.outputs, cell.execution_count = [], None
    return nb


def cell(nb, cell_id: str):
    return next(c for c in nb.cells if c.get("id") == cell_id)


def edit(nb, cell_id: str, old: str, new: str) -> nbformat.NotebookNode:
    """Replace `old` by `new` in one cell (old must be there)."""
    target = cell(nb, cell_id)
    assert old in target.source, (cell_id, old)
    target.source = target.source.replace(old, new)
    return nb


def body(nb, cell_id: str, code: str) -> nbformat.NotebookNode:
    """Replace the solution between the markers (or the workbook's stub) by `code`."""
    target = cell(nb, cell_id)
    lines = target.source.splitlines()
    start = next(i for i, ln in enumerate(lines) if "BEGIN SOLUTION" in ln or "NotImplementedError"
                 in ln)
    end = next(i for i, ln in enumerate(lines) if "END SOLUTION" in ln or "NotImplementedError"
               in ln and i >= start)
    indent = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
    new = [indent + ln for ln in code.strip("\n").splitlines()]
    target.source = "\n".join(lines[:start] + new + lines[end + 1:])
    return nb


def insert(nb, after_id: str | None, code: str) -> nbformat.NotebookNode:
    """A new code cell after the cell `after_id` (at the end when None)."""
    new = nbformat.v4.new_code_cell(code)
    index = len(nb.cells) if after_id is None else \
        next(i for i, c in enumerate(nb.cells) if c.get("id") == after_id) + 1
    nb.cells.insert(index, new)
    return nb


def save(nb, path: pathlib.Path) -> pathlib.Path:
    nbformat.write(nb, path)
    return path


@functools.cache
def sandbox_blocked() -> str:
    """Why the grader cannot run notebooks as `nobody` here ('' when it can): not root, or a
    Python or checkout that user cannot reach (a clone under /root or in a mode-700 folder)."""
    if os.geteuid() != 0:
        return "running notebooks as another user needs root"
    from companion.grader.batch import child_env
    from companion.grader.sandbox import unreachable
    entry = pwd.getpwnam("nobody")
    why = unreachable((entry.pw_uid, entry.pw_gid), child_env())
    return f"nobody cannot run this Python or import the course: {why}" if why else ""


@functools.lru_cache(maxsize=None)
def kernel_sandbox_blocked() -> str:
    """Why the grader's bubblewrap sandbox cannot run here ('' when it can): no bwrap, or no
    namespaces. The grading tests then grade with --trusted, and the sandbox's own tests skip."""
    from companion.grader.batch import child_env
    from companion.grader.confine import available
    return available(None, child_env())


def trust() -> list[str]:
    """["--trusted"] where the kernel sandbox cannot run (see `kernel_sandbox_blocked`)."""
    return ["--trusted"] if kernel_sandbox_blocked() else []
