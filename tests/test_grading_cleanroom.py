"""The clean room's parts (see companion.grader.cleanroom): what it runs of a notebook, the package
copy with an exercise's references withheld, the review flags, and the grader's own limits. The
whole path, with notebooks that cheat, is in test_grading.py."""
import json
import os
import pathlib
import subprocess
import sys

import nbformat
import pytest

import grading_notebooks as gn
from companion.checks.core import REGISTRY
from companion.grader.cleanroom import needed_sources, withheld_name, withheld_table
from companion.grader.expected import read_chapter
from companion.grader.scan import learner_cells, review_flags
from companion.grader.withhold import MARK, Withheld, withheld_sources, write_tree

HELPER = '''import threading, queue
import companion.gd as _g
_alias = _g.train_epoch
_box = queue.Queue()
_worker = threading.Thread(target=lambda: _box.put(_alias))
_worker.start()
results = [train(1) for _ in range(3)]     # a demo: not needed by the answer'''

ANSWER = '''def helper(x):
    return _alias(x)

def train_epoch(X, y, w, b, lr, batch_size):
    return helper(X), _box.get()'''


def test_the_clean_room_runs_imports_and_what_the_answer_uses_and_nothing_else():
    sources = ["import torch\nfrom companion import gd\ndevice = 'cpu'\nprint(device)",
               "%load_ext companion.launch", "%%worker_module ring\ndef f():\n    pass\n",
               HELPER, ANSWER]
    ran = "\n".join(needed_sources(sources, "train_epoch"))
    for kept in ("import torch", "from companion import gd", "load_ext", "%%worker_module ring",
                 "_alias = _g.train_epoch", "_box = queue.Queue()", "def helper", "def train_epoch",
                 "import threading, queue"):
        assert kept in ran, kept
    for left in ("print(device)", "_worker.start()", "results = ", "device = 'cpu'"):
        assert left not in ran, left
    assert "_worker = threading.Thread" not in ran        # no name the answer uses


def test_a_decorated_definition_and_an_if_of_definitions_are_kept_whole():
    source = "import functools\n\n@functools.cache\ndef f(n):\n    return n\n\n" \
             "if True:\n    g = 2\nelse:\n    g = 3\n"
    ran = needed_sources([source, "def answer():\n    return f(1) + g"], "answer")[0]
    assert "@functools.cache" in ran and "else:" in ran


def _all_references() -> Withheld:
    for n in range(14):
        __import__(f"companion.checks.ch{n:02d}")
    withheld = Withheld()
    for info in REGISTRY.values():
        for dotted in info.reference:
            withheld.add(dotted)
    return withheld


def test_every_reference_of_the_course_is_withheld_and_the_copy_still_imports(tmp_path):
    import companion
    root = pathlib.Path(companion.__file__).resolve().parent.parent
    files = {str(p.relative_to(root)): p.read_bytes() for p in (root / "companion").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    withheld = _all_references()
    write_tree(withheld_sources(files, withheld), tmp_path)
    inside = [dotted for names in withheld.inside.values() for _, dotted in names]
    probe = f'''
import importlib, inspect, json, pkgutil, sys, types
import companion
from companion.grader.withhold import resolve
for m in pkgutil.walk_packages(companion.__path__, "companion."):
    if ".grader" not in m.name:
        importlib.import_module(m.name)
def marked(fn):
    fn = inspect.unwrap(getattr(fn, "__func__", None) or getattr(fn, "fget", None) or fn)
    fn = getattr(fn, "fn", fn)                  # a @triton.jit kernel: its Python function
    return any({MARK!r} in str(c) for c in fn.__code__.co_consts)
bad = []
for dotted in {inside!r}:
    obj = resolve(dotted)
    methods = [v for v in vars(obj).values() if isinstance(v, (types.FunctionType, property,
               staticmethod, classmethod))] if isinstance(obj, type) else [obj]
    own = [m for m in methods if not getattr(m, "__name__", "_").startswith("__")
           or getattr(m, "__name__", "") == "__call__"]
    if not all(marked(m) for m in own) or not any(marked(m) for m in methods):
        bad.append(dotted)
print(json.dumps([companion.__file__, bad]))
'''
    result = subprocess.run([sys.executable, "-P", "-c", probe], cwd=tmp_path, text=True,
                            env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    where, bad = json.loads(result.stdout.splitlines()[-1])
    assert where.startswith(str(tmp_path)) and bad == []
    assert set(withheld.outside) == {          # not the package's: the sandbox replaces these
        "torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.CheckpointFunction",
        "torch._amp_update_scale_", "torch._amp_foreach_non_finite_check_and_unscale_",
        "torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.cross_entropy"}


def test_a_withheld_function_keeps_its_signature_and_raises_with_the_mark(tmp_path):
    withheld = Withheld()
    withheld.add("companion.gd.mse_gradient")
    import companion
    path = pathlib.Path(companion.__file__).parent / "gd.py"
    text = withheld_sources({"companion/gd.py": path.read_bytes()}, withheld)["companion/gd.py"]
    namespace = {"__name__": "copy"}
    exec(compile(text, "gd_copy", "exec"), namespace)
    with pytest.raises(TypeError):                         # the signature is the reference's
        namespace["mse_gradient"]()
    with pytest.raises(RuntimeError, match=r"\[withheld\] companion\.gd\.mse_gradient") as e:
        namespace["mse_gradient"](1, 2, 3, 4)
    assert withheld_name(str(e.value)) == "companion.gd.mse_gradient"
    assert namespace["sgd_step"](1.0, 1.0, 1.0, 1.0, 0.5) == (0.5, 0.5)   # the rest is intact
    assert withheld_name("a plain failure") == ""


# ---------------------------------------------------------------- review flags

CHEATS = {
    "walks frames or the garbage collector": "f = sys._getframe(1)\nwhile f: f = f.f_back",
    "runs code it builds": "exec(compile(inspect.getsource(gd), 'x', 'exec'), ns)",
    "starts threads": "t = threading.Thread(target=run)",
    "calls C directly": "import ctypes",
    "reaches into the hooks or dispatch modes": "from torch.utils._python_dispatch import "
                                                "_disable_current_modes",
    "reaches into the hooks or dispatch modes a check": "saved = dict(model._forward_pre_hooks)",
    "reads the package's or the course's files": "open(gd.__file__).read()",
    "reaches names it computes": "getattr(sys, 'setpro' + 'file')(None)",
    "changes the companion's check or grading code": "floats.__withheld_live__ = False",
}


@pytest.mark.parametrize("why", sorted(CHEATS))
def test_each_way_around_the_reference_rule_is_flagged(why):
    cell = nbformat.v4.new_code_cell(CHEATS[why])
    assert any(flag.startswith(why) for flag in review_flags([cell])), review_flags([cell])


def test_no_source_notebook_is_flagged_and_the_course_s_own_cells_are_not_scanned():
    for path in sorted(gn.COURSE.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        exercises = read_chapter(path).exercises
        ids = {e.solution_cell_id for e in exercises} | {e.cell_id for e in exercises}
        solutions = [c for c in nb.cells if c.get("id") in ids]
        assert review_flags(solutions) == [], path.name         # what an honest learner writes
        assert learner_cells(nb, nb) == [], path.name
    nb = gn.trimmed("01", verbatim=True)
    gn.insert(nb, gn.SETUP, "import threading")
    source = nbformat.read(gn.source("01"), as_version=4)
    assert [c.source for c in learner_cells(nb, source)] == ["import threading"]
    assert [c.source for c in learner_cells(gn.trimmed("01", solved=False), source)] == []


def test_the_docs_list_what_each_exercise_withholds():
    docs = (gn.REPO / "docs" / "GRADING.md").read_text()
    begin, end = "<!-- withheld: begin -->\n", "\n<!-- withheld: end -->"
    assert docs[docs.index(begin) + len(begin):docs.index(end)] == withheld_table()


# ---------------------------------------------------------------- the grader's own limits

def test_the_grading_process_has_a_memory_cap_its_sandboxes_lift():
    code = ("import resource\nfrom companion.grader.job import _cap_memory\n"
            "_cap_memory(3 * 2**30)\n"
            "from companion.grader.child import _apply_limits\n"
            "try:\n    bytearray(4 * 2**30)\nexcept MemoryError:\n    print('capped')\n"
            "_apply_limits({'memory': 0})\n"
            "print(resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["capped", "True"], result.stderr[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="running a sandbox as another user needs root")
def test_a_python_the_sandbox_user_cannot_run_stops_the_grader_with_what_to_do(tmp_path):
    hidden = tmp_path / "home"                           # like /root or a `mktemp -d` folder
    hidden.mkdir(mode=0o700)
    venv = hidden / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    site.mkdir(parents=True)
    (site / "site-packages").symlink_to(next(p for p in map(pathlib.Path, sys.path)
                                             if p.name == "site-packages" and
                                             (p / "torch").is_dir()))
    (venv / "pyvenv.cfg").write_text(f"home = {pathlib.Path(sys.executable).resolve().parent}\n"
                                     "include-system-site-packages = false\n")
    nb = gn.save(gn.trimmed("01"), tmp_path / "nb.ipynb")
    os.chmod(tmp_path, 0o755)
    result = subprocess.run([str(venv / "bin" / "python"), "-m", "companion", "grade", str(nb),
                             "--out", str(tmp_path / "grades")], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=str(gn.REPO)))
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert "cannot start this Python" in result.stderr and "--run-as self" in result.stderr
    assert not (tmp_path / "grades").exists()
