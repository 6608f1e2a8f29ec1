"""Chapter 00, exercise 1: Adam's step, written by hand and compared with torch.optim.Adam."""
from __future__ import annotations

import random

import torch

from companion import optim
from companion.checks.core import call_inplace, compare, exercise, fresh_seeds, harness, require

__all__ = ["check_adam_step"]


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
