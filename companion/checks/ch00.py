"""Checks for chapter 00, the anatomy of memory: bytes of parameters, of model states, of
activations saved for backward (predicted, then measured with `companion.memory.track`)."""
from __future__ import annotations

import random

import torch

from companion import estimate
from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds, require
from companion.memory import format_bytes, track
from companion.models import GPT, MLP, make_classification

__all__ = ["check_param_bytes", "check_model_state_bytes", "check_activation_bytes"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _number(got, name: str) -> float:
    """The learner's answer as a number of bytes, or a CheckFailed that says what was wrong."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise CheckFailed(f"{name}: expected a number of bytes (an int), got {type(got).__name__}",
                          got=got, hint="return the count itself, e.g. `return total`.")
    if got != got:
        raise CheckFailed(f"{name} is NaN", got=got, hint="count bytes with integers.")
    return float(got)


@exercise(points=1, reference="companion.floats.parameter_bytes")
def check_param_bytes(answer) -> str:
    """answer(model) -> bytes of the model's parameters (each counted once, in its own dtype)."""
    for seed in fresh_seeds(4):
        rng = random.Random(seed)
        dtype = rng.choice(_DTYPES)
        if rng.random() < 0.5:
            model = MLP(rng.randint(2, 40), rng.randint(3, 64), rng.randint(1, 4),
                        rng.randint(2, 9), seed=seed, dtype=dtype)
        else:
            heads = rng.randint(1, 4)
            model = GPT(rng.randint(5, 60), rng.randint(4, 20), 8 * heads, rng.randint(1, 2), heads,
                        seed=seed, dtype=dtype)
        params = list(model.parameters())
        expected = sum(p.numel() * p.element_size() for p in params)
        numel = sum(p.numel() for p in params)
        got = _number(call(answer, model), "parameter bytes")
        compare(got, expected, name=f"bytes of a {dtype} {type(model).__name__}", known_wrong={
            "that is the number of values; multiply each by its size (p.element_size()).": numel,
            "the size of a value depends on the dtype: use p.element_size(), not 4.": 4 * numel,
            "that is bits, not bytes.": 8 * expected,
        })
    return "numel × element_size summed over parameters, for 4 models in fp32/bf16/fp16/fp64"


def _state_reference(n: int, optimizer: str, precision: str) -> tuple[int, int, int]:
    s = estimate.model_states(n, optimizer=optimizer, precision=precision)
    return s.params, s.grads, s.optimizer


@exercise(points=2, reference="companion.estimate.model_states")
def check_model_state_bytes(answer) -> str:
    """answer(n_params, optimizer, precision) -> (params, grads, optimizer_state) bytes, for
    optimizer in "sgd", "sgd_momentum", "adam" and precision in "fp32", "mixed"."""
    for n in (random.Random(s).randint(10**3, 10**9) for s in fresh_seeds(2)):
        for optimizer in ("sgd", "sgd_momentum", "adam"):
            for precision in ("fp32", "mixed"):
                got = call(answer, n, optimizer, precision)
                require(isinstance(got, (tuple, list)) and len(got) == 3,
                        f"expected a tuple (params, grads, optimizer_state), got {got!r}"[:200],
                        hint="return three byte counts, e.g. `return p, g, o`.")
                got = tuple(_number(x, "a byte count") for x in got)
                expected = _state_reference(n, optimizer, precision)
                k = {"sgd": 0, "sgd_momentum": 1, "adam": 2}[optimizer]
                compare(got, tuple(float(x) for x in expected),
                        name=f"(params, grads, optimizer_state) for {optimizer}, {precision}",
                        known_wrong={
                            "mixed precision keeps an fp32 master copy of the weights (4 bytes "
                            "per parameter) in the optimizer state.": (2 * n, 2 * n, 4 * k * n),
                            "mixed precision does not halve model states: the optimizer keeps "
                            "fp32 master weights and fp32 moments.": (2 * n, 2 * n, 2 * k * n),
                            "Adam keeps two tensors per parameter: the mean (m) and the mean of "
                            "squares (v) of the gradient.": (4 * n, 4 * n, 4 * n),
                        })
    adam = estimate.model_states(10**9, precision="mixed").total
    return (f"model states per parameter: mixed-precision Adam is 16 bytes, as in fp32 "
            f"(1B parameters: {adam / 1e9:.0f} GB)")


@exercise(points=2, timeout=20.0, reference=("companion.estimate.mlp_activations",
                                             "companion.memory.track", "companion.memory.measure"))
def check_activation_bytes(answer) -> str:
    """answer(batch, width, depth, n_classes, bytes_per_value) -> bytes `MLP.loss` saves for
    backward (beyond its input batch and labels), held against a measurement."""
    lines = []
    for seed in fresh_seeds(3):
        rng = random.Random(seed)
        B, W, L, K = rng.randint(8, 64), rng.randint(16, 96), rng.randint(1, 4), rng.randint(3, 12)
        dtype = rng.choice((torch.float32, torch.bfloat16))
        e = torch.empty((), dtype=dtype).element_size()
        got = _number(call(answer, B, W, L, K, e), "activation bytes")
        model = MLP(rng.randint(3, 20), W, L, K, seed=seed, dtype=dtype)
        X, y = make_classification(B, model.net[0].in_features, K, seed=seed, dtype=dtype)
        with track("cpu") as t:
            loss = model.loss(X, y)
        measured = t.current - loss.untyped_storage().nbytes()
        relu = L * B * W * e
        compare(got, float(measured), name=f"bytes saved by MLP(width={W}, depth={L}) on a batch "
                f"of {B}, {dtype}", rtol=0.01, atol=0.0, known_wrong={
                    "the loss saves the log-softmax of the logits too: B·n_classes values.":
                        float(relu),
                    "a Linear's output is freed once ReLU has used it; only ReLU's output is "
                    "kept.": float(2 * relu + B * K * e),
                    "count bytes: multiply values by bytes_per_value.": float(relu / e + B * K),
                })
        lines.append(f"{format_bytes(got)} vs {format_bytes(measured)}")
    return "predicted vs measured: " + "; ".join(lines)
