"""Chapter 08, exercise 3: a schedule of copies down, host steps and copies up that overlaps
them, with and without the barrier that clipping by the global norm (or an fp16 overflow check)
puts before the first host step."""
from __future__ import annotations

import math
import numbers
import random

from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, require
from companion.offload import schedule_groups

__all__ = ["check_offload_schedule"]


def _schedule_cases(seed: int) -> list[tuple]:
    """Per-group times in every regime: host-bound, link-bound down, link-bound up, mixed, and
    gradients that were all ready at once (accumulated over micro-batches)."""
    rng, out = random.Random(seed), []
    for regime in ("host", "down", "up", "mixed", "mixed", "ready", "one"):
        n = 1 if regime == "one" else rng.randint(3, 9)
        scale = {"host": (1, 6, 1), "down": (6, 1, 1), "up": (1, 1, 6)}.get(regime, (2, 2, 2))
        draw = [[round(rng.uniform(0.2, 1.0) * s, 3) for _ in range(n)] for s in scale]
        backward = [round(rng.uniform(0.1, 2.0), 3) for _ in range(n)]
        ready = [0.0] * n if regime == "ready" else [round(sum(backward[:g + 1]), 3)
                                                     for g in range(n)]
        out.append((ready, *draw))
    return out


# A fixed case, first: two groups ready at once whose every stage takes under a second (a
# schedule whose link or CPU is taken to be free only from 1.0 ends late).
_SHORT_SCHEDULE = ([0.0, 0.0], [0.1, 0.2], [0.3, 0.1], [0.2, 0.1])


def _stage_by_stage(ready, down, step, up):
    """A known mistake (the course's own code before it was pipelined): copies down as the
    gradients are ready, then every host step, then every copy up."""
    out, t = {}, 0.0
    for g, at in enumerate(ready):
        out[("down", g)] = t = max(t, at)
        t += down[g]
    for name, seconds in (("step", step), ("up", up)):
        for g in range(len(ready)):
            out[(name, g)] = t
            t += seconds[g]
    return out


def _after_all_downs(ready, down, step, up):
    """A known mistake without the barrier (and the reference with it): the host waits for every
    copy down before its first step, then steps and copies up group by group."""
    return schedule_groups(ready, down, step, up, barrier=True)


def _one_link(ready, down, step, up, barrier=False):
    """A known mistake: one link carrying both directions, one copy at a time."""
    out, link, host = {}, 0.0, 0.0
    downs = []
    for g, at in enumerate(ready):
        out[("down", g)] = start = max(at, link)
        link = start + down[g]
        downs.append(link)
    for g in range(len(ready)):
        out[("step", g)] = start = max(host, downs[-1] if barrier else downs[g])
        host = start + step[g]
        out[("up", g)] = start = max(link, host)
        link = start + up[g]
    return out


def _end(schedule, down, step, up) -> float:
    lengths = {"down": down, "step": step, "up": up}
    return max(t + lengths[name][g] for (name, g), t in schedule.items())


def _validate_schedule(got, ready, down, step, up, barrier, where) -> dict:
    n = len(ready)
    keys = {(name, g) for name in ("down", "step", "up") for g in range(n)}
    if not isinstance(got, dict) or set(got) != keys:
        have = sorted(got)[:4] if isinstance(got, dict) else got
        raise CheckFailed(f"{where}: expected a dict with the keys ('down', g), ('step', g) and "
                          f"('up', g) for g in 0..{n - 1}, got {have!r:.120}",
                          hint="one start time per stage and group: {('down', 0): 0.0, ...}.")
    starts = {}
    for key in keys:
        value = got[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                math.isfinite(value) and value >= 0):
            raise CheckFailed(f"{where}: the start of {key} is {value!r}",
                              hint="start times are finite, non-negative seconds.")
        starts[key] = float(value)
    eps = 1e-9
    lengths = {"down": down, "step": step, "up": up}
    for g in range(n):
        require(starts[("down", g)] >= ready[g] - eps,
                f"{where}: group {g}'s copy down starts at {starts[('down', g)]:g}, before "
                f"backward made its gradients (at {ready[g]:g})",
                hint="a gradient can leave only once backward has made it: ready[g].")
        for before, after, what in (("down", "step", "the host step reads its gradient buffer"),
                                    ("step", "up", "the copy up reads its updated weights")):
            end = starts[(before, g)] + lengths[before][g]
            require(starts[(after, g)] >= end - eps,
                    f"{where}: group {g}'s {after} starts at {starts[(after, g)]:g}, before its "
                    f"{before} ends at {end:g}: {what} before they are there",
                    hint="a buffer can be used only once the stage that fills it has ended.")
    if barrier:
        last = max(starts[("down", g)] + down[g] for g in range(n))
        for g in range(n):
            require(starts[("step", g)] >= last - eps,
                    f"{where}: group {g}'s host step starts at {starts[('step', g)]:g}, before "
                    f"the last gradient has landed (at {last:g}), with barrier=True",
                    hint="with barrier=True the step clips by the global gradient norm (or "
                    "checks every gradient for inf and NaN): no group can be stepped before "
                    "that norm is known, and it needs every gradient.")
    for name, what in (("down", "device-to-host link"), ("step", "CPU"),
                       ("up", "host-to-device link")):
        spans = sorted((starts[(name, g)], starts[(name, g)] + lengths[name][g], g)
                       for g in range(n))
        for (s0, e0, g0), (s1, _, g1) in zip(spans, spans[1:]):
            require(s1 >= e0 - eps, f"{where}: the {what} runs groups {g0} and {g1} at once "
                    f"({s0:g}-{e0:g} and from {s1:g})",
                    hint=f"the {what} does one thing at a time: start the next when it is free.")
    return starts


@exercise(points=1, timeout=10.0, reference="companion.offload.schedule_groups")
def check_offload_schedule(answer) -> str:
    """answer(ready, down, step, up, barrier) -> {(stage, g): start}: a schedule of every group's
    copy down, host step and copy up that uses no buffer before it is filled, does one thing at a
    time per resource, starts no host step before the last gradient has landed when `barrier`
    (clipping by the global norm, an overflow check), and ends no later than the pipeline that
    takes the groups in order (`schedule_groups`)."""
    cases = [_SHORT_SCHEDULE] + _schedule_cases(fresh_seeds(1)[0])
    saved = barrier_cost = 0.0
    for ready, down, step, up in cases:
        for barrier in (False, True):
            where = (f"{len(ready)} group(s), ready {ready}, down {down}, step {step}, up {up}, "
                     f"barrier={barrier}")
            best = _end(schedule_groups(ready, down, step, up, barrier=barrier), down, step, up)
            got = call(answer, list(ready), list(down), list(step), list(up), barrier=barrier)
            starts = _validate_schedule(got, ready, down, step, up, barrier, where)
            mine = _end(starts, down, step, up)
            wrong = {"the stages can overlap: while the host steps group g, the link can bring "
                     "group g+1 down and take group g-1 up.": _stage_by_stage(ready, down, step,
                                                                              up),
                     "the link carries both directions at once (PCIe is full duplex): a copy up "
                     "need not wait for the copies down.": _one_link(ready, down, step, up,
                                                                     barrier)}
            if not barrier:
                wrong["with barrier=False nothing clips the gradients by their global norm or "
                      "checks them for overflow, so a group's host step needs only its own "
                      "gradients: it can start when that group's copy has landed."] = \
                    _after_all_downs(ready, down, step, up)
            hints = [text for text, sched in wrong.items()
                     if abs(_end(sched, down, step, up) - mine) < 1e-9]
            require(mine <= best + 1e-9, f"{where}: your schedule ends at {mine:g}; the pipeline "
                    f"can end at {best:g}", hint=hints[0] if hints else "start each stage as "
                    "soon as its buffer is filled and its resource is free.")
            saved += _end(_stage_by_stage(ready, down, step, up), down, step, up) - mine
            barrier_cost += mine if barrier else -mine
    return (f"valid and no longer than the in-order pipeline in {len(cases)} cases, each with "
            f"and without the barrier ({saved:.1f} time units saved in all against stage by "
            f"stage; with the barrier they end {barrier_cost:.1f} later in all)")
