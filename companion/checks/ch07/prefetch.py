"""Gathering ZeRO-3 units ahead of their compute (`check_prefetch`)."""
from __future__ import annotations

import torch

from companion.checks.core import (CheckFailed, call, compare, exercise, fresh_seeds, harness,
                                   require)

__all__ = ["check_prefetch"]


class _Work:
    """The handle of the check's asynchronous gather: wait() fills the unit's buffer."""

    def __init__(self, state: dict, i: int, buffer: torch.Tensor):
        self.state, self.i, self.buffer, self.done = state, i, buffer, False

    def wait(self) -> bool:
        self.state["log"].append(("wait", self.i))
        if not self.done:
            self.buffer.copy_(self.state["weights"][self.i])           # the gather lands
            self.done = True
        return True


@harness
def _observe_prefetch(answer, seed: int, n: int, depth: int) -> dict:
    """Run the answer on n units of 4 x 4 weights (each unit: x <- tanh(W x)) with a gather that
    logs when it is issued and waited, and a compute that logs what it got and frees it. Returns
    the log, the most units in memory at once and the outputs, as plain data."""
    g = torch.Generator().manual_seed(seed)
    state = {"log": [], "weights": [torch.randn(4, 4, generator=g) / 2 for _ in range(n)],
             "x": torch.randn(4, generator=g), "in_memory": 0, "peak": 0}
    units = [f"block{seed % 89}.{i}" for i in range(n)]
    index = {u: i for i, u in enumerate(units)}
    owner: dict[int, _Work] = {}                          # buffer address -> its gather

    def gather(unit):
        i = index.get(unit) if isinstance(unit, str) else None
        buffer = torch.full((4, 4), float("nan"))          # garbage until the gather lands
        state["log"].append(("gather", i if i is not None else repr(unit)[:40]))
        state["in_memory"] += 1
        state["peak"] = max(state["peak"], state["in_memory"])
        work = _Work(state, -1 if i is None else i, buffer)
        owner[buffer.data_ptr()] = work
        return buffer, work

    def compute(unit, weights):
        i = index.get(unit) if isinstance(unit, str) else None
        work = owner.get(weights.data_ptr()) if isinstance(weights, torch.Tensor) else None
        state["log"].append(("compute", i if i is not None else repr(unit)[:40],
                             None if work is None else work.i, work is not None and work.done))
        y = torch.full((4,), float("nan"))
        if work is not None:
            y = torch.tanh(weights @ state["x"])
            del owner[weights.data_ptr()]
            weights.fill_(float("nan"))                    # freed, like a reshard
            state["in_memory"] -= 1
        state["x"] = y
        return y.clone()

    result = call(answer, list(units), gather, compute, depth)
    outputs = [o.detach().clone() if isinstance(o, torch.Tensor) else repr(o)[:40]
               for o in result] if isinstance(result, (list, tuple)) else repr(result)[:80]
    return {"log": state["log"], "peak": state["peak"], "outputs": outputs}


def _prefetch_reference(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(4, 4, generator=g) / 2 for _ in range(n)]
    x, out = torch.randn(4, generator=g), []
    for w in weights:
        x = torch.tanh(w @ x)
        out.append(x.clone())
    return out


def _judge_compute(event: tuple, done: int, gathered: list, n: int, depth: int) -> None:
    """One compute event: the right unit, its own waited weights, the next `depth` in flight."""
    _, i, owner, waited = event
    require(i == done, f"compute ran on {i!r} when unit {done} was next",
            hint="compute every unit once, in the order of `units`, with the unit itself "
                 "(units[j]) as its first argument.")
    require(owner == i, f"unit {i} was computed on " + (f"unit {owner}'s weights" if
            isinstance(owner, int) and owner >= 0 else "weights that no gather of it returned"),
            hint="hand compute the `weights` that gather(unit) returned for that same unit.")
    require(waited, f"unit {i} was computed before its gather was waited",
            hint="call work.wait() before compute: until then the buffer holds whatever was in "
                 "memory, not the unit's weights.")
    missing = [j for j in range(i + 1, min(i + depth + 1, n)) if j not in gathered]
    if missing:
        beyond = [j for j in gathered if j > i + depth]
        hint = (f"off by one: you gathered unit {beyond[0]} ahead, but while unit i computes the "
                "units in flight are i+1 … i+depth." if beyond else
                "nothing was in flight: with depth d, the gathers of units i+1 … i+d must be "
                "issued before unit i computes, so they overlap it." if len(missing) == depth
                else "keep depth units in flight: before computing unit i, issue the gathers "
                     "of units up to i+depth that are not issued yet.")
        raise CheckFailed(f"unit {i} was computed before unit {missing[0]}'s gather was "
                          "issued", hint=hint)


def _judge_prefetch(seen: dict, n: int, depth: int, expected: list) -> None:
    """Walk the log in time order; the first broken rule fails with its hint."""
    gathered, done, in_memory = [], 0, 0
    kinds = [event[0] for event in seen["log"]]
    upfront = kinds.index("compute") if "compute" in kinds else len(kinds)   # gathers first
    for event in seen["log"]:
        kind, i = event[0], event[1]
        if kind == "gather":
            require(isinstance(i, int), f"gather was called with {i}, not one of the units",
                    hint="pass the unit itself: gather(units[j]).")
            require(i not in gathered, f"unit {i} was gathered twice",
                    hint="gather each unit once: every gather moves a whole unit's weights.")
            gathered.append(i)
            in_memory += 1
            require(in_memory <= depth + 1, f"{in_memory} units' weights were in memory at "
                    f"once (at most {depth + 1}: the one computing and {depth} in flight)",
                    hint="you gathered every unit before computing: prefetching trades memory "
                    "for overlap, depth units at a time." if kinds[:upfront].count("gather") == n
                    else f"off by one: unit {max(gathered)} was gathered while unit {done} had "
                    "yet to compute; while unit i computes, the units in flight are i+1 … "
                    "i+depth." if max(gathered) > done + depth else
                    "issue unit i+depth's gather only when unit i-1 has been computed (compute "
                    "frees a unit's weights when it returns).")
        elif kind == "wait" and i > done:
            raise CheckFailed(f"unit {i}'s gather was waited before unit {i - 1} was computed",
                              hint="wait for a unit's gather just before computing it: an "
                                   "earlier wait blocks until the gather lands, so it no longer "
                                   "overlaps the compute of the units before it.")
        elif kind == "compute":
            _judge_compute(event, done, gathered, n, depth)
            done, in_memory = done + 1, in_memory - 1
    require(done == n, f"{n - done} of the {n} units were never computed (unit {done} first)",
            hint="run every unit, the last ones too: near the end there is nothing left to "
                 "prefetch, but each unit still has to be gathered, waited and computed.")
    compare(seen["outputs"], expected, name="the outputs",
            hint="return the list of compute's results, one per unit, in order.")


@exercise(points=2, reference="companion.zero.run_with_prefetch")
def check_prefetch(answer) -> str:
    """answer(units, gather, compute, depth) -> outputs: run every unit, in order, with the
    gathers of the next `depth` units in flight while one computes.

    - units: the units, a list in the order they run.
    - gather(unit) -> (weights, work): starts the unit's all-gather and returns at once; the
      buffer `weights` holds garbage until `work.wait()` has returned.
    - compute(unit, weights) -> output: runs the unit on its weights, then frees them.
    - depth: an int >= 0.
    Return the outputs of compute, in the order of `units`. Checked on several unit counts and
    depths: every unit gathered once and computed once, in order, on its own weights after its
    work.wait(); while unit i computes, the gathers of units i+1 … i+depth have been issued; at
    most depth+1 units' weights in memory at once (gathered, not yet computed); unit i's wait
    comes after unit i-1's compute.
    """
    peaks = {}
    for seed, (n, depth) in zip(fresh_seeds(7), [(1, 0), (4, 0), (5, 1), (7, 2), (6, 3),
                                                 (3, 5), (2, 1)]):
        want = _prefetch_reference(seed, n)
        seen = _observe_prefetch(answer, seed, n, depth)
        try:
            _judge_prefetch(seen, n, depth, want)
        except CheckFailed as failure:
            failure.summary = f"{n} unit{'s' * (n != 1)}, depth {depth}: {failure.summary}"
            raise
        peaks[n, depth] = seen["peak"]
    return (f"1 to 7 units at depths 0 to 5 run in order, units i+1 … i+depth in flight while "
            f"unit i computes; 7 units at depth 2 held at most {peaks[7, 2]} units' weights at "
            "once (7 if all were gathered up front), and no unit was gathered twice")
