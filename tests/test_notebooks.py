"""Workbooks: no solution survives, outputs are cleared, a learner's file is never overwritten."""
import datetime
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from companion.notebooks import (BEGIN, END, SolutionMarkerError, make_workbooks, reset_workbook,
                                 strip_solutions)

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


def _chapter_dir(tmp_path):
    source = tmp_path / "course"
    source.mkdir()
    for name in ("01_a.ipynb", "02_b.ipynb"):
        nbformat.write(new_notebook(cells=[new_code_cell(f"{BEGIN}\nx = 1\n{END}")]), source / name)
    return source


def test_reset_keeps_the_old_workbook_as_a_backup_and_writes_a_fresh_one(tmp_path):
    source, dest = _chapter_dir(tmp_path), tmp_path / "workbook"
    make_workbooks(source, dest)
    mine, when = dest / "01_a.ipynb", datetime.datetime(2026, 1, 2, 3, 4, 5)
    backups, works = [], []
    for _ in range(3):                                    # three resets in the same second
        nbformat.write(new_notebook(cells=[new_code_cell("x = 42  # my own work")]), mine)
        works.append(mine.read_bytes())
        backups.append(reset_workbook("1", source, dest, now=when)[0])
    assert [b.name for b in backups] == ["01_a.20260102-030405.ipynb",
                                         "01_a.20260102-030405-2.ipynb",
                                         "01_a.20260102-030405-3.ipynb"]
    assert [b.read_bytes() for b in backups] == works     # the learner's work, byte for byte
    assert "my own work" not in mine.read_text() and "NotImplementedError" in mine.read_text()
    assert (dest / "02_b.ipynb").exists()                 # other chapters untouched


def test_reset_of_a_missing_workbook_just_creates_it(tmp_path):
    source, dest = _chapter_dir(tmp_path), tmp_path / "workbook"    # no workbook/ folder yet
    backup, fresh = reset_workbook("02_b", source, dest)
    assert backup is None and fresh.exists() and not (dest / "backups").exists()


@pytest.mark.parametrize("chapter", ["7", "ab", "0"])
def test_reset_of_an_unknown_chapter_names_the_chapters(tmp_path, chapter):
    source = _chapter_dir(tmp_path)
    with pytest.raises(ValueError, match="choose one of 01, 02"):
        reset_workbook(chapter, source, tmp_path / "workbook")


def test_reset_of_an_untouched_workbook_makes_no_backup(tmp_path):
    source, dest = _chapter_dir(tmp_path), tmp_path / "workbook"
    make_workbooks(source, dest)
    fresh = (dest / "01_a.ipynb").read_bytes()
    assert [reset_workbook("01", source, dest)[0] for _ in range(2)] == [None, None]
    assert (dest / "01_a.ipynb").read_bytes() == fresh and not (dest / "backups").exists()
    (dest / "01_a.ipynb").write_bytes(fresh + b" ")       # one byte more is the learner's: kept
    backup, _ = reset_workbook("01", source, dest)
    assert backup.read_bytes() == fresh + b" " and (dest / "01_a.ipynb").read_bytes() == fresh


def test_reset_command(tmp_path):
    source, dest = _chapter_dir(tmp_path), tmp_path / "workbook"
    make_workbooks(source, dest)
    nbformat.write(new_notebook(cells=[new_code_cell("x = 42  # my own work")]), dest / "01_a.ipynb")
    args = [sys.executable, "-m", "companion", "reset", "--source", str(source), "--dest", str(dest)]
    done = subprocess.run([*args, "01", "02"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "your old work, kept" in done.stdout and "02_b.ipynb (already fresh" in done.stdout
    assert len(list((dest / "backups").iterdir())) == 1
    (dest / "01_a.ipynb").write_text("my work again")
    before = {p: p.read_bytes() for p in dest.rglob("*.ipynb")}
    bad = subprocess.run([*args, "01", "09", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "no chapter '09': choose one of 01, 02" in bad.stderr and "no chapter 'x'" in bad.stderr
    assert {p: p.read_bytes() for p in dest.rglob("*.ipynb")} == before    # nothing moved


HEADING = re.compile(r"^#{2,4} Exercise (\d+) · .+ \((?:optional, )?(\d+) points?\)$", re.MULTILINE)
CHECK_CALL = re.compile(r"^(check_\w+)\(", re.MULTILINE)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_each_exercise_heading_shows_the_points_its_check_gives(source):
    """Each check call follows a markdown heading "### Exercise N · Title (P points)" with N
    counting 1, 2, 3 ... and P the points the check is registered with."""
    from companion.checks.core import REGISTRY

    for module in sorted(p.stem for p in (COURSE.parent / "companion" / "checks").glob("ch*")
                         if p.suffix == ".py" or (p / "__init__.py").exists()):   # or a package
        __import__(f"companion.checks.{module}")         # each module registers its checks
    nb = nbformat.read(source, as_version=4)
    heading, numbers = None, []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            found = HEADING.findall(cell.source)
            heading = found[-1] if found else heading if not cell.source.startswith("#") else None
            continue
        for name in CHECK_CALL.findall(cell.source):
            assert heading, f"cell {i} calls {name} with no '### Exercise N · ... (P points)' above"
            number, points = map(int, heading)
            assert points == REGISTRY[name].points, (
                f"cell {i}: the heading says {points} point(s), {name} gives "
                f"{REGISTRY[name].points}")
            numbers.append(number)
            heading = None
    assert numbers == list(range(1, len(numbers) + 1)) and numbers, numbers


def test_a_fresh_workbook_runs_to_its_last_cell_in_a_real_kernel(tmp_path):
    """Run All on a workbook with every exercise not done: no cell raises (nbclient stops at the
    first error, as JupyterLab's Run All does), and the last code cell has run."""
    from nbclient import NotebookClient

    created = make_workbooks(COURSE, tmp_path)["created"]
    path = next(p for p in created if p.name.startswith("01_"))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert code[-1].execution_count is not None
    notices = [o for c in code for o in c.outputs
               if "not done yet" in "".join(o.get("data", {}).get("text/plain", ""))]
    assert len(notices) == 3
