"""The mutation harness (tests/mutants, benchmarks/bench_mutants.py): mutants are made as described,
a check that catches them kills them all, and a weak check's survivor is reported as one. That
every check kills all its mutants is the benchmark's to show (it runs for many minutes); here each
chapter's fixed sample, two mutants of each exercise, must die under the three seeds."""
import ast
import pathlib
import re
import sys

import pytest
import torch

from companion.checks.core import call, compare, exercise, fresh_seeds

from mutants import KINDS, Chapter, Target, mutants, run_target, select
from mutants.run import equivalent_table

REPO = pathlib.Path(__file__).resolve().parent.parent

TOY = '''\
import torch


def square_sum(x, n):
    """Sum of the squares of x[:n]."""
    ### BEGIN SOLUTION
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        if x[i] > 0.5:
            total += x[i] * x[i]
        else:
            total = total - x[i] ** 2
    return total
    ### END SOLUTION


unrelated = 1 + 2
'''
SOLUTION = set(range(7, 14))


def _reference(x, n):
    x = x[:n].double()
    return torch.where(x > 0.5, x * x, -x * x).sum()


@exercise(points=1, timeout=5.0)
def check_square_sum_weak(answer):
    """Weak on purpose: one fixed input, x = [2, 2]. At 2, x * x equals x + x."""
    x = torch.tensor([2.0, 2.0])
    compare(call(answer, x, 2), _reference(x, 2), name="sum")
    return "ok"


@exercise(points=1, timeout=5.0)
def check_square_sum_lucky(answer):
    """One draw of two: x = [2, 2] (where x + x passes) or x = [3, 0.2]."""
    for seed in fresh_seeds(1):
        x = torch.tensor([2.0, 2.0]) if seed % 2 else torch.tensor([3.0, 0.2])
        compare(call(answer, x, 2), _reference(x, 2), name="sum")
    return "ok"


@exercise(points=1, timeout=5.0)
def check_square_sum_strong(answer):
    for x in (torch.tensor([3.0, 0.25, 2.0]), torch.tensor([0.125, 0.625, 5.0]),
              torch.tensor([0.5, 0.75, 1.5])):
        for n in (1, 3):
            compare(call(answer, x, n), _reference(x, n), name="sum")
    return "ok"


class Toy:
    """What run_target needs of a Chapter: run a mutant's code, return the answer."""

    def answer(self, target, source):
        namespace = {}
        exec(compile(source, "<toy>", "exec"), namespace)
        return namespace[target.answer]

    def restore(self, target):
        pass


def _target(check):
    return Target("toy", check, "square_sum", TOY, SOLUTION)


def test_mutants_cover_every_kind_and_only_the_solution():
    found = mutants(TOY, SOLUTION)
    kinds = {m.kind for m in found}
    assert kinds >= {"compare", "arith", "term", "off1", "const", "args", "dtype", "early", "call"}
    assert kinds <= set(KINDS)
    assert all(m.line in SOLUTION for m in found)
    assert len({m.source for m in found}) == len(found)              # no mutant twice
    original = ast.unparse(ast.parse(TOY))
    for m in found:
        assert m.source != original
        compile(m.source, "<mutant>", "exec")
        assert "unrelated = 1 + 2" in m.source                      # outside the solution: kept
    described = {m.description for m in found}
    assert "line 9: compare: `x[i] > 0.5`: Gt -> GtE" in described
    assert "line 10: arith: `x[i] * x[i]`: Mult -> Div" in described
    assert "line 8: off1: `range(n)`: range bound 0 -1" in described
    assert "line 7: dtype: `torch.float64`: torch.float64 -> torch.float32" in described
    assert any(m.kind == "early" and "return total" in m.change for m in found)


def test_a_call_statement_removed_and_a_context_dropped():
    code = ("def step(model, opt, loss):\n    ### BEGIN SOLUTION\n    opt.zero_grad()\n"
            "    with torch.no_grad():\n        loss.backward()\n    opt.step()\n"
            "    ### END SOLUTION\n")
    found = {m.description: m.source for m in mutants(code, {3, 4, 5, 6})}
    assert "opt.zero_grad()" not in found["line 3: call: `opt.zero_grad()`: call removed"]
    assert "no_grad" not in found["line 4: context: `with torch.no_grad()` dropped"]
    assert "backward" not in found["line 5: call: `loss.backward()`: call removed"]


def test_a_strong_check_kills_every_mutant():
    report = run_target(Toy(), _target("check_square_sum_strong"), table={})
    assert report.found == len(report.outcomes) > 20
    survivors = [o.mutant.description for o in report.outcomes if o.verdict != "killed"]
    assert survivors == []


def test_a_weak_check_lets_a_mutant_survive_and_the_report_says_which():
    report = run_target(Toy(), _target("check_square_sum_weak"), table={})
    survived = {o.mutant.description for o in report.outcomes if o.verdict == "survived"}
    assert "line 10: arith: `x[i] * x[i]`: Mult -> Div" not in survived      # 2 / 2 != 4
    assert "line 12: arith: `x[i] ** 2`: Pow -> Mult" in survived            # 2 * 2 == 2 ** 2
    assert report.count("killed") > 0 and report.count("killed") + len(survived) == len(
        report.outcomes)
    # the reviewed table turns a survivor into an equivalent, with its reason
    table = {("check_square_sum_weak", "total = total - x[i] ** 2",
              "arith: `x[i] ** 2`: Pow -> Mult"): "x ** 2 == x * 2 at 2"}
    again = run_target(Toy(), _target("check_square_sum_weak"), table=table)
    (equal,) = [o for o in again.outcomes if o.verdict == "equivalent"]
    assert equal.how == "x ** 2 == x * 2 at 2"
    assert again.count("survived") == report.count("survived") - 1


def test_a_survivor_that_passes_by_the_luck_of_the_draw_is_told_apart():
    report = run_target(Toy(), _target("check_square_sum_lucky"), table={}, probe=6)
    lucky = [o for o in report.outcomes if o.verdict == "survived" and "lucky-draw" in o.how]
    steady = [o for o in report.outcomes if o.verdict == "survived" and "lucky" not in o.how]
    assert lucky or steady
    for o in lucky:
        assert re.search(r"fails [1-6] of 6 more", o.how), o.how
    # under fixed seeds the verdicts repeat exactly
    again = run_target(Toy(), _target("check_square_sum_lucky"), table={}, probe=6)
    assert [(o.verdict, o.how) for o in again.outcomes] == [(o.verdict, o.how)
                                                            for o in report.outcomes]


def test_select_keeps_every_kind_and_is_the_same_every_time():
    found = mutants(TOY, SOLUTION)
    chosen = select(found, 9)
    assert len(chosen) == 9 and chosen == select(found, 9)
    assert {m.kind for m in chosen} == {m.kind for m in found}
    assert select(found, None) == found


def test_an_equivalent_without_a_reason_is_refused(tmp_path):
    table = tmp_path / "equivalent.toml"
    table.write_text('[[mutant]]\ncheck = "check_x"\ncode = "n = 1"\nchange = "off1: `1`: 1 -> 2"\n'
                     'why = ""\n')
    with pytest.raises(ValueError, match="gives no reason"):
        equivalent_table(table)
    assert isinstance(equivalent_table(), dict)               # the repository's own table reads


def test_a_chapter_exercise_end_to_end():
    """Chapter 01's MSE gradient: the namespace is the notebook's, every mutant is killed."""
    import IPython
    before = IPython.get_ipython()                           # another test's shell, or None
    with Chapter("01") as chapter:
        (target,) = [t for t in chapter.targets if t.check == "check_mse_gradient"]
        assert target.answer == "mse_gradient" and not target.skip
        report = run_target(chapter, target, table={})
    assert IPython.get_ipython() is before                   # the process's shell is back
    assert report.skip == "" and len(report.outcomes) == report.found > 5
    assert [o.mutant.description for o in report.outcomes if o.verdict != "killed"] == []


def test_the_benchmark_ends_with_its_summary_line(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_mutants
    assert bench_mutants.main(["--chapter", "01", "--check", "check_mse_gradient",
                               "--sample", "6", "--probe", "0"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"0 survivors of 6 non-equivalent mutants \(0 equivalent\)", last), last
    with pytest.raises(SystemExit):
        bench_mutants.main(["--chapter", "99"])


def test_a_spent_budget_leaves_the_rest_counted_not_run():
    report = run_target(Toy(), _target("check_square_sum_strong"), table={}, budget=0.0, cap=5)
    assert report.selected == 5 and report.unrun == 5 and report.outcomes == []


def test_every_reviewed_equivalent_names_a_mutant_that_exists():
    """A stale entry (its line or change edited away) would silently judge nothing: fail instead."""
    table = equivalent_table()
    wanted = {check for check, _, _ in table}
    found = set()
    from companion.checks.core import REGISTRY
    _import_all()
    numbers = set()
    for check in wanted:
        assert check in REGISTRY, f"{check} in equivalent.toml is no registered check"
        numbers.add(REGISTRY[check].module.rsplit(".ch", 1)[1])
    for number in sorted(numbers):
        with Chapter(number) as chapter:
            for target in chapter.targets:
                if target.check in wanted:
                    found |= {(target.check, m.code, f"{m.kind}: {m.change}")
                              for m in mutants(target.code, target.lines)}
    assert sorted(set(table) - found) == []


def _import_all() -> None:
    """Import every chapter's checks: the registry fills as they import."""
    import importlib
    import pkgutil
    import companion.checks as package
    for m in pkgutil.iter_modules(package.__path__):
        if re.fullmatch(r"ch\d\d", m.name):
            importlib.import_module(f"companion.checks.{m.name}")


def test_a_shell_the_process_already_has_is_set_aside_and_given_back():
    # CI runs this file in a worker where an earlier test may have made an IPython shell
    import IPython
    from IPython.core.interactiveshell import InteractiveShell
    had = InteractiveShell.initialized()
    outer = InteractiveShell.instance()
    try:
        with Chapter("01") as chapter:
            assert chapter.shell is not outer and IPython.get_ipython() is chapter.shell
        assert IPython.get_ipython() is outer and InteractiveShell.instance() is outer
    finally:
        if not had:
            InteractiveShell.clear_instance()


# Lines whose mutants only a CUDA device tells apart: on a CPU they compute what the reference
# computes (bench_mutants lists them as survivors; the checks hold a CUDA case for each)
CUDA_ONLY = {
    "found_inf = torch.zeros((), device=inv_scale.device)",                    # 05 unscale
    'room = budget if device.type == "cpu" else 0.8 * budget',                 # 09 budget
    "if predict_memory(shape, c, device_type=device.type).peak <= room]",
    "model = model_fn(dtype=torch.float32, device=device)",
}


@pytest.mark.parametrize("number", [f"{n:02d}" for n in range(14)])
def test_a_fixed_sample_of_each_chapters_mutants_is_killed(number, capsys):
    """Two mutants of each exercise, the same every run (`select`: a different kind of mistake
    each), run against the check under seeds 0, 1 and 2: a check made weaker fails here."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_mutants
    bench_mutants.main(["--chapter", number, "--sample", "2", "--probe", "0", "--budget", "0"])
    out = capsys.readouterr().out.strip().splitlines()
    found = re.fullmatch(r"(\d+) survivors of (\d+) non-equivalent mutants \(\d+ equivalent\)",
                         out[-1])
    assert found and int(found[2]) > 0, out[-1]
    survived = [re.search(r"survived: line \d+ `(.*?)`: ", line)[1] for line in out
                if "survived: line" in line]
    allowed = set() if torch.cuda.is_available() else CUDA_ONLY
    assert int(found[1]) == len(survived), out[-1]
    assert [code for code in survived if code not in allowed] == [], "\n".join(out[-30:])
