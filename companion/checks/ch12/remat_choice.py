"""Chapter 12, exercise 3: keep, recompute or offload each saved tensor when a side stream hides
the copies behind compute."""
from __future__ import annotations

import random

import numpy as np

from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, require

__all__ = ["check_choose_remat", "added_seconds"]

WORDS = ("keep", "recompute", "offload")


def added_seconds(tensors, choices, rate: float, window: float) -> float:
    """Seconds a choice adds to the step: the recomputed tensors' seconds, and each direction's
    copies beyond what `window` seconds of compute hide (down in forward, up in backward)."""
    recompute = sum(s for (_, s), c in zip(tensors, choices) if c == "recompute")
    offloaded = sum(b for (b, _), c in zip(tensors, choices) if c == "offload")
    return recompute + 2 * max(0.0, offloaded / rate - window)


def _best(tensors, budget: int, rate: float, window: float) -> tuple[float, list[str]]:
    """Every one of the 3^n choices at once (numpy): the least added seconds within the budget."""
    n = len(tensors)
    codes = np.stack(np.unravel_index(np.arange(3 ** n), (3,) * n), axis=1)   # (3^n, n)
    nbytes = np.array([b for b, _ in tensors], dtype=np.float64)
    seconds = np.array([s for _, s in tensors], dtype=np.float64)
    kept = (codes == 0) @ nbytes
    cost = (codes == 1) @ seconds + 2 * np.maximum(0.0, (codes == 2) @ nbytes / rate - window)
    cost[kept > budget] = np.inf
    best = int(np.argmin(cost))
    return float(cost[best]), [WORDS[c] for c in codes[best]]


def _crafted(rng: random.Random) -> list[tuple]:
    """(label, tensors, budget, rate, window) in units of U bytes and S seconds, each built so
    that one kind of mistake cannot pass it, whatever the draw (the units and order are drawn)."""
    U, S = 2 ** rng.randrange(16, 24), rng.choice([1e-4, 3e-4, 2e-3])
    def scaled(pairs):
        pairs = [(b * U, s * S) for b, s in pairs]
        rng.shuffle(pairs)
        return pairs
    spread = [(rng.randrange(1, 9), rng.randrange(1, 6)) for _ in range(6)]
    return [
        ("three tensors, a slow link", scaled([(6, 7), (5, 5), (5, 5)]), 10 * U, U / (10 * S), 0.0),
        ("a budget of 0, a window that hides every copy", scaled(spread), 0, U / S,
         sum(b for b, _ in spread) * S * rng.uniform(1.0, 1.5)),
        ("a budget of 0, no window", scaled([(1, 1.5)] * 3), 0, U / S, 0.0),
        ("a budget of 0, a window that hides one copy of three", scaled([(3, 0.5)] * 3), 0,
         5 * U / S, 1.0 * S),
        ("a budget that holds everything", scaled(spread), sum(b for b, _ in spread) * U, U / S,
         0.0),
        ("a budget one byte short of a tensor", scaled([(4, 9), (1, 0.5)]), 4 * U - 1,
         U / (3 * S), 0.0),
        # a window hides half of a copy, and copy and recompute lie one byte's transfer apart:
        # a count of copied bytes off by one picks the wrong one
        ("a copy that beats recompute by one byte's time", scaled([(2, 2 + 1 / U), (1, 9)]),
         U, U / S, 1.0 * S),
        ("a recompute that beats the copy by one byte's time", scaled([(2, 2 - 1 / U), (1, 9)]),
         U, U / S, 1.0 * S),
        # the window hides two of the smaller copies exactly: offloading the dearest tensor per
        # byte first leaves one small copy exposed
        ("a window that fits two small copies", scaled([(6, 6.0), (5, 4.9), (5, 4.9)]), 0,
         U / S, 10.0 * S),
        # what to keep depends on the window: keeping by the cheaper of recompute and an
        # unhidden copy, then splitting the rest, keeps the wrong pair
        ("a window that changes what to keep", scaled([(2, 3.45), (6, 1.25), (4, 4.45)]),
         10 * U, U / S, 3.5 * S),
    ]


def _drawn(rng: random.Random) -> list[tuple]:
    """Fresh random cases: no window, a window that hides part of the copies, one that hides
    them all."""
    cases = []
    for label, hides in (("no window", 0.0), ("a window hiding part", rng.uniform(0.2, 0.6)),
                         ("a window hiding all", 1.1)):
        n = rng.randrange(7, 11)
        tensors = [(rng.randrange(1, 2 ** 20) * 4, rng.uniform(1e-4, 5e-3)) for _ in range(n)]
        total = sum(b for b, _ in tensors)
        rate = rng.choice([2e9, 12e9, 25e9])
        budget = int(total * rng.uniform(0.2, 0.7))
        cases.append((f"{n} random tensors, {label}", tensors, budget, rate,
                       hides * total / rate))
    return cases


@exercise(points=2, timeout=20.0, reference=("companion.checkpointing.budget.solve",
                                             "companion.checkpointing.solve",
                                             "companion.checks.ch12.remat_choice._best"))
def check_choose_remat(answer) -> str:
    """answer(tensors, budget_bytes, host_bytes_per_second, window_seconds) -> ["keep" |
    "recompute" | "offload", ...]: within the budget, the least added seconds."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = _crafted(rng) + _drawn(rng)
    for label, tensors, budget, rate, window in cases:
        want, best = _best(tensors, budget, rate, window)
        got = call(answer, list(tensors), budget, rate, window)
        where = (f"{label} ({len(tensors)} tensors, budget {budget:,} bytes, "
                 f"{rate / 1e9:.3g} GB/s, window {window * 1e3:.3g} ms)")
        sized = isinstance(got, (list, tuple))
        require(sized and len(got) == len(tensors), f"{where}: expected a list of "
                f"{len(tensors)} choices, one per tensor, got {type(got).__name__}"
                + (f" of {len(got)}" if sized else ""))
        bad = [c for c in got if c not in WORDS]
        require(not bad, f"{where}: each choice is 'keep', 'recompute' or 'offload'; got "
                         f"{bad[:1]!r}")
        kept = sum(b for (b, _), c in zip(tensors, got) if c == "keep")
        require(kept <= budget, f"{where}: the kept tensors hold {kept:,} bytes, over the budget "
                                f"of {budget:,}",
                hint="only the kept tensors stay on the device; they must fit the budget.")
        mine = added_seconds(tensors, got, rate, window)
        if mine > want * (1 + 1e-9) + 1e-15:
            raise CheckFailed(f"{where}: your choice adds {mine * 1e3:.6g} ms; another within "
                              f"the budget adds {want * 1e3:.6g} ms",
                              expected=want, got=mine, hint=_hint(tensors, got, best, rate, window))
    return (f"{len(cases)} cases, from a window of 0 (every copy exposed) to one that hides "
            "them all: each choice fits and adds the least time")


def _hint(tensors, got, best, rate: float, window: float) -> str:
    """What the answer's choice did differently from a best one."""
    offloaded = [sum(b for (b, _), c in zip(tensors, choice) if c == "offload")
                 for choice in (got, best)]
    hides = f", and {window * 1e3:.3g} ms of compute can hide copies in each direction"
    if offloaded[0] / rate > window and offloaded[0] > offloaded[1]:
        return ("the copies beyond the window are exposed: down in forward, and up again in "
                "backward.")
    if offloaded[0] < offloaded[1]:
        return (f"your copies take {offloaded[0] / rate * 1e3:.3g} ms each way"
                + (hides if window > 0 else "") + ": price a copy against recomputing.")
    return ("keeping one large tensor can leave out two smaller ones worth more together: a "
            "choice made tensor by tensor can miss the best set.")
