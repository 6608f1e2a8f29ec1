"""Chapter 13, exercise 3: choose t, p, d and the ZeRO stage for a model and a cluster under a
memory limit, priced by `companion.plan.parallel`'s formulas."""
from __future__ import annotations

import functools
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


def _valid(shape: Shape, gpus: int, node: int, batch: int, *, kv_rule=True, batch_rule=True):
    """Every (t, p, d) the exercise's rules allow: t inside a node and dividing the heads and
    key/value heads, p dividing the layers, d dividing the batch's sequences (the key/value
    and batch rules switchable, to price the answers that break them)."""
    for t in _divisors(node):
        for p in _divisors(gpus // t) if gpus % t == 0 else ():
            d = gpus // (t * p)
            if not (shape.heads % t or (kv_rule and shape.kv_heads % t) or shape.layers % p
                    or d > batch or (batch_rule and batch % d)):
                yield t, p, d


def _best(shape: Shape, gpus: int, node: int, limit: int, seq: int, batch: int):
    """(seconds, (t, p, d, zero), bytes) of the fastest layout that fits; None if none does."""
    best = None
    for t, p, d in _valid(shape, gpus, node, batch):
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


def _shape(name: str, kv_heads: int | None = None) -> Shape:
    layers, width, heads, kv, intermediate, vocab = _SHAPES[name]
    return Shape(layers, width, heads, kv_heads or kv, intermediate, vocab)


def _priced(shape: Shape, gpus: int, node: int, seq: int, batch: int, *, kv_rule=True,
            batch_rule=True, price_node: int | None = None) -> list[tuple]:
    """(layout, bytes, seconds) of every layout the rules allow (two of them switchable), by the
    formulas; seconds priced as if a node held `price_node` GPUs when given."""
    rows = []
    for t, p, d in _valid(shape, gpus, node, batch, kv_rule=kv_rule, batch_rule=batch_rule):
        for zero in ((0, 1) if d > 1 else (0,)):
            layout = exercise_layout(t, p, d, zero, batch)
            nbytes = _price(shape, layout, seq, node)[0]
            rows.append(((t, p, d, zero), nbytes,
                         _price(shape, layout, seq, price_node or node)[1]))
    return rows


def _fastest(rows: list[tuple], limit: int, keep=lambda layout: True):
    """The (layout, bytes, seconds) row of the fastest layout that fits and `keep` keeps."""
    fit = [row for row in rows if row[1] <= limit and keep(row[0])]
    return min(fit, key=lambda row: row[2]) if fit else None


def _slower(row, than) -> bool:
    return row is None or row[2] > than[2] * (1 + TOLERANCE)


def _property(kind: str, shape: Shape, gpus: int, node: int, seq: int, batch: int,
              limit: int) -> bool:
    """Whether the case (with this limit) has the property that makes `kind`'s mistake fail:
    the fastest layout within the rules, priced right, against what the mistake would pick."""
    rows = _priced(shape, gpus, node, seq, batch)
    best = _fastest(rows, limit)
    if best is None:
        return False
    t, p, d, zero = best[0]
    if kind == "p = 1":          # a search that never tries one stage
        return p == 1 and _slower(_fastest(rows, limit, lambda l: l[1] > 1), best)
    if kind == "t = 1":          # one that never tries t = 1
        return t == 1 and _slower(_fastest(rows, limit, lambda l: l[0] > 1), best)
    if kind == "ZeRO-1":         # ZeRO-1 needed, at d = 2: no ZeRO-0 layout (nor d > 2) is close
        return zero == 1 and d == 2 and _slower(
            _fastest(rows, limit, lambda l: l[3] == 0 or l[2] > 2), best)
    if kind == "the node":       # priced as if a node held 8 GPUs, the pick is slow
        wrong = _fastest(_priced(shape, gpus, node, seq, batch, price_node=8), limit)
        return _slower(next(row for row in rows if row[0] == wrong[0]), best)
    if kind == "key/value heads":    # t that divides the heads but not the key/value heads
        wrong = _fastest(_priced(shape, gpus, node, seq, batch, kv_rule=False), limit)
        return shape.kv_heads % wrong[0][0] != 0
    if kind == "the batch":      # d that does not divide the sequences (fewer tokens priced)
        wrong = _fastest(_priced(shape, gpus, node, seq, batch, batch_rule=False), limit)
        return batch % wrong[0][2] != 0
    raise ValueError(kind)


# where to look for each property: (shape, kv heads or None, gpus, per node, seq, batch), the
# first that has it (with a limit between two layouts' bytes) is the case; tests assert each
# is found
_WHERE = {"p = 1": [("a 13B-like", None, 8, 4, 4096, 16), ("a 13B-like", None, 16, 4, 4096, 16)],
          "t = 1": [("a 13B-like", None, 8, 4, 2048, 96), ("a 13B-like", None, 8, 2, 2048, 256)],
          "ZeRO-1": [("a 3B-like", None, 16, 8, 2048, 256), ("a 3B-like", None, 32, 8, 4096, 16)],
          "the node": [("a 13B-like", None, 8, 2, 2048, 16), ("a 13B-like", None, 8, 2, 2048, 96)],
          "key/value heads": [("a 13B-like", 2, 16, 8, 2048, 16),
                              ("a 13B-like", 2, 16, 4, 4096, 16)],
          "the batch": [("a 3B-like", None, 32, 2, 4096, 24), ("a 13B-like", None, 32, 2, 4096, 24)]}


@functools.lru_cache(maxsize=None)
def _found(kind: str) -> tuple:
    """(shape, gpus, node, limit, seq, batch): the first place in _WHERE with the property, its
    limit halfway between one layout's bytes and the next (never on a boundary)."""
    for name, kv, gpus, node, seq, batch in _WHERE[kind]:
        shape = _shape(name, kv)
        rows = _priced(shape, gpus, node, seq, batch, kv_rule=False, batch_rule=False)
        sizes = sorted({row[1] for row in rows if row[1] <= 80 * 2 ** 30})
        for low, high in zip(sizes, sizes[1:]):
            limit = (low + high) // 2
            if _property(kind, shape, gpus, node, seq, batch, limit):
                return shape, gpus, node, limit, seq, batch
    raise RuntimeError(f"no case in _WHERE has the property {kind!r}: the formulas changed; "
                       "widen the list")


def _crafted(rng: random.Random) -> list[tuple]:
    """(label, shape, gpus, gpus per node, limit, seq, batch): each built so that one kind of
    mistake cannot pass, whatever the draw. Limits are set from the formulas themselves."""
    shape = _shape
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
    labels = {"p = 1": "one pipeline stage is fastest", "t = 1": "no tensor parallelism is fastest",
              "ZeRO-1": "ZeRO-1 is needed", "the node": "two GPUs to a node, the network slow",
              "key/value heads": "2 key/value heads",
              "the batch": "a batch that not every d divides"}
    for kind, label in labels.items():
        found = _found(kind)
        cases.append((label, *found))
    return cases


def _drawn(rng: random.Random) -> list[tuple]:
    """Fresh random cases: a shape, the fewest nodes on which it fits 80 GiB, and a limit
    between the least that fits and 1.6 times it."""
    cases = []
    for name in rng.sample(sorted(_SHAPES), 2):
        shape = _shape(name, rng.choice([2, 4, 8]))
        node, seq = rng.choice([4, 8]), rng.choice([2048, 4096])
        for nodes in (2, 4, 8, 16):
            gpus = node * nodes
            batch = gpus * rng.choice([3, 4, 6, 8, 12, 16]) // 4     # not always a multiple
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
    totals = [_price(shape, exercise_layout(t, p, d, 1 if d > 1 else 0, batch), seq, node)[0]
              for t, p, d in _valid(shape, gpus, node, batch)]
    return min(totals, default=None)


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
    require(batch % d == 0, f"{where}: d={d} does not divide the {batch} sequences",
            hint="each data-parallel rank takes batch/d whole sequences a step.")
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
                 f"{shape.kv_heads} key/value, {gpus} GPUs, {node} to a node, limit {limit / 2 ** 30:.2f} GiB, "
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
