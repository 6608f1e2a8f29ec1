"""Chapter 13, exercise 3: choose t, p, d and the ZeRO stage for a model and a cluster under a
memory limit, priced by `companion.plan.parallel`'s formulas."""
from __future__ import annotations

import random

from companion.checks.core import CheckFailed, call, exercise, fresh_seeds, require
from companion.plan.parallel import Layout, Shape, estimate, memory, step_time

__all__ = ["check_choose_parallel", "exercise_layout", "TOLERANCE"]

TOLERANCE = 0.02              # an answer within 2% of the best step time passes
GPU = "H100 SXM"


def exercise_layout(t: int, p: int, d: int, zero: int, batch_sequences: int) -> Layout:
    """The exercise's layout: no context parallelism, one sequence a micro-batch (batch / d of
    them), selective checkpointing, plain 1F1B."""
    return Layout(t, p, 1, d, zero, 1, batch_sequences // d, "selective")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _best(shape: Shape, gpus: int, node: int, limit: int, seq: int, batch: int):
    """(seconds, (t, p, d, zero), bytes) of the fastest layout that fits; None if none does."""
    best = None
    for t in _divisors(node):
        for p in _divisors(gpus // t) if gpus % t == 0 else ():
            d = gpus // (t * p)
            if shape.heads % t or shape.kv_heads % t or shape.layers % p or batch % d:
                continue
            for zero in ((0, 1) if d > 1 else (0,)):
                e = estimate(shape, exercise_layout(t, p, d, zero, batch), seq, gpu=GPU,
                             gpus_per_node=node)
                if e.fits(limit) and (best is None or e.seconds < best[0]):
                    best = (e.seconds, (t, p, d, zero), e.total_bytes)
    return best


def _price(shape: Shape, layout: Layout, seq: int, node: int) -> tuple[int, float]:
    """(bytes, seconds) by the formulas, whatever rules the layout breaks."""
    return (int(sum(x.value for x in memory(shape, layout, seq)[1])),
            sum(x.value for x in step_time(shape, layout, seq, gpu=GPU, gpus_per_node=node)))


# shapes no notebook cell uses: (layers, width, heads, kv_heads, intermediate, vocab)
_SHAPES = {"a 3B-like": (30, 3072, 24, 8, 8192, 64000),
           "a 13B-like": (40, 5120, 40, 8, 13824, 32000),
           "a 34B-like": (48, 8192, 64, 8, 22016, 32000),
           "a 110B-like": (80, 12288, 96, 8, 32768, 64000)}


def _crafted(rng: random.Random) -> list[tuple]:
    """(label, shape, gpus, gpus per node, limit, seq, batch): each built so that one kind of
    mistake cannot pass, whatever the draw. Limits are set from the formulas themselves."""
    def shape(name):
        return Shape(*_SHAPES[name])
    small, mid, big = shape("a 3B-like"), shape("a 13B-like"), shape("a 34B-like")
    cases = [("a small model, memory to spare", small, 16, 8, 80 * 2 ** 30, 4096,
              rng.choice([256, 512])),
             ("a wide model on few layers' worth of GPUs", shape("a 110B-like"), 32, 8,
              78 * 2 ** 30, 4096, 256),
             ("two GPUs to a node, a short batch", big, 16, 2, 64 * 2 ** 30, 4096, 16),
             ("48 layers over 32 GPUs", big, 32, 4, 40 * 2 ** 30, 4096, 256),
             # 30 layers: p is 1 or 2 on 16 GPUs; p = 4 or 8 would be faster, were it whole
             ("30 layers over 16 GPUs", small, 16, 8, 9 * 2 ** 30, 2048, 256)]
    # the fastest layout of all, left just out of reach
    free = _best(mid, 32, 8, 10 ** 15, 4096, 256)
    cases.append(("a limit one byte under the fastest layout's", mid, 32, 8, free[2] - 1, 4096,
                  256))
    return cases


def _drawn(rng: random.Random) -> list[tuple]:
    """Fresh random cases: a shape, the fewest nodes on which it fits 80 GiB, and a limit
    between the least that fits and 1.6 times it."""
    cases = []
    for name in rng.sample(sorted(_SHAPES), 2):
        shape = Shape(*_SHAPES[name])
        node, seq = rng.choice([4, 8]), rng.choice([2048, 4096])
        for nodes in (2, 4, 8, 16):
            gpus = node * nodes
            batch = gpus * rng.choice([4, 8, 16])
            floor = _least_bytes(shape, gpus, node, seq, batch)
            if floor is not None and floor * 1.05 <= 80 * 2 ** 30:
                break
        else:
            continue
        limit = int(floor * rng.uniform(1.05, 1.6))
        cases.append((f"{name} on {gpus} GPUs, {node} to a node", shape, gpus, node, limit,
                      seq, batch))
    return cases


def _least_bytes(shape: Shape, gpus: int, node: int, seq: int, batch: int) -> int:
    """The least memory per GPU over the valid layouts."""
    least = None
    for t in _divisors(node):
        for p in _divisors(gpus // t) if gpus % t == 0 else ():
            d = gpus // (t * p)
            if shape.heads % t or shape.kv_heads % t or shape.layers % p or batch % d:
                continue
            total = _price(shape, exercise_layout(t, p, d, 1 if d > 1 else 0, batch), seq,
                           node)[0]
            least = total if least is None else min(least, total)
    return least


def _verdict(got, shape: Shape, gpus: int, node: int, limit: int, seq: int, batch: int,
             where: str) -> tuple[float, tuple]:
    """The answer's (seconds, layout), or a CheckFailed naming the rule it breaks."""
    require(isinstance(got, (tuple, list)) and len(got) == 4, f"{where}: expected (t, p, d, "
            f"zero_stage), four whole numbers; got {got!r}"[:300])
    require(all(isinstance(n, int) and not isinstance(n, bool) for n in got),
            f"{where}: t, p, d and zero_stage are whole numbers (int); got {got!r}")
    t, p, d, zero = got
    require(min(t, p, d) >= 1 and zero in (0, 1), f"{where}: t, p and d are at least 1 and "
            f"zero_stage 0 or 1; got {got!r}")
    require(t * p * d == gpus, f"{where}: t·p·d = {t * p * d}, not the {gpus} GPUs",
            hint="every GPU holds one (tensor, pipeline, data) coordinate: t·p·d == gpus.")
    require(t <= node and node % t == 0, f"{where}: t={t} crosses the node of {node} GPUs",
            hint="tensor parallelism talks at every layer: keep its group inside one node's "
                 "NVLink.")
    require(shape.heads % t == 0 and shape.kv_heads % t == 0,
            f"{where}: t={t} does not divide the {shape.heads} heads and {shape.kv_heads} "
            "key/value heads", hint="each rank owns whole heads: t divides both.")
    require(shape.layers % p == 0, f"{where}: p={p} does not divide the {shape.layers} layers",
            hint="each pipeline stage holds L/p whole layers.")
    require(batch % d == 0, f"{where}: d={d} does not divide the {batch} sequences")
    require(zero == 0 or d > 1, f"{where}: ZeRO-1 over one data-parallel rank shards nothing")
    e = estimate(shape, exercise_layout(t, p, d, zero, batch), seq, gpu=GPU, gpus_per_node=node)
    require(e.fits(limit), f"{where}: ({t}, {p}, {d}, {zero}) needs {e.total_bytes:,} bytes a "
            f"GPU, over the limit of {limit:,}",
            hint="price the memory of every candidate and keep only those that fit.")
    return e.seconds, (t, p, d, zero)


@exercise(points=2, timeout=30.0, reference=("companion.plan.parallel.search",
                                             "companion.plan.parallel.layouts",
                                             "companion.plan.parallel_report.plan_parallel",
                                             "companion.checks.ch13.choose_parallel._best"))
def check_choose_parallel(answer) -> str:
    """answer(model: Shape, gpus, gpus_per_node, memory_limit_bytes, seq_len, batch_tokens) ->
    (t, p, d, zero_stage): a layout that fits, within TOLERANCE of the fastest that does."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = _crafted(rng) + _drawn(rng)
    for label, shape, gpus, node, limit, seq, batch in cases:
        where = (f"{label} (L={shape.layers}, C={shape.width}, {shape.heads} heads, "
                 f"{gpus} GPUs, {node} to a node, limit {limit / 2 ** 30:.2f} GiB, "
                 f"{batch} x {seq} tokens)")
        want, best, _ = _best(shape, gpus, node, limit, seq, batch)
        got = call(answer, shape, gpus, node, limit, seq, batch * seq)
        mine, layout = _verdict(got, shape, gpus, node, limit, seq, batch, where)
        if mine > want * (1 + TOLERANCE):
            raise CheckFailed(f"{where}: {layout} fits but takes {mine:.3f} s a step; "
                              f"{best} takes {want:.3f} s", expected=best, got=layout,
                              hint=_hint(layout, best))
    return (f"{len(cases)} clusters and limits: each layout fits and is within "
            f"{TOLERANCE:.0%} of the fastest that does")


def _hint(got: tuple, best: tuple) -> str:
    if got[0] > best[0]:
        return ("more tensor parallelism than needed: its all-gathers and reduce-scatters run "
                "at every layer, not hidden by compute.")
    if got[1] > best[1]:
        return "more pipeline stages than needed: the bubble (p-1)/m grows with p."
    return ("compare the step time of every layout that fits, not one rule of thumb: "
            "communication, bubble and compute each move with t, p and d.")
