"""Chapter 05, exercise 1: which layout of weights, gradients and optimizer state fits a GPU."""
from __future__ import annotations

import numbers
import random
from collections import Counter

from companion import estimate
from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, require
from companion.estimate import OPTIMIZERS
from companion.memory import format_bytes

__all__ = ["check_bf16_layout"]


LAYOUTS = {"fp32": ("fp32", {}), "autocast": ("autocast", {}), "master": ("mixed", {}),
           "main_grad": ("mixed", {"fp32_grads": True}),
           "both_grads": ("mixed", {"fp32_grad_buffer": True}), "bf16": ("bf16", {})}
_SIXTEEN_BIT_WEIGHTS = ("master", "main_grad", "both_grads", "bf16")


def _layout_bytes(n: int, optimizer: str, layout: str) -> int:
    precision, options = LAYOUTS[layout]
    return estimate.model_states(n, optimizer=optimizer, precision=precision, **options).total


def _pick(n: int, optimizer: str, k: int, free: int, *, exact=None, bytes_of=None) -> tuple:
    """The 16-bit-weight layout with an fp32 master whose gradient sum is exact, fewest bytes
    first; `exact` and `bytes_of` replace the rules, for the known-wrong answers."""
    exact = exact or (lambda layout: layout != "bf16" and (k == 1 or layout != "master"))
    bytes_of = bytes_of or (lambda layout: _layout_bytes(n, optimizer, layout))
    for layout in sorted(_SIXTEEN_BIT_WEIGHTS, key=bytes_of):
        need = bytes_of(layout)
        if exact(layout) and need <= free:
            return layout, need
    return None, 0


def _pick_mistakes(n: int, optimizer: str, k: int, gpu: int, activations: int) -> dict:
    free = gpu - activations
    miscounted = {hint: _pick(n, optimizer, k, free, bytes_of=lambda lay, h=hint:
                              _bytes_mistakes(n, optimizer, lay)[h])
                  for hint in _bytes_mistakes(n, optimizer, "master")}
    return {"the activations need the GPU too: what is left for model states is gpu_bytes - "
            "activation_bytes.": _pick(n, optimizer, k, gpu)} | miscounted | {
        "one micro-batch's bf16 gradient, copied into fp32, is exact (the chapter measured it at "
        "k = 1): the 2 extra bytes buy nothing there.":
            _pick(n, optimizer, k, free, exact=lambda lay: lay in ("main_grad", "both_grads")),
        "with more than one micro-batch the bf16 .grad sums them with bf16 rounding (the drift "
        "measured above): the sum must be kept in fp32.":
            _pick(n, optimizer, k, free, exact=lambda lay: lay != "bf16"),
        "the fp32 buffer alone keeps the sum exact; keeping the bf16 .grad beside it adds 2 bytes "
        "per parameter and no exactness.":
            _pick(n, optimizer, k, free, exact=lambda lay: lay == "both_grads" or
                  (k == 1 and lay == "master")),
        "pure bf16 loses every update below half of bf16's spacing at its weight: it is not exact "
        "with any gradient sum.": _pick(n, optimizer, k, free, exact=lambda lay: k == 1 or
                                        lay != "master"),
        "when no exact layout fits, say so (None): a layout that fits but drifts or loses "
        "updates is not the answer asked for.": _fallback(n, optimizer, k, free),
    }


def _fallback(n: int, optimizer: str, k: int, free: int):
    layout, need = _pick(n, optimizer, k, free)
    if layout is not None:
        return None
    fitting = [lay for lay in _SIXTEEN_BIT_WEIGHTS if _layout_bytes(n, optimizer, lay) <= free]
    return None if not fitting else (fitting[0], _layout_bytes(n, optimizer, fitting[0]))


def _bytes_mistakes(n: int, optimizer: str, layout: str) -> dict[str, int]:
    """What the usual miscounts give for a layout (the right count where one does not apply)."""
    states = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}[optimizer]
    right = _layout_bytes(n, optimizer, layout)
    return {
        "count the optimizer you are given: SGD keeps no state and SGD with momentum one tensor, "
        "not Adam's two.": _layout_bytes(n, "adam", layout),
        "the optimizer steps the fp32 master, so its states are fp32 too (4 bytes each), not "
        "16-bit.": right - 2 * states * n if layout != "bf16" else right,
        "the optimizer steps an fp32 master copy of the weights: 4 more bytes per parameter.":
            right - 4 * n if layout != "bf16" else right,
        "main_grad replaces the bf16 .grad (each one is added in and freed): 4 bytes of "
        "gradient, not 2 + 4.": right + 2 * n if layout == "main_grad" else right,
        "AdamW differs from Adam only in where its weight decay goes (onto the weights, not into "
        "the gradient): does that need a state tensor of its own?":
            right + (4 if layout != "bf16" else 2) * n if optimizer == "adamw" else right,
    }


_GPUS = {"24 GiB": 24 * 2**30, "40 GiB": 40 * 2**30, "80 GiB (H100)": 80 * 2**30,
         "141 GB (H200)": 141 * 10**9}


def _pick_cases(seed: int) -> list[tuple[int, str, int, int, int]]:
    """(n_params, optimizer, micro_batches, gpu_bytes, activation_bytes), each regime once: the
    16 B layout fits (k = 1), the 18 B one (k = 2 always: an answer that keeps 16-bit gradients
    for a few micro-batches must fail every run, not when the draw is small), Adam's and AdamW's
    exact layouts (both every run: a count of AdamW's states unlike Adam's must fail every run,
    not when AdamW is drawn), only a drifting one fits, nothing fits beside the activations (but
    would without them), nothing fits at all."""
    rng = random.Random(seed)
    cases = []
    for k, regime, optimizer in [
            (1, "exact", "sgd"), (2, "exact", "sgd_momentum"),
            (rng.randint(1, 64), "exact", "adam"), (rng.randint(1, 64), "exact", "adamw"),
            (rng.randint(2, 64), "drift", rng.choice(OPTIMIZERS)),
            (rng.randint(1, 16), "tight", rng.choice(OPTIMIZERS)),
            (rng.randint(1, 16), "none", rng.choice(OPTIMIZERS))]:
        gpu = rng.choice(list(_GPUS.values()))
        activations = int(gpu * rng.uniform(0.1, 0.4))
        free = gpu - activations
        per = _layout_bytes(1, optimizer, "master" if k == 1 else "main_grad")   # bytes/param
        low = _layout_bytes(1, optimizer, "master")
        if regime == "exact":
            n = int(free / per / rng.uniform(1.02, 1.25))
        elif regime == "drift":                       # master fits, main_grad does not
            n = int(free / rng.uniform(low * 1.01, per * 0.99))
        elif regime == "tight":                       # fits in gpu_bytes, not beside activations
            n = int(rng.uniform(free * 1.02, gpu * 0.98) / per)
        else:
            n = int(gpu / per * rng.uniform(1.05, 2.0))
        cases.append((n, optimizer, k, gpu, activations))
    return cases


_ROOMY = 2**60      # a GPU that holds anything: what the answer prefers when everything fits


def _diagnose(answer, n: int, optimizer: str, k: int, gpu: int, activations: int, got) -> str:
    """The hint for a wrong layout: first ask the answer what it picks when everything fits (a
    wrong preference or a miscount shows there), else what went wrong in fitting."""
    preferred = call(answer, n, optimizer, k, _ROOMY, 0)
    if isinstance(preferred, (tuple, list)) and len(preferred) == 2 and \
            tuple(preferred) != _pick(n, optimizer, k, _ROOMY):
        suspects = _pick_mistakes(n, optimizer, k, _ROOMY, 0)
        got = tuple(preferred)
    else:
        suspects = _pick_mistakes(n, optimizer, k, gpu, activations)
    want = _pick(n, optimizer, k, gpu - activations)
    hints = [h for h, v in suspects.items() if v is not None and tuple(v) == tuple(got)
             and v != want] or [h for h, v in suspects.items()
                                if v is not None and v[0] == got[0] and v != want]
    if not hints:
        return "which layouts keep the sum exact, and which of those fit?"
    return hints[0] if len(hints) == 1 else f"one of two things: (1) {hints[0]} (2) {hints[1]}"


@exercise(points=2, reference=("companion.estimate.model_states",
                               "companion.checks.ch05.layout._pick", "companion.checks.ch05.layout._layout_bytes"))
def check_bf16_layout(answer) -> str:
    """answer(n_params, optimizer, micro_batches, gpu_bytes, activation_bytes) -> (layout,
    model-state bytes), or (None, 0): the fewest-bytes layout with 16-bit weights whose updates
    and gradient sums are as exact as fp32's that fits beside the activations."""
    seen = Counter()
    for seed in fresh_seeds(2):
        for n, optimizer, k, gpu, activations in _pick_cases(seed):
            want = _pick(n, optimizer, k, gpu - activations)
            got = call(answer, n, optimizer, k, gpu, activations)
            require(isinstance(got, (tuple, list)) and len(got) == 2,
                    f"expected (layout, model-state bytes), got {got!r}"[:200],
                    hint="return two things, e.g. `return \"master\", nbytes` or `return None, 0`.")
            layout, nbytes = got
            what = (f"{n:,} parameters, {optimizer}, {k} micro-batch{'es' * (k > 1)}, a "
                    f"{format_bytes(gpu)} GPU with {format_bytes(activations)} of activations")
            require(layout is None or layout in LAYOUTS,
                    f"with {what}: layout {layout!r} is not one of {sorted(LAYOUTS)} or None")
            if layout != want[0]:
                raise CheckFailed(f"with {what}: got {layout!r}, expected {want[0]!r}",
                                  hint=_diagnose(answer, n, optimizer, k, gpu, activations,
                                                 (layout, nbytes)))
            require(isinstance(nbytes, numbers.Integral) and not isinstance(nbytes, bool),
                    f"with {what}: the bytes should be an int, got {type(nbytes).__name__}")
            if int(nbytes) != want[1]:
                hints = [h for h, v in _bytes_mistakes(n, optimizer, layout).items()
                         if v == int(nbytes) and v != want[1]]
                raise CheckFailed(f"with {what}: {layout!r} is right, but its model states are "
                                  f"{want[1]:,} bytes, not {int(nbytes):,}",
                                  hint=hints[0] if hints else
                                  "count weights, gradients, the fp32 master and the optimizer's "
                                  "states for this optimizer.")
            seen[want[0]] += 1
    return ("right on every GPU, optimizer and micro-batch count tried: " +
            ", ".join(f"{lay or 'nothing fits'} {c}x" for lay, c in seen.items()))
