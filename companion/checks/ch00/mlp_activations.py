"""Chapter 00, exercise 3: the activation bytes an MLP saves for backward, predicted."""
from __future__ import annotations

import random

import torch

from companion.checks.ch00._common import _number
from companion.checks.core import MEASURES_ACTIVATIONS, call, compare, exercise, fresh_seeds
from companion.memory import format_bytes, track
from companion.models import MLP, make_classification

__all__ = ["check_activation_bytes"]


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
