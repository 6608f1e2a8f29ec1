"""nbval guards the course: a wrong solution or a changed deterministic result fails the run."""
import pathlib
import subprocess
import sys

import nbformat

CHAPTER = pathlib.Path(__file__).resolve().parent.parent / "course" / "01_gradient_descent.ipynb"


def _nbval(path: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--nbval-lax", str(path)], capture_output=True, text=True, timeout=300,
                          cwd=path.parent)


def _variant(tmp_path, edit) -> pathlib.Path:
    nb = nbformat.read(CHAPTER, as_version=4)
    edit(nb)
    path = tmp_path / CHAPTER.name
    nbformat.write(nb, path)
    return path


def test_a_wrong_solution_fails_nbval(tmp_path):
    def break_solution(nb):
        cell = next(c for c in nb.cells if "def largest_stable_lr" in c.source)
        cell.source = cell.source.replace("return 2 / torch", "return 1 / torch")
    result = _nbval(_variant(tmp_path, break_solution))
    assert result.returncode != 0 and "in one step" in result.stdout


def test_a_changed_deterministic_output_fails_nbval(tmp_path):
    def change_stored_output(nb):
        cell = next(c for c in nb.cells if "nbval-check-output" in c.metadata.get("tags", [])
                    and c.outputs)
        cell.outputs[0]["text"] = cell.outputs[0]["text"].replace("512", "513")
    result = _nbval(_variant(tmp_path, change_stored_output))
    assert result.returncode != 0 and "mismatch" in result.stdout.lower()
