"""Workbooks: no solution survives, outputs are cleared, a learner's file is never overwritten."""
import pathlib

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from companion.notebooks import BEGIN, END, SolutionMarkerError, make_workbooks, strip_solutions

COURSE = pathlib.Path(__file__).resolve().parent.parent / "course"
SOURCES = sorted(COURSE.glob("[0-9][0-9]_*.ipynb"))


def _solution_lines(nb) -> list[str]:
    """Every non-empty line that sits between solution markers."""
    lines, inside = [], False
    for cell in nb.cells:
        for line in cell.source.splitlines():
            if line.strip() == BEGIN:
                inside = True
            elif line.strip() == END:
                inside = False
            elif inside and line.strip():
                lines.append(line.strip())
    return lines


def _outside_solutions(nb) -> str:
    """The notebook's text outside solution blocks: lines there are not solution text (a demo may
    call `loss.backward()` too)."""
    kept, inside = [], False
    for cell in nb.cells:
        for line in cell.source.splitlines():
            if line.strip() in (BEGIN, END):
                inside = line.strip() == BEGIN
            elif not inside:
                kept.append(line)
    return "\n".join(kept)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_solution_text_survives(source):
    nb = nbformat.read(source, as_version=4)
    solutions = _solution_lines(nb)
    assert solutions, f"{source.name} has no exercises"
    workbook = strip_solutions(nb)
    text = "\n".join(c.source for c in workbook.cells)
    assert BEGIN not in text and END not in text
    survivors = [line for line in solutions
                 if len(line) > 12 and line in text and line not in _outside_solutions(nb)]
    assert not survivors, f"solution lines left in the workbook: {survivors}"
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in workbook.cells if c.cell_type == "code")


def test_stub_keeps_indentation_and_says_the_size():
    nb = new_notebook(cells=[new_code_cell(
        f"def f(x):\n    '''doc'''\n    {BEGIN}\n    y = x + 1\n\n    return y\n    {END}\n\ncheck_f(f)")])
    source = strip_solutions(nb).cells[0].source
    assert source.splitlines()[2].startswith("    raise NotImplementedError(")
    assert "about 2 lines" in source and "check_f(f)" in source and "'''doc'''" in source
    compile(source, "cell", "exec")


def test_markdown_answers_are_stripped_too():
    nb = new_notebook(cells=[new_markdown_cell(f"Why?\n{BEGIN}\nBecause.\n{END}")])
    assert "Because" not in strip_solutions(nb).cells[0].source


@pytest.mark.parametrize("source", [f"{BEGIN}\nx = 1", f"x = 1\n{END}", f"{BEGIN}\n{BEGIN}\n{END}"])
def test_unpaired_markers_are_an_error(source):
    with pytest.raises(SolutionMarkerError, match="cell 0"):
        strip_solutions(new_notebook(cells=[new_code_cell(source)]))


def test_make_workbooks_never_overwrites(tmp_path):
    source, dest = tmp_path / "course", tmp_path / "workbook"
    source.mkdir()
    for name in ("01_a.ipynb", "02_b.ipynb"):
        nbformat.write(new_notebook(cells=[new_code_cell(f"{BEGIN}\nx = 1\n{END}")]), source / name)
    first = make_workbooks(source, dest)
    assert sorted(p.name for p in first["created"]) == ["01_a.ipynb", "02_b.ipynb"]
    mine = dest / "01_a.ipynb"
    nb = nbformat.read(mine, as_version=4)
    nb.cells[0].source = "x = 42  # my own work"
    nbformat.write(nb, mine)
    before = mine.read_bytes()
    (dest / "02_b.ipynb").unlink()
    second = make_workbooks(source, dest)
    assert mine.read_bytes() == before
    assert [p.name for p in second["created"]] == ["02_b.ipynb"] and second["kept"] == [mine]


def test_every_course_notebook_makes_a_workbook(tmp_path):
    created = make_workbooks(COURSE, tmp_path)["created"]
    assert sorted(p.name for p in created) == [p.name for p in SOURCES]
