"""The exercises of a chapter and the namespace each runs in, without running the notebook.

`Chapter(number)` runs, in one IPython shell, what the grading tests' trimmed notebooks run
(`grading_notebooks.trimmed`): the setup cell (`start("NN")`, the imports) and the exercise cells,
with every check call blanked out, so no check runs. The demos are left out: a chapter is ready in
seconds, not the minutes its whole notebook takes. Each `Target` is one exercise: its check, the
name the check is called with, and the code to mutate with the lines of its solution
(between `### BEGIN SOLUTION` and `### END SOLUTION`, every such block of the cell).

`Chapter.answer(target, source)` runs a mutant's code the way the notebook would run the cell and
returns the answer to check: a plain cell's definitions (and any statement holding the solution)
run in a copy of the shell's namespace (one mutant's functions never reach the next); a `%%worker_module NAME` cell is written to its module again by
the magic itself (the gloo workers import it by name), and `restore(target)` puts the reference
back afterwards. `close()` (or `with Chapter(...) as chapter:`) removes the shell again, so the
rest of the process (other tests) sees no IPython.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import os
import pathlib
import sys
import time

import nbformat

from companion.grader.expected import _check_calls, python_of, read_chapter

__all__ = ["Target", "Chapter", "chapters", "COURSE"]

COURSE = pathlib.Path(__file__).resolve().parents[2] / "course"


@dataclasses.dataclass
class Target:
    chapter: str
    check: str
    answer: str               # the name the check is called with
    code: str                 # Python: the solution cell (a worker module's body), checks blanked
    lines: set[int]           # the solution's lines in `code`
    worker: str = ""          # the module name of a %%worker_module cell
    skip: str = ""            # why its mutants cannot run here ("" when they can)


def chapters() -> list[str]:
    return sorted(p.name[:2] for p in COURSE.glob("[0-9][0-9]_*.ipynb"))


def _solution_lines(code: str) -> set[int]:
    lines, inside = set(), False
    for number, text in enumerate(code.splitlines(), start=1):
        if "### BEGIN SOLUTION" in text:
            inside = True
        elif "### END SOLUTION" in text:
            inside = False
        elif inside:
            lines.add(number)
    return lines


def _blank_checks(source: str, registry) -> str:
    """The cell as Python (IPython syntax translated) with each check call's lines blanked."""
    from IPython.core.inputtransformer2 import TransformerManager
    code = TransformerManager().transform_cell(source)
    lines = code.splitlines()
    for _, node in _check_calls(ast.parse(code), registry):
        for i in range(node.lineno - 1, node.end_lineno):
            lines[i] = ""
    return "\n".join(lines) + "\n"


# What a mutant's cell runs again: its definitions and the statements holding the solution (the
# rest, demos included, ran once when the namespace was built)
_DEFINES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)


class Chapter:
    """One chapter's exercises, and a shell holding their namespace (see the module's doc)."""

    def __init__(self, number: str):
        from IPython.core.interactiveshell import InteractiveShell
        from companion.checks.core import REGISTRY
        os.environ.setdefault("MPLBACKEND", "Agg")
        path = next(COURSE.glob(f"{number}_*.ipynb"), None)
        if path is None:
            raise ValueError(f"no chapter {number!r} in {COURSE}: one of {chapters()}")
        self.number, self.path = number, path
        info = read_chapter(path)
        if info.error:
            raise RuntimeError(f"chapter {number}: {info.error}")
        # a shell another test of this process made is set aside and given back by close()
        self._outer = InteractiveShell.instance() if InteractiveShell.initialized() else None
        if self._outer is not None:
            InteractiveShell.clear_instance()
        began = time.perf_counter()
        self._main = sys.modules["__main__"]
        self.shell = InteractiveShell.instance()
        if not hasattr(self.shell.user_module, "__spec__"):
            # what a kernel's __main__ has: multiprocessing's spawn (the gloo workers) reads it
            self.shell.user_module.__spec__ = None
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        by_id = {c.get("id"): c for c in code}
        keep = {e.cell_id for e in info.exercises} | {e.solution_cell_id for e in info.exercises}
        self.targets: list[Target] = []
        self.notes: list[str] = []    # cells that raised while the namespace was built
        for cell in [code[0]] + [c for c in code[1:] if c.get("id") in keep]:
            self._run(_blank_checks(cell.source, REGISTRY) if python_of(cell.source) else
                      cell.source, cell.get("id"))
        for e in info.exercises:
            source = by_id[e.solution_cell_id].source
            first, _, body = source.partition("\n")
            if first.startswith("%%worker_module"):
                target = Target(number, e.check, e.answer, body, _solution_lines(body),
                                worker=first.split()[1])
            else:
                program = _blank_checks(source, REGISTRY)
                target = Target(number, e.check, e.answer, program, _solution_lines(program))
            if not target.lines:
                target.skip = "no ### BEGIN SOLUTION block in its cell"
            elif "import triton" in target.code:
                import importlib.util
                if importlib.util.find_spec("triton") is None or not _cuda():
                    target.skip = "a Triton kernel: needs a CUDA GPU and triton"
            self.targets.append(target)
        self.built_in = time.perf_counter() - began      # seconds to build the namespace

    def close(self) -> None:
        """Give the process back as it was: the IPython shell it had (or none), its __main__."""
        from IPython.core.interactiveshell import InteractiveShell
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = self._main
        if self._outer is not None:                   # the singleton's slots, as instance()
            for cls in type(self._outer).mro():        # fills them
                if isinstance(cls, type) and issubclass(cls, InteractiveShell):
                    cls._instance = self._outer

    def __enter__(self) -> "Chapter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, source: str, cell_id: str) -> None:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            result = self.shell.run_cell(source, store_history=False, silent=True)
        if not result.success:        # a demo line after the solution needs a cell left out
            error = result.error_in_exec or result.error_before_exec
            self.notes.append(f"cell {cell_id} raised {error!r} (what it defined before stays)")

    def answer(self, target: Target, source: str):
        """Run a mutant's `source` in place of the exercise's cell; return the answer it binds.
        Raises what the cell raises (a mutant that breaks the cell is a mistake caught)."""
        quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
        if target.worker:
            from companion.launch import _worker_module
            folder = self._worker_folder()
            with quiet[0], quiet[1]:
                _worker_module(target.worker, source, folder)
            return self.shell.user_ns[target.answer]
        namespace = dict(self.shell.user_ns)
        tree = ast.parse(source)
        tree.body = [s for s in tree.body if isinstance(s, _DEFINES) or any(
            line in target.lines for line in range(s.lineno, s.end_lineno + 1))]
        with quiet[0], quiet[1]:
            exec(compile(tree, f"<mutant of {target.check}>", "exec"), namespace)
        return namespace[target.answer]

    def restore(self, target: Target) -> None:
        """Put the reference back where a mutant of a worker module replaced it."""
        if target.worker:
            self.answer(target, target.code)

    def _worker_folder(self) -> str:
        import tempfile
        return next((p for p in sys.path if os.path.basename(p).startswith("companion-workers-")),
                    None) or tempfile.mkdtemp(prefix="companion-workers-")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()
