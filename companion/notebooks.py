"""Source notebooks and learner workbooks: strip solutions, make workbooks, execute notebooks.

Source notebooks in course/ hold the solutions between nbgrader's markers:

    def mse_gradient(X, y, w, b):
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

A learner's workbook is the same notebook with each solution replaced by a stub that raises
NotImplementedError (with a hint of the solution's size) and all outputs cleared. `make_workbooks`
creates only the workbooks that do not exist yet: a learner's work is never overwritten.
`reset_workbook` gives a learner a fresh copy of one chapter after moving theirs to a backup
(`find_chapter` checks a chapter's name first).
"""
from __future__ import annotations

import copy
import datetime
import pathlib
import re

import nbformat

__all__ = ["strip_solutions", "make_workbooks", "find_chapter", "reset_workbook", "execute",
           "SolutionMarkerError"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_MARKER = re.compile(r"^(\s*)(### (?:BEGIN|END) SOLUTION)\s*$")


class SolutionMarkerError(ValueError):
    """A cell's solution markers do not pair up."""


def _stub(indent: str, n_lines: int, markdown: bool) -> list[str]:
    size = f"about {n_lines} line{'s' if n_lines != 1 else ''}"
    if markdown:
        return [f"*Your answer here ({size} in the reference answer).*"]
    return [f'{indent}raise NotImplementedError("Exercise: replace this line with your code '
            f'({size} in the reference solution).")']


def _strip_source(source: str, *, markdown: bool, where: str) -> str:
    out: list[str] = []
    inside: tuple[str, int] | None = None          # (indent, lines seen) while in a solution
    for line in source.splitlines():
        match = _MARKER.match(line)
        if match and match.group(2) == BEGIN:
            if inside is not None:
                raise SolutionMarkerError(f"{where}: {BEGIN} inside another solution")
            inside = (match.group(1), 0)
        elif match:
            if inside is None:
                raise SolutionMarkerError(f"{where}: {END} without {BEGIN}")
            out += _stub(inside[0], inside[1], markdown)
            inside = None
        elif inside is not None:
            inside = (inside[0], inside[1] + bool(line.strip()))
        else:
            out.append(line)
    if inside is not None:
        raise SolutionMarkerError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out)


def strip_solutions(nb: nbformat.NotebookNode, *, name: str = "notebook") -> nbformat.NotebookNode:
    """A copy of `nb` with every solution replaced by a stub and every output cleared."""
    nb = copy.deepcopy(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type in ("code", "markdown"):
            cell.source = _strip_source(cell.source, markdown=cell.cell_type == "markdown",
                                        where=f"{name}, cell {i}")
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def _fresh_text(src: pathlib.Path) -> str:
    """The text of a fresh workbook for source notebook `src`, as make_workbooks writes it."""
    text = nbformat.writes(strip_solutions(nbformat.read(src, as_version=4), name=src.name))
    return text if text.endswith("\n") else text + "\n"


def _create(path: pathlib.Path, text: str) -> None:
    with open(path, "x", encoding="utf-8", newline="\n") as f:   # "x": never replace a file
        f.write(text)


def make_workbooks(source_dir: str | pathlib.Path, dest_dir: str | pathlib.Path) -> dict[str, list]:
    """Write a workbook for each source notebook that has none yet in `dest_dir`.

    Returns {"created": [...], "kept": [...]}: existing workbooks are left exactly as they are."""
    source_dir, dest_dir = pathlib.Path(source_dir), pathlib.Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, list] = {"created": [], "kept": []}
    for src in sorted(source_dir.glob("[0-9][0-9]_*.ipynb")):
        dest = dest_dir / src.name
        if dest.exists():
            report["kept"].append(dest)
            continue
        _create(dest, _fresh_text(src))
        report["created"].append(dest)
    return report


def find_chapter(chapter: str, source_dir: str | pathlib.Path) -> pathlib.Path:
    """The source notebook of chapter `chapter` ("01", "1" or "01_gradient_descent").

    Raises ValueError naming `chapter` and the chapters that exist when it matches none."""
    chapters = sorted(pathlib.Path(source_dir).glob("[0-9][0-9]_*.ipynb"))
    key = chapter.removesuffix(".ipynb")
    key = f"{int(key):02d}" if key.isdigit() else key
    found = [p for p in chapters if p.stem == key or p.stem.split("_", 1)[0] == key]
    if len(found) != 1:
        names = ", ".join(p.stem.split("_", 1)[0] for p in chapters)
        raise ValueError(f"no chapter {chapter!r}: choose one of {names}")
    return found[0]


def reset_workbook(chapter: str, source_dir: str | pathlib.Path, dest_dir: str | pathlib.Path, *,
                   now: datetime.datetime | None = None) -> tuple[pathlib.Path | None, pathlib.Path]:
    """Give chapter `chapter` ("01", "1" or "01_gradient_descent") a fresh workbook.

    The learner's file, if any, is first *moved* to dest_dir/backups/NN_name.<time>.ipynb (a name
    that does not exist yet: a backup is never overwritten either), unless it is byte for byte a
    fresh workbook already: then nothing is moved or written. Returns (backup or None, workbook).
    Raises ValueError naming the chapters when `chapter` matches none (see find_chapter)."""
    src, dest_dir = find_chapter(chapter, source_dir), pathlib.Path(dest_dir)
    mine, text = dest_dir / src.name, _fresh_text(src)
    if mine.exists() and mine.read_bytes() == text.encode("utf-8"):
        return None, mine                       # untouched: a backup would be a copy of nothing
    dest_dir.mkdir(parents=True, exist_ok=True)
    backup = None
    if mine.exists():
        stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
        (dest_dir / "backups").mkdir(parents=True, exist_ok=True)
        backup = dest_dir / "backups" / f"{src.stem}.{stamp}.ipynb"
        n = 1
        while backup.exists():
            n += 1
            backup = backup.with_name(f"{src.stem}.{stamp}-{n}.ipynb")
        mine.rename(backup)                     # same folder tree: a move, never a copy-and-delete
    _create(mine, text)
    return backup, mine


def execute(path: str | pathlib.Path, *, timeout: int = 600) -> None:
    """Run a notebook top to bottom in a fresh kernel and save it with its outputs."""
    from nbclient import NotebookClient

    path = pathlib.Path(path)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
