"""The grader's parts, without running notebooks: what it expects of a notebook, what it reads back
from a sandbox, how it writes reports, what it reverts."""
import csv
import dataclasses
import hashlib
import io
import json
import os
import pickle
import time

import nbformat
import pytest
import torch

import grading_notebooks as gn
from companion.checks.core import REGISTRY, CheckFailed, GraderError, call, evaluate
from companion.checks.harness import Remote, harness
from companion.grader import wire
from companion.grader.answer import _apply
from companion.grader.expected import make_plan, match_chapter, read_chapter
from companion.grader.integrity import Snapshot
from companion.grader.scan import reference_uses, review_flags
from companion.grading import Row, escape_csv, format_table, write_reports


@pytest.fixture(scope="module")
def chapter01():
    return read_chapter(gn.source("01"))


# ---------------------------------------------------------------- expectations and tampering

def test_expected_exercises_come_from_the_source_with_registry_points(chapter01):
    assert [e.check for e in chapter01.exercises] == ["check_mse_gradient",
                                                      "check_largest_stable_lr", "check_train_epoch"]
    assert [e.points for e in chapter01.exercises] == [REGISTRY[e.check].points
                                                       for e in chapter01.exercises]
    assert chapter01.exercises[0].answer == "mse_gradient"
    assert "companion.gd.mse_gradient" in chapter01.exercises[0].references


def test_plan_takes_every_check_call_out_and_places_each_expected_check_once(chapter01):
    nb = gn.trimmed("01")
    gn.insert(nb, gn.EPOCH, "check_train_epoch(train_epoch)\nprint('after')")
    plan = make_plan(nb, chapter01)
    code = "".join(s.source for s in plan.steps if s.kind == "exec")
    assert "check_" not in code.replace("import check_largest_stable_lr, "
                                        "check_mse_gradient, check_train_epoch", "")
    checks = [s.exercise.check for s in plan.steps if s.kind == "check"]
    assert checks == ["check_mse_gradient", "check_largest_stable_lr", "check_train_epoch"]
    assert "print('after')" in code
    assert not plan.tampered and "ignored" in plan.notes["check_train_epoch"][0]


def test_a_deleted_or_changed_check_line_is_tampered(chapter01):
    nb = gn.trimmed("01", solved=False)
    gn.edit(nb, gn.SGD, "check_largest_stable_lr(largest_stable_lr)", "")
    gn.edit(nb, gn.MSE, "check_mse_gradient(mse_gradient)", "check_mse_gradient(gd.mse_gradient)")
    plan = make_plan(nb, chapter01)
    assert "deleted" in plan.tampered["check_largest_stable_lr"]
    assert "changed to `check_mse_gradient(gd.mse_gradient)`" in plan.tampered["check_mse_gradient"]
    assert [s.exercise.check for s in plan.steps if s.kind == "check"] == ["check_train_epoch"]


def test_a_check_line_moved_to_another_cell_still_counts(chapter01):
    nb = gn.trimmed("01")
    gn.edit(nb, gn.SGD, "check_largest_stable_lr(largest_stable_lr)", "")
    gn.insert(nb, None, "check_largest_stable_lr(largest_stable_lr)")
    plan = make_plan(nb, chapter01)
    assert not plan.tampered and "another cell" in plan.notes["check_largest_stable_lr"][0]


def test_a_submission_is_matched_by_its_cell_ids_then_its_file_name(chapter01):
    chapters = [read_chapter(gn.source(n)) for n in ("00", "01")]
    assert match_chapter(gn.trimmed("01"), "anything.ipynb", chapters).path.name.startswith("01")
    empty = nbformat.v4.new_notebook()
    assert match_chapter(empty, "alice_01.ipynb", chapters) is None
    assert match_chapter(empty, "01_mine.ipynb", chapters).path.name.startswith("01")
    assert match_chapter(empty, "notes.ipynb", chapters) is None


def test_reference_uses_in_the_exercise_cell_are_found(chapter01):
    nb = gn.trimmed("01")
    ex = chapter01.exercises[0]
    assert reference_uses(nb, ex) == []
    gn.body(nb, gn.MSE, "return getattr(gd, 'mse_gradient')(X, y, w, b)")
    assert reference_uses(nb, ex) and "companion.gd.mse_gradient" in reference_uses(nb, ex)[0]
    epoch = gn.trimmed("01")        # the reference solution of train_epoch uses gd.mse_gradient:
    assert reference_uses(epoch, chapter01.exercises[2]) == []        # not its own reference


def test_review_flags_name_what_deserves_a_look():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import signal, os\nsignal.setitimer(signal.ITIMER_REAL, 0)\nos.kill(os.getppid(), 9)\n"
        "display({'application/vnd.companion.check+json': {}}, raw=True)\n"
        "import companion.checks.ch01 as ch01\nch01.compare = None")])
    flags = " | ".join(review_flags(nb.cells))
    for words in ("timers", "other processes", "check-result record", "check or grading code"):
        assert words in flags
    assert review_flags(gn.trimmed("01").cells) == []


# ---------------------------------------------------------------- what comes back from a sandbox

def _roundtrip(value):
    return wire.decode(wire.dumps({"value": wire.encode(value)}))["value"]


class _Forged(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch.tensor(True)


def test_plain_data_comes_back_and_a_tensor_subclass_does_not():
    back = _roundtrip((torch.ones(3), 2, 2.5, "s", None, [True], {"k": torch.float16}))
    assert type(back[0]) is torch.Tensor and back[1:4] == (2, 2.5, "s") and back[5] == [True]
    forged = _roundtrip(torch.ones(3).as_subclass(_Forged))
    assert not isinstance(forged, torch.Tensor) and "subclass" in repr(forged)
    with pytest.raises(CheckFailed, match="expected a tensor"):
        from companion.checks.core import compare
        compare(forged, torch.ones(3))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_the_grader_refuses_replies_that_are_not_plain_data():
    class Evil:
        def __reduce__(self):
            return (print, ("ran code",))
    with pytest.raises(wire.WireError):
        wire.decode(pickle.dumps({"value": Evil()}))            # plain pickle is refused
    buffer = io.BytesIO()
    torch.save({"value": torch.nn.Parameter(torch.ones(2))}, buffer)
    assert type(wire.decode(buffer.getvalue())["value"]) is torch.Tensor
    with pytest.raises(wire.WireError):
        wire.plain({"value": {1.5: "float keys"}})
    with pytest.raises(wire.WireError):
        wire.plain({"value": {(1, (2, (3, (4,)))): "keys nested too deep"}})


def test_a_dict_keyed_by_tuples_comes_back_as_it_is():
    """Chapter 08's schedule {(stage, group): start}: it came back as an opaque stand-in, and an
    honest answer failed under the grader only."""
    schedule = {("down", 0): 0.5, ("step", 0): 1.0, ("up", 1): 2.25}
    assert _roundtrip(schedule) == schedule
    assert "opaque" in repr(type(_roundtrip({object(): 1}))).lower() or \
        not isinstance(_roundtrip({object(): 1}), dict)


def test_arguments_on_the_meta_device_are_compared_by_shape_not_data():
    """Chapter 11's pick_layout gets a model on the meta device: the sandbox's check for changes
    in place called torch.equal on it and failed an honest answer."""
    from companion.grader.child import _same
    a, b = torch.empty(2, 3, device="meta"), torch.empty(2, 3, device="meta")
    assert _same(a, b) and not _same(a, torch.empty(3, 2, device="meta"))
    assert not _same(a, torch.zeros(2, 3)) and _same(torch.ones(2), torch.ones(2))
    with pytest.raises(wire.WireError):
        wire.plain(torch.ones(2).to_sparse())


def test_changes_in_place_are_copied_back_into_the_checks_arguments():
    w, model = torch.zeros(3), torch.nn.Linear(2, 1)
    changed = [([0, 1], "tensor", torch.ones(3)),
               ([0, 2], "module", {"state": {"weight": torch.full((1, 2), 7.0)},
                                   "grads": {"bias": torch.ones(1)}}),
               ([0, 9], "tensor", torch.ones(1)), (["bad"], "tensor", 3)]
    _apply(changed, (("answer", w, model), {}))
    assert torch.equal(w, torch.ones(3)) and torch.equal(model.weight, torch.full((1, 2), 7.0))
    assert torch.equal(model.bias.grad, torch.ones(1))


# ---------------------------------------------------------------- checks against a Remote

class _Local(Remote):
    """A Remote that runs the answer here: the check-side protocol without a sandbox."""

    def __init__(self, fn):
        super().__init__("f")
        self.fn = fn

    def call(self, args, kwargs):
        return call(self.fn, *args, **kwargs)

    def run_harness(self, fn, args, kwargs):
        return fn(*[self.fn if a is self else a for a in args], **kwargs)

    def limit(self, seconds):
        import contextlib
        return contextlib.nullcontext()


def test_a_check_sees_the_same_verdicts_through_a_remote():
    assert "3 random batches" in evaluate("check_mse_gradient", _Local(
        lambda X, y, w, b: (2 * X.T @ (X @ w + b - y) / len(y), 2 * (X @ w + b - y).mean())))
    with pytest.raises(CheckFailed, match="divide the sums by m"):
        evaluate("check_mse_gradient", _Local(
            lambda X, y, w, b: (2 * X.T @ (X @ w + b - y), 2 * (X @ w + b - y).sum())))


@harness
def _observe(answer, x):
    return answer(x) + 1


def test_harness_runs_here_for_a_function_and_in_the_sandbox_for_a_remote():
    assert _observe(lambda x: 2 * x, 3) == 7
    assert _observe(_Local(lambda x: 2 * x), 3) == 7


def test_a_check_that_needs_a_harness_fails_loudly_not_as_the_learners_fault():
    remote = _Local(lambda x: x)
    with pytest.raises(GraderError):
        pickle.dumps(remote)
    with pytest.raises(GraderError):
        remote.register_forward_hook


# ---------------------------------------------------------------- reports

def test_csv_cells_that_a_spreadsheet_would_run_are_escaped(tmp_path):
    for text in ("=1+1", "+1", "-1", "@SUM(A1)", "\tx", "\rx"):
        assert escape_csv(text) == "'" + text
    assert escape_csv("fine") == "fine" and escape_csv(3) == 3
    rows = [Row("=HYPERLINK(\"x\")", "mse_gradient", False, 0, 1, "-2 points", "failed")]
    _, csv_path = write_reports(rows, tmp_path)
    record = next(csv.DictReader(csv_path.open(newline="")))
    assert record["notebook"].startswith("'=") and record["message"] == "'-2 points"


def test_reports_are_written_with_their_digest(tmp_path):
    rows = [Row("a.ipynb", "x", True, 2, 2, "ok", "passed"),
            Row("a.ipynb", "y", False, 0, 1, "not done yet", "not done")]
    json_path, csv_path = write_reports(rows, tmp_path)
    assert json.loads(json_path.read_text())[1]["status"] == "not done"
    sums = dict(line.split("  ")[::-1] for line in (tmp_path / "grades.sha256").read_text()
                .splitlines())
    for path in (json_path, csv_path):
        assert sums[path.name] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grades.csv", "grades.json",
                                                          "grades.sha256"]
    assert "a.ipynb: 2/3" in format_table(rows)


def test_the_console_table_shows_each_message_whole_and_wrapped():
    message = ("check_largest_stable_lr failed (Exercise: replace the placeholder) " * 4).strip() \
        + "\nsecond line of the hint"
    table = format_table([Row("a.ipynb", "check_largest_stable_lr", False, 0, 2, message, "failed")],
                         columns=80)
    assert " ".join(table.split()[5:]).replace(" ", "") == message.replace("\n", "").replace(
        " ", "")                                             # every word, none cut
    assert all(len(line) <= 80 for line in table.splitlines())
    assert "second line of the hint" in table
    statuses = format_table([Row("a.ipynb", "x", False, 0, 1, "m", s) for s in
                             ("not graded", "reference", "ungradable")])
    assert all(s.upper() in statuses for s in ("not graded", "reference", "ungradable"))


# ---------------------------------------------------------------- the grader's own files

def test_a_changed_package_is_found_and_restored_and_the_sources_copied(tmp_path):
    package = tmp_path / "companion"
    (package / "checks").mkdir(parents=True)
    (package / "checks" / "ch01.py").write_text("ORIGINAL = True\n")
    notebook = tmp_path / "01_x.ipynb"
    notebook.write_text("{}")
    snapshot = Snapshot(package, [notebook])
    assert snapshot.changes() == []
    (package / "checks" / "ch01.py").write_text("ORIGINAL = False\n")
    (package / "planted.py").write_text("import os\n")
    notebook.write_text("changed")
    assert set(snapshot.changes()) == {"companion/checks/ch01.py", "companion/planted.py"}
    snapshot.restore()
    assert snapshot.changes() == [] and not (package / "planted.py").exists()
    assert notebook.read_text() == "changed"       # sources are never written; copies are used
    copy = snapshot.private_copy()
    assert (copy / "companion" / "checks" / "ch01.py").read_text() == "ORIGINAL = True\n"
    assert (copy / "sources" / "01_x.ipynb").read_text() == "{}"
    assert oct(copy.stat().st_mode & 0o777) == "0o700"
    Snapshot.remove(copy)


def test_a_chapter_whose_checks_do_not_import_is_read_with_the_reason(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from companion.checks.ch99 import check_nothing\ncheck_nothing(f)")])
    path = tmp_path / "99_unfinished.ipynb"
    nbformat.write(nb, path)
    chapter = read_chapter(path)
    assert chapter.exercises == [] and "ModuleNotFoundError" in chapter.error
    assert chapter.cell_ids == {nb.cells[0].id}


# ---------------------------------------------------------------- the sandbox's limits

@pytest.mark.skipif(bool(gn.sandbox_blocked()), reason=gn.sandbox_blocked())
def test_the_sandbox_runs_as_another_user_under_limits_it_cannot_raise():
    from companion.grader.sandbox import Child, ChildLost, Limits
    # A uid of this test's own, not nobody: test_grading's batch, which may run at the same time
    # on another worker, grades a notebook that signals every process of its user (os.kill(-1)).
    uid = 2_100_000_000 + os.getpid() % 1_000_000
    child = Child(limits=Limits(memory=3 * 2**30, output=1000), user=(uid, uid),
                  env={"PATH": os.environ["PATH"]})
    try:
        assert child.start(timeout=120)["uid"] == uid

        def run(code, timeout=60.0):
            return child.request({"op": "exec", "source": code}, timeout=timeout, interrupt=True)

        assert "memory" in run("import torch\nbig = torch.ones(2**30)   # 4 GiB")["error"].lower()
        assert "not allowed to raise" in run(
            "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))")["error"]
        assert run("import os\nos.kill(1, 9)")["error"].startswith("PermissionError")
        run("print('x' * 100_000)")
        deadline = time.monotonic() + 30          # the output is read by a thread: let it catch up
        while child.output_total <= 100_000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.output_total > 100_000 and len(child.output) == 1000
        with pytest.raises(ChildLost, match="time limit"):
            run("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",
                timeout=2.0)
        assert child.proc is None                    # killed, with its process group
    finally:
        child.kill()


def test_a_deep_dives_exercise_is_read_as_optional_and_totalled_apart():
    """Chapter 05's FP8 exercises sit in a deep dive: the report marks them, the table gives the
    core's total beside theirs, and the CSV carries the column."""
    chapter = read_chapter(gn.source("05"))
    optional = {ex.name for ex in chapter.exercises if ex.optional}
    assert optional == {"to_e4m3", "choose_scaling"}, optional
    rows = [Row("w.ipynb", ex.name, False, 0, ex.points, "not done yet", "not done", "",
                "05", ex.optional) for ex in chapter.exercises]
    rows[0] = dataclasses.replace(rows[0], passed=True, points=rows[0].max_points)
    core = sum(ex.points for ex in chapter.exercises if not ex.optional)
    table = format_table(rows)
    assert (f"w.ipynb (05): {rows[0].points}/11 (core {rows[0].points}/{core}, optional deep "
            f"dives 0/4)") in table
    assert table.count("(optional)") == 2
    assert "a.ipynb: 2/3\n" in format_table([Row("a.ipynb", "x", True, 2, 3, "ok", "passed")]) + "\n"
