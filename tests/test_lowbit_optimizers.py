"""The optimizers of companion.lowbit that keep fewer bits, against fp32 Adam over runs long
enough to show what rounding loses: BF16AdamW's moments (`moments=`) and Adam8bit on bf16
weights (`stochastic_round=`)."""
import copy

import pytest
import torch

from companion import lowbit


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one thread is as fast, and on a loaded 2-core machine two OpenMP threads
    that wait for each other make every operator many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- BF16AdamW's moments

def _direction(m, v, t, betas=(0.9, 0.999)):
    """|m̂| / √v̂ per value: the size of Adam's step over lr, read from the moments."""
    return (m / (1 - betas[0] ** t)).abs() / (v / (1 - betas[1] ** t)).sqrt()


def _shrinking_gradients(n=2048, steps=4000, shrink_at=1000, seen=(1500, 4000)):
    """fp32 AdamW and BF16AdamW with moments "nearest" and "stochastic" fed the same gradients,
    20x smaller after step `shrink_at`: {name: {step: (median v, median |m̂|/√v̂)}}."""
    torch.manual_seed(0)                                  # the stochastic rounding's draws
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(n, generator=g).bfloat16()
    params = {"fp32": torch.nn.Parameter(w0.float())}
    opts = {"fp32": torch.optim.AdamW([params["fp32"]], lr=1e-3, weight_decay=0.0)}
    for moments in ("nearest", "stochastic"):
        params[moments] = torch.nn.Parameter(w0.clone())
        opts[moments] = lowbit.BF16AdamW([params[moments]], lr=1e-3, weight_decay=0.0,
                                         compensation="stochastic", moments=moments)
    seen_at = {name: {} for name in opts}
    for t in range(1, steps + 1):
        grad = torch.randn(n, generator=g) * (1.0 if t <= shrink_at else 0.05)
        for name, p in params.items():
            p.grad = grad.to(p.dtype)
            opts[name].step()
            if t in seen:
                state = opts[name].state[p]
                m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
                seen_at[name][t] = (float(v.median()), float(_direction(m, v, t).median()))
    return seen_at


def test_stochastic_moments_track_fp32_adam_where_nearest_ones_stall():
    """β2 = 0.999 decays v by 0.1% a step, under half of bf16's spacing: written back to nearest,
    v stays at the size of the old gradients after they shrink 20x; written back stochastically it
    follows fp32 AdamW's (measured: ratios 1.00 at steps 1500 and 4000, nearest 1.7 and 19.8)."""
    runs = _shrinking_gradients()
    for t in (1500, 4000):
        (v32, d32), (v_sr, d_sr) = runs["fp32"][t], runs["stochastic"][t]
        assert abs(v_sr / v32 - 1) < 0.2, f"step {t}: median v {v_sr:.3e}, fp32 {v32:.3e}"
        assert abs(d_sr / d32 - 1) < 0.2, f"step {t}: median |update|/lr {d_sr}, fp32 {d32}"
    (v32, d32), (v_rn, d_rn) = runs["fp32"][4000], runs["nearest"][4000]
    assert v_rn / v32 > 5, f"nearest: median v {v_rn:.3e} should have stalled above {v32:.3e}"
    assert d_rn / d32 < 0.5                                  # the steps stay too small


def test_fp32_moments_cost_4_bytes_more_and_survive_a_checkpoint():
    def make(moments):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 65).bfloat16())
        return w, lowbit.BF16AdamW([w], lr=1e-2, moments=moments)

    def train(w, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            w.grad = torch.randn(w.shape, generator=g).bfloat16()
            opt.step()

    def moment_bytes(opt):
        return sum(t.numel() * t.element_size() for s in opt.state.values()
                   for k, t in s.items() if k in ("exp_avg", "exp_avg_sq"))

    (w, opt), (w16, opt16) = make("fp32"), make("stochastic")
    train(w, opt, 3, seed=1)
    train(w16, opt16, 3, seed=1)
    assert opt.state[w]["exp_avg_sq"].dtype == torch.float32
    assert opt16.state[w16]["exp_avg_sq"].dtype == torch.bfloat16
    assert moment_bytes(opt) - moment_bytes(opt16) == 4 * w.numel()
    twin, resumed = make("fp32")
    twin.data.copy_(w.detach())
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))       # as torch.save + torch.load
    assert resumed.state[twin]["exp_avg_sq"].dtype == torch.float32    # not cast to bf16
    train(w, opt, 3, seed=2)
    train(twin, resumed, 3, seed=2)
    assert torch.equal(w, twin)
    assert torch.equal(opt.state[w]["exp_avg_sq"], resumed.state[twin]["exp_avg_sq"])


def test_bf16_adamw_says_which_moments_it_knows():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="moments is one of"):
        lowbit.BF16AdamW([w], moments="bf16")
    with pytest.raises(TypeError):
        lowbit.BF16AdamW([w], 1e-3, (0.9, 0.999), 1e-8, 0.0, "none", "nearest")  # keyword-only
    assert lowbit.BF16AdamW([w]).param_groups[0]["moments"] == "stochastic"


# ---------------------------------------------------------------- Adam8bit on bf16 weights

def _regression(kind, steps=200, lr=1e-3):
    """A (64, 128) weight (8-bit states: 8192 values) pulled 0.05 away from where it starts, with
    updates mostly under half of bf16's spacing at |w| ~ 1. kind: "fp32" (torch.optim.Adam),
    "nearest" or "stochastic" (Adam8bit on bf16). Returns (final loss, mean fraction of weights a
    step leaves unchanged, fraction never moved)."""
    g = torch.Generator().manual_seed(0)
    x, w0 = torch.randn(256, 64, generator=g), torch.randn(64, 128, generator=g).bfloat16()
    y = x @ (w0.float() + 0.05 * torch.randn(64, 128, generator=g))
    w = torch.nn.Parameter(w0.float() if kind == "fp32" else w0.clone())
    opt = (torch.optim.Adam([w], lr=lr) if kind == "fp32" else
           lowbit.Adam8bit([w], lr=lr, stochastic_round=kind == "stochastic"))
    torch.manual_seed(0)
    unchanged = []
    for _ in range(steps):
        opt.zero_grad()
        ((x @ w.float() - y) ** 2).mean().backward()
        before = w.detach().clone()
        opt.step()
        unchanged.append(float((w.detach() == before).float().mean()))
    loss = float(((x @ w.detach().float() - y) ** 2).mean())
    return loss, sum(unchanged) / steps, float((w.detach() == w0.to(w.dtype)).float().mean())


def test_stochastic_rounding_trains_the_bf16_weights_that_nearest_freezes():
    """Measured: final loss fp32 Adam 3.9e-4, stochastic 1.3e-3, nearest 0.108; weights never
    moved in 200 steps 3.5% against 61%; unchanged per step 84% against 93% (a stochastically
    rounded weight moves rarely, by a whole spacing: per step most stay put, but none for good)."""
    fp32, _, _ = _regression("fp32")
    near, near_unchanged, near_never = _regression("nearest")
    sr, sr_unchanged, sr_never = _regression("stochastic")
    assert near_never > 0.4 and sr_never < 0.1, (near_never, sr_never)
    assert sr_unchanged < near_unchanged
    assert sr - fp32 < 0.1 * (near - fp32), f"losses: fp32 {fp32}, stochastic {sr}, nearest {near}"


def test_stochastic_round_leaves_fp32_weights_alone_and_refuses_fp16():
    def run(stochastic_round):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(8192))
        opt = lowbit.Adam8bit([w], lr=1e-3, stochastic_round=stochastic_round)
        for i in range(3):
            w.grad = torch.randn(8192, generator=torch.Generator().manual_seed(i))
            opt.step()
        return w.detach()

    assert torch.equal(run(True), run(False))                  # fp32 keeps every update
    with pytest.raises(TypeError, match="bf16"):
        lowbit.Adam8bit([torch.nn.Parameter(torch.ones(8, dtype=torch.float16))],
                        stochastic_round=True)


def test_the_6_byte_layout_rounds_its_bf16_weights_stochastically():
    from companion import models
    from companion.lowbit import layouts
    for layout, wanted in (("bf16+adam8bit", True), ("fp32+adam8bit", False)):
        _, _, opt, _ = layouts._setup(models.GPT(64, 16, 32, 1, 2), layout, 8, 1e-3)
        assert isinstance(opt, lowbit.Adam8bit)
        assert opt.param_groups[0]["stochastic_round"] is wanted, layout


# ---------------------------------------------------------------- block-wise codes

def test_codes_index_the_map_as_given_when_it_is_not_sorted():
    """The fast path works on ranks of the sorted levels; a shuffled map must get its own
    indices back: the same values as with the sorted map, and codes that differ."""
    code = lowbit.dynamic_map(True)
    shuffled = code[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * torch.logspace(-5, 0, 5000)
    sorted_codes, absmax = lowbit.quantize_blockwise(x, code, 256)
    codes, absmax2 = lowbit.quantize_blockwise(x, shuffled, 256)
    assert torch.equal(absmax, absmax2) and not torch.equal(codes, sorted_codes)
    assert torch.equal(lowbit.dequantize_blockwise(codes, absmax, shuffled, 256),
                       lowbit.dequantize_blockwise(sorted_codes, absmax, code, 256))
