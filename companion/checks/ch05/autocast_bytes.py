"""Chapter 05, exercise 2: the activation bytes an MLP saves under autocast, predicted."""
from __future__ import annotations

import numbers
import random

import torch

from companion import estimate
from companion.checks.core import (MEASURES_ACTIVATIONS, call, compare, exercise, fresh_seeds,
                                   require)
from companion.memory import format_bytes, track
from companion.models import MLP, make_classification

__all__ = ["check_autocast_activation_bytes"]


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
        "one of two things about the ReLU outputs: (1) the ReLU's output and the next Linear's "
        "input are one tensor: count it once; (2) a ReLU after a 16-bit Linear: what dtype is "
        "its output in?": ref + 2 * L * B * W,
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
        want, wrong = _reference_bytes(B, d_in, W, L, K), _mlp_variants(B, d_in, W, L, K)
        got = call(answer, B, d_in, W, L, K)
        compare(got, want,
                name=f"bytes for batch={B}, d_in={d_in}, width={W}, depth={L}, d_out={K}",
                rtol=0.0, atol=0.0, known_wrong=wrong,
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
