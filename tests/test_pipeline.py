"""companion.pipeline: schedules as data, the unit-time simulator, and real runs on gloo ranks."""
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from companion import launch
from companion.models.mlp import MLP
from companion.pipeline import (gpipe, interleaved_1f1b, one_f_one_b, peak_held_bytes,
                                run_pipeline, saved_bytes, simulate, split, validate)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ schedules and the simulator

def test_gpipe_and_1f1b_orders_on_four_stages():
    assert gpipe(2, 2) == [[("F", 0), ("F", 1), ("B", 0), ("B", 1)]] * 2
    assert one_f_one_b(4, 5)[0] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0),
                                    ("F", 4), ("B", 1), ("B", 2), ("B", 3), ("B", 4)]
    assert one_f_one_b(4, 5)[3] == [a for i in range(5) for a in (("F", i), ("B", i))]


def test_a_two_stage_gpipe_timeline_by_hand():
    rows = simulate(gpipe(2, 2)).rows          # t_f = 1, t_b = 2
    assert [(a, s, e) for a, s, e in rows[0]] == [(("F", 0), 0, 1), (("F", 1), 1, 2),
                                                  (("B", 0), 5, 7), (("B", 1), 7, 9)]
    assert [(a, s, e) for a, s, e in rows[1]] == [(("F", 0), 1, 2), (("F", 1), 2, 3),
                                                  (("B", 0), 3, 5), (("B", 1), 5, 7)]


@pytest.mark.parametrize("times", [(1, 2), (1, 1), (2, 1), (3, 5)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(times):
    """Makespan (m + p - 1)(t_f + t_b), busy m(t_f + t_b): derived for GPipe, and 1F1B equals it."""
    t_f, t_b = times
    for p in range(1, 6):
        for m in range(1, 10):
            for schedule in (gpipe(p, m), one_f_one_b(p, m)):
                timeline = simulate(schedule, forward=t_f, backward=t_b)
                assert timeline.makespan == (m + p - 1) * (t_f + t_b)
                assert timeline.bubble == Fraction(p - 1, m + p - 1)
                assert timeline.bubble_over_ideal == Fraction(p - 1, m)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 8, 4), (2, 4, 2), (2, 6, 3), (3, 3, 2)])
def test_interleaved_bubble_is_v_times_smaller(p, m, v):
    timeline = simulate(interleaved_1f1b(p, m, v))
    assert timeline.bubble_over_ideal == Fraction(p - 1, v * m)
    assert timeline.bubble_over_ideal * v == simulate(one_f_one_b(p, m)).bubble_over_ideal
    assert timeline.bubble == Fraction(p - 1, v * m + p - 1)


def test_1f1b_holds_at_most_p_minus_s_micro_batches_gpipe_all_m():
    for p, m in [(4, 8), (4, 2), (3, 7), (1, 3)]:
        assert simulate(one_f_one_b(p, m)).peak_in_flight == [min(p - s, m) for s in range(p)]
        assert simulate(gpipe(p, m)).peak_in_flight == [m] * p


def test_the_figures_for_four_stages_and_eight_micro_batches():
    g, o, i = simulate(gpipe(4, 8)), simulate(one_f_one_b(4, 8)), simulate(interleaved_1f1b(4, 8, 2))
    assert (g.bubble, o.bubble, i.bubble) == (Fraction(3, 11), Fraction(3, 11), Fraction(3, 19))
    assert (g.peak_in_flight[0], o.peak_in_flight[0], i.peak_in_flight[0]) == (8, 4, 11)


def _over_warm(p, m):
    """A wrong 1F1B: one warm-up forward too many on every stage."""
    rows = []
    for s in range(p):
        warm = min(p - s, m)
        rows.append([("F", i) for i in range(warm)]
                    + [a for i in range(m - warm) for a in (("F", warm + i), ("B", i))]
                    + [("B", i) for i in range(m - warm, m)])
    return rows


def test_a_wrong_1f1b_is_told_apart():
    assert simulate(_over_warm(4, 8)).peak_in_flight[0] == 5          # not 4
    naive = [[a for i in range(8) for a in (("F", i), ("B", i))] for _ in range(4)]
    assert simulate(naive).bubble > simulate(one_f_one_b(4, 8)).bubble  # valid but serial


@pytest.mark.parametrize("schedule,p,m,message", [
    ([[("B", 0), ("F", 0)]], 1, 1, "before the forward"),
    ([[("F", 0), ("B", 0), ("F", 0)]], 1, 1, "twice"),
    ([[("F", 0)]], 1, 1, "never runs"),
    ([[("F", 0), ("B", 0)], [("F", 0), ("B", 0)]], 1, 1, "p = 1"),
    ([[("X", 0), ("B", 0)]], 1, 1, "not an action"),
    ([[("F", 0), ("B", 0), ("F", 1), ("B", 1)]], 1, 1, "micro-batches 0..0"),
    ([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("B", 1), ("F", 0), ("B", 0)]], 2, 2,
     "deadlock"),
])
def test_broken_schedules_are_refused_with_a_reason(schedule, p, m, message):
    with pytest.raises(ValueError, match=message):
        validate(schedule, p, m)


def test_the_deadlock_message_names_who_waits_for_whom():
    schedule = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("B", 1), ("F", 0), ("B", 0)]]
    with pytest.raises(ValueError) as err:
        simulate(schedule)
    assert ("stage 0 waits at ('B', 0) for B of micro-batch 0 on stage 1, not run yet: stage 1 is "
            "stuck at ('F', 1)") in str(err.value)
    assert "stage 1 waits at ('F', 1) for F of micro-batch 1 on stage 0" in str(err.value)


def test_bad_arguments():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            gpipe(bad, 4)
    with pytest.raises(ValueError, match="multiple of p"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="positive number"):
        simulate(gpipe(2, 2), backward=0)


# ------------------------------------------------------------------ real runs on gloo ranks

def _case(p, m, v=1):
    model = MLP(6, 8, 2 * p * v, 5, seed=p, dtype=torch.float64)
    g = torch.Generator().manual_seed(10 * p + m)
    xs = list(torch.randn(m, 3, 6, dtype=torch.float64, generator=g).unbind())
    ys = list(torch.randint(5, (m, 3), generator=g).unbind())
    return model, xs, ys


def _reference_gradients(model, xs, ys):
    """One process: the loss of every micro-batch over m, accumulated (chapter 03)."""
    model.zero_grad()
    for x, y in zip(xs, ys):
        (F.cross_entropy(model(x), y) / len(xs)).backward()
    return [param.grad.clone() for param in model.parameters()]


def _pipeline_gradients(model, results, parts):
    by_name = {k: g for out in results for k, g in out["gradients"].items()}
    return [by_name[f"{k}.{name}"] for k, stage in enumerate(split(model.net, parts))
            for name, _ in stage.named_parameters()]


@pytest.mark.parametrize("p", [2, 4])
def test_gpipe_and_1f1b_on_gloo_equal_one_process_and_1f1b_holds_less(p):
    m = 6
    model, xs, ys = _case(p, m)
    stages = split(model.net, p)
    expected = _reference_gradients(model, xs, ys)
    per_micro_batch = saved_bytes(stages[0], xs[0])
    assert per_micro_batch > 0
    peaks = {}
    for name, schedule in (("gpipe", gpipe(p, m)), ("1f1b", one_f_one_b(p, m))):
        results = launch.run(run_pipeline, p, stages, schedule, xs, ys, timeout=120)
        got = _pipeline_gradients(model, results, p)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        for rank, out in enumerate(results):                # each rank ran its list, in order
            assert [a for a, _, _ in out["timeline"]] == schedule[rank]
            assert all(s <= e for _, s, e in out["timeline"])
        peaks[name] = results[0]["peak_activation_bytes"]
        assert peaks[name] == simulate(schedule).peak_in_flight[0] * per_micro_batch
    assert peaks["1f1b"] < peaks["gpipe"]
    assert peaks["gpipe"] == m * per_micro_batch and peaks["1f1b"] == p * per_micro_batch


def test_peak_held_bytes_weighs_each_chunk():
    for p, m in [(4, 8), (3, 2)]:
        for schedule in (gpipe(p, m), one_f_one_b(p, m)):
            peaks = simulate(schedule).peak_in_flight
            assert [peak_held_bytes(schedule, s, [7]) for s in range(p)] == [7 * n for n in peaks]
    schedule = interleaved_1f1b(2, 2, 2)              # stage 0: F0 F1 of chunk 0, then chunk 1
    assert schedule[0][:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    assert peak_held_bytes(schedule, 0, [10, 1]) == 22
    with pytest.raises(ValueError, match="one byte count per chunk"):
        peak_held_bytes(schedule, 0, [10])


def _chunk_inputs(stages, x):
    """Each virtual stage's input for micro-batch x."""
    inputs = []
    with torch.no_grad():
        for stage in stages:
            inputs.append(x)
            x = stage(x)
    return inputs


def test_interleaved_on_gloo_equals_one_process_and_its_bytes_are_predicted():
    p, m, v = 2, 4, 2
    model, xs, ys = _case(p, m, v)
    expected = _reference_gradients(model, xs, ys)
    stages, schedule = split(model.net, p * v), interleaved_1f1b(p, m, v)
    results = launch.run(run_pipeline, p, stages, schedule, xs, ys, timeout=120)
    inputs = _chunk_inputs(stages, xs[0])
    for s in range(p):
        per_chunk = [saved_bytes(stages[c * p + s], inputs[c * p + s], received=c * p + s > 0)
                     for c in range(v)]
        assert results[s]["peak_activation_bytes"] == peak_held_bytes(schedule, s, per_chunk)
    for a, b in zip(_pipeline_gradients(model, results, p * v), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    losses = results[-1]["losses"]
    assert sorted(losses) == list(range(m))
    torch.testing.assert_close(sum(losses.values()),
                               sum(F.cross_entropy(model(x), y).item() for x, y in zip(xs, ys)) / m)


def test_run_pipeline_refuses_mismatched_inputs():
    model, xs, ys = _case(2, 2)
    with pytest.raises(ValueError, match="pass p·v = 2 stages"):
        run_pipeline(0, 2, split(model.net, 3), gpipe(2, 2), xs, ys)
    with pytest.raises(ValueError, match="one target per micro-batch"):
        run_pipeline(0, 2, split(model.net, 2), gpipe(2, 2), xs, ys[:1])


def test_split_cuts_a_sequential_into_consecutive_slices():
    net = MLP(4, 4, 3, 2).net                                   # 7 layers
    parts = split(net, 3)
    assert [len(s) for s in parts] == [2, 3, 2]
    assert [layer for s in parts for layer in s] == list(net)
    with pytest.raises(ValueError, match="from 1 to the 7 layers"):
        split(net, 8)
    with pytest.raises(TypeError, match="nn.Sequential"):
        split(MLP(4, 4, 3, 2), 2)
