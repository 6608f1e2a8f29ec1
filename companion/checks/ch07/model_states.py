"""Exercise 4: model-state bytes per rank under each ZeRO stage (`check_per_rank_model_states`)."""
from __future__ import annotations

import math
import random

from companion import estimate
from companion.checks.ch07._common import _compare_whole, _differs
from companion.checks.core import call, exercise, fresh_seeds, require
from companion.zero import per_rank_state_bytes

__all__ = ["check_per_rank_model_states"]


_CONFIGS = [("fp32", "adamw", (4, 4, 8)), ("mixed", "adam", (2, 2, 12)),
            ("mixed", "sgd_momentum", (2, 2, 8)), ("fp32", "sgd", (4, 4, 0))]


def _wrong(n, stage, world, w, g, k, *, shard_from=(3, 2, 1), floor=False, shard=None):
    shard = shard if shard is not None else n // world if floor else -(-n // world)
    counts = [shard if stage >= s else n for s in shard_from]
    return w * counts[0], g * counts[1], k * counts[2]


def _close(got, value) -> bool:
    """got is three numbers within float rounding of `value` (a float answer, Ψ/N)."""
    return isinstance(got, (tuple, list)) and len(got) == len(value) and all(
        isinstance(a, (int, float)) and not isinstance(a, bool) and
        math.isclose(a, b, rel_tol=1e-12) for a, b in zip(got, value))


def _state_mistakes(n, stage, world, w, g, k) -> dict:
    """Known-wrong per-rank bytes and their hints (the first that matches is shown)."""
    return {
        "a shard is ceil(Ψ / N) elements (-(-n // N)): the last one is padded.":
            _wrong(n, stage, world, w, g, k, floor=True),
        "stage 1 shards only the optimizer state; stage 2 adds the gradients; stage 3 the "
        "parameters.": _wrong(n, stage, world, w, g, k, shard_from=(1, 1, 1)),
        "stage 2 shards the gradients too, and stage 3 the parameters.":
            _wrong(n, stage, world, w, g, k, shard_from=(4, 4, 1)),
        "stage 3 shards the parameters as well.":
            _wrong(n, stage, world, w, g, k, shard_from=(4, 2, 1))}


@exercise(points=1, reference=("companion.zero.per_rank_state_bytes",
                                "companion.estimate.model_states"))
def check_per_rank_model_states(answer) -> str:
    """answer(n_params, stage, world_size, weight_bytes, grad_bytes, state_bytes) ->
    (parameter bytes, gradient bytes, optimizer-state bytes) on one rank."""
    rng = random.Random(fresh_seeds(1)[0])
    for precision, optimizer, (w, g, k) in _CONFIGS:
        for stage in range(4):
            world = rng.choice([2, 3, 8, 64, 100])
            n = world * rng.randint(10**4, 10**7) + 1          # not a multiple: ceil != floor
            states = estimate.model_states(n, optimizer=optimizer, precision=precision,
                                           zero_stage=stage, world_size=world)
            expected = (states.params, states.grads, states.optimizer)
            got = call(answer, n, stage, world, w, g, k)
            require(not _close(got, _wrong(n, stage, world, w, g, k, shard=n / world)) or
                    not _differs(got, expected),
                    f"stage {stage}, {world} ranks, {n:,} parameters: got {got}, which counts "
                    "Ψ/N elements per shard", hint="a shard is a whole number of elements, "
                    "ceil(Ψ/N), not Ψ/N.")
            _compare_whole(got, expected,
                           name=f"stage {stage}, {world} ranks, {n:,} parameters, "
                                f"{w}+{g}+{k} bytes per element",
                           fields=("parameter bytes", "gradient bytes", "optimizer-state bytes"),
                           known_wrong=_state_mistakes(n, stage, world, w, g, k),
                           hint="multiply bytes per element by Ψ, or by ceil(Ψ/N) for what the "
                                "stage shards.")
    figure = [sum(per_rank_state_bytes(7_500_000_000, k, 64, 2, 2, 12)) / 1e9 for k in range(4)]
    return ("per-rank bytes match the estimator; the ZeRO paper's Figure 1 (7.5B parameters, "
            "64 GPUs): " + " / ".join(f"{f:.1f}" for f in figure) + " GB")
