"""companion.plan.search: the pruned search gives the brute force's answer, asks fewer peaks,
never one twice, and none that an earlier answer decides."""
import math
import random

import pytest

from companion.plan import Candidate, CostModel, GPTShape, capstone_model, predict_memory, \
    predict_seconds
from companion.plan.search import all_plans, fastest_fitting, fastest_fitting_brute


def _table(seed):
    """Random levers; peaks that grow with the micro-batch (other levers: anything), times
    that are anything."""
    rng = random.Random(seed)
    levers = {"segments": list(range(1, rng.randrange(2, 6))), "micro_batch": [1, 2, 3, 4, 6, 12],
              "offload": [False, True]}
    settings = {(s, o): (rng.randrange(100), rng.randrange(1, 8))      # (states, per sequence)
                for s in levers["segments"] for o in levers["offload"]}
    peaks, times = {}, {}
    for plan in all_plans(levers):
        key = tuple(plan.values())
        states, per_sequence = settings[plan["segments"], plan["offload"]]
        peaks[key] = states + plan["micro_batch"] * per_sequence
        times[key] = rng.random()
    return levers, peaks, times


def _counting(table):
    asked = []

    def peak(plan):
        asked.append(tuple(plan.values()))
        return table[tuple(plan.values())]
    return peak, asked


@pytest.mark.parametrize("seed", range(20))
def test_the_pruned_search_finds_what_the_brute_force_finds_with_fewer_peaks(seed):
    levers, peaks, times = _table(seed)
    budget = random.Random(seed).choice(sorted(peaks.values()))
    peak, asked = _counting(peaks)
    time = lambda plan: times[tuple(plan.values())]                   # noqa: E731
    got = fastest_fitting(levers, peak, time, budget)
    want = fastest_fitting_brute(levers, lambda p: peaks[tuple(p.values())], time, budget)
    assert got == want
    settings = len(all_plans(levers)) // len(levers["micro_batch"])
    assert len(asked) == len(set(asked)) <= settings * math.ceil(math.log2(7))


def test_nothing_fits_is_none_and_list_order_is_kept():
    levers = {"offload": [False, True], "micro_batch": [1, 2]}
    assert fastest_fitting(levers, lambda p: 10, lambda p: 1.0, 9) is None
    got = fastest_fitting(levers, lambda p: 10, lambda p: p["micro_batch"], 10)
    assert list(got) == ["offload", "micro_batch"] and got["micro_batch"] == 1


def test_on_the_capstones_plans_it_agrees_with_the_brute_force():
    from companion.device import sizes
    S = sizes("cpu")
    shape = GPTShape.of(capstone_model(S))
    cost = CostModel.for_device("cpu")
    levers = {"micro_batch": [1, 2, 4, 8, 16], "segments": [1, 2, 3, 4], "offload": [False, True]}

    def cand(p):
        return Candidate(p["micro_batch"], 16 // p["micro_batch"], p["segments"],
                         offload=p["offload"])
    peak = lambda p: predict_memory(shape, cand(p)).peak                # noqa: E731
    time = lambda p: predict_seconds(shape, cand(p), cost)["total"]     # noqa: E731
    for budget in (4 * 2**20, S.cap_budget, 16 * 2**20, 64 * 2**20):
        assert fastest_fitting(levers, peak, time, budget) == \
            fastest_fitting_brute(levers, peak, time, budget)
