"""companion.zero: every stage trains like one process; balanced shards; memory, traffic per rank.

Workers live at module level so that gloo ranks can import them. Each launch costs about a second,
so one worker usually checks several things.
"""
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from companion import checkpointing, estimate, launch
from companion.models import MLP
from companion.memory import track
from companion.zero import FSDP, FlatLayout, ShardedOptimizer, experiments, flat_partition

BATCH, STEPS = 8, 3
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


# ---------------------------------------------------------------- the partition, no processes

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 7))
def test_flat_partition_covers_every_element_once_in_balanced_contiguous_slices(numels, world):
    if sum(numels) < world:
        return
    owned = [flat_partition(numels, world, r) for r in range(world)]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    flat = [offsets[i] + j for pieces in owned for i, a, b in pieces for j in range(a, b)]
    assert flat == list(range(sum(numels)))              # in order, each element once
    sizes = [sum(b - a for _, a, b in pieces) for pieces in owned]
    s = -(-sum(numels) // world)                         # ceil(Ψ/N): no rank holds more
    assert sizes == [min(s, max(0, sum(numels) - r * s)) for r in range(world)]  # padding last


def test_flat_partition_splits_one_large_matrix_over_every_rank():
    pieces = [flat_partition([1000, 10, 10], 4, r) for r in range(4)]
    assert [p[0][0] for p in pieces] == [0, 0, 0, 0]     # every rank owns part of the matrix
    layout = FlatLayout.of([torch.zeros(3, 3), torch.zeros(2)], 4)
    assert (layout.numel, layout.shard, layout.padded) == (11, 3, 12)
    with pytest.raises(ValueError, match="every rank must own at least one element"):
        FlatLayout.of([torch.zeros(3)], 4)


def test_zero_paper_figure_1():
    """7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12): 120 / 31.4 / 16.6 / 1.9 GB."""
    totals = [estimate.model_states(7_500_000_000, optimizer="adam", precision="mixed",
                                    zero_stage=k, world_size=64).total / 1e9 for k in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


# ---------------------------------------------------------------- equal to unsharded training

class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                                 nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def _mine(rank, world):
    return slice(rank * BATCH // world, (rank + 1) * BATCH // world)


def _one_process(opt, *, slices):
    """Single process, one thread. slices=N: accumulate the N ranks' slices (loss / N each),
    which is what N ranks compute; slices=1: the whole batch at once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                              # ranks run one thread each
    try:
        model = Small()
        cls, kw = OPTIMIZERS[opt]
        optimizer = cls(model.parameters(), **kw)
        for step in range(STEPS):
            x, y = _batch(step)
            for r in range(slices):
                (nn.functional.mse_loss(model(x[_mine(r, slices)]), y[_mine(r, slices)])
                 / slices).backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        torch.set_num_threads(threads)


def _train_all_stages(rank, world, opt, ring):
    cls, kw = OPTIMIZERS[opt]
    out = {}
    for stage in (1, 2, 3):
        model = Small()
        if stage == 3:
            net = FSDP(model, ring=ring)
            optimizer, comm = cls(net.parameters(), **kw), net.comm
        else:
            net = model
            optimizer = ShardedOptimizer(model.parameters(), cls, stage=stage, ring=ring,
                                         bucket_cap_mb=0.0003, **kw)
            comm = optimizer.comm
        for step in range(STEPS):
            x, y = _batch(step)
            nn.functional.mse_loss(net(x[_mine(rank, world)]), y[_mine(rank, world)]).backward()
            if stage == 3:
                net.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad()
        params = list(net.gather_full_params().values()) if stage == 3 else \
            [p.detach().clone() for p in model.parameters()]
        out[stage] = (params, comm.traffic.sent_bytes, dict(comm.payload))
    return out


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_every_stage_equals_one_process_bitwise_and_the_whole_batch_closely(opt):
    sliced, whole = _one_process(opt, slices=2), _one_process(opt, slices=1)
    ring = opt == "sgd"                  # once on our ring, once on gloo's collectives
    for rank_result in launch.run(_train_all_stages, 2, opt, ring, timeout=60):
        for stage, (params, sent, payload) in rank_result.items():
            for got, same, full in zip(params, sliced, whole):
                assert torch.equal(got, same), f"stage {stage}"
                torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
            if stage < 3:                           # a ring sends (N-1)/N = 1/2 of each
                assert sent == sum(payload.values()) // 2


def _fsdp_against_fully_shard(rank, world):
    from torch.distributed.fsdp import fully_shard
    ours = FSDP(Small())
    theirs = Small()
    for layer in theirs.net:
        if isinstance(layer, (nn.Linear, nn.LayerNorm)):
            fully_shard(layer)
    fully_shard(theirs)
    results = []
    for net in (ours, theirs):
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
        for step in range(STEPS):
            x, y = _batch(step)
            nn.functional.mse_loss(net(x[_mine(rank, world)]), y[_mine(rank, world)]).backward()
            if net is ours:
                net.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad()
    results.append(list(ours.gather_full_params().values()))
    results.append([p.full_tensor().detach() for p in theirs.parameters()])
    return results


def test_fsdp_matches_torch_fully_shard():
    for ours, theirs in launch.run(_fsdp_against_fully_shard, 2, timeout=60):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- groups, frozen, tied, state

class Tied(nn.Module):
    """Embedding and output share one weight; a frozen scale does not require grad."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.scale = nn.Parameter(torch.full((dim,), 0.5), requires_grad=False)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))) * self.scale)


def _tied_batch(step):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, 11, (BATCH,), generator=g), torch.randint(0, 11, (BATCH,), generator=g)


def _groups(model, *, tied_twice):
    """Two groups; ours is given the tied weight twice (torch's would step it twice)."""
    tied = [model.embed.weight, model.out.weight] if tied_twice else [model.embed.weight]
    return [{"params": tied + [model.scale], "lr": 0.02},
            {"params": list(model.hidden.parameters()), "weight_decay": 0.3}]


def _fsdp_groups(net):
    """The same two groups over FSDP's flat shards and replicated parameters, found by name."""
    named = [(g.names, s) for g, s in zip(net.groups, net.shards)] + \
        [([n], p) for n, p in zip(net.replicated_names, net.replicated)]
    hidden = [p for names, p in named if names[0].startswith("hidden")]
    return [{"params": [p for names, p in named if not names[0].startswith("hidden")], "lr": 0.02},
            {"params": hidden, "weight_decay": 0.3}]


def _tied_run(rank, world, kind, micro):
    """kind: "torch" (one process: rank 0 of 1), 1, 2, or "fsdp". micro: backwards per step."""
    model = Tied()
    if kind == "fsdp":
        net = FSDP(model)
        optimizer = torch.optim.AdamW(_fsdp_groups(net), lr=0.05)
    elif kind == "torch":
        net, optimizer = model, torch.optim.AdamW(_groups(model, tied_twice=False), lr=0.05)
    else:
        net = model
        optimizer = ShardedOptimizer(_groups(model, tied_twice=True), torch.optim.AdamW,
                                     stage=kind, lr=0.05, bucket_cap_mb=0.0001)
    launched = []
    for step in range(STEPS):
        x, y = _tied_batch(step)
        rows = _mine(rank, world)
        for m in range(micro):                   # accumulation: micro backwards, then one step
            part = slice(rows.start + m * (rows.stop - rows.start) // micro,
                         rows.start + (m + 1) * (rows.stop - rows.start) // micro)
            (nn.functional.cross_entropy(net(x[part]), y[part]) / micro).backward()
        if kind == 2:
            launched.append(sum(b.work is not None for b in optimizer.buckets))
        if kind == "fsdp":
            net.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    params = list(net.gather_full_params().values()) if kind == "fsdp" else \
        [p.detach().clone() for p in model.parameters()]
    state = optimizer.consolidate_state_dict(to=0) if kind in (1, 2) else \
        optimizer.state_dict() if kind == "torch" else None
    shard = optimizer.state_dict() if kind in (1, 2) else None
    return params, state, shard, launched, model.scale.grad is None


def _tied_all(rank, world):
    return {kind: _tied_run(rank, world, kind, micro) for kind, micro in
            [(1, 1), (2, 2), ("fsdp", 2)]}


def test_param_groups_frozen_and_tied_parameters_and_consolidated_state():
    torch.set_num_threads(1)
    try:
        params, state, _, _, _ = launch.run(_tied_run, 1, "torch", 1, timeout=30)[0]
    finally:
        torch.set_num_threads(2)
    results = launch.run(_tied_all, 2, timeout=60)
    for rank, by_kind in enumerate(results):
        for kind, (got, consolidated, shard, launched, frozen_untouched) in by_kind.items():
            assert frozen_untouched
            assert len(got) == len(params) == 4         # tied weight once, frozen scale kept
            for a, b in zip(got, params):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            if kind == 2:                                # buckets reduce-scattered in backward
                assert all(n > 0 for n in launched)
            if kind not in (1, 2):
                continue
            assert shard["rank"] == rank and shard["world_size"] == 2
            if rank == 0:
                assert consolidated["param_groups"] == state["param_groups"]
                assert sorted(consolidated["state"]) == sorted(state["state"])
                for i, s in state["state"].items():
                    for key, value in s.items():
                        torch.testing.assert_close(consolidated["state"][i][key], value)
            else:
                assert consolidated is None


def _consolidate_one_element_shards(rank, world):
    """Ψ == N: every shard holds one element, as many as AdamW's step counter."""
    param = nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = ShardedOptimizer([param], torch.optim.AdamW, lr=0.1)
    param.grad = torch.tensor([0.5, 1.5]) * (rank + 1)
    optimizer.step()
    return optimizer.consolidate_state_dict(to=0)


def test_consolidated_state_keeps_the_step_counter_whole_when_shards_hold_one_element():
    reference = nn.Parameter(torch.tensor([1.0, -2.0]))
    adamw = torch.optim.AdamW([reference], lr=0.1)
    reference.grad = torch.tensor([0.5, 1.5]) * (1 + 2) / 2          # the two ranks' average
    adamw.step()
    consolidated = launch.run(_consolidate_one_element_shards, 2, timeout=30)[0]
    want = adamw.state_dict()["state"][0]
    assert sorted(consolidated["state"][0]) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(consolidated["state"][0][key], value)  # step: 0-dim, 1.0


# ---------------------------------------------------------------- stage 2's bucket memory

def _stage_2_bucket_memory(rank, world, ring):
    """Stages 1 and 2 on a 6-layer MLP, 2 micro-batches per step, buckets of about one layer:
    the peak (tracked), and after each stage-2 backward which buckets still hold full gradients."""
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 64, generator=g), torch.randint(4, (8,), generator=g)
    out = {}
    for stage in (1, 2):
        alive = []
        with track() as t:
            model = MLP(64, 64, 6, 4, seed=0)
            layer_mb = 4 * (64 * 64 + 64) / 2**20
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                         ring=ring, bucket_cap_mb=layer_mb, lr=1e-3)
            for _ in range(2):                                          # steps
                for micro in range(2):
                    (nn.functional.cross_entropy(model(x[micro::2]), y[micro::2]) / 2).backward()
                    alive.append([b.grads.numel() * 4 for b in optimizer.buckets
                                  if stage == 2 and b.grads is not None])
                optimizer.step()
                optimizer.zero_grad()
        out[stage] = {"peak": t.peak, "alive": alive, "buckets": len(optimizer.buckets),
                      "largest": max(4 * b.layout.padded for b in optimizer.buckets),
                      "params": [p.detach().clone() for p in model.parameters()]}
    out["n"] = sum(p.numel() for p in model.parameters())
    return out


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "torch collectives"])
def test_stage_2_keeps_at_most_one_bucket_of_full_gradients_after_backward(ring):
    for r in launch.run(_stage_2_bucket_memory, 2, ring, timeout=60):
        one, two = r[1], r[2]
        assert two["buckets"] >= 3
        assert all(len(alive) <= 1 for alive in two["alive"]), two["alive"]
        for a, b in zip(one["params"], two["params"]):     # sums in another order: not bitwise
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        # stage 1 holds 4Ψ of flat gradients throughout; stage 2 at most two buckets (one in
        # flight, one filling) and its 4Ψ/N shard gradients
        saved = 4 * r["n"] - 2 * two["largest"] - 4 * r["n"] // 2
        assert one["peak"] - two["peak"] >= saved, (one["peak"], two["peak"], saved)


# ---------------------------------------------------------------- memory and traffic per rank

def test_measured_model_states_follow_the_formulas_and_traffic_is_2_2_2_3_psi():
    world = 2
    for rank_reports in launch.run(experiments.stage_report, world, [0, 1, 2, 3], 64, 3, 4,
                                   timeout=60):
        for r in rank_reports:
            replicated = r["n_replicated"] if r["stage"] == 3 else 0
            want = experiments.predicted_model_states(r["n_params"] - replicated, replicated,
                                                      stage=r["stage"], world_size=world)
            slack = 4 * world * 6                        # padding: < N elements per flat group
            assert 0 <= r["params"] - want.params <= slack
            assert 0 <= r["grads"] - want.grads <= slack
            assert 0 <= r["optimizer_state"] - want.optimizer <= 2 * slack   # + Adam's step
            psi = 4 * r["n_params"] * (world - 1) / world                     # bytes a ring sends
            ratio = r["sent_bytes"] / psi
            if r["stage"] < 3:
                assert ratio == pytest.approx(2.0, abs=0.01)
            else:                       # 3Ψ, less the first layer's weight (not saved: its input
                assert 2.5 < ratio <= 3.01                   # needs no gradient)


def test_our_partition_is_balanced_where_zero_redundancy_optimizer_is_not():
    results = launch.run(experiments.imbalance_report, 2, 4096, 32, timeout=60)
    ours = [r["ours"]["optimizer_state"] for r in results]
    theirs = [r["torch"]["optimizer_state"] for r in results]
    assert max(ours) / min(ours) <= 1.05
    assert max(theirs) / min(theirs) > 10
    assert max(ours) < max(theirs)


def _settled(tracker, at_most: int) -> int:
    """tracker.current once it is at most `at_most` bytes, or after 2 s. Gloo's worker thread drops
    a finished collective's tensors a moment after wait() returns: give it that moment."""
    deadline = time.monotonic() + 2.0
    while tracker.current > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
    return tracker.current


def _fsdp_memory(rank, world):
    torch.manual_seed(0)
    with track() as t:
        model = FSDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                                   nn.ReLU(), nn.Linear(256, 4)))
        shards = _settled(t, sum(4 * p.numel() for p in model.parameters()))
        x = torch.randn(2, 256, requires_grad=True)      # input needs grad: all weights saved
        out = model(x)
        after_forward = _settled(t, shards + 4 * 256 * 256 // 4)
        alive = [g.live is not None and g.live() is not None for g in model.groups]
        out.square().sum().backward()
        model.finish_gradient_synchronization()
    return shards, after_forward, alive, dict(model.comm.payload), \
        sum(p.numel() for p in model.shards)


def test_fsdp_frees_gathered_weights_after_forward_and_gathers_them_again_for_backward():
    for shards, after_forward, alive, payload, shard_numel in launch.run(_fsdp_memory, 2,
                                                                         timeout=30):
        full_bytes = 4 * (2 * 256 * 256 + 256 * 4)
        assert not any(alive)
        assert after_forward - shards < full_bytes / 4       # activations only, no full weights
        assert payload["all_gather"] == 2 * payload["reduce_scatter"] == 2 * 4 * 2 * shard_numel


def _fsdp_bf16(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    model = FSDP(Small(), compute_dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(step)
        out = model(x[_mine(rank, world)])
        nn.functional.mse_loss(out.float(), y[_mine(rank, world)]).backward()
        model.finish_gradient_synchronization()
        grads = {p.grad.dtype for p in model.parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return list(model.gather_full_params().values()), out.dtype, grads, \
        {p.dtype for p in model.parameters()}, dict(model.comm.payload)


def test_fsdp_compute_dtype_gathers_in_bf16_and_keeps_fp32_shards_and_gradients():
    expected = _one_process("adamw", slices=2)
    for params, out_dtype, grad_dtypes, param_dtypes, payload in launch.run(
            _fsdp_bf16, 2, "bfloat16", timeout=60):
        assert out_dtype == torch.bfloat16
        assert grad_dtypes == param_dtypes == {torch.float32}
        # two gathers of 2 bytes per element weigh at most one reduce-scatter of 4 bytes
        assert payload["all_gather"] <= payload["reduce_scatter"]
        for got, want in zip(params, expected):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)


def _fsdp_checkpointed(rank, world):
    """Reentrant checkpointing around the middle layers: the gather runs again on recompute."""
    model = FSDP(Small())
    x, y = _batch(0)
    net = model.module.net

    def forward(inp):
        h = net[1](net[0](inp))
        h = checkpointing.checkpoint(lambda t: net[3](net[2](t)), h)
        return net[4](h)

    with torch.autograd.graph.saved_tensors_hooks(model._pack, model._unpack):
        loss = nn.functional.mse_loss(forward(x[_mine(rank, world)]), y[_mine(rank, world)])
    loss.backward()
    model.finish_gradient_synchronization()
    return [p.grad.clone() for p in model.parameters()]


def test_fsdp_under_checkpointing_gives_the_same_gradients():
    plain = launch.run(_fsdp_plain_grads, 2, timeout=30)
    for got, want in zip(launch.run(_fsdp_checkpointed, 2, timeout=30), plain):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def _fsdp_plain_grads(rank, world):
    model = FSDP(Small())
    x, y = _batch(0)
    nn.functional.mse_loss(model(x[_mine(rank, world)]), y[_mine(rank, world)]).backward()
    model.finish_gradient_synchronization()
    return [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------- errors a learner can cause

def _errors(rank, world):
    messages = []

    def expect(exc, fn):
        try:
            fn()
        except exc as e:
            messages.append(str(e))
        else:
            messages.append(f"no {exc.__name__}")

    expect(ValueError, lambda: ShardedOptimizer([nn.Parameter(torch.zeros(1))],
                                                torch.optim.SGD, lr=0.1))
    expect(ValueError, lambda: ShardedOptimizer(
        [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, device="meta"))],
        torch.optim.SGD, lr=0.1))
    expect(TypeError, lambda: ShardedOptimizer(Small().parameters(),
                                               torch.optim.SGD(Small().parameters(), lr=1)))
    expect(ValueError, lambda: ShardedOptimizer(Small().parameters(), torch.optim.SGD, stage=3,
                                                lr=0.1))
    expect(ValueError, lambda: FSDP(nn.LayerNorm(8)))
    model = FSDP(Small())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 5)).sum().backward()
    expect(RuntimeError, optimizer.step)
    model.finish_gradient_synchronization()
    optimizer.step()                                     # fine once synchronized
    sharded = ShardedOptimizer(Small().parameters(), torch.optim.AdamW, lr=0.1)
    saved = sharded.state_dict()
    saved["rank"] = 1 - rank
    expect(ValueError, lambda: sharded.load_state_dict(saved))
    return messages


def test_clear_errors():
    for messages in launch.run(_errors, 2, timeout=30):
        few, devices, instance, stage, no_matrix, early, wrong_rank = messages
        assert "every rank must own at least one element" in few
        assert "different devices" in devices and "model.to(device)" in devices
        assert "the class, not an instance" in instance
        assert "use FSDP" in stage
        assert "companion.ddp.DDP" in no_matrix
        assert "finish_gradient_synchronization()" in early
        assert "consolidate_state_dict" in wrong_rank


def test_chapter_sizes_for_a_gpu_fit_an_80_gb_device_at_60_percent():
    from companion.device import _SIZES
    s = _SIZES["cuda"]
    n = estimate.mlp_params(s.zero_width, s.zero_width, s.zero_depth, 16)
    states = estimate.model_states(n, optimizer="adamw").total          # stage 0: the largest
    activations = estimate.mlp_activations(s.zero_batch, s.zero_width, s.zero_depth, 16)
    embedding = estimate.model_states(s.zero_vocab * 64, optimizer="adamw").total
    assert states + activations <= 0.6 * 80e9 and embedding <= 0.6 * 80e9
