"""Checks for chapter 05, mixed precision, in the notebook's order: the master-weight step, a
prediction of activation bytes under autocast, the loss-scale rule, and unscaling with inf/NaN
detection."""
from __future__ import annotations

import math
import numbers
import random

import torch

from companion import amp, estimate
from companion.amp.scaler import _float32
from companion.checks.core import (MEASURES_ACTIVATIONS, CheckFailed, call, compare, exercise,
                                   fresh_seeds, harness, require)
from companion.memory import format_bytes, track
from companion.models import MLP, make_classification

__all__ = ["check_master_step", "check_autocast_activation_bytes", "check_update_scale",
           "check_unscale_grads"]


# ---------------------------------------------------------------- exercise 1: master weights

def _master_setup(seed: int, width: int, dtype: torch.dtype):
    model = MLP(5, width, 2, 3, seed=seed).to(dtype)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.Adam(master, lr=1e-3)
    x, y = make_classification(17, 5, 3, seed=seed)
    return model, master, opt, x.to(dtype), y


def _master_observe(model, master) -> tuple:
    return ([p.detach().clone() for p in model.parameters()],
            [m.detach().clone() for m in master],
            [p.grad is not None for p in model.parameters()],
            [m.grad is not None for m in master])


@harness
def _master_run(answer, seed: int, width: int, dtype_name: str, steps: int) -> list:
    """`steps` steps with the answer as the step; what model and masters hold after each."""
    model, master, opt, x, y = _master_setup(seed, width, getattr(torch, dtype_name))
    seen = []
    for _ in range(steps):
        model.loss(x, y).backward()
        call(answer, model, master, opt)
        seen.append(_master_observe(model, master))
        if any(p.dtype != x.dtype for p in model.parameters()):
            break                                   # the check reports it; forward would fail
    return seen


def _master_reference(seed: int, width: int, dtype_name: str, steps: int) -> list:
    model, master, opt, x, y = _master_setup(seed, width, getattr(torch, dtype_name))
    helper = amp.MasterWeights(model.parameters())
    helper.master_params = master                   # the optimizer's tensors
    seen = []
    for _ in range(steps):
        model.loss(x, y).backward()
        helper.step(opt)
        seen.append(_master_observe(model, master))
    return seen


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _copy_back_hint(models: list, masters: list, dtype: torch.dtype) -> str | None:
    """None if every step's model is its masters rounded to 16 bits; else what went wrong."""
    rounded = [[m.to(dtype) for m in ms] for ms in masters]
    if all(_same(models[k], rounded[k]) for k in range(1, len(models))):
        return None
    if all(_same(models[k], models[0]) for k in range(1, len(models))):
        return ("copy the master weights back into the model after optimizer.step() (rounded to "
                "16 bits): the next forward runs on the model.")
    if all(_same(models[k], rounded[k - 1]) for k in range(1, len(models))):
        return "copy back after the step, not before: the model is one step behind."
    return "after optimizer.step(), copy each master into its 16-bit parameter: p.copy_(m)."


_LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation"


@exercise(points=2, timeout=20.0, reference="companion.amp.MasterWeights")
def check_master_step(answer) -> str:
    """answer(model, master_params, optimizer): one step of a 16-bit model whose optimizer holds
    fp32 master copies: gradients cast up onto the masters (16-bit ones freed), optimizer.step(),
    masters copied back into the model, fp32 gradients freed."""
    for seed, width, dtype_name in zip(fresh_seeds(2), [7, 12], ["bfloat16", "float16"]):
        dtype, steps = getattr(torch, dtype_name), 3
        try:
            got = _master_run(answer, seed, width, dtype_name, steps)
        except CheckFailed as failure:
            if _LEAF_IN_PLACE in failure.summary:
                failure.hint = ("write into parameters under `with torch.no_grad():` "
                                "(p.copy_(m)): autograd must not record the update.")
            raise
        want = _master_reference(seed, width, dtype_name, steps)
        model, master = _master_setup(seed, width, dtype)[:2]
        start = ([p.detach() for p in model.parameters()], [m.detach() for m in master])
        require(all(p.dtype == dtype for g in got for p in g[0]),
                f"after the step the model's parameters are "
                f"{sorted({str(p.dtype) for g in got for p in g[0]})}, not {dtype}",
                hint="copy into the 16-bit parameters (p.copy_(m) under torch.no_grad()); "
                     "do not replace them with the fp32 masters.")
        compare(tuple(got[0][1]), tuple(want[0][1]), name="master weights after one step",
                rtol=1e-5, atol=1e-7, known_wrong={
                    "the master weights did not move: set m.grad = p.grad.float() before "
                    "optimizer.step(), then copy master -> model (p.copy_(m)), never model -> "
                    "master.": tuple(start[1])})
        hint = _copy_back_hint([start[0]] + [g[0] for g in got], [start[1]] + [g[1] for g in got],
                               dtype)
        require(hint is None, "the 16-bit weights are not the master weights rounded to 16 bits",
                hint=hint or "")
        for step, (g, w) in enumerate(zip(got, want), start=1):
            compare(tuple(g[1]), tuple(w[1]), name=f"master weights after step {step}",
                    rtol=1e-5, atol=1e-7)
            require(not any(g[2]) and not any(g[3]),
                    f"after step {step}, gradients are still held: 16-bit on {sum(g[2])} model "
                    f"parameters, fp32 on {sum(g[3])} masters",
                    hint="free each 16-bit gradient once it is copied (p.grad = None) and the fp32 "
                         "ones after the step (m.grad = None): they cost 2 and 4 bytes/parameter.")
    return ("the fp32 masters take every update, the 16-bit model gets them rounded: "
            "2 + 2 + 12 bytes/parameter with Adam")


# ---------------------------------------------------------------- exercise 2: a prediction

def _mlp_variants(B: int, d_in: int, W: int, L: int, K: int) -> dict[str, int]:
    weights = (L - 1) * W * W + W * K
    ref = _reference_bytes(B, d_in, W, L, K)
    return {
        "half of fp32 is the notes' rule; autocast also saves 16-bit copies of the input and the "
        "weights, and the loss's log-softmax stays fp32.":
            estimate.mlp_activations(B, W, L, K, precision="bf16"),
        "under autocast the ReLU outputs are 16-bit (2 bytes), not fp32.":
            estimate.mlp_activations(B, W, L, K, precision="fp32"),
        "each Linear (but the first) also saves the 16-bit copy of its weight matrix that autocast "
        "made: 2 bytes per weight.": ref - 2 * weights,
        "the first Linear's input needs no gradient, so its weight copy is not saved for "
        "backward.": ref + 2 * d_in * W,
        "cross_entropy is on autocast's fp32 list: its log-softmax (batch · d_out) is saved in "
        "fp32, 4 bytes.": ref - 2 * B * K,
        "the first Linear saves the 16-bit copy of the input batch (batch · d_in · 2 bytes).":
            ref - 2 * B * d_in,
        "the ReLU's output and the next Linear's input are one tensor: count it once.":
            ref + 2 * L * B * W,
        "the 16-bit logits are not saved: cross_entropy casts them to fp32 and saves its "
        "log-softmax.": ref + 2 * B * K,
        "a Linear does not save its bias (its gradient is a sum of the output gradient).":
            ref + 2 * ((L - 1) * W + K),
        "`depth` counts hidden Linear-ReLU layers: depth ReLU outputs, depth + 1 Linears.":
            ref - 2 * B * W,
        "add the loss's one-value total weight, 4 bytes.": ref - 4,
    }


def _distinct_case(rng: random.Random) -> tuple[int, int, int, int, int]:
    """(batch, d_in, width, depth, d_out) at which the reference and every known-wrong count
    differ, so that a matching wrong answer gets its own hint."""
    while True:
        case = (rng.randint(2, 300), rng.randint(2, 64), rng.randint(2, 200), rng.randint(1, 6),
                rng.randint(2, 20))
        values = [_reference_bytes(*case), *_mlp_variants(*case).values()]
        if len(set(values)) == len(values):
            return case


def _reference_bytes(B: int, d_in: int, W: int, L: int, K: int) -> int:
    return estimate.mlp_activations(B, W, L, K, precision="autocast", d_in=d_in)


@exercise(points=1, reference=("companion.estimate.mlp_activations", *MEASURES_ACTIVATIONS))
def check_autocast_activation_bytes(answer) -> str:
    """answer(batch, d_in, width, depth, d_out) -> bytes that `MLP.loss` of an fp32 model saves for
    backward under 16-bit autocast, not counting its fp32 input batch and labels."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = [_distinct_case(rng) for _ in range(6)]
    for B, d_in, W, L, K in cases:
        got = call(answer, B, d_in, W, L, K)
        compare(got, _reference_bytes(B, d_in, W, L, K),
                name=f"bytes for batch={B}, d_in={d_in}, width={W}, depth={L}, d_out={K}",
                rtol=0.0, atol=0.0, known_wrong=_mlp_variants(B, d_in, W, L, K),
                hint="count per Linear what it saves, in 16 bits, then the loss's fp32 "
                     "log-softmax and its one-value total weight (4 bytes).")
        require(isinstance(got, numbers.Integral) and not isinstance(got, bool),
                f"got {got!r}, a {type(got).__name__}: bytes are a whole number",
                hint="return an int: multiply element counts by bytes per element (use // "
                     "rather than / if you divide).")
    B, d_in, W, L, K = cases[0]
    model = MLP(d_in, W, L, K)
    X, y = make_classification(B, d_in, K)
    with track("cpu") as t:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(X, y)
    measured = t.current - loss.untyped_storage().nbytes()
    return (f"predicted {format_bytes(call(answer, B, d_in, W, L, K))}, measured "
            f"{format_bytes(measured)} (batch {B}, d_in {d_in}, width {W}, depth {L}, d_out {K})")


# ---------------------------------------------------------------- exercise 3: the update rule

def _wrong_rule(kind: str):
    """A known-wrong version of `amp.update_scale`, positional like the learner's."""
    def rule(scale, tracker, found, growth_factor, backoff_factor, interval):
        if found and kind != "ignore_inf":
            scale = scale / backoff_factor if kind == "divide" else scale * backoff_factor
            return scale, (tracker if kind == "keep_count" else 0)
        clean = tracker + 1
        if kind == "every_step" or clean >= interval + (kind == "late"):
            if kind == "float64" or math.isfinite(_float32(scale * growth_factor)):
                return scale * growth_factor, (clean if kind == "no_reset" else 0)
            return scale, (clean if kind in ("no_reset", "ceiling_count") else 0)
        return scale, clean
    return rule


def _reference_rule(scale, tracker, found, growth_factor, backoff_factor, interval):
    return amp.update_scale(scale, tracker, found, growth_factor=growth_factor,
                            backoff_factor=backoff_factor, growth_interval=interval)


def _trajectory(rule, start: float, flags: list[bool], factors: tuple) -> list[tuple]:
    scale, tracker, out = start, 0, []
    for found in flags:
        got = rule(scale, tracker, found, *factors)
        require(isinstance(got, (tuple, list)) and len(got) == 2,
                f"expected (new_scale, new_growth_tracker), got {got!r}"[:200],
                hint="return two values: `return scale, growth_tracker`.")
        scale, tracker = got
        out.append((scale, tracker))
    return out


_WRONG = {
    "after an inf/NaN the count of clean steps starts again at 0.": "keep_count",
    "a step with inf/NaN gradients means the scale is too large: multiply it by backoff_factor.":
        "ignore_inf",
    "grow only after growth_interval clean steps in a row, not after every one.": "every_step",
    "grow when the count reaches growth_interval (count + 1 == growth_interval), "
    "not one step later.": "late",
    "reset the count to 0 when the scale grows, or it grows again on every next step.": "no_reset",
    "the scale is stored in float32 (largest 3.4e38): if the grown scale would be inf there, "
    "keep the old one.": "float64",
    "back off by multiplying by backoff_factor: dividing by it doubles the scale.": "divide",
    "reset the count to 0 whenever it reaches growth_interval, even when float32's ceiling "
    "stops the growth.": "ceiling_count",
}


@exercise(points=1, reference=("companion.amp.update_scale",
                               "companion.checks.ch05._wrong_rule",
                               "torch._amp_update_scale_"))
def check_update_scale(answer) -> str:
    """answer(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    -> (new_scale, new_growth_tracker): one step of GradScaler's dynamic loss-scale rule."""
    rng = random.Random(fresh_seeds(1)[0])
    configs = [(2.0**16, (2.0, 0.5, rng.randint(2, 6)), 0.15, 80),
               (2.0**10, (1.5, 0.25, rng.randint(3, 5)), 0.1, 60),
               (1.0, (2.0, 0.5, 1), 0.3, 30),
               (2.0**126, (2.0, 0.5, 2), 0.0, 8)]          # grows into float32's ceiling
    backoffs = growths = 0
    for start, factors, p_inf, n in configs:
        flags = [rng.random() < p_inf for _ in range(n)]
        want = _trajectory(_reference_rule, start, flags, factors)
        got = _trajectory(lambda *a: call(answer, *a), start, flags, factors)
        label = (f"(scale, growth_tracker) after each of {n} steps, starting at {start:g}, "
                 f"factors {factors}, found_inf by step: "
                 f"{''.join('I' if f else '.' for f in flags)}")
        compare([s for s, _ in got], [s for s, _ in want], name=f"scales {label}", rtol=1e-6,
                known_wrong={hint: [s for s, _ in _trajectory(_wrong_rule(kind), start, flags,
                                                             factors)]
                             for hint, kind in _WRONG.items()})
        compare([t for _, t in got], [t for _, t in want], name=f"growth_tracker {label}",
                known_wrong={hint: [t for _, t in _trajectory(_wrong_rule(kind), start, flags,
                                                             factors)]
                             for hint, kind in _WRONG.items()})
        backoffs += sum(flags)
        growths += sum(b > a for (a, _), (b, _) in zip([(start, 0)] + want, want))
    return (f"same scale and count as torch.amp.GradScaler's rule over {backoffs} backoffs and "
            f"{growths} growths")


# ---------------------------------------------------------------- exercise 4: unscale, find infs

def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (13,), (3, 2, 3), (1,)]
    out = [torch.randn(s, generator=g) * 2.0**12 for s in shapes]
    out[1] = out[1].bfloat16()                               # mixed dtypes, as in a real model
    return out


def _flag(value) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise CheckFailed(f"expected found_inf as a bool (or a one-element tensor), got "
                          f"{type(value).__name__}", hint="return whether any gradient held an "
                                                          "inf or NaN, e.g. `return found_inf`.")
    return bool(value)


@harness
def _unscale_run(answer, seed: int, inv_scale: float, where, value) -> tuple:
    """The answer's flag, and the gradients the optimizer would then read from p.grad."""
    grads = _grads(seed)
    if isinstance(value, tuple):                   # two entries, at two different positions
        flat = grads[where].view(-1)
        flat[0], flat[flat.numel() - 1] = value
    elif where is not None:
        grads[where].view(-1)[seed % grads[where].numel()] = value
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    found = call(answer, [p.grad for p in params], torch.tensor(inv_scale))
    return found, [p.grad for p in params]


@exercise(points=2, reference=("companion.amp.unscale_grads_",
                               "companion.amp.GradScaler",
                               "torch._amp_foreach_non_finite_check_and_unscale_"))
def check_unscale_grads(answer) -> str:
    """answer(grads, inv_scale) -> found_inf: multiply every gradient by inv_scale (a 0-d tensor)
    in place and say whether any of them held an inf or NaN."""
    poisons = [(None, None), (3, math.inf), (2, -math.inf), (1, math.nan), (0, math.nan)]
    for seed in fresh_seeds(2):
        for inv_scale in (2.0**-12, 2.0**-7):
            for where, value in poisons:
                found, grads = _unscale_run(answer, seed, inv_scale, where, value)
                _judge_flag(_flag(found), where, value)
                if where is not None:
                    _require_all_unscaled(grads, seed, inv_scale, where, value)
                if where is None:
                    originals = _grads(seed)
                    expected = [g.clone() for g in originals]
                    amp.unscale_grads_(expected, torch.tensor(inv_scale))
                    compare(tuple(grads), tuple(expected), name="p.grad after unscaling",
                            known_wrong={
                                "unscale in place (g.mul_(inv_scale)): the optimizer reads the "
                                "same tensors in p.grad; new tensors would not reach it.":
                                    tuple(originals),
                                "multiply by inv_scale = 1/scale: backward made the gradients "
                                "scale times too large.": tuple(g / inv_scale for g in originals),
                            })
        for where in (0, 1):                     # fp32 and bf16: finite, but x2 overflows
            big = torch.finfo(_grads(seed)[where].dtype).max / 1.5
            found, _ = _unscale_run(answer, seed, 2.0, where, big)
            require(not _flag(found), f"found_inf is True for a finite gradient ({big:.3g} in "
                    f"gradient {where}) unscaled with inv_scale = 2 (a scale below 1)",
                    hint="look before you multiply: check each gradient for inf and NaN first, "
                         "then multiply, as PyTorch's kernel does (with inv_scale > 1 the product "
                         "of a finite gradient can itself be inf).")
        big = torch.finfo(torch.float32).max / 1.5                  # finite; two of them sum to inf
        found, _ = _unscale_run(answer, seed, 2.0**-8, 0, (big, big))
        require(not _flag(found), f"found_inf is True, but every gradient is finite (two entries of "
                f"{big:.3g} in gradient 0, whose sum overflows to inf)",
                hint="a sum of finite gradients can overflow: test the elements "
                     "(torch.isfinite(g).all()), not their sum.")
        found, _ = _unscale_run(answer, seed, 2.0**-8, 2, (math.inf, -math.inf))
        require(_flag(found), "found_inf is False, but gradient 2 holds an inf and a -inf",
                hint="inf + (-inf) is NaN, not inf: a test on a sum misses it (and a finite sum "
                     "can overflow); test the elements: (~torch.isfinite(g)).any().")
    return ("every gradient unscaled in place, the ones after an inf too; inf, -inf and NaN found "
            "element by element in any tensor, finite sums that overflow not flagged")


def _require_all_unscaled(grads, seed: int, inv_scale: float, where, value) -> None:
    """After an inf or NaN, every gradient is still unscaled, as PyTorch's kernel does."""
    expected = _grads(seed)
    expected[where].view(-1)[seed % expected[where].numel()] = value
    amp.unscale_grads_(expected, torch.tensor(inv_scale))
    for i, (got, want) in enumerate(zip(grads, expected)):
        same = isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(
            got.float().nan_to_num(), want.float().nan_to_num())
        require(same, f"gradient {i} is not unscaled after gradient {where} held a non-finite value",
                hint="unscale every gradient even after finding an inf or NaN, as PyTorch's kernel "
                     "does: whoever reads them next (a clip, a log of the norm) expects them "
                     "unscaled. Do not return early.")


def _judge_flag(found: bool, where, value) -> None:
    if where is None:
        require(not found, "found_inf is True but every gradient is finite",
                hint="flag only inf and NaN: (~torch.isfinite(g)).any().")
        return
    kind = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    require(found, f"found_inf is False, but gradient {where} holds a {kind}",
            hint="NaN counts too: torch.isfinite is False for inf, -inf and NaN (isinf misses "
                 "NaN)." if kind == "NaN" else
                 "look at every gradient tensor, not only the first, and at every element.")


# ---------------------------------------------------------------- FP8 with a scale

def _fp8_cases(seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, x, amax): the tensor's own amax, a delayed amax 4x too small (a spike), values that
    land between 448 and the overflow limit, amax 0 and inf, bf16 input, every sign."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 19, generator=g) * 3.0
    own = x.abs().max()
    near = torch.tensor([455.0, -460.0, 463.9, 464.1, -470.0, 100.0, 1.0])   # at scale 1
    return [("its own amax", x, own),
            ("an amax from earlier steps, 4x below this tensor's (a spike)", x, own / 4),
            ("an amax of 448 (scale 1) on values from 1 to 470 of both signs", near,
             torch.tensor(448.0)),
            ("an amax of 0 (nothing to scale by)", x, torch.tensor(0.0)),
            ("an amax of inf", x, torch.tensor(math.inf)),
            ("a bf16 tensor and its own amax", x.bfloat16(), x.bfloat16().abs().max().float())]


def _as_scale(value) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckFailed(f"expected the scale as a number (or a one-element tensor), got "
                          f"{type(value).__name__}", hint="return (codes, scale, overflows).")
    return float(value)


@exercise(points=2, reference=("companion.scaling.quantize", "companion.scaling.amax_scale",
                               "companion.scaling.overflow_limit",
                               "companion.scaling.DelayedScaling"))
def check_to_e4m3(answer) -> str:
    """answer(x, amax) -> (codes, scale, overflows): x times the scale that maps amax onto e4m3's
    largest value, cast to float8_e4m3fn, and how many values the cast could not represent."""
    from companion import scaling
    for seed in fresh_seeds(2):
        for what, x, amax in _fp8_cases(seed):
            out = call(answer, x.clone(), amax.clone())
            require(isinstance(out, tuple) and len(out) == 3,
                    f"expected (codes, scale, overflows), got {type(out).__name__}",
                    hint="return three things: the float8 tensor, the scale, the count.")
            codes, scale, overflows = out
            want_scale = float(scaling.amax_scale(amax, "e4m3"))
            got_scale = _as_scale(scale)
            if not math.isclose(got_scale, want_scale, rel_tol=1e-6):
                _wrong_scale(got_scale, want_scale, amax, x, what)
            require(isinstance(codes, torch.Tensor) and codes.dtype == torch.float8_e4m3fn
                    and codes.shape == x.shape,
                    f"with {what}: codes should be a float8_e4m3fn tensor of shape "
                    f"{tuple(x.shape)}, got "
                    f"{codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__}",
                    hint="cast x * scale with .to(torch.float8_e4m3fn).")
            # From the answer's own scale: one ulp of the scale apart (448 / amax rounded once or
            # twice) moves products that sit on an e4m3 midpoint, common for bf16 inputs.
            want_codes, want_over = scaling.quantize(x, got_scale, "e4m3")
            require(torch.equal(codes.float(), want_codes.float()),
                    f"with {what}: the codes differ from x * scale cast to e4m3",
                    hint="multiply in float32 (x.float() * scale), then cast.")
            require(isinstance(overflows, numbers.Integral) or (
                isinstance(overflows, torch.Tensor) and overflows.numel() == 1),
                f"expected the overflow count as an int, got {type(overflows).__name__}")
            got_over = int(overflows)
            if got_over != want_over:
                _wrong_overflows(got_over, want_over, x, got_scale, what)
    return ("scales from the amax you are given, overflows counted before the saturating cast, "
            "at the limit round-to-nearest really has")


def _wrong_scale(got: float, want: float, amax, x, what: str) -> None:
    hint = "the scale multiplies x so that amax lands on e4m3's largest value."
    own = float(_own_amax(x))
    if want and math.isclose(got, 1 / want, rel_tol=1e-6):
        hint = "the scale is 448 / amax, a multiplier, not amax / 448."
    elif not (float(amax) > 0 and math.isfinite(float(amax))):
        hint = ("with an amax of 0 or inf there is nothing to scale by: use a scale of 1, as "
                "Transformer Engine does, rather than inf or 0.")
    elif own and math.isclose(got, 448.0 / own, rel_tol=1e-6):
        hint = ("use the amax you are given, not the tensor's own: delayed scaling's amax comes "
                "from earlier steps, and the whole point is not to look at this tensor first.")
    raise CheckFailed(f"with {what}: scale {got:.6g}, expected {want:.6g}", hint=hint)


def _own_amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().abs().max()


def _wrong_overflows(got: int, want: int, x, scale: float, what: str) -> None:
    scaled = (x.float() * scale).abs()
    hint = "count the values of x * scale the cast cannot bring into e4m3's range."
    if got == 0 and want > 0:
        hint = ("count before the cast: torch's float8_e4m3fn cast saturates at 448 (even inf "
                "becomes 448), so after it nothing looks too large.")
    elif got == int((scaled > 448).sum()):
        hint = ("a value a little above 448 still rounds to 448, the nearest e4m3 value: where "
                "does round-to-nearest stop reaching it? (The next step above 448 would be 480.)")
    elif got == int(((x.float() * scale) >= 464).sum()):
        hint = "overflow is about magnitude: large negative values overflow too."
    raise CheckFailed(f"with {what}: {got} overflows counted, expected {want}", hint=hint)
