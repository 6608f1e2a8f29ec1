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

__all__ = ["reference_uses", "review_flags"]

_REVIEW = {
    "displays a check-result record (the grader does not read displayed output)":
        r"vnd\.companion|RESULT_MIME|_show_pass|_show\(",
    "changes the companion's check or grading code inside the notebook":
        r"companion\.(checks|grader|grading)\b[^\n]*(=|setattr|__code__)|"
        r"setattr\(\s*(core|ch\d\d)\b|\b(core|ch\d\d)\.\w+\s*=[^=]",
    "writes files of the installed companion or of the grader":
        r"__file__[^\n]*(open|write)|(open|write_text|write_bytes)[^\n]*__file__|site-packages",
    "changes timers or signal handlers": r"setitimer|signal\.alarm|signal\.signal\(",
    "signals or ends other processes": r"os\.kill|killpg|getppid|os\._exit",
    "starts processes that may outlive the notebook":
        r"start_new_session|setsid|os\.fork|subprocess|Popen|os\.system|daemon",
    "changes the interpreter's tracing or modules": r"setprofile|settrace|sys\.modules\[",
}


def review_flags(cells) -> list[str]:
    """Short reasons to look at this notebook, from patterns in its code cells."""
    text = "\n".join(c.source for c in cells if c.cell_type == "code")
    return [why for why, pattern in _REVIEW.items() if re.search(pattern, text)]


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
