"""What the grader expects of a notebook, read from the course's source notebook, never from the
submission; and how a submission is turned into steps to run.

The source notebook names each exercise's check call (`check_mse_gradient(mse_gradient)`), the cell
it sits in (cell ids survive `strip_solutions` and editing in JupyterLab) and the cell holding the
solution; points, time limits and references come from the check registry. A submission is matched
to its chapter by those cell ids (or its file name); then every top-level call of a registered
check is taken out of its cells (the grader runs each check itself, once), and an exercise whose
check line was deleted or changed is reported as tampered.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import re

import nbformat

__all__ = ["Exercise", "Chapter", "Step", "Plan", "read_chapter", "match_chapter", "make_plan",
           "python_of"]

_CHECK_IMPORT = re.compile(r"companion\.checks\.(ch\d\d)\b")


@dataclasses.dataclass
class Exercise:
    check: str                 # check_mse_gradient
    points: int
    answer: str                # the name the check is called with: mse_gradient
    cell_id: str               # the cell holding the check line
    statement: str             # ast.dump of the check call, to compare with the submission's
    line: str                  # the check line as written
    solution_cell_id: str      # the cell holding the solution (the same one, or the one before)
    references: tuple[str, ...]
    timeout: float
    optional: bool = False     # under "### Exercise N · ... (optional, P points)": a deep dive's

    @property
    def name(self) -> str:
        return self.check.removeprefix("check_")


@dataclasses.dataclass
class Chapter:
    path: pathlib.Path
    exercises: list[Exercise]
    cell_ids: set[str]
    error: str = ""            # why its checks cannot be read (a chapter still being written)


@dataclasses.dataclass
class Step:
    kind: str                  # "exec" or "check"
    source: str = ""
    cell: int = -1
    exercise: Exercise | None = None
    before_failed: bool = False   # filled in while running: its cell stopped before the check


@dataclasses.dataclass
class Plan:
    steps: list[Step]
    tampered: dict[str, str]   # check -> why it scores 0
    notes: dict[str, list[str]]


def python_of(source: str) -> ast.Module | None:
    """A cell's code as Python (IPython magics translated), or None if it does not parse."""
    from IPython.core.inputtransformer2 import TransformerManager
    try:
        code = TransformerManager().transform_cell(source)
        tree = ast.parse(code)
    except (SyntaxError, ValueError, IndexError):
        return None
    same_lines = code.rstrip("\n").count("\n") == source.rstrip("\n").count("\n")
    return tree if same_lines else None             # a cell magic: one call, not its lines


def _check_calls(tree: ast.Module | None, names) -> list[tuple[str, ast.Expr]]:
    """Top-level statements that call a registered check: [(check name, statement)]."""
    found = []
    for node in tree.body if tree is not None else []:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id in names:
            found.append((node.value.func.id, node))
    return found


def _registry(cells) -> dict:
    """Import the check modules a notebook imports; return the registry."""
    from companion.checks.core import REGISTRY
    for cell in cells:
        for module in _CHECK_IMPORT.findall(cell.source):
            importlib.import_module(f"companion.checks.{module}")
    return REGISTRY


def read_chapter(path: str | pathlib.Path) -> Chapter:
    """The exercises of one source notebook, in order, with their points and references; a
    chapter whose check module does not import has none, and says why in `error`."""
    path = pathlib.Path(path)
    nb = nbformat.read(path, as_version=4)
    ids = {c.get("id", "") for c in nb.cells} - {""}
    try:
        registry = _registry(nb.cells)
    except Exception as e:
        return Chapter(path, [], ids, f"its checks do not import ({type(e).__name__}: {e})")
    exercises, solution_id, optional = [], "", False
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#") and " Exercise " in line:
                    optional = "(optional," in line     # the heading the next check is under
            continue
        if cell.cell_type != "code":
            continue
        if "### BEGIN SOLUTION" in cell.source:
            solution_id = cell.get("id", "")
        for name, node in _check_calls(python_of(cell.source), registry):
            arg = node.value.args[0] if node.value.args else None
            info = registry[name]
            exercises.append(Exercise(
                name, info.points, arg.id if isinstance(arg, ast.Name) else "", cell.get("id", ""),
                ast.dump(node.value), ast.unparse(node.value), solution_id, info.reference,
                info.timeout, optional))
    return Chapter(path, exercises, ids)


def match_chapter(nb, filename: str, chapters: list[Chapter]) -> Chapter | None:
    """The chapter whose cell ids the submission shares most; else the one its file name names."""
    ids = {c.get("id", "") for c in nb.cells} - {""}
    best = max(chapters, key=lambda ch: len(ids & ch.cell_ids), default=None)
    if best is not None and ids & best.cell_ids:
        return best
    stem = pathlib.Path(filename).stem
    for chapter in chapters:
        number = chapter.path.stem.split("_", 1)[0]
        if chapter.path.stem in stem or re.match(rf"^{number}(\D|$)", stem):
            return chapter
    return None


def make_plan(nb, chapter: Chapter) -> Plan:
    """The submission's cells as steps, check calls taken out, each expected check once, where
    its line is; exercises whose check line is missing or changed are `tampered`."""
    from companion.checks.core import REGISTRY
    cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    trees = {i: python_of(c.source) for i, c in cells}
    calls = {i: _check_calls(trees[i], REGISTRY) for i, _ in cells}
    placed, tampered, notes = {}, {}, {}
    for ex in chapter.exercises:
        spots = [(i, node) for i, c in cells for name, node in calls[i]
                 if ast.dump(node.value) == ex.statement]
        own = [(i, node) for i, node in spots if nb.cells[i].get("id", "") == ex.cell_id]
        if own or spots:
            placed[(own or spots)[0][0], (own or spots)[0][1].lineno] = ex
            if not own:
                notes.setdefault(ex.check, []).append("its check line was found in another cell")
        else:
            tampered[ex.check] = _why_missing(ex, nb, calls)
        extra = sum(name == ex.check for i, _ in cells for name, _ in calls[i]) - bool(spots)
        if extra > 0:
            notes.setdefault(ex.check, []).append(
                f"{extra} more call(s) of {ex.check} ignored: a check counts once")
    steps = []
    for i, cell in cells:
        steps += _cell_steps(i, cell.source, calls[i], placed)
    return Plan(steps, tampered, notes)


def _why_missing(ex: Exercise, nb, calls) -> str:
    changed = [ast.unparse(node.value) for i, c in enumerate(nb.cells) if i in calls
               for name, node in calls[i] if name == ex.check]
    if changed:
        return f"tampered: the check line was changed to `{changed[0][:120]}` (it must read " \
               f"`{ex.line}`)"
    return f"tampered: the check line `{ex.line}` was deleted (or its cell was)"


def _cell_steps(index: int, source: str, calls, placed: dict) -> list[Step]:
    """One cell as exec steps around its check steps, with every check call cut out."""
    if not calls:
        return [Step("exec", source, index)] if source.strip() else []
    lines, steps, start = source.splitlines(keepends=True), [], 0
    for _, node in calls:
        part = "".join(lines[start:node.lineno - 1])
        if part.strip():
            steps.append(Step("exec", part, index))
        if (index, node.lineno) in placed:
            steps.append(Step("check", cell=index, exercise=placed[index, node.lineno]))
        start = node.end_lineno
    rest = "".join(lines[start:])
    if rest.strip():
        steps.append(Step("exec", rest, index))
    return steps
