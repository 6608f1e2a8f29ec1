"""companion.cost on a transport that runs collectives at once (gloo's worker threads), and the
first-touch cost of gradients allocated afresh: schedules against hand-worked cases, the
calibration's arithmetic on a fake clock."""
import dataclasses
import itertools

import pytest
import torch

from companion.cost import network, profile
from companion.cost import step as model
from companion.cost.speeds import Layer, Speeds

MS = 1e-3

# ---------------------------------------------------------------- the link's schedule


def test_one_lane_sends_one_message_at_a_time_in_issue_order():
    # end = max(previous end, ready) + latency + transfer; a later-issued message that is
    # ready first still waits its turn
    assert network.link_schedule([(0, 1, 2), (0, 1, 2)]) == [3, 6]
    assert network.link_schedule([(5, 0, 1), (0, 0, 1)]) == [6, 7]
    assert network.link_schedule([]) == []


def test_two_lanes_overlap_latencies_and_share_the_transfers():
    # both start at 0, pay 1 s of latency side by side, then split the link: 2 s each at half
    # the rate ends both at 1 + 4
    assert network.link_schedule([(0, 1, 2), (0, 1, 2)], lanes=2) == [5, 5]
    # sharing 0: each lane is a link of its own
    assert network.link_schedule([(0, 1, 2), (0, 1, 2)], lanes=2, sharing=0) == [3, 3]
    # the first moves 1 s alone, then both at half rate: the second's 1 s takes 2 (ends at 3),
    # the first has 4 - 1 - 1 = 2 left alone (ends at 5)
    assert network.link_schedule([(0, 0, 4), (1, 0, 1)], lanes=2) == pytest.approx([5, 3])
    # a third waits for a free lane: the first two end at 2 (1 s each at half rate)
    assert network.link_schedule([(0, 0, 1), (0, 0, 1), (0, 0, 1)], lanes=2) == \
        pytest.approx([2, 2, 3])
    # sharing 0.5: two at once move at 1 / 1.5 of the rate each
    assert network.link_schedule([(0, 0, 1), (0, 0, 1)], lanes=2, sharing=0.5) == \
        pytest.approx([1.5, 1.5])


def test_link_schedule_rejects_what_is_not_a_schedule():
    with pytest.raises(ValueError, match="lanes"):
        network.link_schedule([(0, 0, 1)], lanes=0)
    with pytest.raises(ValueError, match="sharing"):
        network.link_schedule([(0, 0, 1)], lanes=2, sharing=1.5)
    with pytest.raises(ValueError, match="non-negative"):
        network.link_schedule([(0, -1, 1)])


def test_bucketed_exposure_stays_one_at_a_time_unless_given_lanes():
    # two 1 MiB buckets ready at 1 ms and 2 ms; ring on 2 ranks: 2α latency + S·β transfer
    grads, times = [2**20, 2**20], [1 * MS, 1 * MS]
    alpha, beta = 0.5 * MS, 2 * MS / 2**20                  # latency 1 ms, transfer 2 ms
    args = dict(alpha=alpha, beta=beta, cap_bytes=2**20)
    # one at a time: 1 + 3 = 4, then max(4, 2) + 3 = 7 -> 5 ms after backward ends at 2
    assert network.bucketed_exposed(grads, times, 2, **args) == pytest.approx(5 * MS)
    # two lanes: the second's latency runs 2..3 beside the first's transfer (from 2); from 3
    # both transfer at half rate, the first's last 1 ms ends at 5, the second is then 1 ms
    # along and ends alone at 6 -> 4 ms exposed
    assert network.bucketed_exposed(grads, times, 2, lanes=2, **args) == \
        pytest.approx(4 * MS)


def test_a_gather_beside_the_last_reduce_scatter_by_hand():
    # backward over units 1 then 0: gather (0.5 latency, 1 transfer), 1 s of compute, then the
    # unit's reduce-scatter (0.5, 2)
    g, rs = (0.5, 1.0), (0.5, 2.0)
    args = dict(order=[1, 0], gather=[g, g], compute=[1.0, 1.0], prefetch=0, overlap=1.0,
                after=[rs, rs])
    # one lane: G1 ends 1.5, RS1 2.5..5, G0 queued 5..6.5, compute to 7.5, RS0 7.5..10:
    # waited 7.5 - 2 = 5.5, tail 2.5
    assert model.exposed_link(**args) == pytest.approx(8.0)
    # two lanes: G0 issued at 2.5 runs beside RS1; from 3 both transfer at half rate, G0 ends
    # at 5, RS1 at 6; compute to 6, RS0 6..8.5: waited 4, tail 2.5
    assert model.exposed_link(**args, lanes=2) == pytest.approx(6.5)
    # the same with half the compute and separate links: RS0 waits for RS1 (ends 4.5) when the
    # course's FSDP keeps one in flight
    fast = dict(args, compute=[0.5, 0.5])
    assert model.exposed_link(**fast, lanes=2, sharing=0) == pytest.approx(5.5)
    assert model.exposed_link(**fast, lanes=2, sharing=0, one_after=True) == pytest.approx(6.0)


def _two_layers(**speeds) -> tuple[list[Layer], Speeds]:
    """Two layers of 2^18 parameters (1 MiB of gradient each) whose backward takes 2 ms each
    (2 operators of 1 ms), on a link of latency 2α = 2 ms and transfer S·β = 4 ms per MiB."""
    layers = [Layer(matmuls=(), other_bytes=0, ops=1, params=2**18, tensors=1)] * 2
    s = Speeds(matmul_flops=1e12, memory_bandwidth=1e12, op_seconds=1 * MS, alpha=1 * MS,
               beta=4 * MS / 2**20, **speeds)
    return layers, s


@pytest.mark.parametrize("lanes, sharing, exposed", [
    (1, 1.0, 10.0),   # 2..8 and 8..14: backward ends at 4
    (2, 1.0, 8.0),    # B1 transfers 4..6 alone, 6..10 at half rate; B0 6..10 half, 10..12 alone
    (2, 0.0, 6.0),    # B1 ends at 8, B0 4..6 latency, 6..10 transfer
])
def test_ddp_buckets_at_once_by_hand(lanes, sharing, exposed):
    layers, s = _two_layers(concurrent_collectives=lanes, link_sharing=sharing)
    t = model.ddp_step(layers, s, 2, bucket_bytes=2**20)
    assert t.communication == pytest.approx(exposed * MS)


def test_zero1_starts_its_reduce_scatters_together_on_two_lanes():
    layers, one = _two_layers()
    _, two = _two_layers(concurrent_collectives=2, link_sharing=1.0)
    # a reduce-scatter of 1 MiB: α latency + S/2·β = 1 + 2 ms; the same for the all-gather
    # one lane: 2 x 3 ms each way; two: 1 + 2 x 2 ms each way
    assert model.zero_step(layers, one, 2, 1, bucket_bytes=2**20).communication == \
        pytest.approx(12 * MS)
    assert model.zero_step(layers, two, 2, 1, bucket_bytes=2**20).communication == \
        pytest.approx(10 * MS)


def test_one_lane_gpu_speeds_are_unchanged_by_the_lanes_model():
    s = Speeds.for_gpu("H100 SXM")
    assert s.concurrent_collectives == 1 and not s.first_touch and not s.optimizer_rates
    layers = model.mlp_layers(1024, 8, 16)
    t = model.ddp_step(layers, s, 8, bucket_bytes=2**20)
    assert t.first_touch == 0
    # one lane: what the link's old order gave, message after message
    buckets = model._buckets(layers, 2**20, 4)
    ends = model._backward_ends(layers, s.ranks(8))
    link = 0.0
    for i, size in buckets:
        link = max(link, ends[i]) + s.collective_seconds("all_reduce", size, 8)
    assert t.communication == pytest.approx(max(0.0, link - ends[0]))


# ---------------------------------------------------------------- measured parts of Speeds


def test_collective_parts_split_the_measured_curve_at_its_smallest_time():
    table = (("all_reduce", 2, ((1000, 1 * MS), (10**6, 2 * MS))),
             ("all_reduce", 1, ((1000, 0.05 * MS), (10**6, 0.05 * MS))))
    s = Speeds(matmul_flops=1e9, memory_bandwidth=1e9, op_seconds=0, alpha=1e-5, beta=1e-9,
               collective_table=table)
    assert s.collective_parts("all_reduce", 10**6, 2) == pytest.approx((1 * MS, 1 * MS))
    assert s.collective_parts("all_reduce", 500, 2) == pytest.approx((1 * MS, 0.0))
    # a gloo group of one rank still pays its curve; without one, one rank pays nothing
    assert s.collective_seconds("all_reduce", 10**6, 1) == pytest.approx(0.05 * MS)
    assert s.collective_seconds("all_gather", 10**6, 1) == 0.0
    # without a curve: the ring's 2(N-1) steps of α, the rest is transfer
    assert s.collective_parts("all_gather", 10**6, 4) == pytest.approx(
        (3e-5, 3 / 4 * 10**6 * 1e-9))


def test_fresh_gradients_follow_the_measured_curve():
    curve = ((8 * 2**20, 0.0), (16 * 2**20, 4 * MS), (32 * 2**20, 12 * MS))
    s = Speeds(matmul_flops=1e9, memory_bandwidth=1e9, op_seconds=0, first_touch=curve,
               shared_compute=2.0)
    assert s.fresh_seconds(4 * 2**20) == 0.0
    assert s.fresh_seconds(12 * 2**20) == pytest.approx(2 * MS)
    assert s.fresh_seconds(24 * 2**20) == pytest.approx(8 * MS)
    assert s.fresh_seconds(64 * 2**20) == pytest.approx(24 * MS)     # the last rate per byte
    assert s.ranks(2).fresh_seconds(24 * 2**20) == pytest.approx(16 * MS)   # ranks share cores
    layers = model.mlp_layers(1024, 6, 8, bias=False)                  # 24 MiB of gradients
    assert model.single_step(layers, s).first_touch == pytest.approx(8 * MS)
    assert model.single_step(layers, s, fresh_gradients=0.0).first_touch == 0
    assert model.zero_step(layers, s, 2, 1).first_touch == 0          # a flat buffer, kept
    assert model.zero_step(layers, s, 2, 3).first_touch == pytest.approx(
        dataclasses.replace(s, shared_compute=1.0).fresh_seconds(12 * 2**20) * 2)
    assert model.offload_step(layers, s).first_touch == 0
    with pytest.raises(ValueError, match="first_touch"):
        Speeds(matmul_flops=1e9, memory_bandwidth=1e9, op_seconds=0, first_touch=((0, 1.0),))


def test_a_measured_optimizer_rate_replaces_the_bytes():
    layers = model.mlp_layers(256, 4, 8, bias=False)                  # 4 tensors, 2^18 params
    s = Speeds(matmul_flops=1e9, memory_bandwidth=28e9, op_seconds=1e-6)
    rated = dataclasses.replace(s, optimizer_rates=(("adamw", 1e8),))
    params = 4 * 256 * 256
    assert model.single_step(layers, s, optimizer="adamw").optimizer == pytest.approx(
        28 * params / 28e9 + 12 * 4 * 1e-6)
    assert model.single_step(layers, rated, optimizer="adamw").optimizer == pytest.approx(
        params / 1e8 + 12 * 4 * 1e-6)
    assert model.single_step(layers, rated, optimizer="sgd").optimizer == \
        model.single_step(layers, s, optimizer="sgd").optimizer      # no SGD rate given
    with pytest.raises(ValueError, match="optimizer_rates"):
        dataclasses.replace(s, optimizer_rates=(("sgd", 0.0),))


@pytest.mark.parametrize("field, value", [("concurrent_collectives", 0),
                                          ("concurrent_collectives", 1.5),
                                          ("link_sharing", -0.1), ("link_sharing", 2.0)])
def test_speeds_reject_impossible_lanes(field, value):
    with pytest.raises(ValueError, match=field):
        Speeds(matmul_flops=1e9, memory_bandwidth=1e9, op_seconds=0, **{field: value})


# ---------------------------------------------------------------- calibration, on a fake clock


class _FakeClock:
    """`now()` that moves 1 ms on every call; a test adds to `t` what the work "took"."""

    def __init__(self):
        self.t = 0.0

    def __call__(self, device=None) -> float:
        self.t += 1 * MS
        return self.t


def test_link_sharing_inverts_the_two_lane_schedule():
    # latency 1 ms; transfers of 4, 8 and 16 ms; two at once take 1 + (1 + sharing)·transfer
    for sharing in (0.0, 0.4, 1.0):
        rounds = [[(1 * MS + w, 1 * MS + (1 + sharing) * w) for _ in range(5)]
                  for w in (4 * MS, 8 * MS, 16 * MS)]
        assert profile._link_sharing(rounds, 1 * MS).median == pytest.approx(sharing)
    # what the schedule itself gives for two 8 ms transfers
    two = network.link_schedule([(0, MS, 8 * MS)] * 2, lanes=2, sharing=0.4)[0]
    assert profile._link_sharing([[(9 * MS, two)] * 3], 1 * MS).median == pytest.approx(0.4)
    # faster than one lane each, or slower than one at a time: clipped to [0, 1]
    assert profile._link_sharing([[(5 * MS, 4 * MS)] * 3], 1 * MS).median == 0.0
    assert profile._link_sharing([[(5 * MS, 20 * MS)] * 3], 1 * MS).median == 1.0


def test_optimizer_rates_on_a_fake_clock(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(profile, "now", clock)
    rates = profile._optimizer_rates(3, op_seconds=1e-6)
    # every step "takes" the clock's 1 ms, less its operators per tensor (16 tensors)
    assert rates["sgd"].median == pytest.approx(2**22 / (1 * MS - 16 * 1 * 1e-6))
    assert rates["adamw"].median == pytest.approx(2**22 / (1 * MS - 16 * 12 * 1e-6))


def test_first_touch_on_a_fake_clock(monkeypatch):
    # the fake backward costs 2 ms, plus 0.5 ms per MiB when its gradients were freed
    clock = _FakeClock()
    monkeypatch.setattr(profile, "now", clock)
    real = torch.Tensor.backward

    def backward(loss, *args, **kwargs):
        leaves = [p for p in _leaves(loss.grad_fn)]
        fresh = all(p.grad is None for p in leaves)
        clock.t += 2 * MS + (0.5 * MS * len(leaves) if fresh else 0.0)   # 1 MiB per layer
        return real(loss, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    curve = profile._first_touch(torch.device("cpu"), 3, sizes_mib=(1, 2))
    # the copy "takes" 1 ms: 2·8 Mi·4 bytes per ms; the kept backward's accumulation is added
    bandwidth = 2 * 8 * 2**20 * 4 / MS
    for (nbytes, m), mib in zip(curve, (1, 2)):
        assert nbytes == mib * 2**20
        assert m.median == pytest.approx(0.5 * MS * mib + 3 * mib * 2**20 / bandwidth)


def _leaves(fn, seen=None):
    """The parameters a graph accumulates into (AccumulateGrad nodes' variables)."""
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return
    seen.add(fn)
    if hasattr(fn, "variable"):
        yield fn.variable
    for next_fn, _ in fn.next_functions:
        yield from _leaves(next_fn, seen)


def test_a_profile_recorded_before_the_lanes_reads_back_as_one_lane(monkeypatch):
    fields = {f.name for f in dataclasses.fields(profile.DeviceProfile)}
    new = {"collectives_one", "collective_lanes", "link_sharing", "first_touch",
           "optimizer_rates"}
    assert new <= fields
    m = profile.Measured(1.0, 1.0, 1.0, 3)
    old = profile.DeviceProfile(device="cuda", name="old", threads=1, matmul={"float32": [(256, m)]},
                                grid={}, linear={}, copy_bandwidth=m, op_seconds=m,
                                layer_seconds=m, adamw={"for-loop": m})
    import json
    d = json.loads(old.to_json())
    for key in new:
        d.pop(key)
    again = profile.DeviceProfile.from_json(json.dumps(d))
    assert again == old
    s = again.speeds()
    assert s.concurrent_collectives == 1 and s.link_sharing == 1.0 and not s.first_touch


def _bare_profile(device: str = "cpu") -> "profile.DeviceProfile":
    m = profile.Measured(1.0, 1.0, 1.0, 3)
    return profile.DeviceProfile(device=device, name="bare", threads=1,
                                 matmul={"float32": [(256, profile.Measured(1e9, 1e9, 1e9, 3))]},
                                 grid={}, linear={}, copy_bandwidth=profile.Measured(1e9, 1e9, 1e9, 3),
                                 op_seconds=profile.Measured(1e-6, 1e-6, 1e-6, 3),
                                 layer_seconds=m, adamw={"for-loop": profile.Measured(1e8, 1e8, 1e8, 3)})


def test_a_units_cost_is_what_the_model_leaves_per_unit_added():
    bare = _bare_profile()
    s = bare.speeds()

    def priced(depth):
        t = model.zero_step(model.mlp_layers(32, depth, 8, bias=False), s, 1, 3)
        return t.total - t.optimizer
    # 4 units then 20: the 16 added cost what the model says plus 0.5 ms each
    rounds = [[0.010] * 3, [0.010 + priced(20) - priced(4) + 16 * 0.5 * MS] * 3]
    assert profile._unit_seconds(bare, rounds).median == pytest.approx(0.5 * MS)
    # in the step model: 0.5 ms per unit per micro-batch, slowed as compute by sharing cores
    u = dataclasses.replace(s, unit_seconds=0.5 * MS, shared_compute=2.0)
    layers = model.mlp_layers(32, 6, 8, bias=False)
    plain = model.zero_step(layers, dataclasses.replace(u, unit_seconds=0.0), 2, 3, k=2)
    assert model.zero_step(layers, u, 2, 3, k=2).compute - plain.compute == \
        pytest.approx(2 * 6 * 2 * 0.5 * MS)
    assert model.zero_step(layers, u, 2, 2).compute == \
        model.zero_step(layers, dataclasses.replace(u, unit_seconds=0.0), 2, 2).compute
