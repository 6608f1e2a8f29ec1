"""Checks for chapter 07 (ZeRO). The reduce-scatter runs in real gloo worker processes; the
partition, the gather hooks and the memory prediction run here."""
from __future__ import annotations

import contextlib
import math
import pickle
import random
import re
import weakref

import torch
from torch import nn

from companion import collectives, estimate
from companion.checks import _ranks
from companion.checks._collective_guard import point_to_point_only, ring_direction
from companion.checks.core import (CheckFailed, call, compare, exercise, fresh_seeds, harness,
                                   require)
from companion.memory import format_bytes
from companion.zero import flat_partition, per_rank_state_bytes

__all__ = ["check_flat_partition", "check_ring_reduce_scatter", "check_gather_hooks",
           "check_per_rank_model_states"]


# ---------------------------------------------------------------- exercise 1: flat partition

def _whole_tensors(numels, world, rank):
    """Known wrong: whole parameters, each to the least-loaded rank (ZeroRedundancyOptimizer)."""
    loads, owner = [0] * world, []
    for n in numels:
        r = loads.index(min(loads))
        owner.append(r)
        loads[r] += n
    return [(i, 0, n) for i, n in enumerate(numels) if owner[i] == rank]


def _slices(numels, world, rank, s, *, remainder=False):
    """Known wrong: slices of s elements, the last rank taking the rest if `remainder`."""
    return _pieces(numels, rank * s, sum(numels) if remainder and rank == world - 1
                   else (rank + 1) * s)


def _inclusive_stop(numels, world, rank):
    return [(i, a, b - 1) for i, a, b in flat_partition(numels, world, rank)]


def _flat_coordinates(numels, world, rank):
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    return [(i, a + offsets[i], b + offsets[i]) for i, a, b in flat_partition(numels, world, rank)]


def _pieces(numels, lo, hi):
    out, offset = [], 0
    for i, n in enumerate(numels):
        if max(lo, offset) < min(hi, offset + n):
            out.append((i, max(lo, offset) - offset, min(hi, offset + n) - offset))
        offset += n
    return out


def _partition_cases(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    big = [rng.randint(900, 1100)] + [rng.randint(1, 30) for _ in range(5)]   # one large matrix
    odd = [rng.randint(1, 40) for _ in range(rng.randint(3, 8))]
    return [(big, 2), (big, 4), (odd, 3), (odd, 7), ([5], 4), ([3, 3], 2)]


def _compare_whole(got, expected, *, name: str, fields: tuple[str, ...] = (), **options) -> None:
    """compare() with rtol = atol = 0, but a failure shows the whole expected and got values and
    names the fields that differ, instead of an index path such as [0][2]."""
    try:
        compare(got, expected, rtol=0, atol=0, name=name, **options)
    except CheckFailed as failure:
        reason = re.sub(r"^(\[\d+\])+", "", failure.summary[len(name):])   # drop "[0][2]"
        if reason.startswith(" does not match"):
            reason = ": not what the reference returns"
        if fields and isinstance(got, (tuple, list)) and len(got) == len(fields):
            wrong = [f for f, g, e in zip(fields, got, expected) if _differs(g, e)]
            reason = f": the {' and the '.join(wrong)} differ" if wrong else reason
        failure.summary = name + reason
        failure.expected, failure.got, failure.max_diff = expected, got, None
        raise


def _differs(got, expected) -> bool:
    try:
        compare(got, expected, rtol=0, atol=0)
    except (CheckFailed, TypeError, RuntimeError, ValueError):
        return True
    return False


def _partition_mistakes(numels, world) -> dict:
    """Known-wrong partitions, each on every rank, and their hints (the first that matches is
    shown). Matched on all ranks at once: on one rank two mistakes can give the same pieces."""
    floor = sum(numels) // world
    wrong = {
        "split by elements, not whole tensors: with one large matrix, whole tensors leave one "
        "rank holding almost everything.": _whole_tensors,
        "stop is exclusive, like a Python slice: a piece (i, start, stop) holds elements "
        "start … stop-1.": _inclusive_stop,
        "every rank gets s = ceil(Ψ/N) elements (-(-total // N)): all shards must be the same "
        "size for the collectives; the last one is padded.":
            lambda *a: _slices(*a, floor, remainder=True),
        "use s = ceil(Ψ / N) elements per rank (-(-total // N)): with the floor, the last "
        "elements belong to no rank.": lambda *a: _slices(*a, floor),
        "when N divides Ψ, ceil(Ψ/N) = Ψ/N: use -(-total // N), not total // N + 1.":
            lambda *a: _slices(*a, floor + 1),
        "start and stop count inside each parameter (subtract where the parameter begins in "
        "the flat vector).": _flat_coordinates}
    return {text: [fn(numels, world, r) for r in range(world)] for text, fn in wrong.items()}


@exercise(points=1, reference="companion.zero.flat_partition")
def check_flat_partition(answer) -> str:
    """answer(numels, world_size, rank) -> [(param index, start, stop), ...]: the pieces of the
    flattened parameters that `rank` owns, start/stop inside each parameter."""
    for seed in fresh_seeds(2):
        for numels, world in _partition_cases(seed):
            got = [call(answer, list(numels), world, rank) for rank in range(world)]
            mistake = [text for text, wrong in _partition_mistakes(numels, world).items()
                       if not _differs(got, wrong)]
            for rank in range(world):
                _compare_whole(got[rank], flat_partition(numels, world, rank),
                               name=f"rank {rank}'s pieces of {numels} on {world} ranks",
                               hint=mistake[0] if mistake else
                               "rank r owns flat elements [r·s, (r+1)·s) with s = ceil(Ψ/N); "
                               "list each parameter that range overlaps, in order, and leave "
                               "out those it misses.")
    numels, world = _partition_cases(0)[1]
    ours = [sum(b - a for _, a, b in flat_partition(numels, world, r)) for r in range(world)]
    whole = [sum(b - a for _, a, b in _whole_tensors(numels, world, r)) for r in range(world)]
    return (f"{sum(numels)} elements on {world} ranks: largest slice {max(ours)} elements "
            f"(whole tensors: {max(whole)})")


# ---------------------------------------------------------------- exercise 2: reduce-scatter

def _scatter_worker(rank: int, world: int, packed: bytes, seed: int, shards: list[int]):
    """Run the answer on each shard size under the guard: (output, sends as (peer, bytes), whether
    it returned nothing) per size."""
    results, log = [], []
    with point_to_point_only(log):
        answer = pickle.loads(packed)        # imported after patching: `from dist import send`
        for s in shards:
            full = _ranks.rank_tensor(seed, rank, world * s)
            output = torch.zeros(s)
            del log[:]
            returned = answer(output, full.clone())
            results.append((output, list(log), returned is None or returned is output))
    return results


def _scatter_hint(got, rank, world, s, seed) -> str:
    def chunk_sum(c, ranks):
        return sum(_ranks.rank_tensor(seed, r, world * s).view(world, s)[c] for r in ranks)
    if torch.allclose(got, torch.zeros(s)):
        return "the output is still zeros: write the result into `output` (output.copy_(...))."
    if torch.allclose(got * world, chunk_sum(rank, range(world)), atol=1e-5):
        return ("your result is 1/N of the sum: a reduce-scatter sums; averaging is the "
                "caller's job (ShardedOptimizer divides afterwards).")
    for c in range(world):
        if c != rank and torch.allclose(got, chunk_sum(c, range(world)), atol=1e-5):
            return (f"rank {rank} ended with the sum of chunk {c}: it must own chunk {rank}. In "
                    "step k send chunk (rank - k - 1) % N, add into (rank - k - 2) % N.")
    if torch.allclose(got, chunk_sum(rank, [r for r in range(world) if r != rank]), atol=1e-5):
        return "every rank's own part is missing: add your own chunk to what arrives."
    return ("keep one running sum: send it right, receive the left neighbour's, add your own "
            "part of that chunk; after N-1 steps it is your chunk, summed over all ranks.")


def _judge_scatter_traffic(sends: list[tuple[int, int]], rank: int, world: int, s: int) -> None:
    """Exactly (N-1)·s elements sent, all to one ring neighbour: a ring, not a shortcut."""
    sent, ring = sum(b for _, b in sends), (world - 1) * s * 4
    require(sent == ring, f"rank {rank} sent {sent} bytes; a ring reduce-scatter sends exactly "
            f"(N-1)/N of the {world * s * 4}-byte input, {ring} bytes",
            hint="send one chunk (s elements) per step, N-1 steps, with dist.isend / dist.send: a "
                 "reduce-scatter is the first half of the ring all-reduce, nothing more.")
    require(ring_direction(sends, rank, world) is not None, f"rank {rank} sent to ranks "
            f"{sorted({peer for peer, _ in sends})}, not only to its neighbour",
            hint="in a ring, rank r sends only to its right neighbour (r + 1) % N and receives "
                 "from its left one; sending each chunk straight to its owner is not a ring.")


@exercise(points=2, timeout=90.0, reference="companion.collectives.ring_reduce_scatter")
def check_ring_reduce_scatter(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(output, input): sum `input` (N·s elements) over the ranks of the world and leave
    chunk `rank` of the sum in `output` (s elements), with point-to-point sends only."""
    packed, seed = _ranks.packed(answer), fresh_seeds(1)[0]
    shards = [257, 3, 1]
    for world in (2, 3):
        per_rank = _ranks.on_ranks(_scatter_worker, world, packed, seed, shards,
                             timeout=worker_timeout)
        for i, s in enumerate(shards):
            expected = sum(_ranks.rank_tensor(seed, r, world * s) for r in range(world)).view(world, s)
            for rank in range(world):
                got, sends, returned_nothing = per_rank[rank][i]
                compare(got, expected[rank], name=f"rank {rank}'s output (s = {s}, {world} "
                        "ranks)", hint=_scatter_hint(got, rank, world, s, seed))
                require(returned_nothing, "return nothing (None): the result goes into output")
                _judge_scatter_traffic(sends, rank, world, s)
    full = 3 * 257 * 4
    return (f"rank r holds chunk r of the sum on 2 and 3 ranks; each of 3 ranks sent "
            f"{sum(b for _, b in per_rank[0][0][1])} bytes for a {full}-byte input ((N-1)/N·S = "
            f"{collectives.shard_bytes_per_rank(full, 3):.0f}; an all-reduce sends twice that)")


# ---------------------------------------------------------------- exercise 3: gather hooks

class _Sharded(nn.Module):
    """A Linear whose weight and bias were taken out (sharded): forward reads plain attributes."""

    def __init__(self, d_in: int, d_out: int, gathered: list[str]):
        super().__init__()
        object.__setattr__(self, "weight", None)
        object.__setattr__(self, "bias", None)
        self.shape, self.gathered = (d_out, d_in), gathered       # names gather() was called on

    def forward(self, x):
        if self.weight is None or self.bias is None:
            if not self.gathered:
                raise RuntimeError("weight is None when forward ran, and gather was never called")
            raise RuntimeError("weight is None when forward ran: gather in a forward pre-hook "
                               "and free in a forward hook (after), not in a second pre-hook")
        return nn.functional.linear(x, self.weight, self.bias)


def _gather_case(seed: int, d_in: int, d_out: int) -> tuple[dict, torch.Tensor]:
    """The full weights that gather() hands out, and the input, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    full = {"weight": torch.randn(d_out, d_in, generator=g),
            "bias": torch.randn(d_out, generator=g)}
    return full, torch.randn(5, d_in, generator=g)


@harness
def _observe_gather_hooks(answer, seed: int, d_in: int, d_out: int) -> dict:
    """Register the answer's hooks on a sharded layer and run it: what was gathered and when, the
    output, what the layer holds after forward, how many gathered bytes are still alive, and what
    remove() does. Plain data only."""
    full, x = _gather_case(seed, d_in, d_out)
    calls, alive = [], []
    module = _Sharded(d_in, d_out, calls)

    def gather(name):
        calls.append(name)
        memory = full[name].numpy().copy()      # a fresh "all-gathered" buffer each time
        alive.append((weakref.ref(memory), memory.nbytes))     # lives while any view of it does
        return torch.from_numpy(memory)

    handles = call(answer, module, ["weight", "bias"], gather)
    seen = {"early": list(calls)}
    with torch.no_grad():
        seen["output"] = call(module, x)
    seen["calls"], seen["kept"] = list(calls), hasattr(module, "weight") and hasattr(module, "bias")
    seen["freed"] = seen["kept"] and module.weight is None and module.bias is None
    seen["alive"] = sum(nbytes for ref, nbytes in alive if ref() is not None)   # bytes
    seen["handles"] = type(handles).__name__ if not (
        isinstance(handles, (tuple, list)) and len(handles) == 2 and
        all(hasattr(h, "remove") for h in handles)) else None
    seen["after_remove"] = None
    if seen["handles"] is None:
        for h in handles:
            h.remove()
        calls.clear()
        with contextlib.suppress(RuntimeError, AttributeError), torch.no_grad():
            module(x)                           # without hooks: None, or deleted, weights
        seen["after_remove"] = list(calls)
    return seen


def _judge_gather_hooks(seen: dict, expected: torch.Tensor) -> None:
    require(not seen["early"], "gather was called before any forward",
            hint="gather inside the pre-forward hook, not when registering it: "
                 "the full weights must not exist between forwards.")
    compare(seen["output"], expected, name="the module's output")
    require(sorted(seen["calls"]) == ["bias", "weight"],
            f"gather was called {seen['calls']} in one forward",
            hint="gather each name once per forward, in the pre-forward hook.")
    require(seen["kept"], "after forward the module has no attribute weight (or bias) any more",
            hint="set each name back to None in a forward hook (setattr(mod, name, None)); don't "
                 "delete it: the module reads the attribute.")
    require(seen["freed"], "after forward the module still holds the full weights",
            hint="set each name back to None in a forward hook (module.register_forward_hook), "
                 "so the full tensors can be freed.")
    require(not seen["alive"], f"{format_bytes(seen['alive'])} of gathered weights are still "
            "in memory after forward", hint="keep no other reference to the gathered tensors or "
            "to views of them (no list, no closure, no .detach() copy): while one lives, so does "
            "the full weight's memory.")
    require(seen["handles"] is None, f"expected the two hook handles, got {seen['handles']}",
            hint="return (module.register_forward_pre_hook(...), "
                 "module.register_forward_hook(...)).")
    require(not seen["after_remove"], "gather still runs after removing the handles",
            hint="return the handles that register_forward_pre_hook / register_forward_hook gave.")


@exercise(points=2, reference="companion.zero.register_gather_hooks")
def check_gather_hooks(answer) -> str:
    """answer(module, names, gather) -> (pre_handle, post_handle): before module's forward set each
    name to gather(name), after it set each to None."""
    for seed, (d_in, d_out) in zip(fresh_seeds(2), [(7, 5), (33, 17)]):
        try:
            seen = _observe_gather_hooks(answer, seed, d_in, d_out)
        except CheckFailed as failure:
            if "gather was never called" in failure.summary:
                failure.hint = ("register a forward pre-hook (module.register_forward_pre_hook) "
                                "that sets each name to gather(name).")
            elif "when forward ran" in failure.summary:
                failure.hint = ("free with module.register_forward_hook(fn), whose fn(mod, "
                                "inputs, output) runs after forward.")
            raise
        full, x = _gather_case(seed, d_in, d_out)           # the verdict's own reference
        _judge_gather_hooks(seen, nn.functional.linear(x, full["weight"], full["bias"]))
    return (f"full weights exist only during forward ({format_bytes(4 * (33 * 17 + 17))} for a "
            "33 x 17 layer, then freed)")


# ---------------------------------------------------------------- exercise 4: memory per rank

_CONFIGS = [("fp32", "adamw", (4, 4, 8)), ("mixed", "adam", (2, 2, 12)),
            ("mixed", "sgd_momentum", (2, 2, 8)), ("fp32", "sgd", (4, 4, 0))]


def _wrong(n, stage, world, w, g, k, *, shard_from=(3, 2, 1), floor=False, shard=None):
    shard = shard if shard is not None else n // world if floor else -(-n // world)
    counts = [shard if stage >= s else n for s in shard_from]
    return w * counts[0], g * counts[1], k * counts[2]


def _close(got, value) -> bool:
    """got is three numbers within float rounding of `value` (a float answer, Ψ/N)."""
    return isinstance(got, (tuple, list)) and len(got) == len(value) and all(
        isinstance(a, (int, float)) and not isinstance(a, bool) and
        math.isclose(a, b, rel_tol=1e-12) for a, b in zip(got, value))


def _state_mistakes(n, stage, world, w, g, k) -> dict:
    """Known-wrong per-rank bytes and their hints (the first that matches is shown)."""
    return {
        "a shard is ceil(Ψ / N) elements (-(-n // N)): the last one is padded.":
            _wrong(n, stage, world, w, g, k, floor=True),
        "stage 1 shards only the optimizer state; stage 2 adds the gradients; stage 3 the "
        "parameters.": _wrong(n, stage, world, w, g, k, shard_from=(1, 1, 1)),
        "stage 2 shards the gradients too, and stage 3 the parameters.":
            _wrong(n, stage, world, w, g, k, shard_from=(4, 4, 1)),
        "stage 3 shards the parameters as well.":
            _wrong(n, stage, world, w, g, k, shard_from=(4, 2, 1))}


@exercise(points=1, reference=("companion.zero.per_rank_state_bytes",
                                "companion.estimate.model_states"))
def check_per_rank_model_states(answer) -> str:
    """answer(n_params, stage, world_size, weight_bytes, grad_bytes, state_bytes) ->
    (parameter bytes, gradient bytes, optimizer-state bytes) on one rank."""
    rng = random.Random(fresh_seeds(1)[0])
    for precision, optimizer, (w, g, k) in _CONFIGS:
        for stage in range(4):
            world = rng.choice([2, 3, 8, 64, 100])
            n = world * rng.randint(10**4, 10**7) + 1          # not a multiple: ceil != floor
            got = call(answer, n, stage, world, w, g, k)
            states = estimate.model_states(n, optimizer=optimizer, precision=precision,
                                           zero_stage=stage, world_size=world)
            expected = (states.params, states.grads, states.optimizer)
            require(not _close(got, _wrong(n, stage, world, w, g, k, shard=n / world)) or
                    not _differs(got, expected),
                    f"stage {stage}, {world} ranks, {n:,} parameters: got {got}, which counts "
                    "Ψ/N elements per shard", hint="a shard is a whole number of elements, "
                    "ceil(Ψ/N), not Ψ/N.")
            _compare_whole(got, expected,
                           name=f"stage {stage}, {world} ranks, {n:,} parameters, "
                                f"{w}+{g}+{k} bytes per element",
                           fields=("parameter bytes", "gradient bytes", "optimizer-state bytes"),
                           known_wrong=_state_mistakes(n, stage, world, w, g, k),
                           hint="multiply bytes per element by Ψ, or by ceil(Ψ/N) for what the "
                                "stage shards.")
    figure = [sum(per_rank_state_bytes(7_500_000_000, k, 64, 2, 2, 12)) / 1e9 for k in range(4)]
    return ("per-rank bytes match the estimator; the ZeRO paper's Figure 1 (7.5B parameters, "
            "64 GPUs): " + " / ".join(f"{f:.1f}" for f in figure) + " GB")
