"""Chapter 09, exercise 2: search the levers for the fastest plan that fits a budget, without
predicting the peaks the promise already decides (the micro-batch's peak never falls as it
grows), on grids, models and budgets the notebook does not show."""
from __future__ import annotations

import functools
import math
import random

from companion.checkpointing.segments import predicted_activation_bytes
from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, harness, require
from companion.models import GPT
from companion.plan import Candidate, CostModel, GPTShape, predict_memory, predict_seconds
from companion.plan import search

__all__ = ["check_fastest_fitting", "MONOTONE"]

MONOTONE = "micro_batch"      # the lever whose peak the exercise promises never falls as it grows


def _divisors(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def _accumulating(batch: int) -> list[int]:
    """The exercise's micro-batch sizes: those that split `batch` into two or more micro-batches.
    The whole batch at once is the one exception to the promise in the planner's predictions (it
    keeps no gradients between micro-batches: 10 of the 64 grids of `_planner_case`'s sizes
    have a setting where it needs less than the largest size below it), so it is left out."""
    return _divisors(batch)[:-1]


def _table_case(seed: int, at_boundary: bool, largest: bool = False) -> dict:
    """Levers the notebook does not show, with peaks that follow the course's formulas (states,
    then activations per sequence times the micro-batch, checkpoint_sequential's uneven segments)
    and step times that wobble as measured ones do (±25%, so the fastest plan of a setting of
    the other levers need not be its largest micro-batch). The budget is, `at_boundary`, exactly
    the peak of the fastest plan that fits (whose peak is the budget's), else between peaks.
    Drawn until the fastest plan that fits is missed by a search that reads the promise the
    wrong way round (its setting's largest micro-batch does not fit) and differs from the
    fastest of each setting's largest fitting micro-batch; `largest`: drawn until the fastest
    plan that fits is the largest micro-batch of its setting instead (a search that never asks
    for the last size misses it) and a scan of each setting's sizes from the smallest up asks
    more peaks than a binary search per setting can (`_judge_asking`)."""
    rng = random.Random(seed)
    while True:
        batch, depth = rng.choice((24, 36, 48)), rng.choice((5, 6, 7))
        levers = {MONOTONE: _accumulating(batch), "segments": list(range(1, depth + 1)),
                  "offload": [False, True]}
        if rng.random() < 0.5:
            levers["precision"] = ["fp32", "bf16"]
        names = list(levers)
        rng.shuffle(names)
        levers = {name: levers[name] for name in names}
        block, kept, outside = (rng.randrange(30_000, 90_000), rng.randrange(2_000, 6_000),
                                rng.randrange(20_000, 60_000))
        params = rng.randrange(200_000, 2_000_000)
        peaks, times = {}, {}
        for plan in search.all_plans(levers):
            low = plan.get("precision") == "bf16"
            states = (4 if plan["offload"] else 16) * params
            per_sequence = outside + predicted_activation_bytes(depth, plan["segments"], block, kept)
            peaks[_key(levers, plan)] = states + plan[MONOTONE] * per_sequence // (2 if low else 1)
            compute = (1 + (plan["segments"] > 1) / 3) * (0.6 if low else 1.0)
            overhead = 0.02 * batch / plan[MONOTONE] + (0.3 if plan["offload"] else 0.0)
            times[_key(levers, plan)] = (compute + overhead) * rng.uniform(0.8, 1.25)
        budget = _table_budget(peaks, times, rng, at_boundary)
        case = {"levers": levers, "peaks": peaks, "times": times, "budget": budget}
        if budget is not None and (_largest_is_best(case) and _scan_asks(case) > _asks_at_most(case)
                                   if largest else _telling(case, at_boundary)):
            return case


def _table_budget(peaks: dict, times: dict, rng: random.Random, at_boundary: bool):
    """A budget leaving between 15% and 70% of the plans out of it (see `_table_case`)."""
    ordered = sorted(peaks.values())
    low, high = ordered[int(0.3 * len(ordered))], ordered[int(0.85 * len(ordered))]
    if not at_boundary:
        return rng.uniform(low, high) // 1 + 0.5            # between integer peaks
    qualifying = []
    best_peak = math.inf                                    # the smallest peak of faster plans
    for key in sorted(times, key=times.get):
        if low <= peaks[key] <= high and peaks[key] < best_peak:
            qualifying.append(peaks[key])
        best_peak = min(best_peak, peaks[key])
    return rng.choice(qualifying) if qualifying else None


def _planner_case(seed: int) -> dict:
    """The course GPT at sizes the notebook does not show, its peaks and times from the planner's
    own `predict_memory` and `predict_seconds` (the CPU's cost model), over the micro-batches that
    accumulate, segments, offload and precision, taken as drawn: over those micro-batches the
    promise holds on every grid of these sizes (a test checks all 64)."""
    rng = random.Random(seed)
    width, depth = rng.choice((80, 96, 144, 176)), rng.choice((3, 5, 6, 7))
    batch = rng.choice((12, 18, 24, 30))
    shape = GPTShape.of(functools.partial(GPT, 128, 64, width, depth, 4, fused_attention=True))
    levers = {MONOTONE: _accumulating(batch), "segments": list(range(1, depth + 1)),
              "offload": [False, True], "precision": ["fp32", "autocast", "mixed"]}
    cost = CostModel.for_device("cpu")
    peaks, times = {}, {}
    for plan in search.all_plans(levers):
        c = Candidate(plan[MONOTONE], batch // plan[MONOTONE], plan["segments"],
                      plan["precision"], offload=plan["offload"])
        peaks[_key(levers, plan)] = predict_memory(shape, c).peak
        times[_key(levers, plan)] = predict_seconds(shape, c, cost)["total"]
    ordered = sorted(peaks.values())
    budget = rng.uniform(ordered[len(ordered) // 4], ordered[3 * len(ordered) // 4]) // 1
    return {"levers": levers, "peaks": peaks, "times": times, "budget": budget + 0.5}


def _promise_holds(case: dict) -> bool:
    """Whether each setting's peaks never fall as the micro-batch grows."""
    levers, peaks = case["levers"], case["peaks"]
    for plans in _settings(levers).values():
        got = [peaks[_key(levers, p)] for p in plans]
        if any(a > b for a, b in zip(got, got[1:])):
            return False
    return True


def _settings(levers: dict) -> dict:
    """{the other levers' values: that setting's plans, micro-batch ascending}."""
    out: dict = {}
    for plan in search.all_plans(levers):
        out.setdefault(tuple(v for k, v in plan.items() if k != MONOTONE), []).append(plan)
    for plans in out.values():
        plans.sort(key=lambda p: p[MONOTONE])
    return out


def _segments_pruned(case: dict) -> tuple | None:
    """The fastest plan that fits by a search that reads more checkpoint segments as never
    needing more memory: a setting whose smallest micro-batch does not fit rules out the
    settings of the same other levers with fewer segments."""
    levers, budget = case["levers"], case["budget"]
    where = list(levers).index(MONOTONE)
    plans = _settings(levers)
    names = [k for k in levers if k != MONOTONE]
    seg = names.index("segments")
    dead = {key for key, setting in plans.items()
            if case["peaks"][_key(levers, setting[0])] > budget}

    def ruled_out(key: tuple) -> bool:
        other = key[:where] + key[where + 1:]
        return any(d[:seg] + d[seg + 1:] == other[:seg] + other[seg + 1:] and d[seg] > other[seg]
                   for d in dead)

    keys = [k for k in _fitting(case) if not ruled_out(k)]
    return _fastest(case, keys)


def _largest_pruned(case: dict, order: list) -> tuple | None:
    """The fastest plan that fits by a search that, visiting the settings in `order`, skips one
    whose largest micro-batch is no faster than the best plan so far (it reads the largest
    micro-batch as its setting's fastest)."""
    levers, best = case["levers"], None
    for setting in order:
        keys = [_key(levers, p) for p in setting]
        if best is not None and case["times"][keys[-1]] >= case["times"][best]:
            continue
        for key in keys:
            if case["peaks"][key] <= case["budget"] and (best is None or
                                                         case["times"][key] < case["times"][best]):
                best = key
    return best


def _fixed_budget_case(seed: int, *wrong) -> dict:
    """A table case (`_table_case`) whose budget sits where each rule of `wrong` misses the
    fastest plan that fits: drawn, from the seed, among the budgets between two peaks where
    they all do."""
    rng = random.Random(seed)
    while True:
        case = _table_case(rng.randrange(2**32), at_boundary=False)
        ordered = sorted(set(case["peaks"].values()))
        budgets = [p + 0.5 for p in ordered[:-1]]     # uneven segments tell only low ones
        telling = [b for b in budgets if all(_misses(dict(case, budget=b), rule)
                                             for rule in wrong)]
        if telling:
            return dict(case, budget=rng.choice(telling))


def _misses(case: dict, wrong) -> bool:
    best = _fastest(case, _fitting(case))
    return best is not None and case["times"].get(wrong(case), math.inf) > case["times"][best]


def _case(seed: int, kind: str) -> dict:
    """One of the check's cases, the same from the same seed in any process."""
    if kind == "planner":
        return _planner_case(seed)
    if kind == "uneven segments":
        return _fixed_budget_case(seed, _segments_pruned)
    if kind == "largest not fastest":
        return _fixed_budget_case(   # the settings visited in the levers' order or reversed
            seed, lambda case: _largest_pruned(case, list(_settings(case["levers"]).values())),
            lambda case: _largest_pruned(case, list(_settings(case["levers"]).values())[::-1]))
    case = _table_case(seed, at_boundary=kind == "boundary", largest=kind == "largest fits")
    if kind == "nothing fits":
        case["budget"] = min(case["peaks"].values()) - 1
    return case


def _key(levers: dict, plan) -> tuple:
    """A plan's values in the levers' order; ValueError (to the learner) unless it is a plan."""
    if not isinstance(plan, dict) or set(plan) != set(levers):
        raise ValueError(f"a plan is a dict with one value for each lever {list(levers)}, e.g. "
                         f"{ {k: v[0] for k, v in levers.items()} }; got {plan!r}")
    for name, values in levers.items():
        if not any(type(v) is type(plan[name]) and v == plan[name] for v in values):
            raise ValueError(f"{plan[name]!r} is not a value of the lever {name!r}: {values}")
    return tuple(plan[name] for name in levers)


@harness
def _search(answer, seed: int, kind: str) -> dict:
    """The answer on one case, with counting predictors: what it returned (plain data) and which
    plans it asked the peak of, in order."""
    case = _case(seed, kind)
    levers, asked, timed = case["levers"], [], [0]

    def predict_peak(plan: dict) -> int:
        key = _key(levers, plan)
        asked.append(key)
        return case["peaks"][key]

    def predict_time(plan: dict) -> float:
        timed[0] += 1
        return case["times"][_key(levers, plan)]

    got = call(answer, {k: list(v) for k, v in levers.items()}, predict_peak, predict_time,
               case["budget"])
    if isinstance(got, dict):
        got = {str(k): v if isinstance(v, (bool, int, float, str)) else repr(v)
               for k, v in got.items()}
    elif got is not None:
        got = f"a {type(got).__name__}: {got!r}"[:200]
    return {"got": got, "asked": asked, "timed": timed[0]}


def _fastest(case: dict, keys) -> tuple | None:
    return min(keys, key=case["times"].get, default=None)


def _fitting(case: dict, strict: bool = False) -> list[tuple]:
    b = case["budget"]
    return [k for k, p in case["peaks"].items() if (p < b if strict else p <= b)]


def _telling(case: dict, at_boundary: bool) -> bool:
    """Whether the case tells the right search from the wrong ones of `_WRONG` that it can (at
    the boundary `<` for `<=`, between peaks the largest micro-batch for the fastest) and from one
    that reads the promise the wrong way round (skipping a setting whose largest micro-batch does
    not fit)."""
    best = _fastest(case, _fitting(case))
    levers = case["levers"]
    if best is None:
        return False
    setting = _settings(levers)[tuple(v for k, v in zip(levers, best) if k != MONOTONE)]
    rules = list(_WRONG.values())
    rules = [rules[0], rules[1]] if at_boundary else [rules[0], rules[2]]
    return (case["peaks"][_key(levers, setting[-1])] > case["budget"]
            and all(rule(case) != best for rule in rules))


def _largest_is_best(case: dict) -> bool:
    """Whether the fastest plan that fits is the largest micro-batch of its setting."""
    best, levers = _fastest(case, _fitting(case)), case["levers"]
    where = list(levers).index(MONOTONE)
    return best is not None and best[where] == levers[MONOTONE][-1]


def _asks_at_most(case: dict) -> int:
    """The most peaks a binary search per setting of the other levers asks: ceil(log2(n + 1))
    per setting for n micro-batch sizes."""
    n = len(case["levers"][MONOTONE])
    return len(_settings(case["levers"])) * math.ceil(math.log2(n + 1))


def _scan_asks(case: dict) -> int:
    """The peaks a scan of each setting's sizes from the smallest up asks: those that fit, and
    the first that does not."""
    levers, asks = case["levers"], 0
    for plans in _settings(levers).values():
        fit = sum(case["peaks"][_key(levers, p)] <= case["budget"] for p in plans)
        asks += fit + (fit < len(plans))
    return asks


# The cases whose budget most plans fit, where asking each size that fits costs more peaks than a
# binary search per setting can ask (where few fit, a search that asks the fastest plans first
# may ask more than that and still few: it is not held to it there)
FEW_ASKS = ("boundary", "between peaks", "largest fits")


def _largest_per_setting(case: dict) -> tuple | None:
    levers, budget, keys = case["levers"], case["budget"], []
    for plans in _settings(levers).values():
        fits = [_key(levers, p) for p in plans if case["peaks"][_key(levers, p)] <= budget]
        keys += fits[-1:]
    return _fastest(case, keys)


_WRONG = {
    "you returned the plan with the smallest peak among those that fit; the task asks for the "
    "fastest one that fits: compare predict_time among the plans whose peak fits.":
        lambda case: min(_fitting(case), key=lambda k: (case["peaks"][k], case["times"][k]),
                         default=None),
    "a plan whose peak equals the budget fits too: keep plans with predict_peak(plan) <= budget, "
    "not <.": lambda case: _fastest(case, _fitting(case, strict=True)),
    "the largest micro-batch that fits is not always the fastest: nothing promises an order of "
    "the times (here they wobble, as measured ones do), so time every plan that fits.": _largest_per_setting,
}


def _plan_of(case: dict, key: tuple | None) -> str:
    if key is None:
        return "None"
    return (f"{dict(zip(case['levers'], key))} (peak {case['peaks'][key]:,.0f}, "
            f"{case['times'][key]:.4g} s)")


def _as_key(case: dict, got, label: str) -> tuple | None:
    """The answer's plan as the grid's key, None for None; CheckFailed for anything else."""
    if got is None:
        return None
    try:
        return _key(case["levers"], got)
    except ValueError as bad:
        raise CheckFailed(f"{label}: expected a plan (a dict with one value of each lever) or "
                          f"None, got {got!r}: {bad}",
                          hint="return the plan you chose as predict_peak takes it, or None when "
                               "no plan fits.") from None


def _judge_answer(case: dict, got: tuple | None, label: str, mistake: str | None) -> None:
    """Pass when `got` is the fastest plan that fits (any of them, on a tie), else CheckFailed;
    `mistake`: the hint of the wrong rule that gives every answer the learner gave."""
    budget, best = case["budget"], _fastest(case, _fitting(case))
    if best is None:
        require(got is None, f"{label}: no plan fits the budget {budget:,.0f} (the smallest peak "
                f"is {min(case['peaks'].values()):,}); you returned {_plan_of(case, got)}",
                hint="return None when no plan's peak is at most the budget.")
        return
    if got is not None and case["peaks"][got] > budget:
        raise CheckFailed(f"{label}: your plan {_plan_of(case, got)} is over the budget "
                          f"{budget:,.0f}", expected=_plan_of(case, best),
                          hint="only a plan with predict_peak(plan) <= budget fits: look at the "
                               "end of your search (a binary search's last step is easy to be "
                               "off by one in).")
    if got is None or case["times"][got] > case["times"][best]:
        raise CheckFailed(
            f"{label}: a faster plan fits: {_plan_of(case, best)}; you returned "
            f"{_plan_of(case, got)}", expected=_plan_of(case, best), got=_plan_of(case, got),
            hint=mistake or "only the micro-batch promises an order: with the other levers fixed, "
            "the peak never falls as micro_batch grows, so the micro-batch sizes that fit are a "
            "prefix of the ascending list. Nothing is promised for the other levers "
            "(checkpoint_sequential's segments are uneven), so no setting of them may be skipped.")


def _judge_asking(case: dict, asked: list, label: str, kind: str) -> None:
    """No peak asked twice, nor one that earlier answers decide by the promise; on the cases
    `FEW_ASKS`, no more peaks than a binary search per setting can ask."""
    levers, budget = case["levers"], case["budget"]
    where = [i for i, k in enumerate(levers) if k == MONOTONE][0]
    known: dict = {}                                # setting -> (largest fitting, smallest not)
    for n, key in enumerate(asked):
        setting, size = key[:where] + key[where + 1:], key[where]
        fits_up_to, fails_from = known.get(setting, (-math.inf, math.inf))
        require(asked.index(key) == n, f"{label}: you predicted the peak of "
                f"{dict(zip(levers, key))} twice",
                hint="each predicted peak is a simulated step: keep what you learned instead of "
                     "asking again.")
        decided = "fits" if size <= fits_up_to else "does not fit" if size >= fails_from else ""
        require(not decided, f"{label}: you predicted the peak of {dict(zip(levers, key))}, "
                f"which an earlier prediction had decided: it {decided} (call {n + 1} of "
                f"{len(asked)}; the grid has {len(case['peaks'])} plans)",
                hint="with the other levers fixed, the peak never falls as micro_batch grows: a "
                     "plan with a smaller micro-batch than one that fits fits too, one with a "
                     "larger micro-batch than one that does not fit does not fit either. Ask "
                     "only what you cannot tell yet (a binary search per setting asks about "
                     "log2 of the sizes).")
        if case["peaks"][key] <= budget:
            known[setting] = (max(fits_up_to, size), fails_from)
        else:
            known[setting] = (fits_up_to, min(fails_from, size))
    if kind in FEW_ASKS:
        most = _asks_at_most(case)
        require(len(asked) <= most,
                f"{label}: you predicted {len(asked)} peaks; a binary search in each of the "
                f"{len(_settings(levers))} settings of the other levers asks at most "
                f"{most // len(_settings(levers))} of its {len(levers[MONOTONE])} micro-batch "
                f"sizes, {most} in all",
                hint="the sizes that fit are a prefix of the ascending list: under a budget that "
                     "most plans fit, asking the sizes one by one asks nearly all of them. Find "
                     "where each prefix ends with as few predictions as the promise allows.")


@exercise(points=2, timeout=30.0, reference=("companion.plan.search.fastest_fitting",))
def check_fastest_fitting(answer) -> str:
    """answer(levers, predict_peak, predict_time, budget) -> the fastest plan whose peak is at
    most budget, or None: tried on grids, models and budgets the notebook does not show, its
    calls of predict_peak counted."""
    kinds = ("boundary", "between peaks", "largest fits", "uneven segments",
             "largest not fastest", "planner", "nothing fits")
    runs = []
    for seed, kind in zip(fresh_seeds(len(kinds)), kinds):
        case = _case(seed, kind)
        label = (f"{len(case['peaks'])} plans over {list(case['levers'])}, budget "
                 f"{case['budget']:,.1f} ({kind})")
        seen = _search(answer, seed, kind)
        runs.append((case, _as_key(case, seen["got"], label), seen["asked"], label, kind))
    # One wrong rule that gives every answer the learner gave names the mistake.
    mistakes = [hint for hint, rule in _WRONG.items()
                if all(rule(case) == got for case, got, _, _, _ in runs)]
    for case, got, _, label, _ in runs:
        _judge_answer(case, got, label, mistakes[0] if mistakes else None)
    for case, _, asked, label, kind in runs:
        _judge_asking(case, asked, label, kind)
    asked = sum(len(run[2]) for run in runs)
    total = sum(len(run[0]["peaks"]) for run in runs)
    return (f"the fastest plan that fits on {len(kinds)} grids the notebook does not show, "
            f"{asked} peaks predicted where predicting every plan takes {total}")
