"""companion.checkpointing against plain autograd and torch.utils.checkpoint."""
import functools
import itertools
import math
import random

import pytest
import torch
import torch.utils.checkpoint as tuc
from hypothesis import given, settings
from hypothesis import strategies as st

from companion import checkpointing as ck
from companion import memory, models
from companion.memory import track


def _block(width=12, p=0.0, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                               torch.nn.Dropout(p), torch.nn.Linear(2 * width, width))


def _grads(module, x):
    return [p.grad.clone() for p in module.parameters()] + ([x.grad.clone()] if x.requires_grad else [])


def _run(module, x, how, seed=1):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    y = how(module, x)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), _grads(module, x)


PLAIN = lambda m, x: m(x)
OURS = lambda m, x: ck.checkpoint(m, x)
TORCH = lambda m, x: tuc.checkpoint(m, x, use_reentrant=False)


@pytest.mark.parametrize("p", [0.0, 0.5])
@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_checkpoint_matches_plain_and_torch(p, x_requires_grad):
    block = _block(p=p)
    x = torch.randn(7, 12, requires_grad=x_requires_grad)
    y0, g0 = _run(block, x, PLAIN)
    for how in (OURS, TORCH):
        y, g = _run(block, x, how)
        torch.testing.assert_close(y, y0)
        assert len(g) == len(g0)
        for a, b in zip(g, g0):
            torch.testing.assert_close(a, b)


def test_dropout_recompute_uses_the_forward_masks():
    block = _block(p=0.5)
    x = torch.randn(9, 12, requires_grad=True)
    _, g_plain = _run(block, x, PLAIN, seed=3)
    _, g_ours = _run(block, x, OURS, seed=3)
    _, g_other_seed = _run(block, x, PLAIN, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_ours))
    assert not all(torch.equal(a, b) for a, b in zip(g_plain, g_other_seed))


def test_backward_leaves_the_random_stream_where_plain_autograd_leaves_it():
    block = _block(p=0.5)
    x = torch.randn(5, 12, requires_grad=True)
    _run(block, x, PLAIN, seed=7)
    after_plain = torch.rand(4)
    _run(block, x, OURS, seed=7)
    after_ours = torch.rand(4)
    assert torch.equal(after_plain, after_ours)


def test_fn_runs_twice_and_saves_only_its_inputs():
    calls = []
    block = _block()

    def fn(x):
        calls.append(1)
        return block(x)

    x = torch.randn(6, 12, requires_grad=True)
    saved_plain = ck.saved_for_backward(fn, x)
    calls.clear()
    saved = ck.saved_for_backward(lambda t: ck.checkpoint(fn, t), x)
    assert len(calls) == 1
    assert [s.shape for s in saved] == [(6, 12)]          # only the input
    assert sum(s.nbytes for s in saved_plain if not s.is_parameter) > saved[0].nbytes
    ck.checkpoint(fn, x).sum().backward()
    assert len(calls) == 3                                # forward, then recompute in backward


def test_tuple_outputs_and_non_tensor_arguments():
    w = torch.randn(4, 4, requires_grad=True)

    def fn(a, scale, b):
        return (a @ w * scale, (b * a).sin())

    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    out = ck.checkpoint(fn, a, 2.5, b)
    (out[0].sum() + out[1].pow(2).sum()).backward()
    ours = [a.grad.clone(), b.grad.clone(), w.grad.clone()]
    for t in (a, b, w):
        t.grad = None
    ref = fn(a, 2.5, b)
    (ref[0].sum() + ref[1].pow(2).sum()).backward()
    for got, want in zip(ours, [a.grad, b.grad, w.grad]):
        torch.testing.assert_close(got, want)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 9), data=st.data())
def test_checkpoint_sequential_matches_torch(n, data):
    segments = data.draw(st.integers(1, n))
    torch.manual_seed(n)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
                                   for _ in range(n)])
    x = torch.randn(5, 6, requires_grad=True)
    y0, g0 = _run(layers, x, lambda m, t: tuc.checkpoint_sequential(m, segments, t,
                                                                     use_reentrant=False))
    y, g = _run(layers, x, lambda m, t: ck.checkpoint_sequential(list(m), segments, t))
    torch.testing.assert_close(y, y0)
    for a, b in zip(g, g0):
        torch.testing.assert_close(a, b)


def test_checkpoint_sequential_rejects_bad_segment_counts():
    layers = [torch.nn.Identity()] * 3
    for bad in (0, 4):
        with pytest.raises(ValueError, match="segments must be between 1 and"):
            ck.checkpoint_sequential(layers, bad, torch.zeros(1))


def test_checkpoint_sequential_keeps_fewer_activations():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(16)]
    x = torch.randn(4, 16, requires_grad=True)

    def activation_bytes(segments):
        saved = ck.saved_for_backward(lambda t: ck.checkpoint_sequential(layers, segments, t), x)
        return sum(s.nbytes for s in saved if not s.is_parameter and s.shape == (4, 16))

    assert activation_bytes(4) < activation_bytes(1) / 2


def test_saved_for_backward_lists_duplicates_and_marks_parameters():
    lin = torch.nn.Linear(3, 5)
    saved = ck.saved_for_backward(lin, torch.randn(2, 3, requires_grad=True))
    assert sorted((s.shape, s.is_parameter) for s in saved) == [((2, 3), False), ((3, 5), True)]   # W saved as W.T
    x = torch.randn(8, requires_grad=True)
    twice = ck.saved_for_backward(lambda t: t * t, x)
    assert [s.nbytes for s in twice] == [32, 32]


def test_predicted_units_plain_and_near_sqrt():
    assert ck.predicted_activation_units(16, 1) == 16
    assert ck.predicted_activation_units(16, 4) == 3 + 4
    for n in (4, 9, 16, 25, 30, 100):
        best = ck.sqrt_segments(n)
        assert abs(best - math.sqrt(n)) <= 1.5
        assert ck.predicted_activation_units(n, best) <= 2 * math.ceil(math.sqrt(n))


@given(n=st.integers(1, 60), layer_bytes=st.integers(1, 1000), budget=st.integers(0, 80_000))
def test_segments_for_budget_is_the_fewest_that_fits(n, layer_bytes, budget):
    s = ck.segments_for_budget(n, layer_bytes, budget)
    fits = [k for k in range(1, n + 1) if ck.predicted_activation_units(n, k) * layer_bytes <= budget]
    assert s == (min(fits) if fits else None)


def test_profile_segments_measures_less_saved_memory_near_sqrt_n():
    torch.manual_seed(0)
    n, b, w = 16, 32, 16
    blocks = [torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU()) for _ in range(n)]
    x = torch.randn(b, w)

    def step(segments):
        ck.checkpoint_sequential(blocks, segments, x).square().mean().backward()

    runs = ck.profile_segments(step, [1, 4], device="cpu", repeats=3)
    assert [r.segments for r in runs] == [1, 4]
    assert all(0 < r.fastest <= r.seconds <= r.slowest for r in runs)
    unit = b * w * 4
    assert runs[0].activation_bytes >= n * unit
    assert runs[1].activation_bytes <= ck.predicted_activation_units(n, 4) * unit + unit
    assert runs[1].peak_bytes < runs[0].peak_bytes


def test_predicted_time_ratio_is_at_most_four_thirds():
    assert ck.predicted_time_ratio(16, 1) == 1.0
    assert ck.predicted_time_ratio(16, 4) == pytest.approx(1 + 12 / 48)
    assert all(ck.predicted_time_ratio(n, s) <= 4 / 3 for n in range(1, 30) for s in range(1, n + 1))


def test_activation_bytes_counts_each_storage_once_and_skips_parameters():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    x = torch.randn(4, 5, requires_grad=True)
    # Linear saves x (4·5); ReLU saves its output (4·7), which the second Linear saves again.
    assert ck.activation_bytes(mlp, x) == 4 * (4 * 5 + 4 * 7)
    assert ck.activation_bytes(lambda t: t * t, x) == 4 * 20


# ---------------------------------------------------------------- the saved-tensor-hooks design

HOOKS = lambda m, x: ck.checkpoint(m, x, use_reentrant=False)
SELECTIVE = lambda m, x: ck.checkpoint_hooks(m, x, policy=ck.save_linear_outputs)
TORCH_SELECTIVE = lambda m, x: tuc.checkpoint(
    m, x, use_reentrant=False, context_fn=lambda: tuc.create_selective_checkpoint_contexts(
        lambda ctx, op, *a, **k: tuc.CheckpointPolicy.MUST_SAVE if ck.save_linear_outputs(op)
        else tuc.CheckpointPolicy.PREFER_RECOMPUTE))


@pytest.mark.parametrize("how", [HOOKS, SELECTIVE], ids=["full", "selective"])
@pytest.mark.parametrize("p", [0.0, 0.5])
@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_hooks_checkpoint_equals_torch_bit_for_bit(how, p, x_requires_grad):
    block = _block(p=p)
    x = torch.randn(5, 12, requires_grad=x_requires_grad)
    y_plain, g_plain = _run(block, x, PLAIN)
    y_torch, g_torch = _run(block, x, TORCH if how is HOOKS else TORCH_SELECTIVE)
    y_ours, g_ours = _run(block, x, how)
    for a, b, c in zip([y_ours] + g_ours, [y_torch] + g_torch, [y_plain] + g_plain):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_hooks_checkpoint_serves_autograd_grad_keywords_and_non_tensor_outputs():
    block = _block()
    x = torch.randn(3, 12, requires_grad=True)

    def fn(t, *, scale):
        return {"y": block(t) * scale, "note": "kept as it is"}

    out = ck.checkpoint(fn, x, use_reentrant=False, scale=2.0)
    (gx,) = torch.autograd.grad(out["y"].sum(), x)
    (want,) = torch.autograd.grad((block(x) * 2.0).sum(), x)
    assert torch.equal(gx, want) and out["note"] == "kept as it is"
    with pytest.raises(ValueError, match="use_reentrant=False"):
        ck.checkpoint(fn, x, scale=2.0)
    weight = block[0].weight                              # a parameter inside the block
    (gw,) = torch.autograd.grad(ck.checkpoint(block, x, use_reentrant=False).sum(), weight)
    assert torch.equal(gw, torch.autograd.grad(block(x).sum(), weight)[0]) and weight.grad is None
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(ck.checkpoint(block, x).sum(), weight)   # the reentrant one cannot


def test_hooks_checkpoint_keeps_nothing_but_inputs_until_backward():
    block = _block(width=64)
    x = torch.randn(256, 64, requires_grad=True)
    kept = {}
    for name, how in [("plain", PLAIN), ("full", HOOKS), ("selective", SELECTIVE)]:
        with memory.track("cpu") as t:
            y = how(block, x)
            kept[name] = t.current - y.untyped_storage().nbytes()
        del y
    linear_outputs = 256 * (128 + 64) * 4                 # what save_linear_outputs keeps
    assert kept["full"] == 0
    assert kept["selective"] == linear_outputs - 256 * 64 * 4   # the last one is the output
    assert kept["plain"] > kept["selective"] > kept["full"]


def test_retain_graph_recomputes_again():
    block = _block()
    x = torch.randn(4, 12, requires_grad=True)
    y = ck.checkpoint_hooks(block, x, policy=ck.save_matmul_outputs)
    (g1,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated through once"):
        torch.autograd.grad(y.sum(), x)                   # kept outputs were handed over once
    y = ck.checkpoint_hooks(block, x)
    (a,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    (b,) = torch.autograd.grad(y.sum(), x)
    (plain,) = torch.autograd.grad(block(x).sum(), x)
    assert torch.equal(a, b) and torch.equal(a, g1) and torch.equal(a, plain)


def test_selective_kept_outputs_are_freed_with_the_graph():
    block = _block()
    x = torch.randn(64, 12, requires_grad=True)
    with memory.track("cpu") as t:
        y = ck.checkpoint_hooks(block, x, policy=ck.save_matmul_outputs)
        kept = t.current - y.untyped_storage().nbytes()
        y.sum().backward()
        del y
        left = t.current
    grads = x.nbytes + sum(p.nbytes for p in block.parameters())
    assert kept > 0 and left == grads                 # only the .grads are left after backward


def test_policies_name_the_right_operators():
    aten = torch.ops.aten
    assert ck.save_linear_outputs(aten.addmm.default) and ck.save_linear_outputs(aten.mm.default)
    assert not ck.save_linear_outputs(aten.bmm.default) and ck.save_matmul_outputs(aten.bmm.default)
    assert not ck.save_matmul_outputs(aten._softmax.default)


# ---------------------------------------------------------------- the contract of torch.utils.checkpoint
# The same scenario through torch.utils.checkpoint and ours: same numbers, or the same refusal.

def _keep(policy):
    """Our policy as torch's selective checkpoint context."""
    return lambda: tuc.create_selective_checkpoint_contexts(
        lambda ctx, op, *a, **k: tuc.CheckpointPolicy.MUST_SAVE if policy(op)
        else tuc.CheckpointPolicy.PREFER_RECOMPUTE)


def _sin_then_double(t):
    return t.sin().mul_(2).cos()                       # the kept sin changed in place


def _residual_in_place(lin):
    def fn(t):
        h = lin(t)
        h += t                                        # the kept addmm output changed in place
        return h.tanh()
    return fn


KEEP_SIN = lambda op: op.overloadpacket is torch.ops.aten.sin


@pytest.mark.parametrize("case", ["sin", "residual"])
def test_a_kept_output_changed_in_place_raises_like_torch_instead_of_wrong_gradients(case):
    lin = torch.nn.Linear(6, 6)
    fn, policy = (_sin_then_double, KEEP_SIN) if case == "sin" else \
        (_residual_in_place(lin), ck.save_linear_outputs)
    x = torch.randn(4, 6, requires_grad=True)
    for run in (lambda: ck.checkpoint_hooks(fn, x, policy=policy),
                lambda: tuc.checkpoint(fn, x, use_reentrant=False, context_fn=_keep(policy))):
        y = run()
        with pytest.raises(RuntimeError, match="has been mutated"):
            y.sum().backward()
    assert x.grad is None


def test_an_out_of_place_residual_keeps_working_and_equals_torch():
    lin = torch.nn.Linear(6, 6)

    def fn(t):
        h = lin(t)
        h = h + t
        return h.tanh()
    x = torch.randn(4, 6, requires_grad=True)
    (ours,) = torch.autograd.grad(ck.checkpoint_hooks(fn, x, policy=ck.save_linear_outputs).sum(), x)
    (theirs,) = torch.autograd.grad(tuc.checkpoint(fn, x, use_reentrant=False,
                                                   context_fn=_keep(ck.save_linear_outputs)).sum(), x)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("call", ["grad", "create_graph", "inputs"])
def test_the_reentrant_checkpoint_refuses_autograd_grad_as_torch_does_and_leaves_no_grad(call):
    block = _block()
    x = torch.randn(3, 12, requires_grad=True)
    weight = block[0].weight

    def backprop(y):
        if call == "inputs":
            y.sum().backward(inputs=[x])
        else:
            torch.autograd.grad(y.sum(), x, create_graph=call == "create_graph")
    messages = []
    for run in (lambda: ck.checkpoint(block, x), lambda: tuc.checkpoint(block, x, use_reentrant=True)):
        with pytest.raises(RuntimeError, match="incompatible with .grad()") as err:
            backprop(run())
        messages.append(str(err.value))
        assert weight.grad is None and x.grad is None       # no side effect before the error
    assert messages[0] == messages[1]


def test_the_reentrant_checkpoint_recomputes_under_forwards_autocast_like_torch():
    block = _block()
    x = torch.randn(6, 12, requires_grad=True)
    grads = {}
    for name, run in [("plain", lambda: block(x)), ("ours", lambda: ck.checkpoint(block, x)),
                      ("torch", lambda: tuc.checkpoint(block, x, use_reentrant=True))]:
        block.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run()
        y.float().sum().backward()                          # backward outside autocast
        grads[name] = [x.grad] + [p.grad for p in block.parameters()]
    for ours, theirs, plain in zip(grads["ours"], grads["torch"], grads["plain"]):
        assert torch.equal(ours, theirs) and torch.equal(ours, plain)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_retain_graph_and_nesting_give_torchs_gradients(use_reentrant):
    outer, inner = _block(seed=1), _block(seed=2)

    def nested(ckpt):
        return lambda t: outer(ckpt(inner, t))
    x = torch.randn(4, 12, requires_grad=True)
    got = {}
    for name, ckpt in [("ours", lambda f, t: ck.checkpoint(f, t, use_reentrant=use_reentrant)),
                       ("torch", lambda f, t: tuc.checkpoint(f, t, use_reentrant=use_reentrant))]:
        for m in (outer, inner):
            m.zero_grad(set_to_none=True)
        x.grad = None
        y = ckpt(nested(ckpt), x)
        y.sum().backward(retain_graph=True)
        (y * 2).sum().backward()                            # the second backward of one graph
        got[name] = [x.grad] + [p.grad for m in (outer, inner) for p in m.parameters()]
    for a, b in zip(got["ours"], got["torch"]):
        assert torch.equal(a, b)


def test_torchs_own_options_are_refused_not_passed_to_the_function():
    block = _block()
    x = torch.randn(2, 12, requires_grad=True)
    y = ck.checkpoint(block, x, preserve_rng_state=True)    # what ours always does
    assert torch.equal(y, block(x))
    for use_reentrant in (True, False):
        with pytest.raises(ValueError, match="preserve_rng_state=False"):
            ck.checkpoint(block, x, preserve_rng_state=False, use_reentrant=use_reentrant)
        for option in ("context_fn", "determinism_check", "debug"):
            with pytest.raises(ValueError, match=f"{option}= is an option of torch"):
                ck.checkpoint(block, x, use_reentrant=use_reentrant, **{option: None})


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_sequential_with_dropout_equals_torch_for_both_designs(use_reentrant):
    layers = [m for seed in range(5) for m in _block(p=0.3, seed=seed)]
    x = torch.randn(6, 12, requires_grad=True)
    got = {}
    for name, run in [("ours", ck.checkpoint_sequential), ("torch", tuc.checkpoint_sequential)]:
        for m in layers:
            m.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(3)
        y = run(layers, 3, x, use_reentrant=use_reentrant)
        y.sum().backward()
        got[name] = [y.detach(), x.grad] + [p.grad for m in layers for p in m.parameters()]
    for a, b in zip(got["ours"], got["torch"]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- Korthikanti's selective recompute

def _kept_between(fn, x):
    """Bytes live between forward and backward, the input x included (it exists before)."""
    with track(x.device) as tracker:
        y = fn(x)
        kept = tracker.current - y.untyped_storage().nbytes()
    return kept + x.untyped_storage().nbytes()


@pytest.mark.parametrize("batch, seq, width, heads", [(3, 13, 24, 3), (2, 32, 40, 5), (1, 9, 16, 4)])
def test_selective_block_matches_the_block_bit_for_bit(batch, seq, width, heads):
    torch.manual_seed(seq)
    block = models.Block(width, heads)
    x = torch.randn(batch, seq, width)

    def grads(run):
        block.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = run(xx)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return [y.detach()] + [p.grad for p in block.parameters()] + [xx.grad]

    plain = grads(block)
    for run in (lambda t: ck.selective_block(block, t),
                lambda t: ck.checkpoint_hooks(block, t, policy=ck.attention_core_policy)):
        assert all(torch.equal(a, b) for a, b in zip(grads(run), plain))


@pytest.mark.parametrize("batch, seq, width, heads", [(3, 13, 24, 3), (2, 32, 40, 5), (4, 17, 12, 2)])
def test_selective_block_drops_exactly_the_attention_core_of_the_formula(batch, seq, width, heads):
    torch.manual_seed(0)
    block = models.Block(width, heads)
    x = torch.randn(batch, seq, width, requires_grad=True)
    plain = ck.activation_bytes(block, x)
    selective = _kept_between(lambda t: ck.selective_block(block, t), x)
    assert plain == ck.block_activation_bytes(batch, seq, width, heads)
    assert selective == ck.block_activation_bytes(batch, seq, width, heads, recompute_core=True)
    # the core's term: the fp32 softmax output (a·s²·b·4) and the bool causal mask (s²)
    assert plain - selective == 4 * heads * seq * seq * batch + seq * seq


def test_block_formula_is_megatrons_without_its_dropouts_in_16_bits():
    b, s, h, a = 2, 64, 48, 4
    ours16 = ck.block_activation_bytes(b, s, h, a, dtype=torch.bfloat16)
    # Megatron: 34·sbh + 5·a·s²·b; less two sbh-byte dropout masks, the attention dropout's mask
    # (a·s²·b) and output (2·a·s²·b); plus LayerNorm statistics (4·s·b·2) and the mask (s²)
    assert ours16 == (ck.megatron_activation_bytes(b, s, h, a) - 2 * s * b * h - 3 * a * s * s * b
                      + 8 * s * b + s * s)
    assert ck.megatron_activation_bytes(b, s, h, a, recompute_core=True) == 34 * s * b * h


def test_attention_core_policy_keeps_no_sequence_squared_tensor():
    torch.manual_seed(1)
    block = models.Block(24, 3)
    kept = [_kept_between(lambda t: ck.checkpoint_hooks(block, t, policy=ck.attention_core_policy),
                          torch.randn(2, T, 24, requires_grad=True)) for T in (10, 20)]
    assert kept[1] == 2 * kept[0]


@pytest.mark.parametrize("seed", range(5))
def test_checkpoint_plan_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 9)
    saved = [rng.randrange(1, 50) for _ in range(n)]
    inputs = [rng.randrange(1, 10) for _ in range(n)]
    cost = [rng.randrange(1, 9) for _ in range(n)]
    budget = rng.randrange(1, sum(saved) + 10)
    plan = ck.checkpoint_plan(saved, inputs, cost, budget)
    plans = [[0, *c] for k in range(n) for c in itertools.combinations(range(1, n), k)]
    fits = [ck.plan_cost(p, saved, inputs, cost) for p in plans
            if ck.plan_cost(p, saved, inputs, cost)[0] <= budget]
    if not fits:
        assert plan is None
    else:
        peak, recompute = ck.plan_cost(plan, saved, inputs, cost)
        assert peak <= budget and recompute == min(r for _, r in fits)


@pytest.mark.parametrize("copies", [[12, 1, 1, 1, 1, 1], [1, 1, 12, 1, 1, 1], [3, 5, 2, 7, 1, 4]])
@pytest.mark.parametrize("checkpoint_fn", [ck.checkpoint,
                                           functools.partial(tuc.checkpoint, use_reentrant=True)])
def test_plan_cost_is_the_measured_peak_and_the_bound_is_above_it(copies, checkpoint_fn):
    layers = [ck.UnevenLayer(c) for c in copies]
    x = torch.randn(8, 16, requires_grad=True)
    unit = x.numel() * x.element_size()                        # one (8, 16) fp32 tensor
    saved, inputs, cost = [c * unit for c in copies], [unit] * len(copies), [1.0] * len(copies)
    over = 0
    for starts in ([0], [0, 1], [0, 1, 2], [0, 2, 4], [0, 3], [0, 1, 2, 3, 4, 5]):
        measured = ck.measure_plan(layers, starts, x, checkpoint_fn=checkpoint_fn)
        assert ck.plan_cost(starts, saved, inputs, cost)[0] == measured, starts
        bound = ck.plan_cost(starts, saved, inputs, cost, bound=True)[0]
        assert bound >= measured
        over += bound > measured
    assert over > 0                                            # the bound is not the peak


class _SavesItsInput(torch.nn.Module):
    """An UnevenLayer that also saves its own input (h * h saves h), as Linear does."""

    def __init__(self, copies: int):
        super().__init__()
        self.inner = ck.UnevenLayer(copies)

    def forward(self, h):
        return self.inner(h) + h * h


def _peak_when_layers_save_their_input(starts, saved, inputs):
    """The peak with each input counted in saved[i]: a recomputed segment's own checkpoint is its
    first layer's saved input, so only the checkpoints before it are added."""
    ends = starts[1:] + [len(saved)]
    held = [sum(saved[a:b]) for a, b in zip(starts, ends)]
    before = [sum(inputs[a] for a in starts[:j]) for j in range(len(starts))]
    return max([b + h for b, h in zip(before[:-1], held[:-1])]
               + [sum(inputs[a] for a in starts[:-1]) + held[-1]])


@pytest.mark.parametrize("checkpoint_fn", [ck.checkpoint,
                                           functools.partial(tuc.checkpoint, use_reentrant=True)])
def test_measure_plan_counts_layers_that_save_their_input_once(checkpoint_fn):
    copies = [12, 1, 1, 1, 1, 1]
    layers = [_SavesItsInput(c) for c in copies]
    x = torch.randn(8, 16, requires_grad=True)
    unit = x.numel() * x.element_size()
    saved, inputs = [(c + 1) * unit for c in copies], [unit] * len(copies)
    for starts in ([0], [0, 1], [0, 1, 2], [0, 3], [0, 5], [0, 1, 2, 3, 4, 5]):
        measured = ck.measure_plan(layers, starts, x, checkpoint_fn=checkpoint_fn)
        assert measured == _peak_when_layers_save_their_input(starts, saved, inputs), starts
        assert ck.measure_plan(layers, starts, x, checkpoint_fn=checkpoint_fn,
                               step_peak=True) > measured
    assert ck.measure_plan(layers, [0, 1], x, checkpoint_fn=checkpoint_fn) == 13 * unit


def test_the_bound_is_exact_on_equal_layers():
    saved, inputs, cost = [5] * 9, [2] * 9, [1.0] * 9
    for s in range(1, 10):
        starts = [i * (9 // s) for i in range(s)]
        assert (ck.plan_cost(starts, saved, inputs, cost)
                == ck.plan_cost(starts, saved, inputs, cost, bound=True))
