"""Checks for chapter 06 (data parallelism). Every answer runs in real gloo worker processes.

The learner's function must be importable by the workers: in the notebook the exercise cell starts
with `%%worker_module NAME`, which writes it to a module. A rank that raises, hangs or returns
garbage becomes a CheckFailed that names the rank.
"""
from __future__ import annotations

import contextlib
import math
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

from companion import collectives
from companion.checks import _ranks
from companion.checks._collective_guard import point_to_point_only, ring_direction
from companion.checks.core import compare, exercise, fresh_seeds, require

__all__ = ["check_ring_all_reduce", "check_bucketed_hooks"]


# ---------------------------------------------------------------- exercise 1: ring all-reduce

def _ring_worker(rank: int, world_size: int, packed: bytes, seed: int, lengths: list[int]):
    results, log = [], []
    with point_to_point_only(log):
        answer = pickle.loads(packed)        # imported after patching: `from dist import send`
        for numel in lengths:
            tensor = _ranks.rank_tensor(seed, rank, numel)
            del log[:]
            returned = answer(tensor)
            results.append((tensor, list(log), returned is None or returned is tensor))
    return results


def _chunk_hint(got: torch.Tensor, expected: torch.Tensor, own: torch.Tensor) -> str:
    if torch.allclose(got, own):
        return "the tensor is unchanged: write the sum into it in place (tensor.copy_(...))."
    right = float(torch.isclose(got, expected, rtol=1e-4, atol=1e-5).float().mean())
    return (f"{right:.0%} of the elements are right: chunks are sent too early or land in the "
            "wrong slot. In step s of reduce-scatter, send chunk (rank - s) % N and add into chunk "
            "(rank - s - 1) % N; in all-gather, send (rank + 1 - s) % N, receive (rank - s) % N.")


def _judge_ring_traffic(sends: list[list[tuple[int, int]]], numel: int) -> None:
    """Each rank sent at most 2(N-1)·ceil(numel/N) elements, all to one ring neighbour, and the
    ranks together exactly 2(N-1) chunks' worth: 2(N-1)·numel elements (or with chunks padded to
    ceil(numel/N), 2(N-1)·N·ceil)."""
    world = len(sends)
    sent = [sum(b for _, b in log) for log in sends]
    limit, chunk = 2 * (world - 1) * math.ceil(numel / world) * 4, math.ceil(numel / world)
    hint = ("send one chunk (1/N of the tensor) per step, 2(N-1) steps, with dist.isend / "
            "dist.send; sending whole tensors to one rank is the naive all-reduce.")
    for rank in range(world):
        require(sent[rank] <= limit, f"rank {rank} sent {sent[rank]} bytes for a {numel * 4}-"
                f"byte tensor on {world} ranks; a ring sends 2(N-1)/N·S, at most {limit}",
                hint=hint)
    ring = [2 * (world - 1) * numel * 4, 2 * (world - 1) * world * chunk * 4]
    require(sum(sent) in ring, f"the {world} ranks sent {sum(sent)} bytes in all for a "
            f"{numel * 4}-byte tensor; a ring sends exactly 2(N-1)·S = {ring[0]}", hint=hint)
    for rank in range(world):
        require(not sends[rank] or ring_direction(sends[rank], rank, world) is not None,
                f"rank {rank} sent to ranks {sorted({peer for peer, _ in sends[rank]})}, not "
                "only to its neighbour", hint="in a ring, rank r sends only to its right "
                "neighbour (r + 1) % N and receives from its left one.")


@exercise(points=2, timeout=90.0, reference=("companion.collectives.ring_all_reduce",
                                             "companion.collectives.naive_all_reduce"))
def check_ring_all_reduce(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(tensor, group=None): sum `tensor` over all ranks in place, with a ring of sends."""
    packed, seed = _ranks.packed(answer), fresh_seeds(1)[0]
    lengths = [1001, 12, 5, 2, 1]           # the long one first: its failure says most
    for world in (2, 3):
        per_rank = _ranks.on_ranks(_ring_worker, world, packed, seed, lengths, timeout=worker_timeout)
        for i, numel in enumerate(lengths):
            expected = sum(_ranks.rank_tensor(seed, r, numel) for r in range(world))
            for rank in range(world):
                got, sends, in_place = per_rank[rank][i]
                compare(got, expected, name=f"rank {rank}'s tensor ({numel} elements, "
                        f"{world} ranks)", hint=_chunk_hint(got, expected,
                                                           _ranks.rank_tensor(seed, rank, numel)))
                require(in_place, "return nothing (None): the result goes into the tensor itself")
            _judge_ring_traffic([r[i][1] for r in per_rank], numel)
    s = 1001 * 4
    return (f"matches the sum on 2 and 3 ranks for {len(lengths)} lengths; each of 3 ranks sent "
            f"{sum(b for _, b in per_rank[0][0][1])} bytes for a {s}-byte tensor (2(N-1)/N·S = "
            f"{collectives.ring_bytes_per_rank(s, 3):.0f}; the naive root sends "
            f"{collectives.naive_root_bytes(s, 3)})")


# ---------------------------------------------------------------- exercise 2: bucketed hooks

def _bucket_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 9), nn.Tanh(),
                         nn.Linear(9, 3))


def _bucket_batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 31 * rank + 977 * step)
    return torch.randn(5, 7, generator=g), torch.randn(5, 3, generator=g)


def _buckets_of(model: nn.Module) -> list[list[nn.Parameter]]:
    """Three buckets in the order backward makes the gradients: last layer first."""
    last, middle, first = model[4], model[2], model[0]
    return [[last.bias, last.weight, middle.bias], [middle.weight], [first.bias, first.weight]]


class _WatchedWork:
    """An all-reduce's Work, wrapped: each wait() notes whether backward was still running."""

    def __init__(self, work: Any, waits: list[bool]):
        self._work, self._waits = work, waits

    def wait(self, *args, **kwargs):
        self._waits.append(torch._C._current_graph_task_id() != -1)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def _watched_all_reduce(buckets: list[list[nn.Parameter]], events: list, waits: list[bool]):
    """Inside, dist.all_reduce (also as distributed_c10d.all_reduce, and as imported by `from
    torch.distributed import all_reduce` inside the block) appends ("launch", bucket, async, in
    backward) to `events` and returns its Work wrapped in a `_WatchedWork`. Yields `adopt(obj)`,
    which also watches the all_reduce that obj's module imported by name before the block (a
    worker may have imported it already, e.g. with the parent's __main__)."""
    real, sizes = c10d.all_reduce, [sum(p.numel() for p in b) for b in buckets]

    def watched(tensor, *args, **kwargs):
        which = sizes.index(tensor.numel()) if tensor.numel() in sizes else -1
        async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        events.append(("launch", which, async_op, torch._C._current_graph_task_id() != -1))
        work = real(tensor, *args, **kwargs)
        return _WatchedWork(work, waits) if work is not None else None

    rebound: list[tuple[dict, str]] = []

    def adopt(obj: Any) -> Any:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        for name, value in list(vars(module).items()) if module else []:
            if value is real:
                vars(module)[name] = watched
                rebound.append((vars(module), name))
        return obj

    dist.all_reduce = c10d.all_reduce = watched
    try:
        yield adopt
    finally:
        dist.all_reduce = c10d.all_reduce = real
        for namespace, name in rebound:
            namespace[name] = real


def _bucket_worker(rank: int, world_size: int, packed: bytes, seed: int, steps: int):
    """Build the learner's averager on a model, run `steps` backward + finish, and record per
    step, in order, every gradient's arrival (the check's own hooks, registered first, so they
    run before the learner's) and every all-reduce started, and whether a wait() ran in backward."""
    model = _bucket_model(seed)
    buckets = _buckets_of(model)
    events: list = []
    for i, bucket in enumerate(buckets):
        for param in bucket:
            param.register_post_accumulate_grad_hook(
                lambda p, i=i: events.append(("grad", i)))
    grads, per_step, waits = [], [], []
    with _watched_all_reduce(buckets, events, waits) as adopt:
        averager = adopt(pickle.loads(packed))(buckets)   # imported after patching if not yet
        for step in range(steps):
            model.zero_grad(set_to_none=False)
            x, y = _bucket_batch(seed, rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            averager.finish()
            grads.append([p.grad.clone() for p in model.parameters()])
            per_step.append(list(events))
            del events[:]
    return grads, per_step, any(waits)


def _late_launch(events: list, need: list[int]) -> int | None:
    """The first bucket not launched as soon as it (and every bucket before it) was complete,
    before the next gradient arrived; None if every launch was on time. need: gradients per
    bucket."""
    buckets = len(need)
    done, launched, next_bucket = [0] * buckets, set(), 0
    for event in events:
        if event[0] == "launch":
            launched.add(event[1])
            continue
        while next_bucket < buckets and done[next_bucket] == need[next_bucket]:
            if next_bucket not in launched:
                return next_bucket                  # a gradient arrived; this one still waits
            next_bucket += 1
        done[event[1]] += 1
    return None


def _bucket_local_grads(seed: int, rank: int, step: int) -> list[torch.Tensor]:
    model = _bucket_model(seed)
    x, y = _bucket_batch(seed, rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def _judge_launches(rank: int, step: int, events: list, waited_in_backward: bool) -> None:
    """One rank's step: one asynchronous all-reduce per bucket, in order, each launched from the
    hooks before the next gradient arrived, and no wait() while backward runs."""
    launches = [e[1:] for e in events if e[0] == "launch"]
    where = f"rank {rank}, step {step + 1}:"
    require(len(launches) == 3, f"{where} {len(launches)} all-reduces started for 3 buckets; "
            "expected one per bucket", hint="all-reduce a bucket's flat buffer once, when its "
            "last gradient is in; reset what you count in finish() for the next step.")
    require([w for w, _, _ in launches] == [0, 1, 2], f"{where} buckets all-reduced in the order "
            f"{[w for w, _, _ in launches]}", hint="launch bucket 0, then 1, then 2 (every rank "
            "in the same order, or their all-reduces do not match), each as soon as it is complete.")
    require(all(a for _, a, _ in launches), f"{where} an all-reduce blocked backward",
            hint="start it with dist.all_reduce(flat, async_op=True) and keep the returned work; "
                 "wait for it in finish().")
    require(all(b for _, _, b in launches), f"{where} a bucket's all-reduce started after "
            "backward had finished", hint="launch it from the hook, as soon as the bucket's last "
            "gradient arrives: that is the overlap DDP is for.")
    late = _late_launch(events, [3, 1, 2])
    require(late is None, f"{where} bucket {late} was complete, but a gradient of a later bucket "
            "arrived before its all-reduce started", hint="launch each bucket from the hook call "
            "that completes it (and every bucket before it), not later: a bucket held back "
            "until the last hook overlaps nothing with backward.")
    require(not waited_in_backward, f"rank {rank}: an all-reduce's work.wait() ran while backward "
            "was still running", hint="keep the work and wait for it in finish(): a wait() in the "
            "hook stops backward until the communication is done, so nothing overlaps.")


@exercise(points=3, timeout=90.0, reference=("companion.ddp.DDP",
                                             "companion.ddp.average_gradients"))
def check_bucketed_hooks(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(buckets) -> an object whose parameters' post-accumulate-grad hooks average the
    gradients over the ranks, one asynchronous all-reduce per bucket launched during backward as
    soon as the bucket is complete, and whose finish() waits and leaves the averages in every
    param.grad."""
    packed, world, steps = _ranks.packed(answer), 2, 2
    for seed in fresh_seeds(2):
        results = _ranks.on_ranks(_bucket_worker, world, packed, seed, steps, timeout=worker_timeout)
        for rank, (grads, per_step, waited_in_backward) in enumerate(results):
            for step, events in enumerate(per_step):
                _judge_launches(rank, step, events, waited_in_backward)
            for step in range(steps):
                local = [_bucket_local_grads(seed, r, step) for r in range(world)]
                for i, g in enumerate(grads[step]):
                    want = sum(grad[i] for grad in local) / world
                    compare(g, want, name=f"rank {rank}'s gradient {i} after step {step + 1}",
                            known_wrong={"divide by the world size: all_reduce sums.":
                                         want * world,
                                         "each rank still has its own gradient: copy the "
                                         "averaged bucket back into param.grad in finish().":
                                         local[rank][i]})
    return ("3 buckets on 2 ranks, each all-reduced once, asynchronously, launched from the hook "
            "that completed it while backward was still running, and waited for only in "
            "finish(); every rank left with the average")
