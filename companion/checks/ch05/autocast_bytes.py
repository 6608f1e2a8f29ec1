"""Chapter 05, exercise 2: from which batch size autocast keeps fewer activation bytes than fp32."""
from __future__ import annotations

import numbers
import random

import torch

from companion import estimate
from companion.checks.core import (MEASURES_ACTIVATIONS, call, compare, exercise, fresh_seeds,
                                   require)
from companion.memory import track
from companion.models import MLP, make_classification

__all__ = ["check_autocast_activation_bytes"]

# (d_in, width, depth, d_out) the check always tries: the break-even divides exactly (149 x 24 =
# 3576 > 3552 = 148 x 24: the answer is 149, not 148), no batch saves (width x depth below d_in,
# and equal to it: a division by zero), one hidden layer (no weight copy but the last), and a
# break-even 2 bytes short of the next batch (54 = 3 x 14 + 12: 4 bytes more make it 5, not 4)
_PINNED = [(62, 37, 2, 11), (300, 40, 3, 7), (96, 48, 2, 10), (5, 64, 1, 3), (2, 9, 1, 3)]


def _first_below(fixed: int, per_example: int) -> int | None:
    """The smallest batch B >= 1 with fixed - B * per_example < 0, or None."""
    return None if per_example <= 0 else fixed // per_example + 1


def _reference(d_in: int, W: int, L: int, K: int) -> int | None:
    """From the estimator's two counts, which tests/test_estimate.py holds against `track`:
    autocast minus fp32 is affine in the batch, fixed - B * per_example."""
    def gap(B: int) -> int:
        return (estimate.mlp_activations(B, W, L, K, precision="autocast", d_in=d_in)
                - estimate.mlp_activations(B, W, L, K))
    return _first_below(gap(0), gap(0) - gap(1))


def _wrong(d_in: int, W: int, L: int, K: int) -> dict[str, int | None]:
    """Known-wrong answers, each from one mistaken term of the two counts."""
    fixed = 2 * ((L - 1) * W * W + W * K)
    per = 2 * L * W - 2 * d_in
    return {
        "autocast's 16-bit copies of the weight matrices are saved for backward too, and they do "
        "not shrink with the batch: at small batches they outweigh the saving.":
            _first_below(0, per),
        "the first Linear's input (the batch) needs no gradient, so its weight copy is not saved: "
        "only the other Linears keep theirs.": _first_below(fixed + 2 * d_in * W, per),
        "the first Linear saves a 16-bit copy of the input batch, new memory that fp32 training "
        "does not make (there it saves the input itself).": _first_below(fixed, 2 * L * W),
        "cross_entropy is on autocast's fp32 list: its log-softmax is fp32 under autocast too, so "
        "it saves nothing.": _first_below(fixed, per + 2 * K),
        "the 16-bit logits are not saved: cross_entropy casts them to fp32 and saves its "
        "log-softmax, as in fp32.": _first_below(fixed, per - 2 * K),
        "a ReLU after a 16-bit Linear computes in 16 bits: its outputs take 2 bytes, not 4.": None,
        "the ReLU's output and the next Linear's input are one tensor: count it once.":
            _first_below(fixed, 2 * per + 2 * d_in),
        "`depth` counts the hidden Linear-ReLU layers: depth ReLU outputs, depth + 1 Linears.":
            _first_below(fixed, per + 2 * W),
        "a Linear does not save its bias (its gradient is a sum of the output gradient).":
            _first_below(fixed + 2 * ((L - 1) * W + K), per),
        "`fewer` is strict: where the two counts are equal autocast saves nothing yet.":
            -(-fixed // per) if per > 0 else None,
    }


def _distinct_case(rng: random.Random) -> tuple[int, int, int, int]:
    """(d_in, width, depth, d_out) at which some batch saves and every known-wrong answer but the
    strictness differs from the reference, so each gets its own hint."""
    while True:
        case = (rng.randint(2, 400), rng.randint(2, 300), rng.randint(1, 6), rng.randint(2, 50))
        want, wrong = _reference(*case), _wrong(*case)
        values = [want, *list(wrong.values())[:-1]]
        if want is not None and want > 1 and len(set(values)) == len(values):
            return case


def _measure(B: int, d_in: int, W: int, L: int, K: int, autocast: bool) -> int:
    """Bytes MLP.loss leaves live for backward, the loss itself not counted."""
    model = MLP(d_in, W, L, K)
    X, y = make_classification(B, d_in, K)
    with track("cpu") as t:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss(X, y)
    return t.current - loss.untyped_storage().nbytes()


@exercise(points=1, reference=("companion.estimate.mlp_activations", *MEASURES_ACTIVATIONS,
                               "companion.checks.ch05.autocast_bytes._reference",
                               "companion.checks.ch05.autocast_bytes._first_below"))
def check_autocast_activation_bytes(answer) -> str:
    """answer(d_in, width, depth, d_out) -> the smallest batch at which `MLP.loss` of an fp32 model
    under 16-bit autocast keeps fewer bytes for backward than in fp32, or None if none does."""
    rng = random.Random(fresh_seeds(1)[0])
    small = _distinct_case(rng)
    while _reference(*small) > 64:                   # small enough to measure at two batches
        small = _distinct_case(rng)
    cases = [*_PINNED, small, *(_distinct_case(rng) for _ in range(4))]
    for d_in, W, L, K in cases:
        want = _reference(d_in, W, L, K)
        got = call(answer, d_in, W, L, K)
        name = f"the batch for d_in={d_in}, width={W}, depth={L}, d_out={K}"
        if want is None:
            require(got is None, f"{name}: expected None (no batch size saves), got {got!r}",
                    hint="per example autocast saves on some tensors and adds others; where the "
                         "additions are at least the savings, no batch size saves: return None.")
            continue
        require(got is not None, f"{name}: expected {want}, got None", hint=next(
            (text for text, value in _wrong(d_in, W, L, K).items() if value is None),
            "count what each Linear, ReLU and the loss keep in both precisions."))
        compare(got, want, name=name, rtol=0.0, atol=0.0, known_wrong=_wrong(d_in, W, L, K),
                hint="count, in both precisions, what each Linear, ReLU and the loss keep: some "
                     "terms grow with the batch, some do not.")
        require(isinstance(got, numbers.Integral) and not isinstance(got, bool),
                f"got {got!r}, a {type(got).__name__}: a batch size is a whole number",
                hint="return an int (use // rather than / if you divide).")
    d_in, W, L, K = small
    b = _reference(*small)
    bytes_ = {B: (_measure(B, d_in, W, L, K, True), _measure(B, d_in, W, L, K, False))
              for B in (b - 1, b)}
    return (f"measured for d_in {d_in}, width {W}, depth {L}, d_out {K}: autocast keeps "
            f"{bytes_[b - 1][0]:,} B against fp32's {bytes_[b - 1][1]:,} B at batch {b - 1}, "
            f"{bytes_[b][0]:,} B against {bytes_[b][1]:,} B at batch {b}")
