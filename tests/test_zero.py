"""companion.zero: every stage trains like one process; balanced shards; memory, traffic per rank.

Workers live at module level so that gloo ranks can import them. Each launch costs about a second,
so one worker usually checks several things.
"""
import functools
import math
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from companion import checkpointing, estimate, launch
from companion.models import MLP
from companion.memory import track
from companion import zero
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
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params, state, _, _, _ = launch.run(_tied_run, 1, "torch", 1, timeout=30)[0]
    finally:
        torch.set_num_threads(threads)
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
    """tracker.current once it is at most `at_most` bytes, or after 10 s. Gloo's worker thread drops
    a finished collective's tensors a moment after wait() returns: give it that moment (a loaded
    machine's moment too; a run that settles returns at once)."""
    deadline = time.monotonic() + 10.0
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
                                                                         timeout=60):
        full_bytes = 4 * (2 * 256 * 256 + 256 * 4)
        assert not any(alive)
        assert after_forward - shards < full_bytes / 4       # activations only, no full weights
        assert payload["all_gather"] == 2 * payload["reduce_scatter"] == 2 * 4 * 2 * shard_numel


def _fsdp_bf16(rank, world, dtype_name, reduce_name=None):
    dtype = getattr(torch, dtype_name)
    model = FSDP(Small(), compute_dtype=dtype) if reduce_name is None else \
        FSDP(Small(), param_dtype=dtype, reduce_dtype=getattr(torch, reduce_name))
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


@pytest.mark.parametrize("reduce_name", [None, "float32", "bfloat16"])
def test_fsdp_param_dtype_gathers_in_bf16_and_keeps_fp32_shards_and_gradients(reduce_name):
    expected = _one_process("adamw", slices=2)
    for params, out_dtype, grad_dtypes, param_dtypes, payload in launch.run(
            _fsdp_bf16, 2, "bfloat16", reduce_name, timeout=60):
        assert out_dtype == torch.bfloat16
        assert grad_dtypes == param_dtypes == {torch.float32}
        # two gathers of 2 bytes per element weigh at most one reduce-scatter of 4 bytes, or
        # twice one of 2 bytes (reduce_dtype=torch.bfloat16)
        ratio = 1 if reduce_name != "bfloat16" else 2
        assert payload["all_gather"] <= ratio * payload["reduce_scatter"]
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
    expect(RuntimeError, lambda: model.clip_grad_norm_(1.0))
    model.finish_gradient_synchronization()
    expect(ValueError, lambda: model.clip_grad_norm_(1.0, norm_type=0))
    optimizer.step()                                     # fine once synchronized
    sharded = ShardedOptimizer(Small().parameters(), torch.optim.AdamW, lr=0.1)
    saved = sharded.state_dict()
    saved["rank"] = 1 - rank
    expect(ValueError, lambda: sharded.load_state_dict(saved))
    expect(ValueError, lambda: FSDP(Small(), prefetch=-1))
    expect(TypeError, lambda: FSDP(Small(), reshard_after_forward="yes"))
    expect(ValueError, lambda: FSDP(Small(), param_dtype=torch.bfloat16,
                                    compute_dtype=torch.float16))
    expect(TypeError, lambda: FSDP(Small(), reduce_dtype=torch.int32))
    expect(ValueError, lambda: zero.shard_by_resize(nn.ReLU(), zero.Comm()))
    small = Small()
    FSDP(small)
    expect(ValueError, lambda: FSDP(small))              # a cell that wraps it run twice
    return messages


def test_clear_errors():
    for messages in launch.run(_errors, 2, timeout=30):
        few, devices, instance, stage, no_matrix, early, clip_early, norm_type, wrong_rank, \
            depth, reshard, two_names, reduce, nothing_to_shard, wrapped_twice = messages
        assert "every rank must own at least one element" in few
        assert "different devices" in devices and "model.to(device)" in devices
        assert "the class, not an instance" in instance
        assert "use FSDP" in stage
        assert "companion.ddp.DDP" in no_matrix
        assert "finish_gradient_synchronization()" in early
        assert "consolidate_state_dict" in wrong_rank
        assert "finish_gradient_synchronization() first" in clip_early
        assert "norm_type must be > 0" in norm_type
        assert "prefetch is how many units" in depth and "True or False" in reshard
        assert "older name of param_dtype" in two_names and "floating torch dtype" in reduce
        assert "owns no parameter of its own" in nothing_to_shard
        assert "already wrapped by an FSDP" in wrapped_twice and "build the model" in wrapped_twice


def test_chapter_sizes_for_a_gpu_fit_an_80_gb_device_at_60_percent():
    from companion.device import _SIZES
    s = _SIZES["cuda"]
    n = estimate.mlp_params(s.zero_width, s.zero_width, s.zero_depth, 16)
    states = estimate.model_states(n, optimizer="adamw").total          # stage 0: the largest
    activations = estimate.mlp_activations(s.zero_batch, s.zero_width, s.zero_depth, 16)
    embedding = estimate.model_states(s.zero_vocab * 64, optimizer="adamw").total
    assert states + activations <= 0.6 * 80e9 and embedding <= 0.6 * 80e9


# ---------------------------------------------------------------- traffic with accumulation

def test_predicted_traffic_grows_with_k_only_at_stages_2_and_3():
    n, share = 1000, 0.5                                  # 2 ranks: a ring sends half
    per = [[zero.predicted_traffic(s, k, 2, n) / (share * 4 * n) for k in (1, 2, 4)]
           for s in (0, 1, 2)]
    assert per == [[2, 2, 2], [2, 2, 2], [2, 3, 5]]
    three = [zero.predicted_traffic(3, k, 2, n) / (share * 4 * n) for k in (1, 2, 4)]
    assert three == [3, 6, 12]
    assert zero.predicted_traffic(3, 2, 2, n, reshard_after_forward=False) == share * 4 * n * 4
    # 100 1-D parameters all-reduced once per step; 200 elements never gathered for backward;
    # bf16 gathers, fp32 reduce-scatters
    got = zero.predicted_traffic(3, 2, 4, n, n_replicated=100, n_skipped=200, param_bytes=2)
    assert got == 0.75 * (2 * (2 * 900 + 2 * 700 + 4 * 900) + 2 * 4 * 100)


@pytest.mark.parametrize("args, kwargs, words", [
    ((4, 1, 2, 10), {}, "stage must be 0"),
    ((2, 0, 2, 10), {}, "micro-batches"),
    ((2, 1, 0, 10), {}, "world_size"),
    ((1, 1, 2, 10), {"n_replicated": 2}, r"stage 3 \(FSDP\) only"),
    ((3, 1, 2, 10), {"n_replicated": 6, "n_skipped": 5}, "parts of n_params"),
    ((3, 1, 2, 10), {"param_bytes": 0}, "param_bytes"),
])
def test_predicted_traffic_explains_bad_input(args, kwargs, words):
    with pytest.raises(ValueError, match=words):
        zero.predicted_traffic(*args, **kwargs)


def _accumulation_traffic(rank, world):
    """One launch: every stage at k = 1, 2, 4 on the ring; FSDP's options on gloo's collectives."""
    out = {"stages": experiments.traffic_with_accumulation(rank, world, [0, 1, 2, 3], [1, 2, 4],
                                                           32, 3, 2)}
    for name, options in [("no reshard", dict(reshard_after_forward=False)),
                          ("prefetch", dict(prefetch=2)),
                          ("bf16 gathers", dict(param_dtype=torch.bfloat16)),
                          ("bf16 both", dict(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.bfloat16))]:
        out[name] = experiments.traffic_with_accumulation(rank, world, [3], [1, 3], 32, 3, 2,
                                                          False, **options)
    return out


def test_traffic_with_accumulation_is_the_predicted_traffic_to_the_byte():
    options = {"stages": {}, "no reshard": {"reshard_after_forward": False}, "prefetch": {},
               "bf16 gathers": {"param_bytes": 2},
               "bf16 both": {"param_bytes": 2, "reduce_bytes": 2}}
    for by_name in launch.run(_accumulation_traffic, 2, timeout=120):
        for name, reports in by_name.items():
            for r in reports:
                want = zero.predicted_traffic(r["stage"], r["k"], 2, r["n_params"],
                                              n_replicated=r["n_replicated"],
                                              n_skipped=r["n_skipped"], **options[name])
                assert r["sent_bytes"] == want, (name, r)
        ratio = {(r["stage"], r["k"]): r["sent_bytes"] / (0.5 * 4 * r["n_params"])
                 for r in by_name["stages"]}
        assert ratio[0, 4] == ratio[1, 4] == 2 and ratio[2, 2] == 3 and ratio[2, 4] == 5
        per_micro = ratio[3, 2] - ratio[3, 1]            # linear in k: 1-D all-reduce once
        assert 2.5 < per_micro < 3 and ratio[3, 4] - ratio[3, 2] == pytest.approx(2 * per_micro)
        gathers = [r["payload"]["all_gather"] for r in by_name["bf16 gathers"]]
        scatters = [r["payload"]["reduce_scatter"] for r in by_name["bf16 gathers"]]
        full = [r["payload"]["all_gather"] for r in by_name["prefetch"]]
        assert [2 * g for g in gathers] == full                # half the gather bytes
        assert scatters == [r["payload"]["reduce_scatter"] for r in by_name["prefetch"]]


# ---------------------------------------------------------------- resharding and prefetching

def test_run_with_prefetch_keeps_depth_plus_one_units_and_gathers_each_once():
    for n, depth in [(1, 0), (5, 0), (5, 1), (6, 2), (3, 7)]:
        log, live, peak = [], set(), [0]

        class Work:
            def __init__(self, i):
                self.i = i

            def wait(self):
                log.append(("wait", self.i))

        def gather(unit):
            live.add(unit)
            peak[0] = max(peak[0], len(live))
            log.append(("gather", unit))
            return unit * 10, Work(unit)

        def compute(unit, weights):
            live.discard(unit)
            log.append(("compute", unit))
            return weights + 1

        assert zero.run_with_prefetch(range(n), gather, compute, depth) == \
            [10 * i + 1 for i in range(n)]
        assert peak[0] == min(depth + 1, n)
        gathered = [u for kind, u in log if kind == "gather"]
        assert gathered == list(range(n))                    # each once, in order
        for i in range(n):                 # units i+1 … i+depth in flight when i computes
            started = log.index(("compute", i))
            assert all(log.index(("gather", j)) < started
                       for j in range(i, min(i + depth + 1, n)))
            assert log.index(("wait", i)) < started
    with pytest.raises(ValueError, match="whole number of units"):
        zero.run_with_prefetch([1], gather, compute, -1)


def test_predicted_gathered_peak():
    units = [4, 4, 4, 1]
    assert [zero.predicted_gathered_peak(units, prefetch=d) for d in (0, 1, 2, 9)] == \
        [4, 8, 12, 13]
    assert zero.predicted_gathered_peak(units, keep=[True] * 4) == 13
    assert zero.predicted_gathered_peak(units, prefetch=1, keep=[True, False, False, False]) == 12
    with pytest.raises(ValueError, match="one True/False per unit"):
        zero.predicted_gathered_peak(units, keep=[True])


def test_fsdp_forward_peak_is_the_gathered_window_and_prefetch_sends_nothing_more():
    settings = [(True, 0), (True, 1), (True, 2), (False, 0), (False, 1)]
    for reports in launch.run(experiments.fsdp_memory_report, 2, 128, 4, 2, settings,
                              timeout=60):
        base = reports[0]
        for r in reports:
            want = zero.predicted_gathered_peak(r["unit_bytes"], prefetch=r["prefetch"],
                                                keep=r["keep"])
            activations = r["after_forward"] - r["kept_after_forward"]
            layer_output = 2 * 128 * 4                   # one Linear's output, freed by ReLU
            assert 0 <= r["forward_peak"] - want <= activations + layer_output, r
            assert r["kept_after_forward"] == (0 if r["reshard_after_forward"] else
                                               sum(r["unit_bytes"]))
            assert torch.equal(r["grads"], base["grads"])
            unit = r["unit_bytes"][0]
            assert r["backward_peak"] - base["backward_peak"] <= r["prefetch"] * unit
            if r["reshard_after_forward"]:
                assert r["payload"] == base["payload"]       # prefetching moves no extra byte
            else:                                            # no gather in backward
                assert r["payload"]["all_gather"] == r["payload"]["reduce_scatter"]


class Rooted(nn.Module):
    """The wrapped module owns a matrix itself (used last, like an output head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Parameter(torch.randn(16, 3) / 4)

    def forward(self, x):
        return torch.tanh(self.body(x)) @ self.head


class Backwards(nn.Module):
    """Registers its layers in the opposite order to the one it runs them in."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.last = nn.Linear(16, 3)
        self.first = nn.Linear(5, 16)

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


def _fsdp_options(rank, world):
    """Three steps of three models under each FSDP option: parameters, payload of the last step."""
    out = {}
    for model_name, build in (("small", Small), ("rooted", Rooted), ("backwards", Backwards)):
        for option in ({}, {"reshard_after_forward": False}, {"prefetch": 1},
                       {"prefetch": 2, "ring": True},
                       {"prefetch": 1, "reshard_after_forward": False}):
            model = FSDP(build(), **option)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
            for step in range(STEPS):
                model.comm.reset()
                x, y = _batch(step)
                nn.functional.mse_loss(model(x[_mine(rank, world)]), y[_mine(rank, world)]
                                       ).backward()
                model.finish_gradient_synchronization()
                optimizer.step()
                optimizer.zero_grad()
            out[model_name, tuple(sorted(option.items()))] = (
                list(model.gather_full_params().values()), dict(model.comm.payload),
                [4 * g.layout.padded for g in model.groups])
    return out


def test_fsdp_options_train_the_same_and_the_root_unit_is_gathered_once():
    for by_option in launch.run(_fsdp_options, 2, timeout=120):
        for (model_name, option), (params, payload, units) in by_option.items():
            plain, plain_payload, _ = by_option[model_name, ()]
            for a, b in zip(params, plain):                  # the same sums, in the same order
                assert torch.equal(a, b), (model_name, option)
            if dict(option).get("reshard_after_forward") is False:
                assert payload["all_gather"] == payload["reduce_scatter"]
            else:                                       # prefetching, in its recorded order
                assert payload == plain_payload, (model_name, option)
        _, payload, (root, first, second) = by_option["rooted", ()]
        # forward gathers all three; backward only the second Linear: the root unit stays whole
        # from forward to backward, the first Linear's weight is not needed (its input is data)
        assert payload["all_gather"] == root + first + 2 * second


# ---------------------------------------------------------------- storage resize, clipping

def _nbytes(flats):
    return [f.untyped_storage().nbytes() for f in flats]


def _resize_and_clip(rank, world):
    """One launch: a model of shard_by_resize units (storage freed and refilled), and
    clip_grad_norm_ over FSDP's and ShardedOptimizer's shards (SGD, lr 1: the step shows the
    clipped gradients)."""
    model = Small()
    shards, flats = zip(*[zero.shard_by_resize(m, zero.Comm()) for m in model.net
                          if isinstance(m, nn.Linear)])
    during = []

    def record(mod, inputs, output):      # runs after the unit's own hook, which gathers it
        output.register_hook(lambda grad: during.append(_nbytes(flats)))   # again for backward

    for m in model.net:
        if isinstance(m, nn.Linear):
            m.register_forward_hook(record)
    x, y = _batch(0)
    out = {"before forward": _nbytes(flats)}
    loss = nn.functional.mse_loss(model(x[_mine(rank, world)]), y[_mine(rank, world)])
    out["after forward"] = _nbytes(flats)
    loss.backward()
    out["during backward"], out["after backward"] = during, _nbytes(flats)
    out["resize grads"] = [s.grad.clone() for s in shards]
    for norm_type in (2.0, 1.0, float("inf")):
        for kind in ("fsdp", 1, 2):
            out[kind, norm_type] = _clipped(rank, world, kind, norm_type, max_norm=0.05)
    out["fsdp", "loose"] = _clipped(rank, world, "fsdp", 2.0, max_norm=1e6)
    out["nonfinite"] = _nonfinite(rank, world)
    return out


def _clipped(rank, world, kind, norm_type, *, max_norm):
    model = Small()
    if kind == "fsdp":
        net = FSDP(model)
        optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    else:
        net = model
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=kind, lr=1.0,
                                     bucket_cap_mb=0.0003)
    x, y = _batch(0)
    nn.functional.mse_loss(net(x[_mine(rank, world)]), y[_mine(rank, world)]).backward()
    if kind == "fsdp":
        net.finish_gradient_synchronization()
        norm = net.clip_grad_norm_(max_norm, norm_type)
    else:
        norm = optimizer.clip_grad_norm_(max_norm, norm_type)
    optimizer.step()
    params = net.gather_full_params().values() if kind == "fsdp" else model.parameters()
    return float(norm), [p.detach().clone() for p in params]


def _nonfinite(rank, world):
    """A NaN or an inf in rank 1's shard only: every rank sees the same non-finite norm."""
    out = {}
    for bad in ("nan", "inf"):
        for norm_type in (2.0, float("inf")):
            model = FSDP(Small())
            x, y = _batch(0)
            nn.functional.mse_loss(model(x[_mine(rank, world)]), y[_mine(rank, world)]).backward()
            model.finish_gradient_synchronization()
            if rank == 1:
                model.shards[0].grad[0] = float(bad)
            try:
                model.clip_grad_norm_(1.0, norm_type, error_if_nonfinite=True)
                raised = ""
            except RuntimeError as e:
                raised = str(e)
            norm = float(model.clip_grad_norm_(1.0, norm_type))
            nonfinite = sum(int((~torch.isfinite(s.grad)).sum()) for s in model.shards)
            out[bad, norm_type] = raised, norm, nonfinite, sum(s.numel() for s in model.shards)
    return out


def _reference_grads():
    """The averaged gradient of the two ranks' slices, in one process."""
    model = Small()
    x, y = _batch(0)
    for r in range(2):
        (nn.functional.mse_loss(model(x[_mine(r, 2)]), y[_mine(r, 2)]) / 2).backward()
    return model


@pytest.fixture(scope="module")
def resize_and_clip():
    return launch.run(_resize_and_clip, 2, timeout=120)


def test_resized_units_free_their_bytes_after_forward_and_refill_them_for_backward(
        resize_and_clip):
    reference = _reference_grads()
    layers = [m for m in reference.net if isinstance(m, nn.Linear)]
    for rank, r in enumerate(resize_and_clip):
        full = [4 * FlatLayout.of(list(m.parameters()), 2).padded for m in layers]
        assert r["before forward"] == r["after forward"] == r["after backward"] == [0, 0, 0]
        # backward runs the layers last to first; each is whole while its backward runs only
        assert r["during backward"] == [[0, 0, full[2]], [0, full[1], 0], [full[0], 0, 0]]
        for got, m in zip(r["resize grads"], layers):
            layout = FlatLayout.of(list(m.parameters()), 2)
            want = layout.chunk(layout.flatten([p.grad for p in m.parameters()]), rank)
            torch.testing.assert_close(got, want)


def test_clip_grad_norm_over_shards_equals_torch_on_the_whole_model(resize_and_clip):
    for key in [(k, p) for p in (2.0, 1.0, float("inf")) for k in ("fsdp", 1, 2)] + \
            [("fsdp", "loose")]:
        model = _reference_grads()
        max_norm, norm_type = (1e6, 2.0) if key[1] == "loose" else (0.05, key[1])
        want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad                                          # SGD, lr 1
        for r in resize_and_clip:
            norm, params = r[key]
            assert norm == pytest.approx(want, rel=1e-6), key
            for a, b in zip(params, model.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for rank, r in enumerate(resize_and_clip):   # as torch: scaled by 1/NaN (NaN) or 1/inf (0)
        for (bad, norm_type), (raised, norm, nonfinite, total) in r["nonfinite"].items():
            assert "non-finite" in raised and "error_if_nonfinite=False" in raised
            assert math.isnan(norm) if bad == "nan" else math.isinf(norm)
            assert nonfinite == (total if bad == "nan" else rank)    # inf · 0 = NaN on rank 1


# ---------------------------------------------------------------- the contract of a torch optimizer
# ShardedOptimizer beside torch.optim.AdamW (every rank gets the same batch, so the averaged
# gradient is each rank's own, exactly) and torch's ZeroRedundancyOptimizer.

def _same_batch_step(model, optimizer, step):
    x, y = _batch(step)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _contract(rank, world, stage):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.set_num_threads(1)
    out = {}
    # 1. param_groups and defaults mirror the inner optimizer's, as ZeroRedundancyOptimizer's do
    ours = ShardedOptimizer(Small().parameters(), torch.optim.AdamW, stage=stage, lr=0.05)
    theirs = ZeroRedundancyOptimizer(Small().parameters(), torch.optim.AdamW, lr=0.05)
    out["groups"] = ({k: v for k, v in ours.param_groups[0].items() if k != "params"},
                     {k: v for k, v in theirs.param_groups[0].items() if k != "params"})
    out["defaults"] = (ours.defaults, theirs.defaults)
    # 2. a group added after the first step is sharded and trained, with its own options
    runs = []
    for make in (lambda ps: ShardedOptimizer(ps, torch.optim.AdamW, stage=stage, lr=0.05,
                                             bucket_cap_mb=0.0003),
                 lambda ps: torch.optim.AdamW(ps, lr=0.05)):
        model = Small()
        first, rest = list(model.net[0].parameters()), list(model.net[2:].parameters())
        optimizer = make(first)
        _same_batch_step(model, optimizer, 0)
        optimizer.add_param_group({"params": rest, "lr": 0.02, "weight_decay": 0.3})
        for step in range(1, STEPS + 1):
            _same_batch_step(model, optimizer, step)
        runs.append([p.detach().clone() for p in model.parameters()])
    out["added"] = runs
    # 3. load_state_dict restores the options too: lr from the file, not from the constructor
    runs = []
    for make in (lambda ps, lr: ShardedOptimizer(ps, torch.optim.AdamW, stage=stage, lr=lr),
                 lambda ps, lr: torch.optim.AdamW(ps, lr=lr)):
        model = Small()
        optimizer = make(model.parameters(), 0.05)
        _same_batch_step(model, optimizer, 0)
        resumed = make(model.parameters(), 0.5)
        resumed.load_state_dict(optimizer.state_dict())
        _same_batch_step(model, resumed, 1)
        runs.append((resumed.param_groups[0]["lr"], [p.detach().clone() for p in model.parameters()]))
    out["resumed"] = runs
    # 4. a second optimizer over the same parameters (a cell run twice) takes them over, while
    #    the first one is still alive; stepping the first one then fails clearly
    model, reference = Small(), Small()
    old = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.05)
    plain = torch.optim.AdamW(reference.parameters(), lr=0.05)
    _same_batch_step(model, old, 0)
    new = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.05)
    fresh = torch.optim.AdamW(reference.parameters(), lr=0.05)
    _same_batch_step(reference, plain, 0)
    for step in range(1, STEPS):
        _same_batch_step(model, new, step)
        _same_batch_step(reference, fresh, step)
    out["rerun"] = [(a.detach().clone(), b.detach().clone())
                    for a, b in zip(model.parameters(), reference.parameters())]
    try:
        old.step()
        out["old_step"] = "no error"
    except RuntimeError as e:
        out["old_step"] = str(e)
    return out


@functools.lru_cache(maxsize=None)
def _contract_results(stage):
    """One launch per stage serves the four tests below."""
    return launch.run(_contract, 2, stage, timeout=90)


@pytest.mark.parametrize("stage", [1, 2])
def test_param_groups_and_defaults_mirror_zero_redundancy_optimizer(stage):
    for r in _contract_results(stage):
        ours, theirs = r["groups"]
        assert ours == theirs and r["defaults"][0] == r["defaults"][1]
        assert ours["betas"] == (0.9, 0.999) and "amsgrad" in ours


@pytest.mark.parametrize("stage", [1, 2])
def test_an_added_param_group_is_sharded_and_trained_like_adamws(stage):
    for r in _contract_results(stage):
        assert all(torch.equal(a, b) for a, b in zip(*r["added"]))


@pytest.mark.parametrize("stage", [1, 2])
def test_load_state_dict_restores_the_learning_rate_as_adamw_does(stage):
    for r in _contract_results(stage):
        (lr, got), (want_lr, want) = r["resumed"]
        assert lr == want_lr == 0.05
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_second_optimizer_on_the_same_parameters_takes_them_over(stage):
    for r in _contract_results(stage):
        assert all(torch.equal(a, b) for a, b in r["rerun"])
        assert "a newer ShardedOptimizer has taken over" in r["old_step"]


def _collected(rank, world):
    import gc
    model = Small()
    ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=0.05)   # dropped at once
    gc.collect()
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()       # no hook of the dead optimizer fires
    return all(p.grad is not None for p in model.parameters())


def test_a_collected_stage_2_optimizer_leaves_no_hooks_behind():
    assert all(launch.run(_collected, 2, timeout=60))
