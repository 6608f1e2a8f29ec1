"""Read timings the way a noisy machine demands: medians of interleaved repeats, a confidence
interval for a ratio, and a rank test that says "faster", "slower" or "no difference detected".

A min–max range over five runs says little: one slow run (a page fault, another process) moves it,
and two overlapping ranges do not mean "the same speed". Three tools replace it:

- `interleave` times several functions in rounds, each round in a new random order
  (`round_order`), so that a slow minute of the machine lands on every contender rather than on
  one, and no contender always runs right after the same other one (a large transfer leaves the
  caches and the transport's buffers in a state the next call pays for: a rotation keeps that
  neighbour fixed, a shuffle spreads it);
- `ratio_interval` is a bootstrap confidence interval of median(a) / median(b) (Efron &
  Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13, the percentile interval);
- `rank_test` is the Mann–Whitney U test (Mann & Whitney 1947), exact for the small samples a
  notebook takes: with 5 runs against 5, every run of one below every run of the other happens
  by luck 2 times in 252 (p ≈ 0.008), while 3 against 3 can never reach p < 0.05 (2 in 20);
- `spearman` is Spearman's rank correlation (Spearman 1904): whether two lists put things in the
  same order (a cost model's predicted step times against the measured ones), whatever the scale.

`compare(a, b)` joins them into one sentence a notebook can print.

Example:
    >>> times = interleave({"fp32": f32, "bf16": bf16}, rounds=7)
    >>> compare(times["bf16"], times["fp32"]).sentence("bf16", "fp32")
    'bf16 takes 0.42x the time of fp32 (95% interval 0.39-0.46): faster (p = 0.001, 7 and 7 runs)'
"""
from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from functools import lru_cache
from typing import Callable, Mapping, Sequence

__all__ = ["interleave", "round_order", "ratio_interval", "rank_test", "compare", "Comparison", "spread",
           "rankdata", "spearman"]


def _check(name: str, xs: Sequence[float]) -> list[float]:
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError(f"{name} is empty: time something first")
    if any(math.isnan(x) or math.isinf(x) for x in xs):
        raise ValueError(f"{name} holds a NaN or an infinity: {xs}")
    return xs


def round_order(n: int, r: int, seed: int = 0) -> list[int]:
    """The order of round `r` over `n` contenders: a permutation drawn from `seed` and `r` alone,
    so every rank of a distributed run (each calling it with the same arguments) runs the same
    collective at the same time."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + r).shuffle(order)
    return order


def interleave(fns: Mapping[str, Callable[[], object]], *, rounds: int = 5, warmup: int = 1,
               clock: Callable[[], float] = time.perf_counter,
               seed: int = 0) -> dict[str, list[float]]:
    """Seconds of each call of each function, `rounds` rounds after `warmup` untimed ones; each
    round runs every function once, in the order `round_order(len(fns), r, seed)`."""
    if rounds < 1 or warmup < 0:
        raise ValueError("rounds must be at least 1 and warmup non-negative")
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for i in round_order(len(names), r, seed):
            start = clock()
            fns[names[i]]()
            if r >= warmup:
                out[names[i]].append(clock() - start)
    return out


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of `xs`."""
    xs = sorted(_check("xs", xs))
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q1, q3


def ratio_interval(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median(a) / median(b), low, high): a percentile-bootstrap interval of the ratio of medians,
    resampling a and b independently."""
    a, b = _check("a", a), _check("b", b)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if min(b) <= 0:
        raise ValueError("b must be positive: it divides")
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a)))
                    / statistics.median(rng.choices(b, k=len(b))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = ratios[int(tail * (resamples - 1))]
    high = ratios[int(math.ceil((1 - tail) * (resamples - 1)))]
    return statistics.median(a) / statistics.median(b), low, high


@lru_cache(maxsize=None)
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """counts[u]: how many orderings of m a's and n b's have exactly u pairs with the a below the
    b: the exact null distribution of the Mann–Whitney U statistic, as integers."""
    if m == 0 or n == 0:
        return (1,)
    # the largest element is an a (it beats no b: U unchanged, m-1 left) or a b (every a is
    # below it: U grows by m, n-1 left)
    with_a, with_b = _u_counts(m - 1, n), _u_counts(m, n - 1)
    out = [0] * (m * n + 1)
    for u, c in enumerate(with_a):
        out[u] += c
    for u, c in enumerate(with_b):
        out[u + m] += c
    return tuple(out)


def rank_test(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of the Mann–Whitney U test that a and b come from one distribution:
    exact for up to 30 values each (ties count one half), a normal approximation beyond."""
    a, b = _check("a", a), _check("b", b)
    m, n = len(a), len(b)
    u = sum((x < y) + 0.5 * (x == y) for x in a for y in b)      # pairs where a is smaller
    tail = min(u, m * n - u)
    if m <= 30 and n <= 30:
        counts = _u_counts(m, n)
        below = sum(counts[: int(math.floor(tail)) + 1])
        return min(1.0, 2 * below / math.comb(m + n, m))
    sd = math.sqrt(m * n * (m + n + 1) / 12)
    z = (tail + 0.5 - m * n / 2) / sd                               # continuity-corrected
    return min(1.0, 2 * 0.5 * math.erfc(-z / math.sqrt(2)))


def rankdata(xs: Sequence[float]) -> list[float]:
    """The rank of each value of `xs`, 1 for the smallest; tied values share the average of the
    ranks they span ([10, 20, 20, 30] -> [1, 2.5, 2.5, 4])."""
    xs = _check("xs", xs)
    order = sorted(range(len(xs)), key=xs.__getitem__)
    out = [0.0] * len(xs)
    start = 0
    while start < len(order):                      # a run of equal values: order[start:end]
        end = start + 1
        while end < len(order) and xs[order[end]] == xs[order[start]]:
            end += 1
        for i in order[start:end]:
            out[i] = (start + 1 + end) / 2         # the mean of ranks start+1 .. end
        start = end
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of a and b: the Pearson correlation of their ranks (ties get
    average ranks), in [-1, 1]; 1 when b grows wherever a does.

    Without ties it equals 1 - 6·Σd² / (n·(n² - 1)), d the rank differences: one swap of two
    neighbours among 10 costs 12/990 ≈ 0.012; one plan moved 5 places among 10 (the 5 it passes
    move one each: Σd² = 25 + 5) costs 180/990 ≈ 0.18.
    """
    a, b = _check("a", a), _check("b", b)
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"spearman needs two lists of the same length, at least 2, got "
                         f"{len(a)} and {len(b)}")
    ra, rb = rankdata(a), rankdata(b)
    mean = (len(a) + 1) / 2                        # the mean rank, ties or not
    da, db = [r - mean for r in ra], [r - mean for r in rb]
    sa, sb = sum(d * d for d in da), sum(d * d for d in db)
    if sa == 0 or sb == 0:
        raise ValueError(f"spearman is undefined when one list has a single value throughout "
                         f"(no order to compare): a={a}, b={b}")
    return sum(x * y for x, y in zip(da, db)) / math.sqrt(sa * sb)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """median(a) / median(b), its interval, the rank test's p-value and what they let one say."""

    ratio: float
    low: float
    high: float
    p: float
    runs: tuple[int, int]
    level: float = 0.05

    @property
    def verdict(self) -> str:
        """"faster" (a takes less time), "slower", or "no difference detected at N runs"."""
        if self.p < self.level and self.high < 1:
            return "faster"
        if self.p < self.level and self.low > 1:
            return "slower"
        return f"no difference detected at {min(self.runs)} runs"

    def sentence(self, a: str = "a", b: str = "b") -> str:
        """One line for a notebook: the ratio, its interval, the verdict and the evidence."""
        return (f"{a} takes {self.ratio:.2f}x the time of {b} (95% interval {self.low:.2f}-"
                f"{self.high:.2f}): {self.verdict} (p = {self.p:.3f}, {self.runs[0]} and "
                f"{self.runs[1]} runs)")


def compare(a: Sequence[float], b: Sequence[float], *, level: float = 0.05,
            seed: int = 0) -> Comparison:
    """Times `a` against times `b` (ideally from `interleave`): ratio of medians with a 95%
    bootstrap interval, and a verdict that needs both the rank test (p < level) and the interval
    (on one side of 1)."""
    ratio, low, high = ratio_interval(a, b, seed=seed)
    return Comparison(ratio, low, high, rank_test(a, b), (len(a), len(b)), level)
