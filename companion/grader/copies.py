"""Answers that are the course's own solutions: the source notebook's solution code, copied.

The source notebook holds each exercise's solution between `### BEGIN SOLUTION` and `### END
SOLUTION`. An exercise is copied when every top-level statement of its solution cell that holds
solution lines (the `def`, the `class`, or the statements themselves) appears among the
submission's top-level statements, compared as parsed code: `ast.dump` of each statement, with
docstrings left out, so comments, blank lines, line breaks, quotes and spacing do not matter
(renamed variables do: an answer written anew is not a copy). A whole source notebook submitted is
the same case for every exercise.

A short solution (under `MIN_NODES` nodes of code between its markers: a few lines) is one an
honest learner may write exactly as the course does; it counts as copied only beside a longer
solution of the same submission that is copied too, or where it comes inside the source's
`### BEGIN SOLUTION` markers (the solution cell pasted: no workbook has them).
"""
from __future__ import annotations

import ast
import dataclasses

from companion.grader.expected import Chapter, Exercise, python_of

__all__ = ["MIN_NODES", "Solution", "solutions", "copied_solutions"]

# Solutions shorter than this, in AST nodes between the markers, are not taken as copies on their
# own (without the source's markers): over the exercises of chapters 00-11, 10 are (14 to 39
# nodes: a return, a loop, a pair of hooks), as a review counted.
MIN_NODES = 40


@dataclasses.dataclass(frozen=True)
class Solution:
    keys: frozenset[str]       # the solution's top-level statements, normalised
    nodes: int                 # AST nodes between its markers


def _code(source: str) -> ast.Module | None:
    if source.lstrip().startswith("%%"):             # %%worker_module NAME: its body
        source = source.split("\n", 1)[1] if "\n" in source else ""
    return python_of(source)


def _lines(source: str) -> list[str]:
    if source.lstrip().startswith("%%"):
        source = source.split("\n", 1)[1] if "\n" in source else ""
    return source.splitlines()


def _without_docstrings(node: ast.AST) -> ast.AST:
    for each in ast.walk(node):
        body = getattr(each, "body", None)
        if isinstance(each, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) \
                and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            each.body = body[1:] or [ast.Pass()]
    return node


def _key(statement: ast.stmt) -> str:
    return ast.dump(_without_docstrings(statement))


def _regions(lines: list[str]) -> list[tuple[int, int]]:
    """(begin, end) line numbers (1-based) of each BEGIN SOLUTION ... END SOLUTION pair."""
    regions, begin = [], None
    for number, line in enumerate(lines, 1):
        if "### BEGIN SOLUTION" in line:
            begin = number
        elif "### END SOLUTION" in line and begin is not None:
            regions.append((begin, number))
            begin = None
    return regions


def solutions(source_nb, chapter: Chapter) -> dict[str, Solution]:
    """Each exercise's solution in the source notebook, by check name (exercises whose solution
    cell has no markers, or does not parse, have none)."""
    cells = {c.get("id", ""): c for c in source_nb.cells if c.cell_type == "code"}
    out = {}
    for ex in chapter.exercises:
        cell = cells.get(ex.solution_cell_id)
        tree = _code(cell.source) if cell is not None else None
        regions = _regions(_lines(cell.source)) if cell is not None else []
        if tree is None or not regions:
            continue
        held = [s for s in tree.body
                if any(s.lineno <= end and s.end_lineno >= begin for begin, end in regions)]
        nodes = sum(1 for s in held for n in ast.walk(s)
                    if any(begin < getattr(n, "lineno", 0) < end for begin, end in regions))
        if held:
            out[ex.check] = Solution(frozenset(_key(s) for s in held), nodes)
    return out


def copied_solutions(nb, source_nb, chapter: Chapter) -> dict[str, str]:
    """{check: why it is `reference`} for each exercise whose solution the submission copies."""
    theirs, marked = set(), set()       # marked: statements inside the course's own markers
    for cell in nb.cells:
        if cell.cell_type == "code":
            tree = _code(cell.source)
            keys = {_key(s) for s in tree.body} if tree is not None else set()
            theirs |= keys
            if tree is not None and _regions(_lines(cell.source)):
                marked |= keys
    found = {check: s for check, s in solutions(source_nb, chapter).items() if s.keys <= theirs}
    if not any(s.nodes >= MIN_NODES for s in found.values()):
        # A short solution alone counts only where it comes with the source's solution markers,
        # which no workbook has: the solution cell itself pasted.
        found = {check: s for check, s in found.items() if s.keys <= marked}
    by_check = {ex.check: ex for ex in chapter.exercises}
    return {check: _message(by_check[check]) for check in found}


def _message(ex: Exercise) -> str:
    return (f"its code is the course's solution for this exercise, copied (the source notebook's "
            f"solution for `{ex.answer}`, statement for statement, whatever the comments and "
            "layout): write it yourself")
