"""What the grader reads in a submission's source before running it: uses of an exercise's
reference implementation, and lines that deserve an instructor's look.

Neither changes how the code runs. A reference used in an exercise's cell scores that exercise 0
(the sandbox also counts calls into the reference while the answer runs, which catches a use
through a helper in another cell). The review flags are for people: the grader's results do not
depend on displayed output, check modules inside the sandbox, timers or signals, but an attempt
at any of them is worth knowing about.
"""
from __future__ import annotations

import ast
import re

from companion.grader.expected import Exercise, python_of

__all__ = ["reference_uses", "review_flags", "learner_cells"]

_REVIEW = {
    "displays a check-result record (the grader does not read displayed output)":
        r"vnd\.companion|RESULT_MIME|_show_pass|_show\(",
    "changes the companion's check or grading code inside the notebook":
        r"companion\.(checks|grader|grading)\b[^\n]*(=|setattr|__code__)|__withheld|"
        r"setattr\(\s*(core|ch\d\d)\b|\b(core|ch\d\d)\.\w+\s*=[^=]",
    "writes files of the installed companion or of the grader":
        r"__file__[^\n]*(open|write)|(open|write_text|write_bytes)[^\n]*__file__|site-packages",
    "changes timers or signal handlers": r"setitimer|signal\.alarm|signal\.signal\(",
    "signals or ends other processes": r"os\.kill|killpg|getppid|os\._exit",
    "starts processes that may outlive the notebook":
        r"start_new_session|setsid|os\.fork|subprocess|Popen|os\.system|daemon",
    "changes the interpreter's tracing or modules": r"setprofile|settrace|sys\.modules\[",
    # what no honest answer to the course's exercises needs: ways around the reference rule
    "walks frames or the garbage collector":
        r"_getframe|currentframe|inspect\.(stack|trace)\b|getouterframes|\bf_(back|globals|"
        r"locals|builtins)\b|tb_frame|gc\.get_(objects|referrers|referents)",
    "runs code it builds (exec, eval, compile, source of a module)":
        r"\b(exec|eval|compile)\s*\(|getsource|importlib\.reload|\brunpy\b|__import__",
    "starts threads": r"\bthreading\b|\b_thread\b|Thread\(|ThreadPool|concurrent\.futures",
    "calls C directly (ctypes, cffi)": r"\bctypes\b|\bcffi\b",
    "reaches into the hooks or dispatch modes a check watches with":
        r"_python_dispatch|_disable_current_modes|_pop_mode|_forward_pre_hooks|_forward_hooks|"
        r"_backward_hooks|_backward_pre_hooks|_saved_tensors_hooks|_DisableTorchDispatch|"
        r"TorchDispatchMode|TorchFunctionMode",
    "reads the package's or the course's files":
        r"__file__|__spec__|__loader__|getsourcefile|getfile\(|find_spec|linecache|"
        r"\.py['\"]|__path__|__code__|__globals__|__closure__",
}

_COMPUTED = "reaches names it computes (getattr, setattr, vars or globals with a name it builds)"


def _glued(node: ast.AST) -> bool:
    """"train_" + "epoch", "".join([...]) of constants: a string the source does not spell out."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        parts = [node.left, node.right]
        return all(isinstance(p, ast.Constant) and isinstance(p.value, str) or _glued(p)
                   for p in parts)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
        node.func.attr == "join" and isinstance(node.func.value, ast.Constant)


def _computed_names(tree: ast.Module | None) -> bool:
    """getattr(x, "train_" + "epoch"), vars(m)[name], globals()[...], a name glued from pieces:
    a name the source does not spell out. (`setattr(module, name, value)` with a plain variable,
    as a parameter-gathering hook writes, is not one.)"""
    for node in ast.walk(tree) if tree is not None else []:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "delattr", "hasattr") and \
                len(node.args) > 1 and not isinstance(node.args[1], (ast.Constant, ast.Name)):
            return True
        if _glued(node):
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and \
                node.value.func.id in ("vars", "globals", "locals") or \
                isinstance(node, ast.Attribute) and node.attr == "__dict__":
            return True
    return False


def learner_cells(nb, source=None) -> list:
    """The code cells the learner wrote or changed: every code cell, less those whose source is
    one of the course notebook's own cells (as the course gives it, or as its workbook does)."""
    own = set()
    if source is not None:
        from companion.notebooks import strip_solutions
        for book in (source, strip_solutions(source)):
            own |= {c.source.strip() for c in book.cells if c.cell_type == "code"}
    return [c for c in nb.cells if c.cell_type == "code" and c.source.strip() not in own]


def review_flags(cells) -> list[str]:
    """Short reasons to look at this notebook, from patterns in the code cells given (the grader
    gives those the learner wrote or changed: `learner_cells`)."""
    cells = [c for c in cells if c.cell_type == "code"]
    text = "\n".join(c.source for c in cells)
    flags = [why for why, pattern in _REVIEW.items() if re.search(pattern, text)]
    if any(_computed_names(_answer_code(c.source)) for c in cells):
        flags.append(_COMPUTED)
    return flags


def _answer_code(cell_source: str) -> ast.Module | None:
    if cell_source.lstrip().startswith("%%"):                 # %%worker_module NAME: its body
        cell_source = cell_source.split("\n", 1)[1] if "\n" in cell_source else ""
    return python_of(cell_source)


def reference_uses(nb, exercise: Exercise) -> list[str]:
    """Where the exercise's own cell names one of its references ("companion.gd.mse_gradient"):
    an attribute `.mse_gradient`, an import of it, or the name as a string (getattr)."""
    leaves = {ref.rsplit(".", 1)[-1]: ref for ref in exercise.references}
    if not leaves:
        return []
    cell_ids = {exercise.solution_cell_id, exercise.cell_id}
    found = []
    for cell in nb.cells:
        if cell.cell_type != "code" or cell.get("id", "") not in cell_ids:
            continue
        tree = _answer_code(cell.source)
        for node in ast.walk(tree) if tree is not None else []:
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.ImportFrom):
                name = next((a.name for a in node.names if a.name in leaves or a.name == "*"), None)
                name = next(iter(leaves)) if name == "*" else name
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            if name in leaves:
                found.append(f"{leaves[name]} (line {getattr(node, 'lineno', '?')})")
    return found
