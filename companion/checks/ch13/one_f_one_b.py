"""Chapter 13, exercise 2: the 1F1B schedule for p stages and m micro-batches, checked on the
simulator's timeline (`companion.pipeline.schedules`): every action once and in an order the
stages can run, the bubble of GPipe, and no stage holding more micro-batches than 1F1B's.

The (p, m) pairs are drawn per call around the edges: one stage, one micro-batch, fewer
micro-batches than stages, as many, and many more; each is simulated with the backward twice the
forward and at another ratio drawn per call."""
from __future__ import annotations

import random
from fractions import Fraction

from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, require
from companion.pipeline.schedules import gpipe, simulate, validate

__all__ = ["check_one_f_one_b"]


def _cases(rng: random.Random) -> list[tuple[int, int]]:
    """(p, m) pairs: one stage; one micro-batch; m < p; m = p; m > p + 1 (twice)."""
    p = [rng.randrange(2, 7) for _ in range(5)]
    return [(1, rng.randrange(1, 6)), (p[0], 1), (p[1] + 1, rng.randrange(2, p[1] + 1)),
            (p[2], p[2]), (p[3], p[3] + rng.randrange(2, 6)), (p[4], 3 * p[4] + rng.randrange(3))]


def _where(p: int, m: int) -> str:
    return f"p = {p} stage{'s' if p > 1 else ''}, m = {m} micro-batch{'es' if m > 1 else ''}"


def _shown(row) -> str:
    """A stage's actions, short: F0 F1 B0 ..."""
    text = " ".join(f"{a[0]}{a[1]}" if isinstance(a, tuple) and len(a) >= 2 else repr(a)
                    for a in list(row)[:24])
    return text + (" ..." if len(row) > 24 else "")


def _schedule(answer, p: int, m: int) -> list:
    """The answer's schedule for (p, m), its shape and actions checked, or a CheckFailed."""
    got = call(answer, p, m)
    where = _where(p, m)
    require(isinstance(got, (list, tuple)) and len(got) == p,
            f"{where}: expected a list of {p} action lists (one per stage), got "
            f"{type(got).__name__}" + (f" of length {len(got)}" if isinstance(got, (list, tuple))
                                       else ""),
            hint="return [[('F', 0), ...], ...]: row s is stage s's actions in order.")
    for s, row in enumerate(got):
        require(isinstance(row, (list, tuple)), f"{where}: stage {s}'s actions are a "
                f"{type(row).__name__}, not a list", hint="each stage's row is a list of "
                "('F', i) and ('B', i) tuples.")
    try:
        validate(got, p, m)
    except ValueError as e:
        raise CheckFailed(f"{where}: {e}", hint="each stage runs the forward and the backward of "
                          "every micro-batch once; a forward needs the stage before it, a "
                          "backward its own forward and the stage after it.") from None
    return [list(row) for row in got]


def _judge(schedule: list, p: int, m: int, ratio) -> None:
    """The bubble of (p, m) and no stage over its share of micro-batches in flight."""
    where = f"{_where(p, m)}, backward {ratio}x the forward"
    timeline = simulate(schedule, forward=1, backward=ratio)
    want = Fraction(p - 1, m + p - 1)
    if timeline.bubble != want:
        late = max(range(p), key=lambda s: timeline.rows[s][-1][2])
        raise CheckFailed(f"{where}: your schedule leaves the stages idle {timeline.bubble} of "
                          f"the time (bubble); 1F1B's, as GPipe's, is (p - 1)/(m + p - 1) = "
                          f"{want}", expected=want, got=timeline.bubble,
                          hint=f"stage {late} ends last: {_shown(schedule[late])}. A stage "
                               "that waits for a backward while a forward could run, or runs a "
                               "forward that delays a backward the stages below wait for, "
                               "stretches the step.")
    for s in range(p):
        held = timeline.peak_in_flight[s]
        if held > p - s:
            raise CheckFailed(f"{where}: stage {s} holds the activations of {held} micro-batches "
                              f"at once; at this p and m, 1F1B's stage {s} holds at most "
                              f"{p - s} (GPipe's holds all {m})",
                              expected=p - s, got=held,
                              hint=f"stage {s} runs {_shown(schedule[s])}. Each forward run "
                                   "before a backward frees one keeps one more micro-batch's "
                                   "activations: start the backwards as soon as the stage "
                                   "can.")


@exercise(points=2, timeout=20.0, reference=("companion.pipeline.schedules.one_f_one_b",
                                             "companion.pipeline.one_f_one_b",
                                             "companion.pipeline.schedules.interleaved_1f1b",
                                             "companion.pipeline.interleaved_1f1b"))
def check_one_f_one_b(answer) -> str:
    """answer(p, m) -> [[("F", i) | ("B", i), ...] for each stage]: the 1F1B schedule."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = _cases(rng)
    other = rng.choice([1, 3, Fraction(3, 2), Fraction(5, 2)])
    for p, m in cases:
        schedule = _schedule(answer, p, m)
        for ratio in (2, other):
            _judge(schedule, p, m, ratio)
    p, m = cases[-1]
    ours = simulate(_schedule(answer, p, m)).peak_in_flight[0]
    theirs = simulate(gpipe(p, m)).peak_in_flight[0]
    return (f"{len(cases)} (p, m) pairs (one stage, one micro-batch, m < p, m = p, m > p), "
            f"backward 2x and {other}x the forward: GPipe's bubble, and at p = {p}, m = {m} the "
            f"first stage holds {ours} micro-batches where GPipe's holds {theirs}")
