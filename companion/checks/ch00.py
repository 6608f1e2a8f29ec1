"""Checks for chapter 00, the anatomy of memory, in the notebook's order: Adam's step and its
state, model states per parameter in five layouts, the activations of an MLP (predicted, then
measured with `companion.memory.track`), and the activations of any GPT (Korthikanti et al.)."""
from __future__ import annotations

import math
import numbers
import operator
import random

import torch

from companion import estimate, optim
from companion.checks.core import (MEASURES_ACTIVATIONS, CheckFailed, call, call_inplace, compare,
                                   exercise, fresh_seeds, harness, require)
from companion.memory import format_bytes, track
from companion.models import MLP, make_classification

__all__ = ["check_adam_step", "check_model_state_bytes", "check_activation_bytes",
           "check_transformer_activations"]


def _number(got, name: str) -> int:
    """The learner's answer as a whole number of bytes: any integer (NumPy's too), or a float that
    holds a whole number; otherwise a CheckFailed that says what was wrong."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise CheckFailed(f"{name}: expected a number of bytes (an int), got "
                          f"{type(got).__name__} {got!r:.60}",
                          got=got, hint="return the count itself, e.g. `return total`.")
    if isinstance(got, numbers.Integral):
        return operator.index(got)                           # np.int64(96) -> 96
    if math.isnan(got):
        raise CheckFailed(f"{name} is NaN", got=got, hint="count bytes with integers.")
    if math.isfinite(got) and abs(got - round(got)) <= 16 * math.ulp(got):
        return int(round(got))                               # / left a rounding error behind
    if not math.isfinite(got) or not float(got).is_integer():
        raise CheckFailed(f"{name}: expected a whole number of bytes, got {got!r}", got=got,
                          hint="a byte count is a whole number: divide with // (integer "
                               "division), not /, or round the result.")
    return int(got)


# ---------------------------------------------------------------- exercise 1: Adam's step

_ADAM_STEPS = 5


def _adam_inputs(seed: int, shape: tuple, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    grads = [(0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
             for _ in range(_ADAM_STEPS)]
    return param, grads


def _plain(value):
    """A state entry as plain data the grader can carry back."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (bool, int, float)):
        return value
    return repr(value)[:80]


@harness
def _adam_run(answer, seed: int, shape: tuple, dtype: torch.dtype, lr: float,
              betas: tuple, eps: float) -> tuple:
    """Five steps of the answer on one parameter; (the parameter, {state key: value})."""
    param, grads = _adam_inputs(seed, shape, dtype)
    state: dict = {}
    for grad in grads:                  # param and state are the answer's own: it steps them
        call_inplace(answer, param, grad, state, lr, betas, eps)
    keys = state.keys() if isinstance(state, dict) else ()
    return param, {str(k): _plain(state[k]) for k in keys}


def _adam_variant(seed: int, shape: tuple, dtype: torch.dtype, lr: float, betas: tuple,
                  eps: float, *, mistake: str = "") -> torch.Tensor:
    """The parameter after five steps of Adam, or of Adam with one usual mistake."""
    param, grads = _adam_inputs(seed, shape, dtype)
    if not mistake:
        state: dict = {}
        for grad in grads:
            optim.adam_step(param, grad, state, lr=lr, betas=betas, eps=eps)
        return param
    (b1, b2), m, v = betas, torch.zeros_like(param), torch.zeros_like(param)
    for t, g in enumerate(grads, start=1):
        if mistake == "state not kept":
            m, v, t = torch.zeros_like(param), torch.zeros_like(param), 1
        m = g if mistake == "no momentum" else b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * (g.abs() if mistake == "v of |g|" else g * g)
        t += mistake == "t one too many"
        c1, c2 = (1.0, 1.0) if mistake == "no bias correction" else (1 - b1**t, 1 - b2**t)
        denom = ((v / c2 + eps).sqrt() if mistake == "eps in sqrt" else (v / c2).sqrt() + eps)
        if mistake == "eps before correction":        # the paper's faster form, eps on sqrt(v)
            denom = (v.sqrt() + eps) * c2**-0.5
        if mistake == "adamw":                         # AdamW's default weight decay, 0.01
            param = param * (1 - lr * 0.01)
        param = param - lr * (m / c1) / denom
    return param


_ADAM_MISTAKES = {
    "bias correction: divide m by 1 − β1^t and v by 1 − β2^t (t counts steps from 1); without "
    "it the first steps are far too small.": "no bias correction",
    "v is the running mean of g², the squared gradient (grad * grad), not of |g|.": "v of |g|",
    "ε goes outside the square root: m̂ / (√v̂ + ε).": "eps in sqrt",
    "the update uses m, the running mean of the gradient, not the gradient itself.":
        "no momentum",
    "keep m, v and the step count in `state` between calls: on the first call create them "
    "there, on the next ones update those same tensors.": "state not kept",
    "t is the number of steps taken, this one included: 1 at the first step. Add 1 to "
    "state[\"step\"] once per step, before the bias correction uses it.": "t one too many",
    "add ε to √v̂, the root of the bias-corrected v (PyTorch's form), not to √v before the "
    "correction (the paper's faster variant, which differs while ε matters).":
        "eps before correction",
    "that is AdamW's decoupled weight decay (0.01 by default): plain Adam, as here, has none.":
        "adamw",
}


@exercise(points=2, timeout=20.0, reference=("companion.optim.adam_step",
                                             "companion.optim.Adam",
                                             "companion.lowbit.adam8bit.adam_direction"))
def check_adam_step(answer) -> str:
    """answer(param, grad, state, lr, betas, eps): one Adam step, param and state in place."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = [((7, 5), torch.float32, 1e-3, (0.9, 0.999), 1e-8),
             ((13,), torch.float64, 0.05, (0.8, 0.99), 1e-6),
             ((3, 1, 4), torch.float32, 0.1, (0.5, 0.9), 1e-3)]
    for shape, dtype, lr, betas, eps in cases:
        seed = rng.randrange(2**31)
        before, _ = _adam_inputs(seed, shape, dtype)
        expected = _adam_variant(seed, shape, dtype, lr, betas, eps)
        wrong = {hint: _adam_variant(seed, shape, dtype, lr, betas, eps, mistake=m)
                 for hint, m in _ADAM_MISTAKES.items()}
        got, state = _adam_run(answer, seed, shape, dtype, lr, betas, eps)
        require(isinstance(got, torch.Tensor) and got.shape == before.shape
                and not torch.equal(got, before),
                "the parameter did not change: update it in place",
                hint="param.sub_(...) or param -= ... changes the tensor the model holds; "
                     "param = param - ... only rebinds a local name.")
        require(bool(state), "state is still empty after five steps",
                hint='keep m, v and the step count in `state` between calls: state["exp_avg"], '
                     'state["exp_avg_sq"], state["step"], made on the first call.')
        for key in ("exp_avg", "exp_avg_sq"):
            value = state.get(key)
            require(isinstance(value, torch.Tensor) and value.shape == before.shape
                    and value.dtype == dtype,
                    f"state[{key!r}] should be a tensor of the parameter's shape and dtype "
                    f"{tuple(before.shape)} {dtype}; got {_short(value)}",
                    hint='name the moments as torch.optim.Adam does: state["exp_avg"] (m) and '
                         'state["exp_avg_sq"] (v), made with torch.zeros_like(param).')
        step = state.get("step")
        step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        require(step == _ADAM_STEPS, f'state["step"] should be {_ADAM_STEPS} after '
                f"{_ADAM_STEPS} steps; got {_short(step)}",
                hint='count the steps in state["step"]: 0 before the first, + 1 at each step.')
        compare(got, expected, name=f"the parameter after {_ADAM_STEPS} steps "
                f"(lr={lr}, betas={betas}, eps={eps}, {dtype})", known_wrong=wrong)
    return ("Adam matches the reference; its state is m and v, each the parameter's size: "
            "8 bytes per fp32 parameter (+ a step count)")


def _short(value) -> str:
    text = f"{type(value).__name__} {tuple(value.shape)} {value.dtype}" if isinstance(
        value, torch.Tensor) else repr(value)
    return text[:80]


# ---------------------------------------------------------------- exercise 2: model states

LAYOUTS = {"fp32": ("fp32", {}), "autocast": ("autocast", {}), "master": ("mixed", {}),
           "master_fp32_grads": ("mixed", {"fp32_grads": True}),
           "master_grad_buffer": ("mixed", {"fp32_grad_buffer": True})}


def _state_reference(n: int, optimizer: str, layout: str) -> tuple[int, int, int]:
    precision, options = LAYOUTS[layout]
    s = estimate.model_states(n, optimizer=optimizer, precision=precision, **options)
    return s.params, s.grads, s.optimizer


_MASTER_GRADS = {"master": 2, "master_fp32_grads": 4, "master_grad_buffer": 2 + 4}   # B/param


def _state_mistakes(n: int, k: int, layout: str) -> dict[str, tuple]:
    """What the usual mistakes give, for a layout and k state tensors per parameter."""
    master = layout.startswith("master")
    return {
        "the 16-bit model's optimizer steps an fp32 master copy of the weights: 4 bytes per "
        "parameter, counted in the optimizer state (ZeRO's K).": (2 * n, 2 * n, 4 * k * n)
        if layout == "master" else None,
        "16-bit weights do not make 16-bit optimizer state: the master weights and the moments "
        "stay fp32.": (2 * n, 2 * n, 2 * k * n) if master else None,
        "torch.amp keeps the parameters and their .grad in fp32: the 16-bit copies autocast "
        "makes are saved for backward, activations, not model states.":
            (2 * n, 2 * n, (4 + 4 * k) * n) if layout == "autocast" else None,
        "fp32 gradients replace the 16-bit ones (4 bytes, not 2 + 4).":
            (2 * n, 6 * n, (4 + 4 * k) * n) if layout == "master_fp32_grads" else None,
        "the fp32 buffer sits beside the 16-bit gradients, it does not replace them: 2 + 4 "
        "bytes.": (2 * n, 4 * n, (4 + 4 * k) * n) if layout == "master_grad_buffer" else None,
        "Adam keeps two tensors per parameter: the mean (m) and the mean of squares (v) of the "
        "gradient.": (4 * n, 4 * n, 4 * n) if layout in ("fp32", "autocast") and k == 2 else None,
        "the same total, split the other way: Hugging Face's pages count the fp32 master copy "
        "with the parameters (2 + 4 = 6 bytes); this exercise follows ZeRO, which counts it in "
        "the optimizer state: params = the 16-bit weights only (2 bytes).":
            (6 * n, _MASTER_GRADS.get(layout, 0) * n, 4 * k * n) if master else None,
        "torch.amp's 16-bit weight copies are made inside each matmul and freed in backward: "
        "they are counted with the activations, so the parameters stay 4 bytes, not 4 + 2.":
            (6 * n, 4 * n, 4 * k * n) if layout == "autocast" else None,
    }


@exercise(points=2, reference="companion.estimate.model_states")
def check_model_state_bytes(answer) -> str:
    """answer(n_params, optimizer, layout) -> (params, grads, optimizer_state) bytes, for
    optimizer in "sgd", "sgd_momentum", "adam" and layout in LAYOUTS."""
    for n in (random.Random(s).randint(10**3, 10**9) for s in fresh_seeds(2)):
        for optimizer, k in (("sgd", 0), ("sgd_momentum", 1), ("adam", 2)):
            for layout in LAYOUTS:
                expected = _state_reference(n, optimizer, layout)
                wrong = {hint: value for hint, value in _state_mistakes(n, k, layout).items()
                         if value is not None and value != expected}
                got = call(answer, n, optimizer, layout)
                require(isinstance(got, (tuple, list)) and len(got) == 3,
                        f"expected a tuple (params, grads, optimizer_state), got {got!r}"[:200],
                        hint="return three byte counts, e.g. `return p, g, o`.")
                got = tuple(_number(x, "a byte count") for x in got)
                compare(got, expected, name=f"(params, grads, optimizer_state) for {optimizer}, "
                        f"{layout}", known_wrong=wrong)
    per = {layout: estimate.model_states(1, precision=p, **o).total
           for layout, (p, o) in LAYOUTS.items()}
    return ("Adam's bytes per parameter: fp32 {fp32}, torch.amp {autocast}, 16-bit + fp32 master "
            "{master}, with fp32 gradients {master_fp32_grads}, with an fp32 gradient buffer "
            "{master_grad_buffer}".format(**per))


# ---------------------------------------------------------------- exercise 3: MLP activations

@exercise(points=2, timeout=20.0,
          reference=("companion.estimate.mlp_activations", *MEASURES_ACTIVATIONS))
def check_activation_bytes(answer) -> str:
    """answer(batch, width, depth, n_classes, bytes_per_value) -> bytes `MLP.loss` saves for
    backward (beyond its input batch and labels), held against a measurement."""
    lines = []
    for case, seed in enumerate(fresh_seeds(3)):
        rng = random.Random(seed)
        B, W, L, K = rng.randint(8, 64), rng.randint(16, 96), rng.randint(1, 4), rng.randint(3, 12)
        # one case of each dtype always (an answer blind to the dtype must fail every run), the
        # third drawn
        dtype = (torch.bfloat16, torch.float32, rng.choice((torch.float32, torch.bfloat16)))[case]
        e = torch.empty((), dtype=dtype).element_size()
        model = MLP(rng.randint(3, 20), W, L, K, seed=seed, dtype=dtype)
        X, y = make_classification(B, model.net[0].in_features, K, seed=seed, dtype=dtype)
        with track("cpu") as t:
            loss = model.loss(X, y)
        measured = t.current - loss.untyped_storage().nbytes()
        got = _number(call(answer, B, W, L, K, e), "activation bytes")
        relu = L * B * W * e
        compare(got, measured, name=f"bytes saved by MLP(width={W}, depth={L}) on a batch "
                f"of {B}, {dtype}", rtol=0.0, atol=0.0, known_wrong={
                    "the loss saves the log-softmax of the logits too: B·n_classes values.":
                        relu,
                    "one value more: cross-entropy saves the total weight it divides the summed "
                    "loss by (a single number).": relu + B * K * e,
                    "a Linear's output is freed once ReLU has used it; only ReLU's output is "
                    "kept.": 2 * relu + B * K * e,
                    "count bytes: multiply values by bytes_per_value.": relu // e + B * K,
                })
        lines.append(f"{format_bytes(got)} vs {format_bytes(measured)}")
    return "predicted vs measured: " + "; ".join(lines)


# ---------------------------------------------------------------- exercise 4: any transformer

_GPT2 = {"GPT-2 small": (768, 12, 12), "GPT-2 XL": (1600, 48, 25)}   # width, depth, heads


def _transformer_mistakes(b: int, s: int, h: int, L: int, a: int, V: int,
                          dropout: bool) -> dict[str, int]:
    right = estimate.transformer_activations(b, s, h, L, a, V, dropout=dropout)
    layer = estimate.transformer_layer_activations(b, s, h, a, dropout=dropout)
    quadratic = (5 if dropout else 2) * a * s * s * b
    outside = right - L * layer
    paper_layers = L * estimate.transformer_layer_activations(b, s, h, a, dropout=True)
    without = ("without dropout three tensors go: the two sbh masks and, in attention, the as²b "
               "mask and dropout's 2as²b output (the product with V saves softmax's output, "
               "already counted)")
    return {
        without: estimate.transformer_activations(b, s, h, L, a, V, dropout=True),
        without + ".": paper_layers + outside,
        "attention saves (heads × s × s) scores per sequence: the 5as²b (2as²b without dropout) "
        "term that grows with the square of the sequence": right - L * quadratic,
        "the attention terms are per head: a·s²·b, not s²·b":
            right - L * quadratic + L * quadratic // a,
        "the loss keeps the log-softmax of the logits, b·s·vocab values in fp32 (4 bytes)":
            right - 4 * s * b * V,
        "the log-softmax is fp32 (4 bytes per value), not 16-bit": right - 2 * s * b * V,
        "every one of the `depth` layers saves its own activations": layer + outside,
        "outside the layers: the final LayerNorm's input and the head's input (2sbh each), and "
        "with dropout the embedding dropout's mask (sbh)": L * layer + 4 * s * b * V,
        "outside the layers, the final LayerNorm's input and the head's input (2sbh each) are "
        "kept too": right - 4 * s * b * h,
        "outside the layers two inputs of 2sbh are kept, the final LayerNorm's and the head's: "
        "one is missing": right - 2 * s * b * h,
        "with dropout, the embeddings' dropout keeps its mask too, outside the layers: sbh bytes "
        "(1 per value)": right - s * b * h if dropout else right,
        "without dropout the product with V saves softmax's output itself, already counted: "
        "2as²b per layer, not 2as²b twice": right if dropout else right + L * 2 * a * s * s * b,
    }


def _coinciding(case: tuple[int, ...], dropout: bool) -> set[tuple[str, str]]:
    mistakes = _transformer_mistakes(*case, dropout)
    return {(one, other) for one in mistakes for other in mistakes
            if one < other and mistakes[one] == mistakes[other]}


def _telling_case(rng: random.Random, heads: int) -> tuple[int, int, int, int, int, int]:
    """A random case in which the known mistakes give different numbers wherever they do in
    general: 2 layers of one head over 28 tokens at width 56 make the s² terms equal the sbh terms
    outside the layers, and the hint would name the wrong one. (Some mistakes are one mistake
    twice over, equal in every case: those stay.)"""
    generic = (7, 101, 8 * heads * 11, 5, heads, 4099)
    while True:
        case = (rng.randint(1, 9), rng.randint(16, 300), 8 * heads * rng.randint(1, 12),
                rng.randint(1, 6), heads, rng.randint(50, 5000))
        if all(_coinciding(case, d) <= _coinciding(generic, d) for d in (True, False)):
            return case


@exercise(points=2, reference=("companion.estimate.transformer_activations",
                               "companion.estimate.transformer_layer_activations"))
def check_transformer_activations(answer) -> str:
    """answer(batch, seq_len, width, depth, heads, vocab, dropout) -> bytes a GPT with 16-bit
    activations saves for backward, Korthikanti et al.'s count plus the head and the loss."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = [_telling_case(rng, heads) for heads in (1, 3, 4, 7)]
    cases += [(8, 1024, h, L, a, 50257) for h, L, a in _GPT2.values()]
    for b, s, h, L, a, V in cases:
        for dropout in (True, False):
            expected = estimate.transformer_activations(b, s, h, L, a, V, dropout=dropout)
            wrong = {hint: v for hint, v in _transformer_mistakes(b, s, h, L, a, V,
                                                                         dropout).items()
                     if v != expected}
            got = _number(call(answer, b, s, h, L, a, V, dropout), "activation bytes")
            compare(got, expected, name=f"batch {b}, seq_len {s}, width {h}, depth {L}, "
                    f"heads {a}, vocab {V}, dropout={dropout}", rtol=0.0, atol=0.5,
                    known_wrong=wrong)
    width, depth, heads = _GPT2["GPT-2 XL"]
    plain, dropped = (estimate.transformer_activations(8, 1024, width, depth, heads, 50257,
                                                       dropout=d) for d in (False, True))
    n = estimate.gpt_params(50257, 1024, width, depth)            # the head not tied: 1.64B
    states = estimate.model_states(n, precision="mixed").total
    return (f"GPT-2 XL, batch 8 × 1024 tokens, 16-bit, {n / 1e9:.2f}B parameters: "
            f"{states / 1e9:.1f} GB of model states (16-bit + fp32 master, Adam); without "
            f"dropout, this chapter's convention, {plain / 1e9:.1f} GB of activations, "
            f"{(plain + states) / 1e9:.0f} GB in all, under 80 GB with "
            f"{80 - (plain + states) / 1e9:.0f} GB for temporaries; with dropout, "
            f"{dropped / 1e9:.1f} GB of activations, {(dropped + states) / 1e9:.0f} GB: more than "
            "an 80 GB GPU holds")
