"""Chapter 05, exercise 3: a dynamic loss scale replayed over recorded gradient maxima."""
from __future__ import annotations

import math
import numbers
import random

import torch

from companion import amp
from companion.amp.scaler import _float32
from companion.checks.core import call, compare, exercise, fresh_seeds, require

__all__ = ["check_replay_loss_scale"]


def _wrong_replay(kind: str):
    """A known-wrong replay of a recorded trace, called like the learner's."""
    def replay(amaxes, init_scale, interval):
        scale, tracker, out = init_scale, 0, []
        for amax in amaxes:
            scaled = amax * scale
            if kind == "at_65504":
                found = not math.isfinite(scaled) or abs(scaled) > 65504
            elif kind == "past_65520":
                found = not math.isfinite(scaled) or abs(scaled) > 65520
            elif kind == "nan_passes":
                found = abs(scaled) >= 65520                     # NaN compares False
            elif kind == "inf_only":
                found = not math.isfinite(scaled)                # overflow of the product, fp32's
            else:
                found = not math.isfinite(scaled) or abs(scaled) >= 65520
            used = scale
            if found:
                scale = scale * 2 if kind == "divide" else scale * 0.5
                tracker = tracker if kind == "count_skipped" else 0
            else:
                tracker += 1
                if tracker >= interval + (kind == "late"):
                    grown = scale * 2
                    if kind == "float64" or math.isfinite(_float32(grown)):
                        scale = grown
                    tracker = tracker if kind == "no_reset" else 0
            out.append((scale if kind == "after" else used, kind == "never_skip" or not found))
        return out
    return replay


_WRONG_REPLAY = {
    "a scaled gradient a little above 65504 still rounds to 65504, fp16's largest value: where "
    "does rounding to nearest stop reaching it? (fp16's next step above 65504 would be 65536.)":
        "at_65504",
    "a scaled gradient of exactly 65520 lies halfway between 65504 and 65536 (fp16's next step "
    "up): which way does rounding to nearest, ties to even, take it, and is that value finite?":
        "past_65520",
    "a NaN gradient must skip the step too, and NaN compares False with every number: test for "
    "finiteness (math.isfinite, torch.isfinite), not with `>`.": "nan_passes",
    "backward runs in fp16: the scaled gradient overflows where fp16 does, long before float32.":
        "inf_only",
    "a skipped step is not a clean one: after an overflow the count starts again at 0.":
        "count_skipped",
    "grow when the count of clean steps reaches growth_interval, not one step later.": "late",
    "each step ran with the scale it had before the update: record it, then update.": "after",
    "the scale is stored in float32 (largest 3.4e38): if the grown scale would be inf there, keep "
    "the old one.": "float64",
    "start counting again after the scale grows, or it grows at every step from then on.":
        "no_reset",
    "an overflowing step is skipped: the optimizer must not step on inf or NaN gradients.":
        "never_skip",
    "back off by multiplying by 0.5: an overflow means the scale was too large.": "divide",
}


def _replay_traces(seed: int) -> list[tuple[str, list[float], float, int]]:
    """(what, trace, init_scale, growth_interval): a noisy run with spikes, inf and NaN; values
    between 65504 and 65520 once scaled, then 65520 itself (the tie that rounds to inf: the scale
    is start / 2 there, after the overflow above 65520 and at most one clean step, whether or
    not the scale grew before it); a scale that float32 cannot grow further. That one
    starts at float32's largest value / 8, not at a power of two: its third growth lands on the
    largest value itself, so a test that stops short of it (`<`, or another dtype's largest
    value), or one that looks further than one growth ahead, keeps a smaller scale."""
    rng = random.Random(seed)
    noisy = [10 ** rng.uniform(-2.5, 0.5) for _ in range(rng.randint(90, 130))]
    for i in rng.sample(range(len(noisy)), len(noisy) // 8):
        noisy[i] *= rng.choice([20.0, 300.0, 1e4, math.inf, math.nan])
    for bad in (math.inf, math.nan):                  # at least one of each, past the start
        noisy[rng.randrange(10, len(noisy))] = bad
    start = 2.0 ** rng.randint(10, 14)
    edge = [rng.randint(65505, 65519) / start for _ in range(rng.randint(3, 6))]
    edge += [rng.randint(65521, 65530) / start, rng.randint(65505, 65519) / (start / 2),
             65520 / (start / 2)]
    edge += [10 ** rng.uniform(-3, -1) for _ in range(6)]
    tiny = [10 ** rng.uniform(-38, -36) for _ in range(10)]
    top = torch.finfo(torch.float32).max
    return [(f"a recorded run of {len(noisy)} steps with spikes, inf and NaN", noisy,
             2.0**16, rng.randint(3, 9)),
            (f"scaled gradients just above 65504 (starting at {start:g})", edge, start, 4),
            ("tiny gradients from float32's largest value / 8, where float32 stops the growth",
             tiny, top / 8, 2)]


def _replay_steps(got, n: int) -> tuple[list[float], list[bool]]:
    require(isinstance(got, (list, tuple)) and len(got) == n,
            f"expected a list of {n} (scale, stepped) pairs, one per step, got "
            f"{type(got).__name__}" + (f" of {len(got)}" if isinstance(got, (list, tuple)) else ""),
            hint="append (scale, stepped) once per entry of amaxes.")
    scales, stepped = [], []
    for i, pair in enumerate(got):
        require(isinstance(pair, (list, tuple)) and len(pair) == 2,
                f"step {i}: expected a (scale, stepped) pair, got {pair!r}"[:200])
        scale, flag = pair
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            scale = scale.item()
        if isinstance(flag, torch.Tensor) and flag.numel() == 1:
            flag = bool(flag.item())
        require(isinstance(scale, numbers.Real) and not isinstance(scale, bool),
                f"step {i}: the scale should be a number, got {type(scale).__name__}")
        require(isinstance(flag, bool), f"step {i}: stepped should be True or False, got "
                                        f"{type(flag).__name__}")
        scales.append(float(scale))
        stepped.append(flag)
    return scales, stepped


@exercise(points=2, reference=("companion.amp.replay_scale", "companion.amp.update_scale",
                               "companion.checks.ch05.loss_scale._wrong_replay",
                               "torch._amp_update_scale_"))
def check_replay_loss_scale(answer) -> str:
    """answer(amaxes, init_scale, growth_interval) -> [(scale, stepped), ...]: the dynamic loss
    scale over a recorded trace of each step's largest unscaled gradient, fp16 backward."""
    skipped = grown = steps = 0
    for what, trace, start, interval in _replay_traces(fresh_seeds(1)[0]):
        want = amp.replay_scale(trace, start, interval)
        wrong = {hint: _wrong_replay(kind)(trace, start, interval)
                 for hint, kind in _WRONG_REPLAY.items()}
        scales, stepped = _replay_steps(call(answer, list(trace), start, interval), len(trace))
        label = f"over {what} (init_scale {start:g}, growth_interval {interval})"
        compare(scales, [s for s, _ in want], name=f"the scale of each step {label}", rtol=1e-6,
                known_wrong={h: [s for s, _ in w] for h, w in wrong.items()})
        flags = "".join("." if f else "S" for _, f in want)
        compare(stepped, [f for _, f in want], name=f"stepped, step by step {label} "
                                                     f"(S: skipped, expected {flags})",
                known_wrong={h: [f for _, f in w] for h, w in wrong.items()})
        skipped += flags.count("S")
        grown += sum(b > a for (a, _), (b, _) in zip(want, want[1:]))
        steps += len(trace)
    return (f"the same scales and skips as torch.amp.GradScaler over {steps} steps of traces you "
            f"had not seen: {skipped} skipped, {grown} growths")
