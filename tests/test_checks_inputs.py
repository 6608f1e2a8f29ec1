"""Inputs are the grader's: a check computes its expectation before the answer runs, and the answer
gets copies of its arguments (`core.call`), so that an answer which changes its inputs (zeroes
them, replaces their `.data`) changes nothing the check compares, in a notebook and under the
grader.

The red team's two cases (`do.zero_()` passed chapter 10's tile_backward, `x.data = ...` chapter
04's saved_bytes); the core's copies; and, over the registry, every exercise's own solution (from
its source notebook) made to vandalise its arguments after computing its result, which must still
pass, beside an answer that only vandalises them, which must not.
"""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

import grading_notebooks as gn
from companion.checks import ch04, ch10
from companion.checks.core import REGISTRY, CheckFailed, call, call_inplace, evaluate
from companion.checks.harness import Remote
from companion.grader.expected import read_chapter

# ---------------------------------------------------------------- the red team's cases


def _zeroes_do(q, k, v, o, do, lse, scale):
    """The red team's tile_backward: zero dO, whose gradients are then all zero, and say so."""
    do.zero_()
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _empties_x(fn, x):
    """The red team's saved_bytes: x with no rows saves nothing, so 0 bytes is 'right'."""
    x.data = torch.empty(0, x.shape[1])
    return 0


def test_zeroing_do_does_not_pass_tile_backward():
    with pytest.raises(CheckFailed, match="does not match the reference"):
        ch10.check_tile_backward(_zeroes_do)


def test_emptying_x_does_not_pass_saved_bytes():
    with pytest.raises(CheckFailed, match="does not match the reference"):
        ch04.check_saved_bytes(_empties_x)


def test_the_same_answers_fail_through_a_remote_whose_changes_are_copied_back():
    """A Remote whose calls change the arguments it was sent, as the grader's copy-back does: the
    changes land in the copies `call` made, not in the check's inputs."""
    with pytest.raises(CheckFailed, match="does not match the reference"):
        evaluate("check_tile_backward", _SendsChangesBack(_zeroes_do))
    with pytest.raises(CheckFailed, match="does not match the reference"):
        evaluate("check_saved_bytes", _SendsChangesBack(_empties_x))


class _SendsChangesBack(Remote):
    """Runs the answer here on the very arguments the check's `call` sent (as `_apply` writes the
    sandbox's in-place changes back into them)."""

    def __init__(self, fn):
        super().__init__(fn.__name__)
        self.fn = fn

    def call(self, args, kwargs):
        return self.fn(*args, **kwargs)

    def run_harness(self, fn, args, kwargs):
        return fn(*[self.fn if a is self else a for a in args], **kwargs)

    def limit(self, seconds):
        return contextlib.nullcontext()


# ---------------------------------------------------------------- the core's copies

def _vandal(*args, **kwargs):
    _vandalise((args, kwargs))


def test_call_hands_the_answer_copies_and_call_inplace_the_objects():
    x = torch.arange(6.0)
    model = torch.nn.Linear(2, 2)
    call(_vandal, x, model, [x], {"x": x})
    assert torch.equal(x, torch.arange(6.0)) and model.weight.shape == (2, 2)
    call_inplace(lambda t: t.zero_(), x)
    assert not x.any()


def test_copies_keep_what_the_answer_may_read():
    """Views keep their offset into one copied storage; a model's optimizer steps the model's
    copied parameters; a parameter keeps its .grad; gradients flow through a graph tensor."""
    base = torch.arange(10.0)
    model = torch.nn.Linear(3, 1)
    model.weight.grad = torch.ones(1, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    leaf = torch.ones(3, requires_grad=True)
    seen = {}

    def look(whole, part, m, o, t):
        seen["shared"] = part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        seen["offset"], seen["grad"] = part.storage_offset(), m.weight.grad.tolist()
        seen["same params"] = o.param_groups[0]["params"][0] is m.weight
        o.step()
        return (t * 2).sum()

    out = call(look, base, base[4:7], model, opt, leaf * 1)
    assert seen == {"shared": True, "offset": 4, "grad": [[1.0] * 3], "same params": True}
    assert torch.equal(model.weight.grad, torch.ones(1, 3))       # the step changed the copy
    out.backward()
    assert torch.equal(leaf.grad, torch.full((3,), 2.0))


def test_calling_a_remote_directly_goes_through_the_copies():
    x = torch.ones(4)
    _SendsChangesBack(lambda t: t.zero_())(x)
    assert torch.equal(x, torch.ones(4))


def test_an_argument_that_cannot_be_copied_is_the_checks_fault_not_the_learners():
    from companion.checks.harness import GraderError
    with pytest.raises(GraderError, match="call_inplace"):
        call(lambda g: None, _Uncopyable())


class _Uncopyable:
    def __deepcopy__(self, memo):
        raise TypeError("no copies of me")


# ---------------------------------------------------------------- every check, every solution

# Exercises whose answer changes its own arguments by design (an optimizer step, gradients
# unscaled in place, hooks on a module, a checkpoint's saved input, training under a budget): the
# check reads the changes back (`call_inplace`, on objects made for the answer from the seed, apart
# from what the expectation is computed from), so vandalising them after the step is a wrong
# answer; so it is for the fused loss's chunk, whose arguments are views of the batch's own
# tensors (its check refuses an answer that changes them). And answers that run in gloo workers
# or are Triton kernels, launched by the check.
IN_PLACE = {"check_adam_step", "check_accumulation_step", "check_token_normalized_step",
            "check_checkpoint_function", "check_unscale_grads", "check_gather_hooks",
            "check_offloaded_step", "check_train_within_budget", "check_fused_chunk"}
ELSEWHERE = {"check_ring_all_reduce", "check_bucketed_hooks", "check_ring_reduce_scatter",
             "check_triton_forward", "check_row_parallel"}
CHAPTERS = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13"]


def _vandalise(value, depth: int = 0) -> None:
    """Zero every tensor reachable from `value` (module parameters and buffers too), then replace
    its .data by an empty tensor; empty every list and dict."""
    if depth > 4:
        return
    if isinstance(value, torch.nn.Module):
        for t in [*value.parameters(), *value.buffers()]:
            _vandalise(t, depth + 1)
    elif isinstance(value, torch.Tensor):
        with torch.no_grad(), contextlib.suppress(RuntimeError):
            value.zero_()
        with contextlib.suppress(RuntimeError):
            value.data = torch.empty(0, dtype=value.dtype, device=value.device)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _vandalise(v, depth + 1)
        if isinstance(value, list):
            value.clear()
    elif isinstance(value, dict):
        for v in value.values():
            _vandalise(v, depth + 1)
        value.clear()


def _own(value):
    """The result with tensors cloned, so that vandalising the inputs cannot reach it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_own(v) for v in value)
    if isinstance(value, dict):
        return {k: _own(v) for k, v in value.items()}
    return value


def _garbage(value):
    """A wrong result of the right shape: zeros for tensors and numbers, flipped bools, empty
    strings, functions that return None."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return type(value)(0)
    if isinstance(value, str):
        return ""
    if isinstance(value, (tuple, list)):
        return type(value)(_garbage(v) for v in value)
    if isinstance(value, dict):
        return {k: _garbage(v) for k, v in value.items()}
    if callable(value):
        return lambda *a, **k: None
    return value


def _vandalising(reference, *, right: bool):
    """The reference, which then vandalises its arguments and returns its result (`right`) or
    garbage shaped like it."""
    def answer(*args, **kwargs):
        result = _own(reference(*args, **kwargs))
        _vandalise((args, kwargs))
        return result if right else _garbage(result)
    answer.__name__ = answer.__qualname__ = f"vandalising_{reference.__name__}"
    return answer


@pytest.fixture(scope="module")
def solutions() -> dict:
    """Each exercise's answer as its source notebook's solution cell defines it: the setup cell
    and the exercise cells run in an IPython shell of their own per chapter, check lines left out
    (and whatever else the trimmed notebook cannot run, printed or raised, is ignored)."""
    from IPython.core.interactiveshell import InteractiveShell
    shell, found = InteractiveShell.instance(), {}
    for chapter in CHAPTERS:
        exercises = read_chapter(gn.source(chapter)).exercises
        checks = tuple(f"{e.check}(" for e in exercises)
        shell.init_create_namespaces(user_ns={})          # its own globals, kept by its functions
        shell.init_user_ns()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for cell in gn.trimmed(chapter).cells:
                lines = [ln for ln in cell.source.splitlines() if not ln.startswith(checks)]
                shell.run_cell("\n".join(lines), store_history=False)
        found.update({e.check: shell.user_ns.get(e.answer) for e in exercises})
    return found


def _chapter_checks() -> set[str]:
    """Every chapter's registered checks (not the ones other tests register)."""
    modules = {f"companion.checks.ch{number}" for number in CHAPTERS}
    for module in modules:
        __import__(module)
    return {name for name, info in REGISTRY.items() if info.module in modules}


def test_the_exclusions_name_registered_checks():
    assert IN_PLACE | ELSEWHERE <= _chapter_checks()


@pytest.mark.timeout(900)
def test_every_solution_passes_though_it_vandalises_its_inputs_and_vandalism_alone_fails(
        solutions):
    """Over the registry: a solution that vandalises its arguments after computing its result
    passes (the check's expectation was computed before, from inputs the answer never had), and
    the same vandalism returning garbage of the result's shape fails."""
    names = sorted(_chapter_checks() - IN_PLACE - ELSEWHERE)
    assert len(names) >= 30, names
    missing = [n for n in names if not callable(solutions.get(n))]
    assert not missing, f"no solution found in the source notebooks for {missing}"
    for name in names:
        try:
            evaluate(name, _vandalising(solutions[name], right=True))
        except CheckFailed as failure:
            pytest.fail(f"{name}: the solution failed once it vandalised its inputs: {failure}")
        with pytest.raises(CheckFailed):
            evaluate(name, _vandalising(solutions[name], right=False))


# ---------------------------------------------------------------- under the grader

@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(gn.sandbox_blocked()), reason=gn.sandbox_blocked())
def test_under_the_grader_vandalised_inputs_earn_nothing_and_honest_answers_pass(tmp_path):
    """The red team's two answers in real notebooks, graded in the sandbox (their in-place changes
    are copied back into the check's copies): both fail; the course's solutions beside them
    pass."""
    folder, out = tmp_path / "class", tmp_path / "grades"
    folder.mkdir()
    cases = {"10": ("check_tile_backward", "do.zero_()\nreturn torch.zeros_like(q), "
                    "torch.zeros_like(k), torch.zeros_like(v)"),
             "04": ("check_saved_bytes", "x.data = torch.empty(0, x.shape[1])\nreturn 0")}
    for chapter, (check, vandal) in cases.items():
        exercise = next(e for e in read_chapter(gn.source(chapter)).exercises if e.check == check)
        for kind in ("honest", "vandal"):
            nb = gn.trimmed(chapter)
            keep = {exercise.cell_id, exercise.solution_cell_id}
            nb.cells = [nb.cells[0]] + [c for c in nb.cells[1:] if c.get("id") in keep]
            if kind == "vandal":
                gn.body(nb, exercise.solution_cell_id, vandal)
            gn.save(nb, folder / f"{kind}_{chapter}.ipynb")
    env = dict(os.environ, PYTHONPATH=str(gn.REPO))     # this checkout's checks and grader
    result = subprocess.run([sys.executable, "-m", "companion", "grade", ".", "--out", str(out),
                             "--jobs", "2", "--exercise-timeout", "30", "--source",
                             str(gn.COURSE)], cwd=folder, env=env, capture_output=True,
                            text=True, timeout=850)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["notebook"], r["exercise"]): r
            for r in json.loads((out / "grades.json").read_text())}
    for chapter, (check, _) in cases.items():
        exercise = check.removeprefix("check_")
        honest = rows[(f"honest_{chapter}.ipynb", exercise)]
        vandal = rows[(f"vandal_{chapter}.ipynb", exercise)]
        assert honest["passed"] and honest["points"] == honest["max_points"], honest
        assert not vandal["passed"] and vandal["points"] == 0, vandal
        assert "does not match the reference" in vandal["message"], vandal
