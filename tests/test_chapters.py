"""The chapters as a learner meets them: a core that fits one sitting, and exercises whose every
name is defined or shown before the learner needs it."""
import ast
import builtins
import json
import pathlib
import re

import pytest
import torch

COURSE = pathlib.Path(__file__).resolve().parent.parent / "course"
CHAPTERS = sorted(COURSE.glob("[0-9][0-9]_*.ipynb"))
CORE_WORDS = 4500            # about 90 minutes with the code cells and exercises
DEEP_DIVE = "## Deep dive (optional) · "


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _src(cell):
    return "".join(cell["source"])


def core_and_optional_words(cells) -> tuple[int, int]:
    """Markdown words in the core and in the deep dives: a deep dive runs from a level-2 heading
    that starts with DEEP_DIVE to the next level-2 heading that does not."""
    core = optional = 0
    inside = False
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        text = _src(cell)
        for line in text.splitlines():
            if line.startswith("## "):
                inside = line.startswith(DEEP_DIVE)
            if inside:
                optional += len(line.split())
            else:
                core += len(line.split())
    return core, optional


def test_the_word_count_follows_deep_dives_to_the_next_core_heading():
    md = lambda s: {"cell_type": "markdown", "source": [s]}
    cells = [md("# T\none two"), md(DEEP_DIVE + "x\nthree four five"), md("### Exercise 9\nsix"),
             md("## Back\nseven")]
    assert core_and_optional_words(cells) == (4 + 3, 9 + 4)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapters_core_fits_one_sitting(path):
    core, optional = core_and_optional_words(_cells(path))
    assert core <= CORE_WORDS, (
        f"{path.name}: {core:,} words of prose in the core (deep dives hold {optional:,}); mark "
        f"longer material '{DEEP_DIVE}...' so the core stays under {CORE_WORDS:,}")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_exercises_inside_a_deep_dive_say_they_are_optional(path):
    inside = False
    for cell in _cells(path):
        if cell["cell_type"] != "markdown":
            continue
        for line in _src(cell).splitlines():
            if line.startswith("## "):
                inside = line.startswith(DEEP_DIVE)
            if inside and line.startswith("### Exercise"):
                assert "(optional," in line, f"{path.name}: {line!r} is in a deep dive"


# ---- every name an exercise needs is defined or shown before it --------------------------------

def _bound_at_top(tree: ast.Module) -> set[str]:
    """Names a cell binds for the cells after it: imports, defs, classes, assignments, loops."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _python(source: str) -> str:
    """A cell's Python without IPython's magics (`%load_ext ...`, `!pip ...`)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def _needs(fn: ast.FunctionDef) -> tuple[set[str], set[tuple[str, str]]]:
    """The free names a solution reads, and (object, attribute) pairs it reads off its own
    arguments and locals (the course's API it must know, e.g. `model.blocks`)."""
    local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)) and node is not fn:
            local |= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            local |= {(a.asname or a.name).split(".")[0] for a in node.names}
    free = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and n.id not in local and not hasattr(builtins, n.id)}
    attrs = {(n.value.id, n.attr) for n in ast.walk(fn) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id in local}
    return free, attrs


_COMMON = (torch.Tensor, list, dict, str, tuple, set, int, float, torch.nn.Module, torch.dtype,
           torch.Size, torch.optim.Optimizer)


def _shown(attr: str, prose: str, code: str) -> bool:
    """`attr` appears in what the learner has read: in prose as `.attr` or in backticks (`attr`,
    or a call `attr(...)`); in code as an attribute read or a keyword (`x.attr`, `attr=...`),
    import lines left out (`from companion.offload import ...` shows no `.offload` attribute)."""
    code = "\n".join(line for line in code.splitlines()
                     if not line.lstrip().startswith(("import ", "from ")))
    return (re.search(rf"\.{attr}\b|`{attr}\b", prose) is not None
            or re.search(rf"\.{attr}\b|\b{attr}=", code) is not None)


def _exercises():
    for path in CHAPTERS:
        cells = _cells(path)
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code" and "### BEGIN SOLUTION" in _src(cell):
                yield pytest.param(path, i, id=f"{path.stem[:2]}-cell{i}")


@pytest.mark.parametrize("path, index", list(_exercises()))
def test_every_name_an_exercise_needs_is_defined_or_shown_before_it(path, index):
    cells = _cells(path)
    defined, prose, code = set(), "", ""
    for cell in cells[:index]:
        if cell["cell_type"] == "markdown":
            prose += _src(cell) + "\n"
        if cell["cell_type"] == "code":
            code += _src(cell) + "\n"
            defined |= _bound_at_top(ast.parse(_python(_src(cell))))
    tree = ast.parse(_python(_src(cells[index])))
    defined |= _bound_at_top(tree)
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        free, attrs = _needs(fn)
        assert free <= defined, f"{path.name} cell {index}: {sorted(free - defined)} never defined"
        unshown = sorted(f"{obj}.{attr}" for obj, attr in attrs
                         if not any(hasattr(t, attr) for t in _COMMON) and not _shown(attr, prose, code))
        assert not unshown, (f"{path.name} cell {index}: {fn.name} reads {unshown}, which nothing "
                             "before it shows the learner")
