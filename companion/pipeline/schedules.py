"""Pipeline schedules as data, checked and simulated on unit times.

A pipeline splits the model's layers over p stages (one per rank) and the batch into m
micro-batches. A schedule says, for each stage, the order of its actions: `("F", i)` runs the
forward of micro-batch i on that stage, `("B", i)` its backward. Interleaved schedules give each
stage v model chunks (stage s holds virtual stages s, s + p, ..., s + (v-1)p) and their actions
name the chunk too: `("F", i, c)`.

- GPipe (Huang et al. 2019): every forward, then every backward. A stage holds the activations of
  all m micro-batches at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2.1): stage s runs p - s - 1 warm-up forwards,
  then alternates one forward and one backward. Same bubble as GPipe, but stage s holds at most
  p - s micro-batches, whatever m is.
- Interleaved 1F1B (§2.2.2): with v chunks per stage each forward and backward is v times shorter,
  and the bubble shrinks by the factor v, at the price of v times more messages.

With forward time t_f and backward time t_b per micro-batch on a whole stage, GPipe and 1F1B both
end at (m + p - 1)(t_f + t_b) (the tests check t_b = 2 t_f, the default, and other ratios): each
stage is busy m(t_f + t_b), so the bubble (idle share of the p × makespan rectangle) is
(p - 1)/(m + p - 1), and the bubble against the ideal time is (p - 1)/m. Interleaved 1F1B ends at
(m + (p - 1)/v)(t_f + t_b): (p - 1)/(v m) against the ideal, v times smaller, and
(p - 1)/(v m + p - 1) of the rectangle.

Example:
    >>> timeline = simulate(one_f_one_b(4, 8))
    >>> timeline.bubble, timeline.peak_in_flight[0]       # (Fraction(3, 11), 4)
    >>> simulate(gpipe(4, 8)).peak_in_flight[0]           # 8

Simplified vs PyTorch (torch.distributed.pipelining) / Megatron: PyTorch's schedules are classes
that also run the actions (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`, and
zero-bubble ones that split the backward in two); Megatron builds the same orders inside its
training loop. Here a schedule is a plain list, the simulator has no communication time, and the
interleaved order is Megatron's (m must be a multiple of p).
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "validate", "simulate", "Timeline",
           "peak_held_bytes"]


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def gpipe(p: int, m: int) -> list[list[tuple]]:
    """GPipe: on every stage, the m forwards in order, then the m backwards in order."""
    _positive(p=p, m=m)
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[tuple]]:
    """1F1B: stage s warms up with p - s - 1 forwards, then alternates F and B, then drains."""
    _positive(p=p, m=m)
    schedule = []
    for s in range(p):
        warm = min(p - s - 1, m)
        actions = [("F", i) for i in range(warm)]              # 1. warm-up: fill the pipe
        for i in range(m - warm):                              # 2. steady state: one F, one B
            actions += [("F", warm + i), ("B", i)]
        actions += [("B", i) for i in range(m - warm, m)]      # 3. cool-down: drain it
        schedule.append(actions)
    return schedule


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[tuple]]:
    """Interleaved 1F1B with v chunks per stage (Megatron's order; m a multiple of p).

    Micro-batches go through the chunks in groups of p: forwards of micro-batches 0..p-1 on chunk
    0, then on chunk 1, ..., then micro-batches p..2p-1; backwards take the chunks in reverse."""
    _positive(p=p, m=m, v=v)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches through the chunks in groups of "
                         f"p = {p}: m = {m} must be a multiple of p")

    def order(k: int, backward: bool) -> tuple:
        group, j = divmod(k, p * v)
        chunk = j // p if not backward else v - 1 - j // p
        return ("B" if backward else "F", group * p + j % p, chunk)

    total, schedule = m * v, []
    for s in range(p):
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        actions = [order(k, False) for k in range(warm)]
        for k in range(total - warm):
            actions += [order(warm + k, False), order(k, True)]
        actions += [order(k, True) for k in range(total - warm, total)]
        schedule.append(actions)
    return schedule


def _parse(action, s: int, m: int, v: int) -> tuple[str, int, int]:
    """("F", i) or ("F", i, chunk) -> (op, i, chunk), with a clear error for anything else."""
    ok = (isinstance(action, tuple) and len(action) in (2, 3) and action[0] in ("F", "B")
          and all(isinstance(x, int) and not isinstance(x, bool) for x in action[1:]))
    if not ok:
        raise ValueError(f"stage {s}: {action!r} is not an action; write ('F', i) or ('B', i), "
                         "or ('F', i, chunk) for interleaved schedules")
    op, i, c = action if len(action) == 3 else (*action, 0)
    if not 0 <= i < m or not 0 <= c < v:
        raise ValueError(f"stage {s}: {action!r} names micro-batch {i} of chunk {c}; there are "
                         f"micro-batches 0..{m - 1} and chunks 0..{v - 1}")
    return op, i, c


def _chunks(schedule) -> int:
    return 1 + max((a[2] for row in schedule for a in row
                    if isinstance(a, tuple) and len(a) == 3 and isinstance(a[2], int)), default=0)


def _deps(op: str, i: int, k: int, stages: int) -> list[tuple[str, int, int]]:
    """What (op, micro-batch i, virtual stage k) waits for."""
    if op == "F":
        return [("F", i, k - 1)] if k > 0 else []
    return [("F", i, k)] + ([("B", i, k + 1)] if k < stages - 1 else [])


def validate(schedule, p: int, m: int) -> None:
    """Raise ValueError unless every stage runs F and B of each micro-batch (and chunk) exactly
    once, each B after its own F, and the stages, each in its own order, can all finish."""
    _positive(p=p, m=m)
    if not isinstance(schedule, (list, tuple)) or len(schedule) != p:
        raise ValueError(f"a schedule is a list of p = {p} action lists (one per stage), got "
                         f"{type(schedule).__name__} of length {len(schedule) if isinstance(schedule, (list, tuple)) else '?'}")
    v = _chunks(schedule)
    for s, row in enumerate(schedule):
        seen = set()
        for action in row:
            op, i, c = _parse(action, s, m, v)
            if (op, i, c) in seen:
                raise ValueError(f"stage {s} runs {action!r} twice")
            if op == "B" and ("F", i, c) not in seen:
                raise ValueError(f"stage {s} runs {action!r} before the forward of micro-batch "
                                 f"{i}: a backward needs the activations its forward saved")
            seen.add((op, i, c))
        missing = [(op, i, c) for op in "FB" for i in range(m) for c in range(v)
                   if (op, i, c) not in seen]
        if missing:
            raise ValueError(f"stage {s} never runs {missing[:4]} (op, micro-batch, chunk)"
                             f"{' and more' if len(missing) > 4 else ''}")
    _play(schedule, p, m, v, 1, 1)


@dataclasses.dataclass
class Timeline:
    """A simulated run: per stage, (action, start, end) in order; times are exact fractions."""
    rows: list[list[tuple[tuple, Fraction, Fraction]]]
    makespan: Fraction
    busy: Fraction                      # the work of one stage: m (t_f + t_b)
    peak_in_flight: list[int]           # per stage: most (micro-batch, chunk) pairs F done, B not

    @property
    def bubble(self) -> Fraction:
        """Idle share of the p × makespan rectangle: 1 - busy / makespan."""
        return 1 - self.busy / self.makespan

    @property
    def bubble_over_ideal(self) -> Fraction:
        """Narayanan et al.'s bubble time fraction: idle time over the ideal time, busy."""
        return (self.makespan - self.busy) / self.busy


def simulate(schedule, *, forward=1, backward=2) -> Timeline:
    """Run a schedule on unit times: each stage takes its actions in order, each as soon as its
    dependencies are done; forward/backward are a whole stage's times for one micro-batch (a chunk
    of an interleaved stage takes 1/v of them); sending takes no time."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError("a schedule is a non-empty list of action lists, one per stage")
    m = 1 + max((a[1] for row in schedule for a in row
                 if isinstance(a, tuple) and len(a) > 1 and isinstance(a[1], int)), default=0)
    for name, t in (("forward", forward), ("backward", backward)):
        if isinstance(t, bool) or not isinstance(t, (int, float, Fraction)) or t <= 0:
            raise ValueError(f"{name} time must be a positive number, got {t!r}")
    validate(schedule, len(schedule), m)
    return _play(schedule, len(schedule), m, _chunks(schedule), Fraction(forward),
                 Fraction(backward))


def _play(schedule, p: int, m: int, v: int, t_f, t_b) -> Timeline:
    """The simulation itself: sweep the stages until none can go on; refuse a deadlock."""
    stages, end = p * v, {}                 # (op, i, virtual stage) -> its end time
    pos, free = [0] * p, [Fraction(0)] * p
    rows: list[list] = [[] for _ in range(p)]
    held, peak = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                action = schedule[s][pos[s]]
                op, i, c = _parse(action, s, m, v)
                deps = _deps(op, i, c * p + s, stages)
                if any(d not in end for d in deps):
                    break
                start = max([free[s]] + [end[d] for d in deps])
                free[s] = end[(op, i, c * p + s)] = start + (t_f if op == "F" else t_b) / v
                rows[s].append((action, start, free[s]))
                held[s] += 1 if op == "F" else -1
                peak[s] = max(peak[s], held[s])
                pos[s], progress = pos[s] + 1, True
    stuck = [s for s in range(p) if pos[s] < len(schedule[s])]
    if stuck:
        raise ValueError("deadlock: no stage can go on. " + "; ".join(
            _waiting(schedule, s, pos, end, p, m, v) for s in stuck))
    return Timeline(rows, max(free), m * (t_f + t_b), peak)


def _waiting(schedule, s: int, pos: list[int], end: dict, p: int, m: int, v: int) -> str:
    action = schedule[s][pos[s]]
    op, i, c = _parse(action, s, m, v)
    missing = [d for d in _deps(op, i, c * p + s, p * v) if d not in end][0]
    owner = missing[2] % p
    return (f"stage {s} waits at {action!r} for {missing[0]} of micro-batch {i} on stage {owner}"
            f"{f' (chunk {missing[2] // p})' if v > 1 else ''}, not run yet: stage {owner} is "
            f"stuck at {schedule[owner][pos[owner]]!r}")


def peak_held_bytes(schedule, stage: int, per_chunk: list[int]) -> int:
    """The most bytes stage `stage` holds for backward when a forward of chunk c keeps
    `per_chunk[c]` bytes until its backward: `peak_in_flight` weighted by chunk (each chunk of an
    interleaved stage holds different layers, so its micro-batches cost different bytes)."""
    if not isinstance(stage, int) or not 0 <= stage < len(schedule):
        raise ValueError(f"stage must be 0..{len(schedule) - 1}, got {stage!r}")
    m = 1 + max(a[1] for row in schedule for a in row)
    validate(schedule, len(schedule), m)
    if len(per_chunk) != _chunks(schedule):
        raise ValueError(f"per_chunk needs one byte count per chunk ({_chunks(schedule)}), "
                         f"got {len(per_chunk)}")
    held = peak = 0
    for action in schedule[stage]:
        op, _, c = _parse(action, stage, m, len(per_chunk))
        held += per_chunk[c] if op == "F" else -per_chunk[c]
        peak = max(peak, held)
    return peak
