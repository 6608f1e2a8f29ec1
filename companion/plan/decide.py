"""The plan chapter 09's reference answer trains (its Exercise 1 withholds this function while an
answer is graded on its own): one rule over the plans predicted to fit."""
from __future__ import annotations

from companion.plan.predict import predict_memory
from companion.plan.space import Candidate, GPTShape, candidates

PARTS = ("accumulation", "checkpointing", "offload")


def rule_plan(shape: GPTShape, batch: int, room: float, *, device_type: str = "cpu",
              allow: tuple[str, ...] = PARTS) -> Candidate:
    """The plan of `allow`'s levers for `batch` sequences that chapter 09's rule keeps among
    those whose predicted peak is at most `room` bytes (the rule is stated in the chapter);
    ValueError when none is predicted to fit."""
    fits = [c for c in candidates(shape, batch, allow=allow)
            if predict_memory(shape, c, device_type=device_type).peak <= room]
    if not fits:
        raise ValueError(f"no plan of {allow} for {batch} sequences is predicted to fit "
                         f"{room:,.0f} bytes")
    return min(fits, key=lambda c: (c.offload, c.accumulation, c.segments))
