"""companion.lowbit against bitsandbytes (CPU backend; a test-only dependency): the same maps, the
nearest codes, NF4's levels, packing and dequantized values, and the bytes stored."""
import copy
import importlib.metadata

import pytest
import torch

from companion import lowbit
from companion.memory import format_bytes, track

F = pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_map_is_bitsandbytes(signed):
    ours, theirs = lowbit.dynamic_map(signed), F.create_dynamic_map(signed=signed).sort().values
    assert ours.shape == (256,) and torch.allclose(ours, theirs, atol=1e-7, rtol=0)
    assert ours.max() == 1.0 and (ours == 0).sum() == 1                # +1 and 0 exactly
    assert (ours.min() > -1) if signed else (ours.min() == 0)


@pytest.mark.parametrize("numel, blocksize", [(1000, 256), (4096, 64), (77, 4096)])
def test_block_wise_codes_are_the_nearest_and_never_worse_than_bitsandbytes(numel, blocksize):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-4, 1, numel)    # moments' many scales
    code = lowbit.dynamic_map(True)
    codes, absmax = lowbit.quantize_blockwise(x.view(-1, 1) if numel % 2 else x, code, blocksize)
    assert codes.dtype == torch.uint8 and absmax.shape == (-(-numel // blocksize),)
    ours = lowbit.dequantize_blockwise(codes, absmax, code, blocksize).reshape(-1)
    q, state = F.quantize_blockwise(x, code=F.create_dynamic_map(True), blocksize=blocksize)
    theirs = F.dequantize_blockwise(q, state)
    assert torch.equal(absmax, state.absmax)
    block = absmax.repeat_interleave(blocksize)[:numel]
    assert ((ours - x).abs() - (theirs - x).abs()).max() <= 1e-4 * block.max()
    levels = code.view(1, -1) * block.view(-1, 1)                     # every level, per value
    best = (levels - x.view(-1, 1)).abs().min(dim=1).values
    assert torch.allclose((ours - x).abs(), best, atol=1e-6)          # the nearest level


def test_nf4_levels_are_qloras():
    theirs = F.get_4bit_type("nf4", device="cpu").sort().values
    assert lowbit.NF4.shape == (16,) and torch.allclose(lowbit.NF4, theirs, atol=1e-6, rtol=0)
    assert (lowbit.NF4 == 0).sum() == 1 and lowbit.NF4.max() == 1 and lowbit.NF4.min() == -1


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_dequantizes_to_bitsandbytes_values_and_stores_its_bits(double_quant):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64 * 300 + 7, generator=g) * 0.02                 # odd: a short last block
    q = lowbit.quantize_nf4(w, 64, double_quant=double_quant)
    ours = lowbit.dequantize_nf4(q)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                    compress_statistics=double_quant)
    theirs = F.dequantize_4bit(packed, state).reshape(-1)
    assert ours.shape == w.shape and torch.allclose(ours, theirs, atol=1e-7, rtol=0)
    blocks = -(-w.numel() // 64)
    absmax_bits = 8 * blocks + 32 * -(-blocks // 256) + 32 if double_quant else 32 * blocks
    assert q.nbytes() * 8 == 4 * (w.numel() + 1) + absmax_bits
    assert 4.12 < q.bits_per_value() < 4.2 if double_quant else 4.49 < q.bits_per_value() < 4.51


def test_bad_input_says_what_to_do():
    code = lowbit.dynamic_map()
    with pytest.raises(TypeError, match="floating-point"):
        lowbit.quantize_blockwise(torch.arange(10), code)
    with pytest.raises(ValueError, match="power of two"):
        lowbit.quantize_blockwise(torch.ones(10), code, blocksize=100)
    with pytest.raises(ValueError, match="blocksize used"):
        codes, absmax = lowbit.quantize_blockwise(torch.ones(512), code, 256)
        lowbit.dequantize_blockwise(codes, absmax, code, 64)
    with pytest.raises(TypeError, match="floating-point"):
        lowbit.quantize_nf4(torch.ones(4, dtype=torch.int32))


# ---------------------------------------------------------------- Adam8bit

def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _train(model, opt, steps=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 128, generator=g), torch.randint(64, (64,), generator=g)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _mean_distance(a, b):
    total = sum(float((p - q).detach().abs().sum()) for p, q in zip(a.parameters(), b.parameters()))
    return total / sum(p.numel() for p in a.parameters())


@pytest.mark.parametrize("seed", [0, 1])
def test_adam8bit_stays_as_close_to_fp32_adam_as_bitsandbytes(seed):
    bnb = pytest.importorskip("bitsandbytes")
    models = [_mlp(seed) for _ in range(3)]
    opts = [torch.optim.Adam(models[0].parameters(), lr=1e-3),
            lowbit.Adam8bit(models[1].parameters(), lr=1e-3),
            bnb.optim.Adam8bit(models[2].parameters(), lr=1e-3)]
    for model, opt in zip(models, opts):
        _train(model, opt, seed=seed)
    ours, theirs = _mean_distance(models[1], models[0]), _mean_distance(models[2], models[0])
    assert 0 < ours <= 1.05 * theirs


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam8bit_decays_as_adam_or_as_adamw(decoupled):
    torch.manual_seed(0)
    w = torch.randn(64, requires_grad=True)            # under min_8bit_size: fp32 moments
    w_ref = w.detach().clone().requires_grad_()
    ours = lowbit.Adam8bit([w], lr=0.1, weight_decay=0.5, decoupled_weight_decay=decoupled)
    ref = (torch.optim.AdamW if decoupled else torch.optim.Adam)([w_ref], lr=0.1,
                                                                 weight_decay=0.5)
    for _ in range(3):
        g = torch.randn(64)
        w.grad, w_ref.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(w, w_ref)


def test_adam8bit_state_is_two_bytes_per_parameter_plus_absmax_and_round_trips():
    model = _mlp(0)
    opt = lowbit.Adam8bit(model.parameters(), lr=1e-3)
    _train(model, opt, steps=2)
    big = [p for p in model.parameters() if p.numel() >= 4096]        # 8-bit: the two weights
    small = [p for p in model.parameters() if p.numel() < 4096]       # fp32: the biases
    want = sum(2 * p.numel() + 2 * 4 * -(-p.numel() // 256) for p in big) + \
        sum(8 * p.numel() for p in small)
    assert opt.state_bytes() == want
    assert all(opt.state[p]["exp_avg_codes"].dtype == torch.uint8 for p in big)
    twin = _mlp(0)
    twin.load_state_dict(model.state_dict())
    resumed = lowbit.Adam8bit(twin.parameters(), lr=1e-3)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))      # as torch.save + torch.load
    _train(model, opt, steps=2, seed=5)
    _train(twin, resumed, steps=2, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


# ---------------------------------------------------------------- bf16 without an fp32 master

def test_stochastic_rounding_is_unbiased_where_round_to_nearest_is_not():
    """x sits a quarter of the way between two bf16 neighbours: nearest always rounds down, the
    stochastic mean must be x (a 5-sigma band over 20000 draws)."""
    low = torch.tensor(1.0)
    spacing = 2.0 ** -7                                   # bf16's spacing in [1, 2)
    x = torch.full((20000,), 1.0 + spacing / 4)
    g = torch.Generator().manual_seed(0)
    draws = lowbit.round_stochastic(x, generator=g).float()
    assert set(draws.unique().tolist()) == {1.0, 1.0 + spacing}
    p_up = float((draws > low).float().mean())
    sigma = (0.25 * 0.75 / x.numel()) ** 0.5
    assert abs(p_up - 0.25) < 5 * sigma
    assert float(x.to(torch.bfloat16).float().mean()) == 1.0       # nearest: biased, always down
    with pytest.raises(TypeError, match="fp32"):
        lowbit.round_stochastic(x.double())


def _tiny_updates(compensation, steps=200):
    """A bf16 weight of 1.0 pushed by updates of a tenth of bf16's spacing there."""
    w = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = lowbit.BF16AdamW([w], lr=2.0 ** -7 / 10, weight_decay=0.0, compensation=compensation)
    torch.manual_seed(0)
    for _ in range(steps):
        w.grad = -torch.ones_like(w)                      # Adam's step: about lr each time
        opt.step()
    return float(w.detach().float().mean()) - 1.0


def test_compensation_keeps_the_updates_that_bf16_rounding_loses():
    wanted = 200 * 2.0 ** -7 / 10                          # what fp32 would have moved
    assert _tiny_updates("none") == 0.0                    # every update below half a spacing
    assert abs(_tiny_updates("kahan") - wanted) < 0.05 * wanted
    assert abs(_tiny_updates("stochastic") - wanted) < 0.05 * wanted


def test_bf16_adamw_refuses_fp32_parameters_and_unknown_modes():
    with pytest.raises(TypeError, match="bf16"):
        lowbit.BF16AdamW([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="compensation"):
        lowbit.BF16AdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))],
                         compensation="exact")



def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors of the same signs are (their bit patterns)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("shape", [(37, 300, 29), (4, 2048, 3)])
def test_fp32_products_give_a_bf16_gemms_result(shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(k)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.rand(k, n, generator=g).bfloat16()               # sums of mixed signs, no cancellation to 0
    exact = (a.double() @ b.double()).bfloat16()               # the correctly rounded product
    with lowbit.fp32_products():
        ours = a @ b
        as_linear = torch.nn.functional.linear(a, b.T)
    assert ours.dtype == as_linear.dtype == torch.bfloat16
    assert torch.equal(ours, as_linear)
    apart = _ulps_apart(ours, exact)
    assert apart.max() <= 1 and (apart == 0).float().mean() > 0.99
    assert _ulps_apart(ours, a @ b).max() <= 1                 # PyTorch's own bf16 GEMM


def test_fp32_products_send_gradients_in_the_weights_dtype_and_leave_fp32_alone():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(4, 16, generator=g).bfloat16().requires_grad_()
    with lowbit.fp32_products():
        torch.nn.functional.linear(x, w).square().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    x2, w2 = (t.detach().float().requires_grad_() for t in (x, w))
    torch.nn.functional.linear(x2, w2).bfloat16().float().square().sum().backward()
    assert torch.equal(w.grad, w2.grad.bfloat16())
    f32 = torch.randn(5, 6, generator=g)
    with lowbit.fp32_products():
        out = f32 @ f32.T
        with pytest.raises(RuntimeError):                       # PyTorch's own dtype error
            f32 @ f32.T.bfloat16()
    assert out.dtype == torch.float32 and torch.equal(out, f32 @ f32.T)


# ---------------------------------------------------------------- QLoRA

def test_qlora_trains_only_the_adapters_on_an_nf4_base_and_merges():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64)
    layer = lowbit.QLoRALinear.from_linear(linear, rank=4, alpha=8)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(5, 128)
    base = lowbit.dequantize_nf4(layer.base)
    want = torch.nn.functional.linear(x, base, linear.bias) + (x @ layer.A.T @ layer.B.T) * 2.0
    y = layer(x)
    assert torch.allclose(y, want, atol=1e-6)
    y.sum().backward()
    assert [n for n, p in layer.named_parameters()] == ["A", "B"]
    assert layer.A.grad is not None and layer.B.grad is not None
    assert torch.allclose(layer.merge()(x), y, atol=1e-5)
    assert (base - linear.weight).abs().max() < 0.16 * linear.weight.abs().max()  # 4 bits:
    # at most half the widest gap between NF4 levels (-1 to -0.70) times the block absmax


def test_qlora_saves_no_dense_weight_for_backward_and_its_gradients_are_the_dense_ones():
    torch.manual_seed(0)
    layer = lowbit.QLoRALinear.from_linear(torch.nn.Linear(256, 128), rank=4)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(3, 256, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        y = layer(x)
    assert torch.Size([128, 256]) not in saved and torch.Size([256, 128]) not in saved
    y.square().sum().backward()
    # the same layer with the dequantized weight as a plain tensor
    x2, A = x.detach().requires_grad_(), layer.A.detach().requires_grad_()
    dense = torch.nn.functional.linear(x2, lowbit.dequantize_nf4(layer.base), layer.bias)
    (dense + (x2 @ A.T @ layer.B.T) * layer.scale).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.A.grad, A.grad, rtol=1e-4, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16                        # autocast's dtype


def test_apply_qlora_replaces_linears_and_says_when_there_are_none():
    from companion.models import GPT
    model = lowbit.apply_qlora(GPT(32, 16, 32, 2, 4, seed=0), rank=2, targets=["fc", "out"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".A", ".B")) for n in trainable)
    tokens = torch.randint(32, (2, 16))
    model.loss(tokens, tokens).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    with pytest.raises(ValueError, match="no nn.Linear"):
        lowbit.apply_qlora(torch.nn.Sequential(torch.nn.ReLU()), rank=2)
    with pytest.raises(TypeError, match="nn.Linear"):
        lowbit.QLoRALinear.from_linear(torch.nn.Conv1d(2, 2, 1), rank=1)
    with pytest.raises(ValueError, match="power of two"):
        lowbit.QLoRALinear.from_linear(torch.nn.Linear(8, 8), rank=1, blocksize=48)


@pytest.mark.parametrize("shape, blocksize, dtype", [
    ((300, 200), 64, torch.float32), ((77, 33), 64, torch.bfloat16), ((5, 3), 4, torch.float32),
    ((64 * 50 + 3,), 64, torch.float16)])
def test_nf4_dequantizes_in_blocks_exactly_as_in_one_piece(shape, blocksize, dtype, monkeypatch):
    from companion.lowbit import nf4
    g = torch.Generator().manual_seed(len(shape))
    q = lowbit.quantize_nf4((torch.randn(shape, generator=g) * 0.02).to(dtype), blocksize,
                            double_quant=True)
    codes = torch.stack([q.packed >> 4, q.packed & 15], 1).reshape(-1)[:q.numel].long()
    scale = nf4._absmax(q).repeat_interleave(blocksize)[:q.numel]
    naive = (lowbit.NF4[codes] * scale).to(dtype).view(shape)          # the whole weight at once
    monkeypatch.setattr(nf4, "BLOCK_VALUES", 3 * blocksize)            # many blocks, odd ends
    whole = lowbit.dequantize_nf4(q)
    assert whole.dtype == dtype and torch.equal(whole, naive)
    assert torch.equal(lowbit.dequantize_nf4(q, torch.bfloat16), naive.to(torch.bfloat16))
    if len(shape) == 1:
        with pytest.raises(ValueError, match="2-D"):
            next(nf4.nf4_row_blocks(q))
        return
    for block_values in (1, 250, 10**6):                # a row, a few, the fewest (4)
        for out_dtype in (None, torch.float32, torch.bfloat16):
            blocks = [(r0, r1, rows.clone()) for r0, r1, rows in
                      nf4.nf4_row_blocks(q, out_dtype, block_values=block_values)]
            assert [b[0] for b in blocks] == [0] + [b[1] for b in blocks[:-1]]
            assert blocks[-1][1] == shape[0]
            assert torch.equal(torch.cat([b[2] for b in blocks]),
                               naive if out_dtype is None else naive.to(out_dtype))


@pytest.mark.parametrize("lead, autocast", [((7,), False), ((2, 5), False), ((3, 4), True)])
def test_qlora_forward_and_backward_are_a_dense_linears_on_the_dequantized_weight(
        lead, autocast, monkeypatch):
    from companion.lowbit import nf4
    monkeypatch.setattr(nf4, "BLOCK_VALUES", 1000)     # (160, 96): 10 rows a block, 16 blocks
    torch.manual_seed(0)
    layer = lowbit.QLoRALinear.from_linear(torch.nn.Linear(96, 160), rank=4, alpha=8)
    with torch.no_grad():
        layer.B.normal_()
    dense = torch.nn.Linear(96, 160)
    with torch.no_grad():
        dense.weight.copy_(lowbit.dequantize_nf4(layer.base))
        dense.bias.copy_(layer.bias)
    dense.requires_grad_(False)
    A, B = (p.detach().clone().requires_grad_() for p in (layer.A, layer.B))
    x = torch.randn(*lead, 96, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
        want = dense(x2) + (x2 @ A.T @ B.T) * layer.scale
    assert y.shape == (*lead, 160) and y.dtype == want.dtype
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(y.float(), want.float(), **tol)
    grad = torch.randn(y.shape).to(y.dtype)
    y.backward(grad)
    want.backward(grad)
    for got, ref in ((x.grad, x2.grad), (layer.A.grad, A.grad), (layer.B.grad, B.grad)):
        assert got.shape == ref.shape and torch.allclose(got, ref, **tol)
    with torch.no_grad():                                # no input gradient asked: none made
        assert torch.allclose(layer(x2.detach()), dense(x2) + (x2 @ A.T @ B.T) * layer.scale,
                              rtol=1e-5, atol=1e-5)


def test_a_qlora_step_holds_less_than_one_dense_fp32_weight_beyond_its_tensors():
    torch.manual_seed(0)
    width, tokens, rank = 1024, 64, 8
    layer = lowbit.QLoRALinear.from_linear(torch.nn.Linear(width, width), rank=rank)
    x = torch.randn(tokens, width, requires_grad=True)
    layer(x).sum().backward()                          # warm-up
    x.grad = None
    layer.zero_grad(set_to_none=True)
    with track("cpu") as t:
        layer(x).sum().backward()
    outputs = 4 * tokens * width * 2                   # y and x's gradient
    adapters = 4 * (2 * rank * width + 4 * tokens * rank)  # A, B's gradients, x·Aᵀ and its grad
    dense = 4 * width * width                          # one fp32 copy of the weight: 4 MiB
    assert outputs < t.peak < outputs + adapters + dense // 2, format_bytes(t.peak)


def test_qlora_says_what_input_it_takes():
    layer = lowbit.QLoRALinear.from_linear(torch.nn.Linear(32, 16), rank=2)
    with pytest.raises(ValueError, match=r"\(\.\.\., 32\)"):
        layer(torch.randn(4, 31))
    with pytest.raises(ValueError, match="in_features"):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(4, 32, dtype=torch.long))
    with pytest.raises(TypeError, match="floating-point"):
        layer([[0.0] * 32])


def test_against_bitsandbytes_measures_both_and_says_when_it_is_missing(monkeypatch, capsys):
    from companion.lowbit import versus
    v = versus.against_bitsandbytes(width=256, tokens=16, rank=4, params=8 * 4096, rounds=3)
    assert v.bitsandbytes == importlib.metadata.version("bitsandbytes")
    assert v.qlora_peak[0] > 0 and v.qlora_peak[1] > 4 * 256 * 256   # theirs: the dense weight
    assert v.qlora_peak_ratio == v.qlora_peak[0] / v.qlora_peak[1] < 1.1
    assert v.adam_params == 8 * 64 * 64 and 0 < v.state_bytes_ratio <= 1.0
    assert v.qlora_time.runs == v.adam_time.runs == (3, 3) and v.qlora_time.ratio > 0
    text = str(v)
    assert "QLoRA layer 256x256" in text and "Adam8bit, 32,768 parameters" in text
    with pytest.raises(ValueError, match="rounds"):
        versus.against_bitsandbytes(rounds=1)
    monkeypatch.setattr(versus, "_import_bitsandbytes", lambda: None)
    assert versus.against_bitsandbytes() is None
    assert "not installed" in capsys.readouterr().out


# ---------------------------------------------------------------- the estimator's count of these layouts

def test_the_estimator_counts_8_bit_states_kahan_and_nf4_as_measured():
    from companion import estimate
    weight = torch.nn.Parameter(torch.randn(256, 512))
    opt = lowbit.Adam8bit([weight])
    weight.grad = torch.randn_like(weight)
    opt.step()
    states = estimate.model_states(weight.numel(), state_bits=8)
    assert opt.state_bytes() == states.optimizer and states.total / weight.numel() == \
        pytest.approx(10.03, abs=0.01)                               # 4 + 4 + 2 x (1 + 4/256)
    assert estimate.model_states(weight.numel(), precision="bf16",
                                 state_bits=8).total / weight.numel() == pytest.approx(6.03, 0.01)
    w16 = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    kahan = lowbit.BF16AdamW([w16], compensation="kahan")
    w16.grad = torch.randn_like(w16)
    kahan.step()
    measured = sum(t.nbytes for t in kahan.state[w16].values() if torch.is_tensor(t))
    assert measured == estimate.model_states(w16.numel(), precision="bf16",
                                             compensation="kahan").optimizer == 6 * w16.numel()
    for n, dq in [(64 * 300 + 7, True), (4096, False), (10**5, True)]:
        q = lowbit.quantize_nf4(torch.randn(n), 64, double_quant=dq)
        assert estimate.nf4_bytes(n, double_quant=dq) == q.nbytes()
    with pytest.raises(ValueError, match="kahan"):
        estimate.model_states(10, compensation="kahan")              # fp32 needs no buffer
    with pytest.raises(ValueError, match="state_bits"):
        estimate.model_states(10, state_bits=4)


@pytest.mark.parametrize("layout, per_param", [
    ("fp32", 16), ("bf16+master", 16), ("bf16+master+main_grad", 18),
    ("bf16+master+fp32_grad_buffer", 20), ("bf16", 8),
    ("bf16+kahan", 10), ("fp32+adam8bit", None), ("bf16+adam8bit", None), ("qlora", None)])
def test_each_layout_holds_the_bytes_the_estimator_counts(layout, per_param):
    from companion import models
    from companion.lowbit import layouts
    x, y = models.make_tokens(4, 32, vocab=64, seed=0)
    make = lambda: models.GPT(64, 32, 64, 2, 4)
    got = layouts.measure(make, layout, x, y, rank=4)
    assert got == layouts.predict(make(), layout, rank=4)
    if per_param is not None:
        assert got.per_param == per_param
    with pytest.raises(ValueError, match="layout is one of"):
        layouts.measure(make, "fp8", x, y)


def test_8_bit_states_and_qlora_save_what_they_promise_at_size():
    from companion import models
    from companion.lowbit import layouts
    big = models.GPT(32000, 256, 1024, 8, 16, device="meta")
    per = {k: layouts.predict(big, k, rank=16).per_param for k in layouts.LAYOUTS}
    assert 10 < per["fp32+adam8bit"] < 10.05 and 6 < per["bf16+adam8bit"] < 6.05
    assert per["qlora"] < 0.2 * per["bf16"]                 # embeddings fp32, adapters trained


@pytest.mark.parametrize("code", [lowbit.dynamic_map(True), lowbit.dynamic_map(False), lowbit.NF4,
                                  lowbit.linear_map(True),
                                  torch.tensor([0.0, 0.5, 0.5 + 2**-12, 0.5 + 2**-11, 1.0])])  # 2 in a bin
def test_the_nearest_level_from_the_bf16_bin_table_is_the_binary_searchs(code):
    from companion.lowbit import blockwise
    ranked = code.sort().values
    middles = (ranked[1:] + ranked[:-1]) / 2
    x = torch.cat([torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 - 1,
                   ranked, middles, middles.nextafter(torch.tensor(2.0)),
                   middles.nextafter(torch.tensor(-2.0)), torch.tensor([0.0, -0.0])])
    assert torch.equal(blockwise._nearest(x, ranked), torch.bucketize(x, middles))
    assert (blockwise._bin_table(tuple(ranked.tolist())) is None) == (code.numel() == 5)
