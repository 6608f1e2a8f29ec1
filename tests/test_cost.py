"""companion.cost: the statistics, the step-time models against hand-computed schedules, the
profile, and the validation harness on real gloo ranks."""
import dataclasses
import math

import pytest
import torch

from companion import cost
from companion.cost import network, stats
from companion.cost import gpus
from companion.cost import step as model
from companion.cost import validate as V

# ---------------------------------------------------------------- statistics


def test_rank_test_is_exact_for_small_samples():
    low, high = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    assert stats.rank_test(low, high) == pytest.approx(2 / 252)        # all 5 below all 5
    assert stats.rank_test([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)   # never < 0.05
    assert stats.rank_test([1, 3, 5], [2, 4, 6]) > 0.5
    assert stats.rank_test([1.0] * 4, [1.0] * 4) == 1.0                # all tied


def test_rank_test_normal_approximation_agrees_with_the_exact_one_near_30():
    a = [i + 0.5 * (i % 3) for i in range(30)]
    b = [i + 4 for i in range(30)]
    exact = stats.rank_test(a, b)
    approx = stats.rank_test(a + [100.0], b + [200.0])                   # 31 each: normal
    assert 0 < exact < 0.2 and abs(approx - exact) < 0.1


def test_compare_says_faster_slower_or_no_difference():
    fast, slow = [1.0, 1.1, 0.9, 1.05, 0.95], [2.0, 2.1, 1.9, 2.2, 2.05]
    c = stats.compare(fast, slow)
    assert c.verdict == "faster" and c.high < 1 and c.ratio == pytest.approx(0.5, rel=0.05)
    assert stats.compare(slow, fast).verdict == "slower"
    same = stats.compare([1.0, 1.2, 0.9], [1.1, 0.95, 1.15])
    assert same.verdict == "no difference detected at 3 runs"
    assert "faster" in c.sentence("bf16", "fp32") and "bf16" in c.sentence("bf16", "fp32")
    low, high = stats.ratio_interval(fast, slow)[1:]
    assert low <= c.ratio <= high


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, float("inf")]])
def test_statistics_reject_what_is_not_a_timing(bad):
    with pytest.raises(ValueError):
        stats.compare(bad, [1.0, 2.0])


def test_interleave_shuffles_each_round_and_skips_the_warm_up():
    calls = []
    out = stats.interleave({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                            "c": lambda: calls.append("c")}, rounds=40, warmup=1)
    rounds = [tuple(calls[i:i + 3]) for i in range(0, len(calls), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)          # each once a round
    assert [len(v) for v in out.values()] == [40, 40, 40]
    # a rotation keeps "a" right after "c" in every round that does not start with "a"; a
    # shuffle puts each contender after each other one
    after = {(r[i - 1], r[i]) for r in rounds for i in (1, 2)}
    assert after == {(x, y) for x in "abc" for y in "abc" if x != y}
    assert len(set(rounds)) == 6                                       # every order turns up


def test_round_order_is_the_same_on_every_rank():
    assert stats.round_order(11, 3) == stats.round_order(11, 3)          # a rank recomputes it
    assert sorted(stats.round_order(11, 3)) == list(range(11))
    assert stats.round_order(11, 3) != stats.round_order(11, 4)
    first = [stats.round_order(11, r)[0] for r in range(60)]
    assert len(set(first)) > 5                                          # not a fixed start


# ---------------------------------------------------------------- speeds and layers


def _speeds(**kw):
    return model.Speeds(**{"matmul_flops": 1e12, "memory_bandwidth": 1e11, "op_seconds": 0.0,
                           **kw})


def test_roofline_and_matmul_time():
    s = _speeds()
    assert s.ridge == 10
    assert s.attainable(1) == 1e11 and s.attainable(1000) == 1e12
    m, k, n = 4096, 4096, 4096                                           # compute-bound
    assert s.matmul_seconds(m, k, n) == pytest.approx(2 * m * k * n / 1e12)
    skinny = s.matmul_seconds(1, 4096, 4096)                             # memory-bound:
    assert skinny == pytest.approx(4 * (4096 + 4096**2 + 4096) / 1e11)   # bytes / bandwidth


def test_a_measured_table_is_interpolated_in_log_size():
    table = tuple(((m, k, n), 1e9 * m) for m in (16, 64) for k in (16, 64) for n in (16, 64))
    s = _speeds(matmul_table=table)
    assert 2 * 16**3 / s.matmul_seconds(16, 16, 16) == pytest.approx(16e9)
    mid = 2 * 32 * 16 * 16 / s.matmul_seconds(32, 16, 16)                # halfway in log2
    assert mid == pytest.approx(math.sqrt(16e9 * 64e9))
    assert 2 * 4 * 16 * 16 / s.matmul_seconds(4, 16, 16) == pytest.approx(16e9)   # clamped


@pytest.mark.parametrize("field, value", [("matmul_flops", 0), ("memory_bandwidth", -1),
                                          ("alpha", -1e-6), ("overlap", 1.5),
                                          ("op_seconds", float("nan"))])
def test_speeds_reject_impossible_values(field, value):
    with pytest.raises(ValueError, match=field):
        _speeds(**{field: value})


def test_ranks_sharing_a_machine_slow_the_compute_only():
    s = _speeds(alpha=1e-4, beta=1e-9, shared_compute=2.0, op_seconds=1e-6,
                matmul_table=(((16, 16, 16), 1e9),), linear_table=(((16, 16, 16), 1e-3, 2e-3),))
    two = s.ranks(2)
    assert s.ranks(1) is s and two.shared_compute == 1
    assert two.matmul_flops == 5e11 and two.memory_bandwidth == 5e10 and two.op_seconds == 2e-6
    assert two.linear_seconds(16, 16, 16) == pytest.approx((2e-3, 4e-3))
    assert (two.alpha, two.beta) == (s.alpha, s.beta)                     # the link as measured
    layers = _two_layers()
    alone = model.single_step(layers, _speeds())
    shared = model.ddp_step(layers, _speeds(shared_compute=2.0), 2, bucket_bytes=1e12)
    assert shared.compute == pytest.approx(2 * alone.compute)
    with pytest.raises(ValueError, match="shared_compute"):
        _speeds(shared_compute=0.5)


def test_collectives_use_the_measured_curve_else_the_ring():
    ring = _speeds(alpha=1e-5, beta=1e-9)
    assert ring.collective_seconds("all_reduce", 1e6, 4) == pytest.approx(
        network.all_reduce_seconds(1e6, 4, alpha=1e-5, beta=1e-9))
    assert ring.collective_seconds("reduce_scatter", 1e6, 4) == pytest.approx(
        3 * (1e-5 + 1e6 / 4 * 1e-9))
    assert ring.collective_seconds("all_gather", 1e6, 1) == 0
    curve = ((1e3, 1e-4), (1e5, 1e-3), (1e7, 1e-2))
    measured = dataclasses.replace(ring, collective_table=(("all_reduce", 4, curve),))
    assert measured.collective_seconds("all_reduce", 1e5, 4) == pytest.approx(1e-3)
    assert measured.collective_seconds("all_reduce", 1e4, 4) == pytest.approx(10**-3.5)
    assert measured.collective_seconds("all_reduce", 2e7, 4) == pytest.approx(
        1e-2 + 1e7 * (1e-2 - 1e-3) / (1e7 - 1e5))                     # the last slope on
    assert measured.collective_seconds("all_reduce", 1e5, 2) == pytest.approx(   # other N:
        network.all_reduce_seconds(1e5, 2, alpha=1e-5, beta=1e-9))                # the ring
    with pytest.raises(ValueError, match="kind"):
        ring.collective_seconds("broadcast", 1e3, 2)


def test_a_layer_costs_its_matmuls_forward_and_twice_backward():
    s = _speeds(op_seconds=1e-6, layer_seconds=3e-6)
    layer = model.Layer(matmuls=((4096, 4096, 4096),), other_bytes=1e8, ops=2, params=4096**2)
    f = 2 * 4096**3 / 1e12 + 1e8 / 1e11 + 2e-6 + 1e-6
    assert layer.forward_seconds(s) == pytest.approx(f)
    assert layer.backward_seconds(s) == pytest.approx(2 * f)
    frozen = dataclasses.replace(layer, trainable=False)
    assert frozen.backward_seconds(s) == pytest.approx(f + 1e8 / 1e11 + 2e-6 + 1e-6)  # no dW


def test_training_flops_follow_6N_plus_attention():
    assert model.training_flops(10**9, 1000) == 6e12
    assert model.training_flops(100, 10, depth=2, seq_len=8, width=4) == 10 * (600 + 12 * 64)
    assert model.training_flops(100, 10, recompute=1.0) == 8000           # 8N with a re-forward
    layers = model.gpt_layers(768, 12, 1024, 50257, 2048)
    forward = sum(l.flops for l in layers)
    n = 12 * (12 * 768**2) + 50257 * 768                                  # matmul weights
    assert forward == pytest.approx(2 * n * 2048 + 12 * 4 * 1024 * 768 * 2048, rel=1e-9)


# ---------------------------------------------------------------- step models, by hand


def _two_layers(c_flops=1e9, params=10**6):
    layer = model.Layer(matmuls=((1000, 1000, c_flops / 2e6),), other_bytes=0, ops=0,
                        params=params)
    return [layer, layer]


def test_ddp_with_one_bucket_exposes_the_whole_all_reduce():
    s = _speeds(alpha=1e-4, beta=1e-10)
    layers = _two_layers()
    one = model.ddp_step(layers, s, 2, bucket_bytes=1e12)               # one bucket, at the end
    ar = network.all_reduce_seconds(8e6, 2, alpha=1e-4, beta=1e-10)
    assert one.communication == pytest.approx(ar)
    assert one.traffic == pytest.approx(8e6)                            # 2(N-1)/N · 8 MB
    two = model.ddp_step(layers, s, 2, bucket_bytes=4e6)                # layer 1's bucket early
    backward_1 = layers[1].backward_seconds(s)                          # 2 ms: hides 4 MB's
    ar_half = network.all_reduce_seconds(4e6, 2, alpha=1e-4, beta=1e-10)
    assert backward_1 > ar_half
    assert two.communication == pytest.approx(ar_half)                  # only the last exposed
    assert model.ddp_step(layers, s, 2, k=4, no_sync=False).communication == \
        pytest.approx(4 * ar)
    assert model.ddp_step(layers, s, 1).communication == 0


def test_partial_overlap_charges_back_what_hid():
    layers = _two_layers()
    full = model.ddp_step(layers, _speeds(alpha=1e-4, beta=1e-10), 2, bucket_bytes=4e6)
    none = model.ddp_step(layers, _speeds(alpha=1e-4, beta=1e-10, overlap=0.0), 2,
                          bucket_bytes=4e6)
    ar_half = network.all_reduce_seconds(4e6, 2, alpha=1e-4, beta=1e-10)
    assert none.communication == pytest.approx(2 * ar_half)             # nothing hides
    assert full.communication == pytest.approx(ar_half)


@pytest.mark.parametrize("stage, k, keep, expected", [(0, 4, True, 2), (1, 4, True, 2),
                                                      (2, 1, True, 2), (2, 2, True, 3),
                                                      (2, 4, True, 5), (3, 1, True, 3),
                                                      (3, 2, True, 6), (3, 2, False, 4)])
def test_zero_traffic_in_k(stage, k, keep, expected):
    got = model.zero_traffic(stage, k, 4, 1.0, reshard_after_forward=keep)
    assert got == pytest.approx(expected * 3 / 4)


def test_zero3_traffic_with_bf16_gathers():
    assert model.zero_traffic(3, 1, 2, 4.0, gather_bytes=2.0) == pytest.approx(0.5 * (4 + 4))


def test_zero3_prefetch_hides_gathers_shorter_than_a_layer():
    s = _speeds(alpha=0.0, beta=1e-9)
    layers = _two_layers(c_flops=1e9, params=250_000)                  # forward 1 ms each
    g = network.all_gather_seconds(1e6, 2, alpha=0, beta=1e-9)          # 0.5 ms per gather
    r = network.reduce_scatter_seconds(1e6, 2, alpha=0, beta=1e-9)
    f = layers[0].forward_seconds(s)
    assert g <= f
    # no prefetch: every gather waited for in full, 2 in forward and 2 in backward, where the
    # first unit's reduce-scatter queues on the link before the second unit's gather; the last
    # reduce-scatter runs after the compute
    plain = model.zero_step(layers, s, 2, 3, prefetch=0)
    assert plain.communication == pytest.approx(2 * g + (g + r + g) + r)
    # prefetch 1: both forward gathers issued at once, only the first is waited for
    assert model.exposed_link([0, 1], [g, g], [f, f], 1, s.overlap) == pytest.approx(g)
    assert model.exposed_link([0, 1], [g, g], [f, f], 0, s.overlap) == pytest.approx(2 * g)
    assert model.exposed_link([0, 1], [g, g], [f, f], 1, 0.0) == pytest.approx(2 * g)   # blocks
    ahead = model.zero_step(layers, s, 2, 3, prefetch=1)
    assert ahead.communication < plain.communication
    kept = model.zero_step(layers, s, 2, 3, reshard_after_forward=False)
    assert kept.communication == pytest.approx(2 * g + r + r)          # no backward gathers


def test_zero_stages_pay_as_their_schedules_say():
    s = _speeds(alpha=1e-4, beta=1e-9)
    layers = _two_layers()
    one = model.zero_step(layers, s, 2, 1, bucket_bytes=1e12)
    rs = network.reduce_scatter_seconds(8e6, 2, alpha=1e-4, beta=1e-9)
    ag = network.all_gather_seconds(8e6, 2, alpha=1e-4, beta=1e-9)
    assert one.communication == pytest.approx(rs + ag)
    assert one.optimizer < model.single_step(layers, s, optimizer="adamw").optimizer
    two_k1 = model.zero_step(layers, s, 2, 2, bucket_bytes=1e12)
    two_k3 = model.zero_step(layers, s, 2, 2, bucket_bytes=1e12, k=3)
    assert two_k3.communication - two_k1.communication == pytest.approx(2 * rs)
    with pytest.raises(ValueError, match="stage"):
        model.zero_step(layers, s, 2, 4)
    with pytest.raises(ValueError, match="prefetch"):
        model.zero_step(layers, s, 2, 3, prefetch=-1)
    with pytest.raises(ValueError, match="world_size"):
        model.zero_step(layers, s, 0, 3)


def test_offload_moves_gradients_down_weights_up_and_steps_on_the_host():
    s = _speeds(host_bandwidth=1e9, host_adam_rate=1e8)
    layers = _two_layers()
    t = model.offload_step(layers, s, overlap_copies=False, pipelined=False)
    assert t.transfers == pytest.approx(2 * 2e6 / 1e9 + 2 * 2e6 / 1e9)   # bf16 down and up
    assert t.host_step == pytest.approx(2e6 / 1e8) and t.optimizer == 0
    hidden = model.offload_step(layers, s)
    assert hidden.transfers < t.transfers


def test_pipelined_copy_up_is_a_two_stage_flow_shop_by_hand():
    s = _speeds(host_bandwidth=1e9, host_adam_rate=1e8)
    layers = _two_layers()                  # per layer: host step 10 ms, copy up 2 ms (bf16)
    serial = model.offload_step(layers, s, overlap_copies=False, pipelined=False)
    piped = model.offload_step(layers, s, overlap_copies=False)
    # host: 0-10, 10-20 ms; link: 10-12, 20-22 ms: only the last group's copy shows
    assert serial.transfers - piped.transfers == pytest.approx(2e-3)
    slow_link = _speeds(host_bandwidth=1e8, host_adam_rate=1e8)      # copy up 20 ms a group
    piped = model.offload_step(layers, slow_link, overlap_copies=False)
    # host 0-10, 10-20; link 10-30, 30-50: 30 ms after the host step, not 40
    assert piped.transfers - 2 * 2e6 / 1e8 == pytest.approx(0.03)


def test_delayed_update_hides_the_host_step_behind_the_next_compute():
    layers = _two_layers(c_flops=1e9)       # compute: 3 x 2 GFLOP at 1 TFLOP/s = 6 ms
    s = _speeds(host_bandwidth=1e12, host_adam_rate=1e9)             # host step 2 ms
    exact = model.offload_step(layers, s)
    late = model.offload_step(layers, s, delay=1)
    assert exact.host_step == pytest.approx(2e-3) and late.host_step == 0
    slow = _speeds(host_bandwidth=1e12, host_adam_rate=1e8)          # host step 20 ms
    late = model.offload_step(layers, slow, delay=1)
    assert late.host_step == pytest.approx(0.02 - late.compute)
    with pytest.raises(ValueError, match="delay"):
        model.offload_step(layers, s, delay=2)


def test_offload_traffic_by_rung_and_dtype():
    P = 1000
    assert model.offload_traffic(P, "none") == {"down": 0, "up": 0, "disk": 0}
    assert model.offload_traffic(P, "optimizer", k=4) == {"down": 2000, "up": 2000, "disk": 0}
    assert model.offload_traffic(P, "gradients", k=4) == {"down": 8000, "up": 2000, "disk": 0}
    assert model.offload_traffic(P, "gradients", weight_bytes=4, grad_bytes=4)["down"] == 4000
    assert model.offload_traffic(P, "parameters", k=2) == {"down": 4000, "up": 8000, "disk": 0}
    assert model.offload_traffic(P, "nvme")["disk"] == 24 * P
    with pytest.raises(ValueError, match="rung"):
        model.offload_traffic(P, "everything")


def test_offload_ladder_times_each_rung_and_micro_batches_can_reorder_them():
    s = _speeds(host_bandwidth=1e9, host_adam_rate=1e8)
    layers = _two_layers(c_flops=1e9)
    ladder = model.offload_ladder(layers, s, disk_bandwidth=1e9)
    assert list(ladder) == list(model.OFFLOAD_RUNGS)
    assert ladder["none"].total < min(t.total for r, t in ladder.items() if r != "none")
    assert ladder["gradients"] == model.offload_step(layers, s)
    # parameters, by hand: forward 2 ms, backward 4 ms; the weights (4 ms over the link) come up
    # during forward (2 ms show), again during backward while the gradients go down (4 ms each
    # way, hidden); and the first layer's fetch (2 ms) before anything runs
    assert ladder["parameters"].transfers == pytest.approx(2e-3 + 2e-3)
    slow = model.offload_ladder(layers, _speeds(host_bandwidth=2.5e8, host_adam_rate=1e8))
    assert slow["parameters"].transfers == pytest.approx(8e-3 + (16e-3 - 2e-3) + (16e-3 - 4e-3))
    assert ladder["nvme"].transfers > ladder["parameters"].transfers
    assert "nvme" not in model.offload_ladder(layers, s)
    # with many micro-batches the gradients go down k times: accumulating on the device and
    # sending once wins on a slow link
    slow = _speeds(host_bandwidth=1e7, host_adam_rate=1e9)
    many = model.offload_ladder(layers, slow, k=8)
    assert many["optimizer"].total < many["gradients"].total
    one = model.offload_ladder(layers, slow, k=1)
    assert one["gradients"].total <= one["optimizer"].total


def test_offload_break_even_by_hand_and_against_the_ladder():
    out = model.offload_break_even(1e14, 2e10, 1e9)
    assert out["backward"] == pytest.approx(1e14 * 2 / (4 * 2e10))
    assert out["delayed"] == pytest.approx(1e14 * (1e-9 + 2 / 2e10) / 6)
    assert out["tokens"] == max(out["backward"], out["delayed"])
    # at that many tokens, the delayed step's host step just hides
    width, depth, T = 1024, 8, 1024
    for tokens, hidden in ((int(out["delayed"] * 1.3) // T * T, True),
                           (int(out["delayed"] * 0.7) // T * T, False)):
        layers = model.gpt_layers(width, depth, T, 512, tokens, dtype_bytes=2)
        s = model.Speeds(matmul_flops=1e14, memory_bandwidth=1e20, op_seconds=0.0,
                         host_bandwidth=2e10, host_adam_rate=1e9)
        late = model.offload_step(layers, s, delay=1)
        assert (late.host_step == 0) == hidden
    with pytest.raises(ValueError, match="host_adam_rate"):
        model.offload_break_even(1e14, 2e10, 0)


def test_rung_placement_matches_the_offload_optimizer_and_falls_down_the_ladder():
    from companion import estimate
    P, L = 10**6, 10**4
    assert estimate.rung_placement(P, "none").device == 16 * P
    assert estimate.rung_placement(P, "none", weight_bytes=4).device == 16 * P
    course = estimate.offload_placement(P, zero_stage=2, offload_optimizer="cpu",
                                        convention="course", param_bytes=2)
    assert estimate.rung_placement(P, "gradients") == course
    devices = [estimate.rung_placement(P, r, largest_layer_params=L).device
               for r in model.OFFLOAD_RUNGS]
    assert devices == sorted(devices, reverse=True)
    nvme = estimate.rung_placement(P, "nvme", largest_layer_params=L)
    assert nvme.disk == 12 * P and nvme.host < estimate.rung_placement(P, "parameters").host
    with pytest.raises(ValueError, match="rung"):
        estimate.rung_placement(P, "gpu")
    with pytest.raises(ValueError, match="weight_bytes"):
        estimate.rung_placement(P, "none", weight_bytes=8)


def test_tokens_to_hide_gathers_by_hand():
    out = model.tokens_to_hide_gathers(1e15, 1e11, 8)
    assert out["forward"] == pytest.approx(1e15 * 7 / 8 * 2 / 2e11)
    assert out["backward"] == pytest.approx(1e15 * 7 / 8 * 6 / 4e11)
    assert out["tokens"] == max(out["forward"], out["backward"])


def test_step_parts_add_up_to_the_total():
    t = model.StepTime(compute=1.0, communication=0.5, bucketing=0.25, traffic=99.0)
    assert t.total == 1.75 and t.parts() == {"compute": 1.0, "communication": 0.5,
                                             "bucketing": 0.25}


# ---------------------------------------------------------------- the profile and validation


@pytest.fixture(scope="module")
def profile():
    return cost.calibrate("cpu", threads=1, repeats=3, dtypes=["float32"])


def test_calibrate_measures_this_machine_with_spreads(profile):
    assert profile.seconds > 0 and profile.threads == 1      # how long it took: never asserted
    assert profile.peak_flops() > 1e8 and profile.copy_bandwidth.median > 1e8
    m = profile.copy_bandwidth
    assert m.low <= m.median <= m.high and m.repeats == 3
    assert set(profile.adamw) >= {"for-loop", "foreach"}
    assert len(profile.grid["float32"]) == 27 and len(profile.linear["float32"]) == 36
    for (m, k, n), forward, backward in profile.linear["float32"]:
        assert 0 < forward.median and 0 < backward.median
    assert profile.alpha.median > 0 and profile.beta.median > 0
    assert set(profile.collectives) == set(network.COLLECTIVES)
    s = profile.speeds()
    assert s.collective_table and s.matmul_table and s.linear_table and s.layer_seconds >= 0
    for _, _, curve in s.collective_table:              # each collective's own fit: a line
        (n0, t0), (n1, t1), (n2, t2) = curve[0], curve[len(curve) // 2], curve[-1]
        assert t0 <= t1 <= t2 and (t2 - t1) / (n2 - n1) == pytest.approx((t1 - t0) / (n1 - n0))
    assert profile.shared_compute.median > 0 and profile.overlap.repeats == 9   # at least 9
    assert s.shared_compute >= 1 and 0 <= s.overlap <= 1
    # gloo's worker threads (2 unless set), the share of concurrent transfers that queue, the
    # one-rank group's collectives, fresh gradients, the optimizers and a ZeRO-3 unit
    assert profile.collective_lanes == s.concurrent_collectives == 2
    assert 0 <= s.link_sharing <= 1 and profile.link_sharing.repeats >= 2
    assert set(profile.collectives_one) == set(network.COLLECTIVES)
    assert ("all_reduce", 1) in {(k, w) for k, w, _ in s.collective_table}
    assert [n for n, _ in profile.first_touch] == [m * 2**20 for m in (8, 16, 32, 64)]
    assert all(t >= 0 for _, t in s.first_touch)
    assert set(profile.optimizer_rates) == {"sgd", "adamw"}
    assert dict(s.optimizer_rates)["sgd"] > dict(s.optimizer_rates)["adamw"] > 1e6
    assert profile.unit_seconds.repeats == 7 and s.unit_seconds >= 0
    again = cost.DeviceProfile.from_json(profile.to_json())
    assert again == profile
    with pytest.raises(ValueError, match="bfloat16"):
        profile.peak_flops(torch.bfloat16)


def test_calibrate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats"):
        cost.calibrate("cpu", repeats=2)
    with pytest.raises(ValueError, match="concurrent"):
        cost.calibrate("cpu", concurrent=0)


def test_cost_model_reads_the_gpu_table_and_the_profile(profile):
    from companion.plan import CostModel

    a100 = CostModel.for_device("cuda")
    assert a100 == CostModel.for_gpu("A100 40GB")
    assert a100.memory_bandwidth == gpus.gpu("A100 40GB").hbm_bandwidth
    assert CostModel.for_gpu("H100 SXM").flops > a100.flops
    measured = CostModel.from_profile(profile)
    assert measured.flops == profile.step_flops.median and measured.half_speedup == 1.0
    # (a block's step rate, not the matmul peak: the equality above says which is read; which is
    # faster is a timing, and under load a small matmul's rate can fall below the step's)
    assert measured.overlap == 0.0                  # the course's ZeRO on gloo: nothing hides
    # a CPU's bf16 is priced at its autocast step's measured rate, not at the matmul peak
    slow = cost.Measured(0.5, 0.4, 0.6, 3)
    peaks = {**profile.matmul,
             "bfloat16": [(256, cost.Measured(7 * profile.peak_flops(), 0, 0, 3))]}
    both = dataclasses.replace(profile, matmul=peaks)
    assert CostModel.from_profile(both).half_speedup == pytest.approx(7.0)
    assert CostModel.from_profile(dataclasses.replace(
        both, autocast={"bfloat16": slow})).half_speedup == 0.5
    # LoRA's adapter passes and the 8-bit Adam step at their measured rates
    assert measured.adapter_bandwidth == profile.adapter_bandwidth.median > 1e8
    assert measured.adam8bit_rate == profile.adam8bit.median > 1e5
    assert measured.adapter_seconds == profile.adapter_seconds.median >= 0
    assert measured.adam8bit_tensor_seconds == profile.adam8bit_tensor.median >= 0
    # activation offload's hooks at the rate they reached in a block's step
    assert measured.activation_bandwidth == profile.activation_offload.median > 1e8
    assert CostModel.from_profile(dataclasses.replace(
        profile, activation_offload=None)).activation_bandwidth == \
        CostModel.for_device("cpu").activation_bandwidth


def test_calibrate_times_a_blocks_autocast_step_against_fp32():
    from companion.cost.profile import _block_steps

    torch.set_num_threads(1)
    flops, found = _block_steps(torch.device("cpu"), ["float32", "bfloat16"], 3)
    assert flops.low <= flops.median <= flops.high and flops.median > 1e8
    assert set(found) == {"bfloat16"} and found["bfloat16"].repeats == 3
    assert found["bfloat16"].low <= found["bfloat16"].median <= found["bfloat16"].high
    assert 0 < found["bfloat16"].median < 100


def test_validation_predicts_and_measures_each_configuration(profile):
    configs = [{"kind": "single", "width": 64, "depth": 2, "batch": 4},
               {"kind": "ddp", "width": 64, "depth": 2, "batch": 4, "bucket_mb": 0.01},
               {"kind": "zero2", "width": 64, "depth": 2, "batch": 4, "k": 2},
               {"kind": "zero3", "width": 64, "depth": 2, "batch": 4}]
    rows = V.validate(configs, profile.speeds(), world_size=2, rounds=3, timeout=120)
    for row in rows:
        assert row["measured"] > 0 and row["predicted"] > 0
        assert row["low"] <= row["measured"] <= row["high"]
        assert row["error"] == pytest.approx((row["predicted"] - row["measured"])
                                             / row["measured"])
    assert "communication" in rows[1]["parts"]
    assert V.summary(rows)["configs"] == 4
    with pytest.raises(ValueError, match="kind"):
        V.predict({"kind": "zero4", "width": 4, "depth": 1, "batch": 1}, profile.speeds(), 2)
    with pytest.raises(ValueError, match="width"):
        V.predict({"kind": "ddp", "width": 0, "depth": 1, "batch": 1}, profile.speeds(), 2)


def test_validation_configurations_take_zero3_prefetch():
    """A zero3 configuration's "prefetch" reaches the model (zero_step) and the ranks (FSDP);
    other kinds refuse it."""
    from companion import launch

    speeds = model.Speeds(matmul_flops=1e10, memory_bandwidth=1e10, op_seconds=1e-6,
                          alpha=1e-4, beta=1e-8)
    config = {"kind": "zero3", "width": 256, "depth": 4, "batch": 64}
    layers = model.mlp_layers(256, 4, 64, bias=False)
    for prefetch in (0, 1):
        want = model.zero_step(layers, speeds, 2, 3, prefetch=prefetch, optimizer="adamw")
        assert V.predict({**config, "prefetch": prefetch}, speeds, 2) == want
    assert V.predict({**config, "prefetch": 1}, speeds, 2).communication < \
        V.predict(config, speeds, 2).communication          # gathers hidden behind layers
    times = launch.run(V.measure, 2, [V._check({**config, "prefetch": p}) for p in (0, 1)], 2,
                       timeout=120)[0]
    assert len(times) == 2 and all(len(t) == 2 and min(t) > 0 for t in times)
    with pytest.raises(ValueError, match="zero3"):
        V.predict({"kind": "zero2", "width": 4, "depth": 1, "batch": 1, "prefetch": 1}, speeds, 2)
    with pytest.raises(ValueError, match="prefetch"):
        V.predict({**config, "prefetch": -1}, speeds, 2)


def test_ddp_with_bucket_views_copies_nothing_and_allocates_no_gradient():
    layers = _two_layers()
    s = _speeds(alpha=1e-4, beta=1e-10, first_touch=((8e6, 5e-3), (16e6, 1e-2)))
    copied, viewed = (model.ddp_step(layers, s, 2, bucket_bytes=4e6, bucket_view=v)
                      for v in (False, True))
    one_pass = 2 * 8e6 / 1e11                               # read and write 8 MB of gradients
    assert copied.bucketing == pytest.approx(3 * one_pass)  # in, divide, out
    assert viewed.bucketing == pytest.approx(1.5 * one_pass)   # divide, then zeros once a step
    assert copied.first_touch == pytest.approx(5e-3) and viewed.first_touch == 0
    assert viewed.communication == copied.communication
    k4 = model.ddp_step(layers, s, 2, k=4, no_sync=False, bucket_view=True)
    assert k4.bucketing == pytest.approx((4 + 0.5) * one_pass)
