"""Chapter 06, exercise 3: the bucket cap that leaves the least communication after backward."""
from __future__ import annotations

import math

from companion.cost import network
from companion.checks.core import CheckFailed, exercise, fresh_seeds, require

__all__ = ["check_bucket_cap"]


def _cap_case(seed: int) -> dict:
    """A model's gradients in backward order (bytes, backward seconds each), N and a fit: uniform
    stacks, a huge embedding gradient arriving last, a huge output layer first, fast and slow
    backward passes, gloo-like and NCCL-like latencies."""
    import random

    rng = random.Random(seed)
    kind = rng.choice(["uniform", "embedding last", "head first", "mixed"])
    layers = rng.randint(12, 48)
    each = rng.choice([2**18, 2**20, 4 * 2**20])
    grads = [float(each * rng.choice([1, 1, 1, 2]) if kind == "mixed" else each)
             for _ in range(layers)]
    if kind == "embedding last":
        grads.append(float(rng.randint(layers // 2, 2 * layers) * each))
    if kind == "head first":
        grads.insert(0, float(rng.randint(layers // 2, 2 * layers) * each))
    world = rng.choice([2, 4, 8, 64])
    alpha = rng.choice([8e-6, 3e-5, 2e-4, 1e-3])
    beta = 1 / rng.choice([1e9, 10e9, 50e9, 200e9])
    one = network.all_reduce_seconds(sum(grads), world, alpha=alpha, beta=beta)
    backward = one * rng.choice([0.2, 1.0, 3.0, 10.0])           # comm-bound .. compute-bound
    weights = [g ** rng.choice([0.5, 1.0]) for g in grads]
    times = [backward * w / sum(weights) for w in weights]
    return {"kind": kind, "grads": grads, "times": times, "world": world, "alpha": alpha,
            "beta": beta}


def _exposed_at(case: dict, cap: float) -> float:
    return network.bucketed_exposed(case["grads"], case["times"], case["world"],
                                    alpha=case["alpha"], beta=case["beta"], cap_bytes=cap)


def _best_cap(case: dict) -> tuple[float, float]:
    """(cap, exposed seconds) of the best cap: every bucketing a cap can make is made by a cap
    equal to the bytes of some run of consecutive gradients."""
    g = case["grads"]
    caps = {sum(g[i:j]) for i in range(len(g)) for j in range(i + 1, len(g) + 1)}
    return min(((c, _exposed_at(case, c)) for c in caps), key=lambda x: (x[1], x[0]))


def _judge_cap(case: dict, cap: float,
               best: tuple[float, float] | None = None) -> tuple[bool, float, float, float]:
    """(good enough, the cap's exposed seconds, the best cap, its exposed seconds; `best`: the
    best (cap, exposed seconds), when found already): good enough is at most 1.5x the best's
    exposure plus 5% of one whole all-reduce (a search over powers of two passes all of the first
    300 drawn cases; the sixth small fixed case fails it every call)."""
    best, best_exposed = best or _best_cap(case)
    mine = _exposed_at(case, cap)
    one = network.all_reduce_seconds(sum(case["grads"]), case["world"], alpha=case["alpha"],
                                     beta=case["beta"])
    return mine <= 1.5 * best_exposed + 0.05 * one, mine, best, best_exposed


# Fixed cases (seeds of _cap_case), where a schedule that takes a bucket as ready at its first
# gradient and equal buckets of network.best_bucket_count's count both leave at least 1.56x the
# exposure the judgement allows, and a search over powers of two passes: a uniform stack of 24,
# an early large head (31) and another uniform stack of 28 (tests/test_checks_ch06.py checks it).
_FIXED_CAP_SEEDS = (55, 60, 89)

# Small fixed cases, judged first (they cost microseconds): a schedule that takes a bucket as
# ready one gradient early or late, or a search that leaves out the caps of single gradients or
# of the runs that start at the last gradient, leaves 1.19x to 4.6x the exposure the judgement
# allows in at least one of them (tests/test_checks_ch06.py checks it). One per gradient is best
# in the first two; the third is latency-bound (64 ranks, α = 1 ms), where one bucket is best;
# the fourth has one gradient (a model of one tensor), where a search must still find a cap.
# The fifth's best buckets are [8 MiB] [1 MiB] after a 16 MiB one, a cap no prefix of the
# gradients makes: a search over prefix sums only leaves 3.2x what is allowed (issue 54; over
# the drawn cases it failed only 9 of the first 300). The sixth's best is [3 MiB x 3] [1/4 MiB],
# a cap in [9, 9.25) MiB, which no power of two is: a search over 2**k leaves 1.39x.
_MiB = 2.0**20
_SMALL_CAP_CASES = (
    {"kind": "small", "grads": [8 * _MiB, 1 * _MiB], "times": [20e-3, 20e-3], "world": 2,
     "alpha": 1e-6, "beta": 1e-9},
    {"kind": "small", "grads": [16 * _MiB, 1 * _MiB, 17 * _MiB], "times": [1e-3, 100e-3, 0.1e-3],
     "world": 8, "alpha": 1e-6, "beta": 1e-9},
    {"kind": "small", "grads": [4 * _MiB, 1 * _MiB], "times": [250e-3, 2.5e-3], "world": 64,
     "alpha": 1e-3, "beta": 5e-12},
    {"kind": "small", "grads": [4 * _MiB], "times": [1e-3], "world": 4, "alpha": 3e-5,
     "beta": 1e-10},
    {"kind": "small", "grads": [16 * _MiB, 8 * _MiB, 1 * _MiB], "times": [3e-3, 30e-3, 10e-3],
     "world": 2, "alpha": 1e-5, "beta": 1e-9},
    {"kind": "small", "grads": [3 * _MiB, 3 * _MiB, 3 * _MiB, _MiB / 4],
     "times": [1e-3, 1e-5, 1e-5, 16e-3], "world": 4, "alpha": 3e-4, "beta": 1e-9},
)


@exercise(points=2, timeout=60.0, reference=("companion.cost.network.bucketed_exposed",))
def check_bucket_cap(answer) -> str:
    """answer(grad_bytes, backward_seconds, world_size, alpha, beta) -> a bucket cap in bytes.
    grad_bytes[i] is the i-th gradient backward makes (in that order) and backward_seconds[i]
    the time backward spends making it; buckets hold at most the cap (one larger gradient gets a
    bucket of its own), each is all-reduced by a ring as soon as it is complete and the link is
    free. Judged by the communication left after backward ends: at most 1.5x the best cap's
    plus 5% of one whole all-reduce, on models, world sizes and links the notebook does not
    show."""
    from companion.checks.core import call

    cases = [(None, dict(c)) for c in _SMALL_CAP_CASES]
    cases += [(seed, _cap_case(seed)) for seed in _FIXED_CAP_SEEDS + tuple(fresh_seeds(12))]
    for seed, case in cases:
        best = _best_cap(case)
        got = call(answer, list(case["grads"]), list(case["times"]), case["world"],
                   case["alpha"], case["beta"])
        require(isinstance(got, (int, float)) and not isinstance(got, bool) and
                math.isfinite(got) and got > 0,
                f"expected a positive number of bytes, got {got!r}",
                hint="return the cap itself, e.g. 8 * 2**20 for 8 MiB.")
        good, mine, best, best_exposed = _judge_cap(case, float(got), best)
        if not good:
            n_mine = len(network.buckets(case["grads"], float(got)))
            n_best = len(network.buckets(case["grads"], best))
            raise CheckFailed(
                f"{case['kind']} model, {len(case['grads'])} gradients, N = {case['world']}, "
                f"α = {case['alpha'] * 1e6:.0f} µs, {1 / case['beta'] / 1e9:.0f} GB/s, backward "
                f"{sum(case['times']) * 1e3:.2f} ms: your cap of {got:,.0f} B makes {n_mine} "
                f"bucket(s) and leaves {mine * 1e3:.3f} ms exposed; a cap of {best:,.0f} B "
                f"({n_best} bucket(s)) leaves {best_exposed * 1e3:.3f} ms",
                seed=seed, hint="the answer depends on when each gradient is ready and what "
                "each bucket costs on the link: try the caps that change the bucketing and "
                "keep the one whose last all-reduce ends soonest after backward.")
    return (f"within 1.5x of the best cap's exposed communication on {len(cases)} models (small "
            "ones, uniform, a late embedding gradient, an early large head, mixed sizes) at N "
            "from 2 to 64 and links from gloo-like to NCCL-like")
