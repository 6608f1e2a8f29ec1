"""The grading core: every kind of bad answer becomes a CheckFailed with a clear message."""
import threading
import time

import pytest
import torch

from companion.checks.core import (REGISTRY, CheckFailed, NotDone, call, compare, exercise,
                                   fresh_seeds, require, time_limit, _TimeUp)


@exercise(points=3, timeout=1.0)
def check_double_for_tests(answer):
    for seed in fresh_seeds(2):
        x = torch.randn(5, generator=torch.Generator().manual_seed(seed))
        compare(call(answer, x), 2 * x, name="2x",
                known_wrong={"multiply, do not add.": x + 2})
    return "doubles"


def _loop_forever(x):
    while True:
        try:
            pass
        except Exception:
            pass


def _raises(x):
    raise ValueError("boom")


def _not_done(x):
    raise NotImplementedError("Exercise")


BAD = {
    "None": None,
    "string": "2*x",
    "number": 3.0,
    "raises": _raises,
    "wrong value": lambda x: x + 2,
    "wrong shape": lambda x: (2 * x)[:3],
    "wrong dtype": lambda x: (2 * x).double(),
    "not a tensor": lambda x: (2 * x).tolist(),
    "NaN": lambda x: x * float("nan"),
    "inf": lambda x: x * float("inf"),
    "tuple": lambda x: (2 * x, 2 * x),
    "slightly off": lambda x: 2 * x + 1e-3,
    "endless loop": _loop_forever,
    "sleeps": lambda x: time.sleep(60),
}


def test_passes_on_the_right_answer(capsys):
    check_double_for_tests(lambda x: x * 2)
    assert "check_double_for_tests passed (3 points): doubles" in capsys.readouterr().out


@pytest.mark.parametrize("name", BAD)
def test_every_bad_answer_fails_cleanly_and_quickly(name):
    start = time.monotonic()
    with pytest.raises(CheckFailed) as info:
        check_double_for_tests(BAD[name])
    assert time.monotonic() - start < 30        # the 1 s limit, not the 60 s sleep, ended it
    assert str(info.value).startswith("check_double_for_tests: ")
    assert isinstance(info.value, AssertionError)


def test_known_wrong_answer_gets_its_hint():
    with pytest.raises(CheckFailed, match="multiply, do not add"):
        check_double_for_tests(lambda x: x + 2)


def test_not_done_is_a_notice_and_the_check_returns(capsys):
    with pytest.raises(NotDone, match="not done yet"):
        check_double_for_tests.__wrapped__(_not_done)           # inside, it is its own kind
    assert check_double_for_tests(_not_done) is None            # the wrapper shows, not raises
    assert "check_double_for_tests: not done yet" in capsys.readouterr().out


def _raises_in_my_code(x):
    y = x * 2
    return y.reshape(3, 5)          # the line the learner should see


def test_an_error_in_the_learners_code_shows_the_learners_line():
    with pytest.raises(CheckFailed) as info:
        check_double_for_tests(_raises_in_my_code)
    text = str(info.value)
    assert "in your code: test_checks_core.py, line" in text and "in _raises_in_my_code" in text
    assert "return y.reshape(3, 5)" in text
    assert ", in call" not in text and "companion" not in text.split("hint:")[0]


def _spins(x):
    while True:
        x = x + 1


def test_a_check_that_times_out_shows_where_the_learners_code_was():
    with pytest.raises(CheckFailed, match="did not finish") as info:
        check_double_for_tests(_spins, timeout=0.5)
    assert "in your code: test_checks_core.py, line" in str(info.value) and "in _spins" in str(info.value)


def test_failure_message_shows_expected_got_and_difference():
    with pytest.raises(CheckFailed) as info:
        check_double_for_tests(lambda x: 2 * x + 0.5)
    text = str(info.value)
    assert "expected:" in text and "got:" in text and "largest difference: 0.5" in text


def test_notebook_shows_message_without_traceback():
    failure = CheckFailed("wrong", check="check_x", hint="try again")
    rendered = "\n".join(failure._render_traceback_())
    assert "check_x: wrong" in rendered and "try again" in rendered
    assert "Traceback" not in rendered


def test_registry_records_points_and_rejects_duplicates():
    assert REGISTRY["check_double_for_tests"].points == 3
    with pytest.raises(ValueError, match="unique"):
        exercise()(check_double_for_tests.__wrapped__)


def test_compare_tolerance_fits_the_dtype():
    x = torch.ones(4, dtype=torch.bfloat16)
    compare(x + 0.0039, x)                      # within bf16 tolerance
    with pytest.raises(CheckFailed):
        compare(torch.ones(4) + 1e-3, torch.ones(4))   # outside fp32 tolerance


def test_compare_numbers_and_tuples():
    assert compare(3, 3.0) == 0.0
    compare((torch.ones(2), 1.0), (torch.ones(2), 1.0))
    with pytest.raises(CheckFailed, match="expected a number"):
        compare("3", 3.0)
    with pytest.raises(CheckFailed, match="expected 2 values"):
        compare((1.0,), (1.0, 2.0))
    with pytest.raises(CheckFailed):
        compare(True, 1.0)


def test_require_fails_with_summary():
    require(True, "fine")
    with pytest.raises(CheckFailed, match="changed the gradient"):
        require(False, "changed the gradient")


def test_call_rejects_non_functions():
    with pytest.raises(CheckFailed, match="expected a function"):
        call(42)


def test_time_limit_off_the_main_thread():
    caught = []

    def worker():
        try:
            with time_limit(0.3):
                while True:
                    pass
        except _TimeUp:
            caught.append(True)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(5)
    assert caught == [True]


def test_time_limit_restores_the_alarm_it_found():
    import signal
    before = signal.getitimer(signal.ITIMER_REAL)[0]      # pytest-timeout may have one set
    with time_limit(5):
        pass
    after = signal.getitimer(signal.ITIMER_REAL)[0]
    assert (before == 0 and after == 0) or 0 < before - after < 1


def test_in_a_notebook_the_learners_line_is_named_by_its_cell():
    """In a real kernel the failing line is shown as IPython names it ("Cell In[2], line 3"),
    with the source line, and without a traceback through the companion."""
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[
        new_code_cell("from companion.checks.ch01 import check_mse_gradient"),
        new_code_cell("def mse_gradient(X, y, w, b):\n    r = X @ w + b - y\n"
                      "    return X @ r, r.sum()     # X @ r: the shapes do not match\n\n"
                      "check_mse_gradient(mse_gradient)")])
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    (error,) = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    shown = "\n".join(error.traceback)
    assert error.ename == "CheckFailed" and "Traceback" not in shown
    assert "in your code: Cell In[2], line 3, in mse_gradient" in shown, shown
    assert "return X @ r, r.sum()" in shown and "hint:" in shown


def test_seeded_fixes_the_draws_and_fresh_draws_return_after():
    from companion.checks.core import seeded
    with seeded(7):
        first = fresh_seeds(3) + fresh_seeds(2)
    with seeded(7):
        again = fresh_seeds(3) + fresh_seeds(2)
    with seeded(8):
        other = fresh_seeds(5)
    assert first == again and first != other
    assert len(set(first)) == 5                    # the two calls inside one block differ
    assert fresh_seeds(5) != first                  # outside the block: SystemRandom again


def test_seeded_blocks_nest_and_unwind_on_error():
    from companion.checks.core import seeded
    with seeded(1):
        outer = fresh_seeds(1)
        with seeded(2):
            inner = fresh_seeds(1)
        after = fresh_seeds(1)
    with seeded(2):
        assert fresh_seeds(1) == inner
    with seeded(1):
        assert fresh_seeds(2) == outer + after     # the inner block did not consume outer draws
    with pytest.raises(ValueError):
        with seeded(3):
            raise ValueError("inside")
    assert fresh_seeds(4) != fresh_seeds(4)        # nothing left seeded after the error


def test_seeded_makes_a_check_repeatable():
    """A wrong answer that passes on some draws passes or fails the same way under one seed."""
    from companion.checks.core import evaluate, seeded

    def half_wrong(x):                            # right when the first value is positive
        return 2 * x if x[0] > 0 else x + x.abs()

    outcomes = []
    for _ in range(2):
        row = []
        for seed in range(8):
            with seeded(seed):
                try:
                    evaluate("check_double_for_tests", half_wrong)
                    row.append(True)
                except CheckFailed:
                    row.append(False)
        outcomes.append(row)
    assert outcomes[0] == outcomes[1] and False in outcomes[0]


def test_seeded_refuses_a_seed_that_is_not_an_int():
    from companion.checks.core import seeded
    with pytest.raises(TypeError, match="must be an int"):
        with seeded("7"):
            pass
