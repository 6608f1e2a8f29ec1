"""Grade an answer a second time on its own: a fresh sandbox that runs only what the answer needs,
with a copy of the package from which the exercise's references are withheld.

The first run (the whole notebook, as the learner ran it) decides nothing about references: the
learner's code could switch off anything watching it there. The clean room decides: a new
interpreter, as a user of its own when the grader is root, with the notebook's first sandbox
stopped (SIGSTOP) while it runs, so no thread or process left from the first run can act. It runs
the notebook's imports, `%load_ext` lines and `%%worker_module` cells, and the definitions the
answer needs (the statements that bind its name and, transitively, the names they use), then the
check again. An answer that reaches a withheld reference, however it got hold of it, meets a
`raise` (`withhold.MARK`) and scores 0 as "reference"; an answer that fails in the clean room for
another reason fails, with the clean room's message.
"""
from __future__ import annotations

import ast
import pathlib
import shutil
import tempfile

from companion.grader.expected import python_of
from companion.grader.withhold import MARK, Withheld, withheld_sources, write_tree

__all__ = ["needed_sources", "build_package", "withheld_name", "LOADERS"]

LOADERS = ("load_ext",)          # line magics the sliced code keeps (%%worker_module needs one)
_COMPOUND = (ast.If, ast.Try)


def _binds(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    names = set()
    for target in targets:
        names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    if isinstance(node, _COMPOUND):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                names |= _binds(child)
    return names


def _definition(node: ast.stmt) -> bool:
    """A statement that only binds names (a compound one only if all its statements do)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                         ast.AnnAssign, ast.AugAssign, ast.Import, ast.ImportFrom, ast.Pass)):
        return True
    if isinstance(node, _COMPOUND):
        parts = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
        for handler in getattr(node, "handlers", []):
            parts += handler.body
        return all(_definition(p) for p in parts)
    return False


def _loader(node: ast.stmt) -> bool:
    """`%load_ext x`, which IPython turns into get_ipython().run_line_magic('load_ext', 'x')."""
    call = node.value if isinstance(node, ast.Expr) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and \
        call.func.attr == "run_line_magic" and bool(call.args) and \
        isinstance(call.args[0], ast.Constant) and call.args[0].value in LOADERS


def _uses(node: ast.stmt) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _lines(source: str, node: ast.stmt) -> tuple[int, int]:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno or node.lineno


def needed_sources(sources: list[str], answer: str) -> list[str]:
    """From the code run before the check (one string per step), what the clean room runs."""
    statements = []                          # (step, node, always)
    for i, source in enumerate(sources):
        tree = None if source.lstrip().startswith("%%") else python_of(source)
        for node in tree.body if tree is not None else []:
            if isinstance(node, (ast.Import, ast.ImportFrom)) or _loader(node):
                statements.append((i, node, True))
            elif _definition(node):
                statements.append((i, node, False))
    needed, chosen = {answer}, {id(n) for _, n, always in statements if always}
    changed = True
    while changed:
        changed = False
        for _, node, _ in statements:
            if id(node) not in chosen and _binds(node) & needed:
                chosen.add(id(node))
                needed |= _uses(node)
                changed = True
    out = []
    for i, source in enumerate(sources):
        if source.lstrip().startswith("%%worker_module"):
            out.append(source)
            continue
        lines = source.splitlines(keepends=True)
        keep = sorted({n for step, node, _ in statements if step == i and id(node) in chosen
                       for n in range(_lines(source, node)[0], _lines(source, node)[1] + 1)})
        if keep:
            out.append("".join(lines[n - 1] for n in keep))
    return out


def build_package(files: dict[str, bytes], references: tuple[str, ...],
                  results: pathlib.Path | None = None) -> tuple[pathlib.Path, list[str], list[str]]:
    """Write the package with `references` withheld into a new folder (every user may read it,
    none but this one write it). Returns (folder for PYTHONPATH, modules rewritten, references
    outside the package, which the sandbox replaces itself)."""
    withheld = Withheld()
    for dotted in references:
        withheld.add(dotted)
    root = pathlib.Path(tempfile.mkdtemp(prefix="companion-withheld-"))
    try:
        package = {rel: data for rel, data in files.items() if rel.startswith("companion/")}
        write_tree(withheld_sources(package, withheld), root)
        if results is not None and results.is_dir():     # companion.results reads course/results
            (root / "course").mkdir(mode=0o755)
            (root / "course" / "results").symlink_to(results)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    modules = [rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for rel in withheld.inside]
    return root, modules, withheld.outside


def withheld_name(text: str) -> str:
    """The withheld reference a message names ("companion.gd.mse_gradient"), or ''."""
    at = text.find(MARK)
    if at < 0:
        return ""
    rest = text[at + len(MARK):].split()
    return rest[0].strip("'\"") if rest else ""


def withheld_table() -> str:
    """docs/GRADING.md's table: what each exercise withholds (from the check registry)."""
    import importlib
    from companion.checks.core import REGISTRY
    for n in range(14):
        importlib.import_module(f"companion.checks.ch{n:02d}")
    lines = ["| chapter | exercise | withheld while it is graded on its own |", "|---|---|---|"]
    for info in sorted(REGISTRY.values(), key=lambda i: i.module):     # in each chapter's order
        if not info.module.startswith("companion.checks.ch"):
            continue
        names = ", ".join(f"`{r}`" for r in info.reference) or "nothing"
        lines.append(f"| {info.module[-2:]} | {info.name.removeprefix('check_')} | {names} |")
    return "\n".join(lines)
