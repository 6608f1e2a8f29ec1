"""Chapter 05, exercise 4: a 16-bit model's scaled gradients unscaled into its fp32 master
weights, clipped, with infs and NaNs found."""
from __future__ import annotations

import math

import torch

from companion.checks.core import (CheckFailed, call_inplace, compare, exercise, fresh_seeds,
                                   harness, require)

__all__ = ["check_unscale_grads"]

_SHAPES = [(7, 5), (13,), (3, 2, 3), (1,), (4, 6)]
# Each tensor's size before unscaling: at a scale of 2^16 the first falls among fp16's subnormals
# once unscaled (2^-18), at 2^24 below its smallest (2^-26); the last is near the top it can hold
_SIZES = [2.0**-2, 2.0**3, 2.0**8, 1.0, 2.0**12]
# (scale, clip, the gradient left without one or None, what is planted in the scaled gradients)
_BIG = ("big", 4, (60000.0, 60000.0))      # finite; doubled, or their sum, beyond fp16's 65504
_CASES = [
    (2.0**16, False, None, None), (2.0**16, True, 2, None), (2.0**24, True, None, None),
    (2.0**24, False, 0, None), (3000.0, True, None, None), (3000.0, False, 3, None),
    (0.5, True, None, _BIG), (0.5, False, 1, _BIG), (2.0**7, True, 4, None),
    (2.0**16, True, None, (3, math.inf)), (2.0**16, False, 2, (0, -math.inf)),
    (2.0**10, True, None, (4, math.nan)), (2.0**20, True, 4, (2, math.nan)),
    (2.0**16, True, None, (1, (math.inf, -math.inf))),
]


def _scaled_grads(seed: int, case: tuple) -> list[torch.Tensor | None]:
    """The fp16 gradients of the scaled loss, as backward leaves them in `.grad` (None: none)."""
    g = torch.Generator().manual_seed(seed)
    _, _, missing, plant = case
    grads = [(torch.randn(s, generator=g) * m).half() for s, m in zip(_SHAPES, _SIZES)]
    if plant is not None:
        where, value = plant[1:] if plant[0] == "big" else plant
        flat = grads[where].view(-1)
        if isinstance(value, tuple):                    # two entries, at two positions
            flat[0], flat[flat.numel() - 1] = value
        else:
            flat[seed % flat.numel()] = value
    if missing is not None:
        grads[missing] = None
    return grads


def _inv_scale(scale: float, device: str = "cpu") -> torch.Tensor:
    """1/scale as torch.amp.GradScaler makes it: in float64, then rounded to float32."""
    return torch.tensor(scale, device=device).double().reciprocal().float()


def _params(grads: list, device: str) -> tuple[list, list]:
    """A 16-bit model's parameters holding `grads`, and their fp32 master copies (no .grad)."""
    model = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float16, device=device))
             for s in _SHAPES]
    for p, g in zip(model, grads):
        p.grad = None if g is None else g.to(device)
    return model, [torch.nn.Parameter(p.detach().float()) for p in model]


def _expected(grads: list, scale: float, max_norm: float, route: str = "torch") -> tuple:
    """(found_inf, norm, master gradients): copied up (as MasterWeights.grads_to_master), unscaled
    by torch.amp.GradScaler.unscale_, clipped by clip_grad_norm_. Other routes are known mistakes:
    unscaled in fp16, clipped before unscaling (to max_norm, or to max_norm times the scale),
    divided by inv_scale, each tensor clipped on its own."""
    _, masters = _params(grads, "cpu")
    inv = _inv_scale(scale)
    for m, g in zip(masters, grads):
        if g is not None:
            m.grad = ((g * inv.half()).float() if route == "fp16" else
                      g.float() / inv if route == "divide" else g.float())
    live = [m for m in masters if m.grad is not None]
    if route in ("clip_first", "clip_scaled"):
        norm = torch.nn.utils.clip_grad_norm_(live, max_norm * (scale if route == "clip_scaled"
                                                                 else 1.0))
        for m in live:
            m.grad.mul_(inv)
        return None, norm, [m.grad for m in masters]
    if route == "per_tensor":
        for m in live:
            m.grad.mul_(inv)
            torch.nn.utils.clip_grad_norm_([m], max_norm)
    stepped = []
    if route == "per_tensor":
        return None, None, [m.grad for m in masters]
    if route == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        scaler.scale(torch.ones(()))                    # the scale tensor, made on first use
        opt = torch.optim.SGD(live, lr=0.0)
        opt.register_step_post_hook(lambda *args: stepped.append(True))
        scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(live, max_norm)
    if route == "torch":
        scaler.step(opt)                                # skipped if an inf or NaN was found
    return not stepped, norm, [None if m.grad is None else m.grad.clone() for m in masters]


@harness
def _run(answer, seed: int, case: tuple, max_norm: float, device: str = "cpu") -> tuple:
    """The answer's return value and the master gradients it left (on the CPU)."""
    model, masters = _params(_scaled_grads(seed, case), device)
    result = call_inplace(answer, model, masters, _inv_scale(case[0], device), max_norm)
    if isinstance(result, (tuple, list)):
        result = tuple(r.detach().cpu() if isinstance(r, torch.Tensor) else r for r in result)
    return result, [None if m.grad is None else m.grad.detach().cpu() for m in masters]


def _number(value, what: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, int, float)) or isinstance(value, bool) and what != "found_inf":
        raise CheckFailed(f"expected {what} as a number (or a one-element tensor), got "
                          f"{type(value).__name__}",
                          hint="return (found_inf, total_norm), e.g. `return found_inf, norm`.")
    return float(value)


@exercise(points=2, reference=("companion.amp.unscale_grads_", "companion.amp.GradScaler",
                               "companion.amp.MasterWeights",
                               "torch._amp_foreach_non_finite_check_and_unscale_",
                               "companion.checks.ch05.unscale._expected"))
def check_unscale_grads(answer) -> str:
    """answer(model_params, master_params, inv_scale, max_norm) -> (found_inf, total_norm): the
    fp16 gradients of the scaled loss onto the fp32 masters, unscaled and clipped as
    torch.amp.GradScaler.unscale_ and clip_grad_norm_ leave them."""
    seeds = fresh_seeds(2)
    cases = [(seed, case) for seed in seeds for case in _CASES]
    if torch.cuda.is_available():             # where training runs: tensors on the GPU
        cases += [(seeds[0], case) for case in (_CASES[0], _CASES[9])]
    for i, (seed, case) in enumerate(cases):
        device = "cuda" if i >= 2 * len(_CASES) else "cpu"
        scale, clip, missing, plant = case
        grads = _scaled_grads(seed, case)
        poisoned = plant is not None and plant[0] != "big"
        norm = float(_expected(grads, scale, math.inf)[1]) if not poisoned else 1.0
        max_norm = norm / 3 if clip else 4 * norm
        found, want_norm, want = _expected(grads, scale, max_norm)
        result, got = _run(answer, seed, case, max_norm, device)
        setting = (f"scale {scale:g}, max_norm {max_norm:.4g} ({'clips' if clip else 'no clip'})"
                   + ("" if missing is None else f", parameter {missing} without a gradient")
                   + ("" if plant is None else f", {plant[1:] if plant[0] == 'big' else plant} "
                      "planted (tensor, value)"))
        require(isinstance(result, (tuple, list)) and len(result) == 2,
                f"expected (found_inf, total_norm), got {result!r:.80}",
                hint="return two values: whether any gradient held an inf or NaN, and the "
                     "gradient norm before clipping.")
        got_found = bool(_number(result[0], "found_inf"))
        if found:
            value = plant[1]
            kind = ("an inf and a -inf" if isinstance(value, tuple) else "a NaN"
                    if math.isnan(value) else "an inf" if value > 0 else "a -inf")
            require(got_found, f"found_inf is False, but scaled gradient {plant[0]} holds {kind} "
                    f"({setting})",
                    hint="torch.isfinite is False for inf, -inf and NaN (isinf misses NaN; inf + "
                         "(-inf) is NaN, not inf): look at every element of every gradient.")
            continue
        require(not got_found, f"found_inf is True but every gradient is finite ({setting})",
                hint="a finite fp16 gradient times inv_scale can pass fp16's 65504 when the scale "
                     "is below 1, and a sum of finite gradients can overflow: look at the "
                     "elements of the gradients backward made, before multiplying.")
        for j, g in enumerate(got):
            require((g is None) == (grads[j] is None),
                    f"master parameter {j}'s .grad is {'None' if g is None else 'set'}, but its "
                    f"model parameter {'has' if grads[j] is not None else 'has no'} gradient "
                    f"({setting})",
                    hint="give each master the gradient of its own model parameter; one without a "
                         "gradient keeps None (a zero gradient would still move it under Adam's "
                         "momentum or weight decay)." if g is not None else
                         "set master.grad (the optimizer reads it), in fp32.")
        routes = [
            ("fp16", "unscale in fp32: bring each gradient up first. Multiplied in fp16, the "
                     "unscaled gradients fall into fp16's subnormals and below its floor again (or "
                     "past 65504, with a scale below 1)."),
            ("clip_first", "clip the unscaled gradients: max_norm is a norm of the true "
                           "gradients, and the scaled ones are scale times larger."),
            ("clip_scaled", "unscale, then clip with max_norm itself: clip_grad_norm_ divides by "
                            "the norm plus 1e-6, and that norm is the unscaled one's."),
            ("per_tensor", "clip the norm of all the gradients together (one coefficient), not "
                           "each tensor's on its own.")]
        if not clip:               # clipped, gradients s^2 times too large come out nearly right
            routes.append(("divide", "multiply by inv_scale = 1/scale: backward made the "
                                     "gradients scale times too large."))
        wrong = {text: [g for g in _expected(grads, scale, max_norm, route)[2] if g is not None]
                 for route, text in routes}
        if clip:
            wrong["clip to max_norm, as clip_grad_norm_ does, after unscaling."] = [
                g for g in _expected(grads, scale, math.inf)[2] if g is not None]
        compare([g for g in got if g is not None], [g for g in want if g is not None],
                name=f"the master gradients ({setting})", rtol=1e-6 if clip else 0.0,
                atol=0.0, known_wrong=wrong,
                hint="up to fp32, multiply by inv_scale, then clip the unscaled gradients as "
                     "clip_grad_norm_ does (its coefficient is max_norm / (norm + 1e-6), at most "
                     "1: the 1e-6 counts when you clip by hand).")
        compare(_number(result[1], "total_norm"), float(want_norm),
                name=f"total_norm ({setting})", rtol=1e-6, atol=0.0, known_wrong={
                    "the norm of the unscaled gradients, before clipping: the scaled one is scale "
                    "times larger, and after clipping it is max_norm.": float(
                        _expected(grads, scale, max_norm, "clip_first")[1]),
                    "the norm before clipping (what clip_grad_norm_ returns), not after it.":
                        float(torch.linalg.vector_norm(torch.stack(
                            [torch.linalg.vector_norm(g) for g in want if g is not None])))})
    on_gpu = "; on the GPU too" if torch.cuda.is_available() else ""
    return (f"the same master gradients, bit for bit where nothing is clipped, the same norms and "
            f"inf/NaN flags as torch.amp.GradScaler and clip_grad_norm_ over {len(cases)} "
            f"gradient sets: scales 0.5 to 2^24, fp16's floor to its top, missing gradients"
            + on_gpu)
