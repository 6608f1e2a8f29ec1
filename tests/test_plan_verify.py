"""companion.plan.verify: the ranking check's arithmetic (on a fake clock), its API on a tiny GPT
timed for real (2 rounds), and its errors. Nothing here asserts on a measured time."""
import dataclasses
import functools
import math
import random
import statistics

import pytest

from companion.cost import stats
from companion.models import GPT
from companion.plan import Candidate, CostModel, GPTShape, predict_seconds, verify
from companion.plan.verify import PlanTiming, RankCheck, default_plans, rank_check

TINY = functools.partial(GPT, 32, 8, 16, 2, 2, fused_attention=True)
PLANS = [Candidate(4), Candidate(1, 4), Candidate(4, segments=2), Candidate(4, offload=True)]


def _fake_steps(monkeypatch, seconds: dict[Candidate, float]):
    """train_step replaced by a clock that advances by each plan's seconds: no kernel runs."""
    now = [0.0]
    calls = []

    def step(setup, x, y):
        calls.append(setup.candidate)
        now[0] += seconds[setup.candidate]
    monkeypatch.setattr(verify, "train_step", step)
    return (lambda: now[0]), calls


def test_the_ranking_math_on_a_fake_clock(monkeypatch):
    cost = CostModel.for_device("cpu")
    shape = GPTShape.of(TINY)
    predicted = [predict_seconds(shape, c, cost)["total"] for c in PLANS]
    measured = [2.0 * p for p in predicted]                     # the same order, twice slower
    measured[0], measured[1] = measured[1], measured[0]         # but two plans swapped
    clock, calls = _fake_steps(monkeypatch, dict(zip(PLANS, measured)))
    check = rank_check(TINY, 4, PLANS, cost=cost, rounds=3, warmup=1, clock=clock)
    assert len(calls) == 4 * len(PLANS)                         # 1 warm-up + 3 timed rounds
    rounds = [calls[i:i + len(PLANS)] for i in range(0, len(calls), len(PLANS))]
    assert rounds == [[PLANS[i] for i in stats.round_order(len(PLANS), r, 0)] for r in range(4)]
    assert [r.measured for r in check.rows] == pytest.approx(measured)
    assert [r.predicted for r in check.rows] == pytest.approx(predicted)
    assert check.spearman == pytest.approx(stats.spearman(predicted, measured))
    ratios = [p / m for p, m in zip(predicted, measured)]
    assert check.median_error == pytest.approx(statistics.median(abs(r - 1) for r in ratios))
    assert check.scale == pytest.approx(statistics.median(ratios))
    assert check.scaled_error == pytest.approx(
        statistics.median(abs(r / check.scale - 1) for r in ratios))
    assert check.interval() == pytest.approx((check.spearman, check.spearman))  # no spread
    slow = dataclasses.replace(cost, layer_seconds=1.0)
    again = check.with_cost(slow)                               # re-predicted, not re-timed
    assert [r.measured for r in again.rows] == [r.measured for r in check.rows]
    assert [r.predicted for r in again.rows] == pytest.approx(
        [predict_seconds(shape, c, slow)["total"] for c in PLANS])
    assert [r.candidate for r in check.subset(lambda c: c.accumulation == 1).rows] == \
        [PLANS[0], PLANS[2], PLANS[3]]


def test_shuffled_rounds_run_every_plan_once_a_round_in_new_orders(monkeypatch):
    cost = CostModel.for_device("cpu")
    measured = {c: 0.1 * (i + 1) for i, c in enumerate(PLANS)}
    clock, calls = _fake_steps(monkeypatch, measured)
    check = rank_check(TINY, 4, PLANS, cost=cost, rounds=6, warmup=1, shuffle=3, clock=clock)
    rounds = [calls[i:i + len(PLANS)] for i in range(0, len(calls), len(PLANS))]
    assert len(rounds) == 7 and all(sorted(map(PLANS.index, r)) == [0, 1, 2, 3] for r in rounds)
    rotations = [PLANS[k:] + PLANS[:k] for k in range(len(PLANS))]
    assert any(r not in rotations for r in rounds)               # not a rotation: shuffled
    assert [check.timing(c).measured for c in PLANS] == pytest.approx(list(measured.values()))
    assert [len(r.samples) for r in check.rows] == [6] * len(PLANS)
    clock2, calls2 = _fake_steps(monkeypatch, measured)
    rank_check(TINY, 4, PLANS, cost=cost, rounds=6, warmup=1, shuffle=3, clock=clock2)
    assert calls2 == calls                                       # the seed fixes the orders


def test_agreement_ranks_one_runs_medians_against_anothers(monkeypatch):
    cost = CostModel.for_device("cpu")
    first = {c: 0.1 * (i + 1) for i, c in enumerate(PLANS)}
    runs = []
    for seconds in (first, {c: 1.0 - t for c, t in first.items()}, first):
        clock, _ = _fake_steps(monkeypatch, seconds)
        runs.append(rank_check(TINY, 4, PLANS, cost=cost, rounds=2, clock=clock))
    assert runs[0].agreement(runs[2]) == pytest.approx(1.0)
    assert runs[0].agreement(runs[1]) == pytest.approx(-1.0)
    fewer = runs[0].subset(lambda c: c.accumulation == 1)
    with pytest.raises(ValueError, match="same plans"):
        runs[0].agreement(fewer)
    with pytest.raises(ValueError, match="was not timed"):
        fewer.timing(Candidate(1, 4))


def test_a_perfect_order_and_a_reversed_one(monkeypatch):
    cost = CostModel.for_device("cpu")
    shape = GPTShape.of(TINY)
    predicted = [predict_seconds(shape, c, cost)["total"] for c in PLANS]
    for sign, expected in ((1, 1.0), (-1, -1.0)):
        measured = {c: 10 + sign * p for c, p in zip(PLANS, predicted)}
        clock, _ = _fake_steps(monkeypatch, measured)
        check = rank_check(TINY, 4, PLANS, cost=cost, rounds=2, clock=clock)
        assert check.spearman == pytest.approx(expected)


def test_rank_check_times_a_tiny_gpt_for_real():
    check = rank_check(TINY, 4, PLANS, rounds=2, warmup=1)
    assert [r.candidate for r in check.rows] == PLANS
    for r in check.rows:
        assert len(r.samples) == 2 and r.low <= r.measured <= r.high and r.measured > 0
        assert r.predicted > 0 and math.isfinite(r.ratio)
    assert -1 <= check.spearman <= 1 and check.median_error >= 0
    low, high = check.interval(resamples=200)
    assert -1 <= low <= high <= 1
    text = str(check)
    assert "| plan |" in text and "Spearman" in text and "median error" in text
    assert all(c.describe() in text for c in PLANS)


def test_default_plans_pull_many_levers_and_keep_the_batch():
    shape = GPTShape.of(TINY)
    plans = default_plans(shape, 16)
    assert len(plans) >= 8 and len(set(plans)) == len(plans)
    assert all(c.micro_batch * c.accumulation == 16 for c in plans)
    assert {1, 4, 16} <= {c.accumulation for c in plans}
    assert any(c.segments > 1 for c in plans) and any(c.offload for c in plans)
    assert any(c.lora_rank for c in plans) and any(c.precision != "fp32" for c in plans)
    assert any(c.state_bits == 8 for c in plans) and any(c.activation_offload for c in plans)
    assert len(default_plans(shape, 1)) >= 8                    # no micro-batches to split
    with pytest.raises(ValueError, match="positive int"):
        default_plans(shape, 0)


@pytest.mark.parametrize("cands, batch, rounds, match", [
    (PLANS[:2], 4, 2, "at least 3"),
    (PLANS + PLANS[:1], 4, 2, "twice"),
    (PLANS + [Candidate(2)], 4, 2, "same batch"),
    (PLANS + [Candidate(4, zero_stage=1)], 4, 2, "several processes"),
    (PLANS, 4, 1, "rounds"),
    (PLANS[:3] + ["plain"], 4, 2, "Candidates"),
])
def test_bad_input_says_what_to_do(cands, batch, rounds, match):
    with pytest.raises(ValueError, match=match):
        rank_check(TINY, batch, cands, rounds=rounds)


@pytest.mark.parametrize("options, match", [({"shuffle": "yes"}, "shuffle is a seed"),
                                            ({"shuffle": True}, "shuffle is a seed"),
                                            ({"warmup": -1}, "warmup")])
def test_bad_orders_say_what_to_do(options, match):
    with pytest.raises(ValueError, match=match):
        rank_check(TINY, 4, PLANS, rounds=2, **options)


def test_a_subset_needs_two_plans_and_an_interval_a_confidence():
    row = PlanTiming(Candidate(4), 1.0, 2.0, 2.0, 2.0, (2.0,))
    check = RankCheck((row, dataclasses.replace(row, candidate=Candidate(1, 4), measured=3.0,
                                                samples=(3.0,))),
                      GPTShape.of(TINY), CostModel.for_device("cpu"), 2)
    with pytest.raises(ValueError, match="at least 2"):
        check.subset(lambda c: c.accumulation == 1)
    with pytest.raises(ValueError, match="confidence"):
        check.interval(confidence=1.5)


def test_activation_offload_is_priced_at_the_rate_a_step_measured_on_the_cpu():
    """On the CPU a step's saved tensors moved at 2.9 GB/s each way, a fifth of the copy
    bandwidth (costmodel's comment); the GPU's model keeps the host link's bandwidth."""
    shape, cand = GPTShape.of(TINY), Candidate(2, 2, activation_offload=True)
    cpu = CostModel.for_device("cpu")
    term = predict_seconds(shape, cand, cpu)["activation offload"]
    at_copy = predict_seconds(shape, cand, dataclasses.replace(cpu, activation_bandwidth=None))[
        "activation offload"]
    assert term == pytest.approx(at_copy * cpu.host_bandwidth / cpu.activation_bandwidth)
    assert cpu.activation_bandwidth <= cpu.host_bandwidth / 4 and term > at_copy > 0
    assert CostModel.for_device("cuda").activation_bandwidth is None
    assert predict_seconds(shape, Candidate(4), cpu)["activation offload"] == 0


def test_the_difference_interval_holds_a_clear_difference_and_not_a_noisy_zero():
    from companion.plan.verify import difference_interval
    rng = random.Random(1)
    base = [0.100 + rng.gauss(0, 0.002) for _ in range(8)]
    slower = [0.120 + rng.gauss(0, 0.002) for _ in range(8)]
    low, high = difference_interval(slower, base)
    assert 0.010 < low < 0.020 < high < 0.030
    same = [0.100 + rng.gauss(0, 0.010) for _ in range(8)]
    low, high = difference_interval(same, base)
    assert low < 0 < high
    with pytest.raises(ValueError, match="at least 2 samples"):
        difference_interval([1.0], base)


def test_the_summary_gives_rho_and_its_interval_to_the_same_decimals():
    import re
    check = verify.RankCheck(tuple(verify.PlanTiming(Candidate(16, 1, s), p, m, m, m, (m, m * 1.01))
                                   for s, p, m in ((1, 1.0, 1.0), (2, 2.0, 2.5), (3, 3.0, 2.4))),
                             None, None, 2)
    rho, low, high = re.findall(r"Spearman (\S+) \(95% bootstrap interval (\S+)-(\S+)\)",
                                check.summary())[0]
    assert len({len(rho.split(".")[1]), len(low.split(".")[1]), len(high.split(".")[1])}) == 1
