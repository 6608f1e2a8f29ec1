"""companion.plan.report: the waterfall from the plain run to the plan, and why a setup OOMs."""
import functools

from companion.models import GPT
from companion.plan import plan, predict_memory
from companion.plan.report import waterfall, why_oom

FN = functools.partial(GPT, 128, 64, 128, 4, 4, fused_attention=True)


def test_the_waterfall_ends_at_the_chosen_plan_and_each_lever_saves_bytes():
    p = plan(FN, 16, budget="8 MiB", device="cpu", verify=1, simulate_plain=False)
    steps = waterfall(p)
    assert steps[0].candidate == p.plain.candidate and steps[-1].candidate == p.chosen
    assert steps[-1].peak == predict_memory(p.shape, p.chosen).peak
    assert all(b.peak < a.peak for a, b in zip(steps, steps[1:]))
    assert len(steps) - 1 == len({s.lever for s in steps[1:]})


def test_why_oom_names_the_overflow_and_fixes_that_fit():
    p = plan(FN, 16, budget="8 MiB", device="cpu", verify=1, simulate_plain=False)
    text = why_oom(p.plain, p.rows, p.budget)
    assert "over, at the" in text and "activations" in text.splitlines()[1]
    fixes = [line for line in text.splitlines() if line.startswith("  fix:")]
    assert fixes and len(fixes) <= 3
