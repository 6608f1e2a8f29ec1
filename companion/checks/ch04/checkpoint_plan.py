"""Chapter 04, exercise 4: where to cut a model into checkpointed segments under a byte budget."""
from __future__ import annotations

import itertools
import random

from companion import checkpointing
from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, require

__all__ = ["check_checkpoint_plan"]


def _equal_segments(saved, inputs, cost, budget):
    """Known wrong: checkpoint_sequential's equal layer counts, the fewest that fit."""
    n = len(saved)
    for s in range(1, n + 1):
        starts = [i * (n // s) for i in range(s)]
        if checkpointing.plan_cost(starts, saved, inputs, cost)[0] <= budget:
            return starts
    return None


def _search(saved, inputs, cost, budget, peak, fits=int.__le__):
    """The least-recompute plan under a given (possibly wrong) peak rule and test of "fits"."""
    n, best = len(saved), None
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            starts = [0, *cuts]
            recompute = checkpointing.plan_cost(starts, saved, inputs, cost)[1]
            if fits(peak(starts), budget) and (best is None or recompute < best[0]):
                best = (recompute, starts)
    return None if best is None else best[1]


def _held(starts, saved):
    """The saved bytes of each segment."""
    return [sum(saved[a:b]) for a, b in zip(starts, list(starts[1:]) + [len(saved)])]


def _kept(starts, inputs):
    """Every checkpoint: the inputs of all segments but the last."""
    return sum(inputs[a] for a in starts[:-1])


def _bound(saved, inputs, cost, budget):
    """Known wrong: Chen et al.'s bound, every checkpoint beside the largest segment."""
    return _search(saved, inputs, cost, budget,
                   lambda st: checkpointing.plan_cost(st, saved, inputs, cost, bound=True)[0])


def _no_inputs(saved, inputs, cost, budget):
    """Known wrong: the kept segment inputs left out of the peak."""
    return _search(saved, inputs, cost, budget, lambda st: max(_held(st, saved)))


def _first_input_free(saved, inputs, cost, budget):
    """Known wrong: the first segment's input (the model's input, data) not counted as kept."""
    free = [0, *inputs[1:]]
    return _search(saved, inputs, cost, budget,
                   lambda st: checkpointing.plan_cost(st, saved, free, cost)[0])


def _last_only(saved, inputs, cost, budget):
    """Known wrong: only the last segment's saved bytes counted, not the recomputed ones."""
    return _search(saved, inputs, cost, budget,
                   lambda st: _kept(st, inputs) + _held(st, saved)[-1])


def _own_input_dropped(saved, inputs, cost, budget):
    """Known wrong: a recomputed segment's own checkpoint left out beside its saved bytes."""
    def peak(st):
        before = [sum(inputs[a] for a in st[:j]) for j in range(len(st))]
        return max(k + h for k, h in zip(before[:-1] + [_kept(st, inputs)], _held(st, saved)))
    return _search(saved, inputs, cost, budget, peak)


def _later_alive(saved, inputs, cost, budget):
    """Known wrong: backward read first to last, so a recomputed segment sits beside its own
    checkpoint and the later ones, the earlier ones freed."""
    def peak(st):
        kept = [inputs[a] for a in st[:-1]]
        alive = [sum(kept[j:]) for j in range(len(kept))] + [sum(kept)]
        return max(k + h for k, h in zip(alive, _held(st, saved)))
    return _search(saved, inputs, cost, budget, peak)


def _all_inputs(saved, inputs, cost, budget):
    """Known wrong (off by one): the last segment's input counted as a kept checkpoint too."""
    return _search(saved, inputs, cost, budget,
                   lambda st: max(checkpointing.plan_cost(st, saved, inputs, cost)[0],
                                  sum(inputs[a] for a in st) + _held(st, saved)[-1]))


def _strict(saved, inputs, cost, budget):
    """Known wrong: "fits" read as peak < budget."""
    return _search(saved, inputs, cost, budget,
                   lambda st: checkpointing.plan_cost(st, saved, inputs, cost)[0], int.__lt__)


def _fewest_segments(saved, inputs, cost, budget):
    """Known wrong: the fewest segments that fit, whatever they recompute."""
    n = len(saved)
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            if checkpointing.plan_cost([0, *cuts], saved, inputs, cost)[0] <= budget:
                return [0, *cuts]
    return None


def _greedy(saved, inputs, cost, budget):
    """Known wrong: grow a segment until it would not fit beside the checkpoints kept so far."""
    starts, kept, run = [0], 0, 0
    for i, b in enumerate(saved):
        if i and kept + inputs[starts[-1]] + run + b > budget:
            kept, run = kept + inputs[starts[-1]], 0
            starts.append(i)
        run += b
    return starts


_PLAN_HINTS = [
    (_equal_segments, "layers differ: equal numbers of layers are not equal bytes or equal "
                      "recompute; cut where the bytes and the costs say."),
    (_no_inputs, "each checkpointed segment keeps its input (inputs[start]) until its backward: "
                 "add the checkpoints alive at each moment to the peak."),
    (_first_input_free, "inputs[0] is the first segment's checkpoint: it is the model's input, "
                        "but is it freed before that segment's backward?"),
    (_last_only, "a checkpointed segment's saved tensors all come back while it is recomputed: "
                 "any segment can set the peak, not only the last one."),
    (_bound, "all checkpoints beside the largest segment is Chen et al.'s upper bound, not the "
             "peak: backward runs from the last segment to the first and frees each checkpoint "
             "when its segment is done, so an earlier segment is recomputed without the later "
             "segments' checkpoints."),
    (_own_input_dropped, "a segment's own checkpoint is still alive while it is recomputed (the "
                         "recomputation starts from it): count it beside the segment's saved "
                         "bytes."),
    (_later_alive, "backward runs the segments from the last to the first: while a segment is "
                   "recomputed, the checkpoints of the segments after it are already freed, and "
                   "its own and those before it are still alive."),
    (_all_inputs, "the last segment is not checkpointed: its input is not a kept checkpoint "
                  "(count inputs[start] for every segment but the last)."),
    (_strict, "a plan fits when its peak is at most the budget: look at plans whose peak equals "
              "the budget exactly."),
    (_fewest_segments, "fewer segments is not less recompute: minimise the cost of the layers in "
                       "checkpointed segments."),
    (_greedy, "cutting greedily does not look ahead: a later checkpoint adds its input to the "
              "peak of the segments after it, and a greedy cut can recompute more than needed; "
              "compare whole plans."),
]


def _plan_cases(seed: int) -> list[tuple[list, list, list, int]]:
    """Fixed cases (the first 14), in an order where each wrong rule above first fails with its own
    hint (two of them where Chen et al.'s bound changes the best plan or finds none; the 14th where
    every plan of the fewest segments that fits recomputes more than the best, which has four),
    then random uneven layers and budgets."""
    cases = [([5, 2, 2, 1], [1, 1, 3, 2], [1, 4, 3, 5], 7),
             # the inputs left out (and only the last segment counted) fail here, so that leaving
             # out only inputs[0] fails first on the next case, with its own hint (review 54a)
             ([5, 7, 6, 4], [1, 1, 1, 3], [2, 1, 4, 4], 10),
             ([1, 2, 3], [1, 1, 1], [5, 1, 2], 5),
             ([5, 4, 5], [1, 1, 1], [5, 4, 2], 8),
             ([1, 3, 4], [1, 1, 3], [5, 3, 2], 6),
             ([2, 4, 2, 3], [1, 1, 1, 1], [3, 4, 4, 1], 7),
             ([3, 1, 2], [1, 1, 1], [5, 2, 1], 5),
             ([3, 3, 8, 5], [3, 2, 1, 1], [3, 4, 1, 5], 13),            # later checkpoints alive
             ([5, 6, 5, 2, 7], [3, 1, 2, 2, 2], [5, 3, 1, 2, 2], 14),    # the bound: a dearer plan
             ([3, 2, 2], [3, 1, 1], [1, 1, 3], 6),                       # the bound: none fits
             ([11, 1, 4, 3, 10], [1, 3, 1, 1, 2], [2, 4, 3, 4, 4], 15),
             ([3, 3, 3], [1, 1, 1], [1, 1, 1], 2), ([7], [2], [1], 7),
             ([7, 7, 3, 3, 3, 7], [3, 4, 6, 1, 1, 7], [4, 4, 3, 4, 5, 4], 18)]   # fewest: dearer
    rng = random.Random(seed)
    for _ in range(10):
        n = rng.randrange(3, 11)
        saved = [rng.choice([rng.randrange(10, 100), rng.randrange(100, 900)]) for _ in range(n)]
        inputs = [max(1, b // rng.randrange(2, 9)) for b in saved]
        cost = [round(rng.uniform(0.5, 5.0), 2) for _ in range(n)]
        low = min(checkpointing.plan_cost([0, *c], saved, inputs, cost)[0]
                  for k in range(n) for c in itertools.combinations(range(1, n), k))
        cases.append((saved, inputs, cost, rng.randrange(low, sum(saved) + 1)))
    return cases


def _starts_ok(got, n) -> bool:
    return (isinstance(got, list) and bool(got) and all(type(i) is int for i in got)
            and got[0] == 0 and all(a < b for a, b in zip(got, got[1:])) and got[-1] < n)


def _accepted(plan, want, saved, inputs, cost, budget) -> bool:
    """Whether `plan` passes a case whose reference answer is `want`."""
    if plan is None or want is None:
        return plan is None and want is None
    if not _starts_ok(plan, len(saved)):
        return False
    peak, recompute = checkpointing.plan_cost(plan, saved, inputs, cost)
    best = checkpointing.plan_cost(want, saved, inputs, cost)[1]
    return peak <= budget and abs(recompute - best) <= 1e-9


def _signature(plan, case) -> tuple | None:
    """What a hint matches a plan on: whether it fits and what it recomputes, so that a wrong rule
    with another tie-break gets the same hint."""
    if plan is None or not _starts_ok(plan, len(case[0])):
        return plan if plan is None else ("not starts",)
    peak, recompute = checkpointing.plan_cost(plan, *case[:3])
    return peak <= case[3], round(recompute, 9)


@exercise(points=2, timeout=60.0, reference=("companion.checkpointing.checkpoint_plan",
                                             "companion.checkpointing.segments.checkpoint_plan",
                                             "companion.checkpointing.plan_cost",
                                             "companion.checkpointing.segments.plan_cost"))
def check_checkpoint_plan(answer) -> str:
    """answer(saved, inputs, cost, budget) -> the starts of the segments (0 first) that fit the
    budget with the least recompute, or None when no plan fits."""
    saved_recompute = 0.0
    suspects = list(_PLAN_HINTS)      # the wrong rules that passed every case the answer passed
    for case in _plan_cases(fresh_seeds(1)[0]):
        saved, inputs, cost, budget = case
        label = f"saved={saved}, inputs={inputs}, cost={cost}, budget={budget}"
        want = checkpointing.checkpoint_plan(*case)
        got = call(answer, list(saved), list(inputs), list(cost), budget)
        hint = next((text for wrong, text in suspects
                     if _signature(wrong(*case), case) == _signature(got, case)), "")
        if want is None or got is None:
            require(got is None and want is None, f"{label}: expected {want}, got {got!r}",
                    hint=hint or ("None only when no plan fits: some plan fits this budget, "
                                  "search them all." if want is not None else "no plan fits this budget: "
                                  "return None."))
        else:
            require(_starts_ok(got, len(saved)), f"{label}: {got!r} is not a list of increasing "
                    "int segment starts beginning with 0", hint="return e.g. [0, 3, 5]: segments "
                    "are layers 0-2, 3-4 and 5 to the end.")
            peak, recompute = checkpointing.plan_cost(got, saved, inputs, cost)
            best = checkpointing.plan_cost(want, saved, inputs, cost)[1]
            require(peak <= budget, f"{label}: your plan {got} peaks at {peak} bytes, over the "
                    "budget", hint=hint or "for each segment, count its saved bytes and the "
                    "checkpoints alive during its backward.")
            if abs(recompute - best) > 1e-9:
                raise CheckFailed(f"{label}: your plan {got} recomputes {recompute:g}; {want} "
                                  f"fits with {best:g}", expected=want, got=got, hint=hint)
            saved_recompute += sum(cost[:-1]) - best
        suspects = [(wrong, text) for wrong, text in suspects
                    if _accepted(wrong(*case), want, *case)]
    return ("the least recompute that fits, on uneven layers; a checkpoint after every layer would "
            f"have recomputed {saved_recompute:g} more cost units over these cases")
