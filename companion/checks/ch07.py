"""Checks for chapter 07 (ZeRO). The reduce-scatter runs in real gloo worker processes; the
partition, the gather hooks and the memory prediction run here."""
from __future__ import annotations

import contextlib
import pickle
import random
import weakref

import torch
import torch.distributed as dist
from torch import nn

from companion import collectives, estimate
from companion.checks.ch06 import _on_ranks, _packed, _point_to_point_only, _rank_tensor
from companion.checks.core import call, compare, exercise, fresh_seeds, require
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


def _floor_slices(numels, world, rank):
    s = sum(numels) // world
    return _pieces(numels, rank * s, (rank + 1) * s)


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


@exercise(points=1)
def check_flat_partition(answer) -> str:
    """answer(numels, world_size, rank) -> [(param index, start, stop), ...]: the pieces of the
    flattened parameters that `rank` owns, start/stop inside each parameter."""
    for seed in fresh_seeds(2):
        for numels, world in _partition_cases(seed):
            for rank in range(world):
                got = call(answer, list(numels), world, rank)
                compare(got, flat_partition(numels, world, rank), rtol=0, atol=0,
                        name=f"rank {rank}'s pieces of {numels} on {world} ranks", known_wrong={
                            "split by elements, not whole tensors: with one large matrix, whole "
                            "tensors leave one rank holding almost everything.":
                                _whole_tensors(numels, world, rank),
                            "use s = ceil(Ψ / N) elements per rank (-(-total // N)): with the "
                            "floor, the last elements belong to no rank.":
                                _floor_slices(numels, world, rank),
                            "start and stop count inside each parameter (subtract where the "
                            "parameter begins in the flat vector).":
                                _flat_coordinates(numels, world, rank)},
                        hint="rank r owns flat elements [r·s, (r+1)·s); list each parameter "
                             "that range overlaps, in order, and leave out those it misses.")
    numels, world = _partition_cases(0)[1]
    ours = [sum(b - a for _, a, b in flat_partition(numels, world, r)) for r in range(world)]
    whole = [sum(b - a for _, a, b in _whole_tensors(numels, world, r)) for r in range(world)]
    return (f"{sum(numels)} elements on {world} ranks: largest slice {max(ours)} elements "
            f"(whole tensors: {max(whole)})")


# ---------------------------------------------------------------- exercise 2: reduce-scatter

_SINGLE = ("all_gather_single", "reduce_scatter_single")


@contextlib.contextmanager
def _no_single_collectives():
    """Chapter 06's guard does not know torch 2.13's *_single names: refuse those too."""
    saved = {n: getattr(dist, n) for n in _SINGLE if hasattr(dist, n)}

    def refuse(*args, **kwargs):
        raise RuntimeError("a collective: build the reduce-scatter from dist.isend / dist.recv")

    for name in saved:
        setattr(dist, name, refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _scatter_worker(rank: int, world: int, packed: bytes, seed: int, shards: list[int]):
    results, sent = [], [0]
    with _point_to_point_only(sent), _no_single_collectives():
        answer = pickle.loads(packed)
        for s in shards:
            full = _rank_tensor(seed, rank, world * s)
            output = torch.zeros(s)
            before = sent[0]
            returned = answer(output, full.clone())
            results.append((output, sent[0] - before, returned is None or returned is output))
    return results


def _scatter_hint(got, rank, world, s, seed) -> str:
    def chunk_sum(c, ranks):
        return sum(_rank_tensor(seed, r, world * s).view(world, s)[c] for r in ranks)
    if torch.allclose(got, torch.zeros(s)):
        return "the output is still zeros: write the result into `output` (output.copy_(...))."
    for c in range(world):
        if c != rank and torch.allclose(got, chunk_sum(c, range(world)), atol=1e-5):
            return (f"rank {rank} ended with the sum of chunk {c}: it must own chunk {rank}. In "
                    "step k send chunk (rank - k - 1) % N, add into (rank - k - 2) % N.")
    if torch.allclose(got, chunk_sum(rank, [r for r in range(world) if r != rank]), atol=1e-5):
        return "every rank's own part is missing: add your own chunk to what arrives."
    return ("keep one running sum: send it right, receive the left neighbour's, add your own "
            "part of that chunk; after N-1 steps it is your chunk, summed over all ranks.")


@exercise(points=2, timeout=90.0)
def check_ring_reduce_scatter(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(output, input, group=None): sum `input` (N·s elements) over ranks and leave chunk
    `rank` of the sum in `output` (s elements), with point-to-point sends only."""
    packed, seed = _packed(answer), fresh_seeds(1)[0]
    shards = [257, 3, 1]
    for world in (2, 3):
        per_rank = _on_ranks(_scatter_worker, world, packed, seed, shards,
                             timeout=worker_timeout)
        for i, s in enumerate(shards):
            expected = sum(_rank_tensor(seed, r, world * s) for r in range(world)).view(world, s)
            for rank in range(world):
                got, sent, returned_nothing = per_rank[rank][i]
                compare(got, expected[rank], name=f"rank {rank}'s output (s = {s}, {world} "
                        "ranks)", hint=_scatter_hint(got, rank, world, s, seed))
                require(returned_nothing, "return nothing (None): the result goes into output")
                limit = (world - 1) * s * 4
                require(sent <= limit, f"rank {rank} sent {sent} bytes; a reduce-scatter sends "
                        f"(N-1)/N of the {world * s * 4}-byte input, {limit} bytes",
                        hint="send one chunk (s elements) per step, N-1 steps: a reduce-scatter "
                             "is the first half of the ring all-reduce, nothing more.")
    full = 3 * 257 * 4
    return (f"rank r holds chunk r of the sum on 2 and 3 ranks; each of 3 ranks sent "
            f"{per_rank[0][0][1]} bytes for a {full}-byte input ((N-1)/N·S = "
            f"{collectives.shard_bytes_per_rank(full, 3):.0f}; an all-reduce sends twice that)")


# ---------------------------------------------------------------- exercise 3: gather hooks

class _Sharded(nn.Module):
    """A Linear whose weight and bias were taken out (sharded): forward reads plain attributes."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        object.__setattr__(self, "weight", None)
        object.__setattr__(self, "bias", None)
        self.shape = (d_out, d_in)

    def forward(self, x):
        if self.weight is None or self.bias is None:
            raise RuntimeError("weight is None: it was not gathered before forward")
        return nn.functional.linear(x, self.weight, self.bias)


def _gather_run(answer, seed: int, d_in: int, d_out: int) -> str:
    g = torch.Generator().manual_seed(seed)
    full = {"weight": torch.randn(d_out, d_in, generator=g),
            "bias": torch.randn(d_out, generator=g)}
    module, calls, alive = _Sharded(d_in, d_out), [], []

    def gather(name):
        calls.append(name)
        t = full[name].clone()                  # a fresh "all-gathered" tensor each time
        alive.append(weakref.ref(t))
        return t

    handles = call(answer, module, ["weight", "bias"], gather)
    require(not calls, "gather was called before any forward",
            hint="gather inside the pre-forward hook, not when registering it: "
                 "the full weights must not exist between forwards.")
    x = torch.randn(5, d_in, generator=g)
    with torch.no_grad():
        out = call(module, x)
    compare(out, nn.functional.linear(x, full["weight"], full["bias"]), name="the module's output")
    require(sorted(calls) == ["bias", "weight"], f"gather was called {calls} in one forward",
            hint="gather each name once per forward, in the pre-forward hook.")
    require(module.weight is None and module.bias is None,
            "after forward the module still holds the full weights",
            hint="set each name back to None in a forward hook (module.register_forward_hook), "
                 "so the full tensors can be freed.")
    require(all(ref() is None for ref in alive), "a gathered tensor is still alive after forward",
            hint="keep no other reference to the gathered tensors (no list, no closure).")
    require(isinstance(handles, (tuple, list)) and len(handles) == 2 and
            all(hasattr(h, "remove") for h in handles),
            f"expected the two hook handles, got {type(handles).__name__}",
            hint="return (module.register_forward_pre_hook(...), "
                 "module.register_forward_hook(...)).")
    for h in handles:
        h.remove()
    calls.clear()
    with contextlib.suppress(RuntimeError), torch.no_grad():
        module(x)
    require(not calls, "gather still runs after removing the handles",
            hint="return the handles that register_forward_pre_hook / register_forward_hook gave.")
    return format_bytes(4 * (d_in * d_out + d_out))


@exercise(points=2)
def check_gather_hooks(answer) -> str:
    """answer(module, names, gather) -> (pre_handle, post_handle): before module's forward set each
    name to gather(name), after it set each to None."""
    for seed, (d_in, d_out) in zip(fresh_seeds(2), [(7, 5), (33, 17)]):
        size = _gather_run(answer, seed, d_in, d_out)
    return f"full weights exist only during forward ({size} for a 33 x 17 layer, then freed)"


# ---------------------------------------------------------------- exercise 4: memory per rank

_CONFIGS = [("fp32", "adamw", (4, 4, 8)), ("mixed", "adam", (2, 2, 12)),
            ("mixed", "sgd_momentum", (2, 2, 8)), ("fp32", "sgd", (4, 4, 0))]


def _wrong(n, stage, world, w, g, k, *, shard_from=(3, 2, 1), floor=False):
    shard = n // world if floor else -(-n // world)
    counts = [shard if stage >= s else n for s in shard_from]
    return w * counts[0], g * counts[1], k * counts[2]


@exercise(points=1)
def check_per_rank_model_states(answer) -> str:
    """answer(n_params, stage, world_size, weight_bytes, grad_bytes, state_bytes) ->
    (parameter bytes, gradient bytes, optimizer-state bytes) on one rank."""
    rng = random.Random(fresh_seeds(1)[0])
    for precision, optimizer, (w, g, k) in _CONFIGS:
        for stage in range(4):
            world = rng.choice([2, 3, 8, 64, 100])
            n = world * rng.randint(10**4, 10**7) + 1          # not a multiple: ceil != floor
            got = call(answer, n, stage, world, w, g, k)
            expected = estimate.model_states(n, optimizer=optimizer, precision=precision,
                                             zero_stage=stage, world_size=world)
            compare(got, (expected.params, expected.grads, expected.optimizer), rtol=0, atol=0,
                    name=f"stage {stage}, {world} ranks, {n:,} parameters, {w}+{g}+{k} bytes",
                    known_wrong={
                        "a shard is ceil(Ψ / N) elements (-(-n // N)): the last one is padded.":
                            _wrong(n, stage, world, w, g, k, floor=True),
                        "stage 1 shards only the optimizer state; stage 2 adds the gradients; "
                        "stage 3 the parameters.": _wrong(n, stage, world, w, g, k,
                                                          shard_from=(1, 1, 1)),
                        "stage 2 shards the gradients too, and stage 3 the parameters.":
                            _wrong(n, stage, world, w, g, k, shard_from=(4, 4, 1)),
                        "stage 3 shards the parameters as well.":
                            _wrong(n, stage, world, w, g, k, shard_from=(4, 2, 1))},
                    hint="multiply bytes per element by Ψ, or by ceil(Ψ/N) for what the stage "
                         "shards.")
    figure = [sum(per_rank_state_bytes(7_500_000_000, k, 64, 2, 2, 12)) / 1e9 for k in range(4)]
    return ("per-rank bytes match the estimator; the ZeRO paper's Figure 1 (7.5B parameters, "
            "64 GPUs): " + " / ".join(f"{f:.1f}" for f in figure) + " GB")
