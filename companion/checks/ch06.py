"""Checks for chapter 06 (data parallelism). Every answer runs in real gloo worker processes.

The learner's function must be importable by the workers: in the notebook the exercise cell starts
with `%%worker_module NAME`, which writes it to a module. A rank that raises, hangs or returns
garbage becomes a CheckFailed that names the rank.
"""
from __future__ import annotations

import contextlib
import math
import pickle
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from companion import collectives, ddp, launch
from companion.checks.core import (CheckFailed, NotDone, compare, exercise, fresh_seeds, harness,
                                   require, require_function)
from companion.checks.harness import Remote

__all__ = ["check_ring_all_reduce", "check_ddp_average_gradients", "check_no_sync_accumulation"]

_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "gather", "scatter")
_P2P = ("send", "isend")


# ---------------------------------------------------------------- running answers on ranks

def _packed(answer: Any) -> bytes:
    """The answer, pickled by reference for the workers, or a CheckFailed saying how to fix it.
    Under the grader the answer lives in its sandbox: this becomes a token that `_on_ranks`
    (a harness, run there) receives as the pickled answer."""
    require_function(answer)
    if isinstance(answer, Remote):
        return answer.through(_packed)
    try:
        return pickle.dumps(answer)
    except Exception:
        raise CheckFailed("the worker processes cannot import your function",
                          hint="start the exercise cell with %%worker_module NAME (after "
                               "%load_ext companion.launch), so the workers can import it.") from None


@harness
def _on_ranks(worker: Callable, world_size: int, *args, timeout: float) -> list:
    """launch.run, with a rank's exception or hang turned into a CheckFailed naming the rank.
    A harness: under the grader the ranks start in the learner's sandbox."""
    try:
        return launch.run(worker, world_size, *args, timeout=timeout)
    except launch.WorkerTimeout as e:
        raise CheckFailed(f"rank(s) {e.ranks} did not finish within {timeout:g} s",
                          hint="a send without a matching recv (or the reverse) waits forever: "
                               "every rank must post its sends and receives in the same order "
                               "as its neighbours.") from None
    except launch.WorkerError as e:
        last = e.traceback.strip().splitlines()[-1] if e.traceback.strip() else "it died"
        if last.startswith("NotImplementedError"):
            raise NotDone(f"not done yet: your function raises {last}") from None
        where = [ln.strip() for ln in e.traceback.splitlines() if ln.strip().startswith("File")]
        raise CheckFailed(f"rank {e.rank} raised {last}", got=where[-1] if where else None,
                          hint="run your function by hand on a small tensor; the line above is "
                               "where it failed.") from None


@contextlib.contextmanager
def _point_to_point_only(sent: list[int]):
    """Inside, collectives raise, and every send/isend adds its bytes to sent[0]."""
    saved = {name: getattr(dist, name) for name in _COLLECTIVES + _P2P}

    def forbidden(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is a collective: build the ring from dist.isend / "
                               "dist.irecv / dist.send / dist.recv only")
        return refuse

    def counted(original):
        def send(tensor, *args, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        return send

    for name in _COLLECTIVES:
        setattr(dist, name, forbidden(name))
    for name in _P2P:
        setattr(dist, name, counted(saved[name]))
        setattr(dist.distributed_c10d, name, getattr(dist, name))   # P2POp compares to these
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        for name in _P2P:
            setattr(dist.distributed_c10d, name, saved[name])


def _rank_tensor(seed: int, rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed + 7919 * rank))


# ---------------------------------------------------------------- exercise 1: ring all-reduce

def _ring_worker(rank: int, world_size: int, packed: bytes, seed: int, lengths: list[int]):
    results, sent = [], [0]
    with _point_to_point_only(sent):
        answer = pickle.loads(packed)        # imported after patching: `from dist import send`
        for numel in lengths:
            tensor = _rank_tensor(seed, rank, numel)
            before = sent[0]
            returned = answer(tensor)
            results.append((tensor, sent[0] - before, returned is None or returned is tensor))
    return results


def _chunk_hint(got: torch.Tensor, expected: torch.Tensor, own: torch.Tensor) -> str:
    if torch.allclose(got, own):
        return "the tensor is unchanged: write the sum into it in place (tensor.copy_(...))."
    right = float(torch.isclose(got, expected, rtol=1e-4, atol=1e-5).float().mean())
    return (f"{right:.0%} of the elements are right: chunks are sent too early or land in the "
            "wrong slot. In step s of reduce-scatter, send chunk (rank - s) % N and add into chunk "
            "(rank - s - 1) % N; in all-gather, send (rank + 1 - s) % N, receive (rank - s) % N.")


@exercise(points=2, timeout=90.0, reference=("companion.collectives.ring_all_reduce",
                                             "companion.collectives.naive_all_reduce"))
def check_ring_all_reduce(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(tensor, group=None): sum `tensor` over all ranks in place, with a ring of sends."""
    packed, seed = _packed(answer), fresh_seeds(1)[0]
    lengths = [1001, 12, 5, 2, 1]           # the long one first: its failure says most
    for world in (2, 3):
        per_rank = _on_ranks(_ring_worker, world, packed, seed, lengths, timeout=worker_timeout)
        for i, numel in enumerate(lengths):
            expected = sum(_rank_tensor(seed, r, numel) for r in range(world))
            for rank in range(world):
                got, sent, in_place = per_rank[rank][i]
                compare(got, expected, name=f"rank {rank}'s tensor ({numel} elements, "
                        f"{world} ranks)", hint=_chunk_hint(got, expected,
                                                           _rank_tensor(seed, rank, numel)))
                require(in_place, "return nothing (None): the result goes into the tensor itself")
                limit = 2 * (world - 1) * math.ceil(numel / world) * 4
                require(sent <= limit, f"rank {rank} sent {sent} bytes for a {numel * 4}-byte "
                        f"tensor on {world} ranks; a ring sends 2(N-1)/N·S, at most {limit}",
                        hint="send one chunk (1/N of the tensor) per step, 2(N-1) steps; sending "
                             "whole tensors to one rank is the naive all-reduce.")
    s = 1001 * 4
    return (f"matches the sum on 2 and 3 ranks for {len(lengths)} lengths; each of 3 ranks sent "
            f"{per_rank[0][0][1]} bytes for a {s}-byte tensor (2(N-1)/N·S = "
            f"{collectives.ring_bytes_per_rank(s, 3):.0f}; the naive root sends "
            f"{collectives.naive_root_bytes(s, 3)})")


# ---------------------------------------------------------------- exercise 2: average gradients

def _grad_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
    model[0].bias.requires_grad_(False)        # a frozen parameter: its grad stays None
    return model


def _rank_batch(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 31 * rank)
    return torch.randn(5, 7, generator=g), torch.randn(5, 3, generator=g)


def _local_grads(seed: int, rank: int) -> tuple[nn.Module, list]:
    model = _grad_model(seed)
    x, y = _rank_batch(seed, rank)
    nn.functional.mse_loss(model(x), y).backward()
    return model, [p.grad for p in model.parameters() if p.grad is not None]


def _average_worker(rank: int, world_size: int, packed: bytes, seed: int):
    model, _ = _local_grads(seed, rank)
    pickle.loads(packed)(model)
    return [None if p.grad is None else p.grad for p in model.parameters()]


@exercise(points=1, timeout=90.0, reference="companion.ddp.average_gradients")
def check_ddp_average_gradients(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(module, group=None): replace every gradient by its average over the ranks."""
    packed = _packed(answer)
    for seed in fresh_seeds(2):
        world = 3
        got = _on_ranks(_average_worker, world, packed, seed, timeout=worker_timeout)
        local = [_local_grads(seed, r)[1] for r in range(world)]
        expected = [sum(g[i] for g in local) / world for i in range(len(local[0]))]
        for rank in range(world):
            require(got[rank][1] is None, "the frozen bias (requires_grad=False) got a gradient",
                    hint="skip parameters whose .grad is None.")
            mine = [g for g in got[rank] if g is not None]
            require(len(mine) == len(expected), f"rank {rank} has {len(mine)} gradients, "
                    f"expected {len(expected)}", hint="keep every gradient; only average it.")
            for i, (g, e) in enumerate(zip(mine, expected)):
                compare(g, e, name=f"rank {rank}'s gradient {i}", known_wrong={
                    "divide by the world size: DDP averages, so that a step matches one process "
                    "on the whole batch.": e * world,
                    "each rank still has its own gradient: all-reduce them.": local[rank][i]})
    return "every rank holds the average of 3 ranks' gradients (one all-reduce per parameter)"


# ---------------------------------------------------------------- exercise 3: no_sync

def _accumulation_data(seed: int, rank: int, k: int) -> list:
    g = torch.Generator().manual_seed(seed + 101 * rank)
    return [(torch.randn(3, 7, generator=g), torch.randn(3, 3, generator=g)) for _ in range(k)]


def _accumulation_worker(rank: int, world_size: int, packed: bytes, seed: int, k: int):
    torch.manual_seed(seed)
    model = ddp.DDP(nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3)),
                    bucket_cap_mb=0.0004)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pickle.loads(packed)(model, _accumulation_data(seed, rank, k), nn.functional.mse_loss,
                         optimizer)
    return ([p.detach() for p in model.parameters()], model.stats.all_reduces,
            len(model.buckets), model._pending)


def _one_process_step(seed: int, world: int, k: int, scale: float) -> list:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
    batches = [b for r in range(world) for b in _accumulation_data(seed, r, k)]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    (scale * nn.functional.mse_loss(model(x), y)).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return [p.detach() for p in model.parameters()]


@exercise(points=1, timeout=90.0, reference="companion.ddp.accumulation_step")
def check_no_sync_accumulation(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(model, micro_batches, loss_fn, optimizer): one step over k micro-batches, syncing
    gradients only after the last backward."""
    packed, world, k = _packed(answer), 2, 3
    for seed in fresh_seeds(2):
        results = _on_ranks(_accumulation_worker, world, packed, seed, k, timeout=worker_timeout)
        expected = _one_process_step(seed, world, k, 1.0)
        for rank, (params, calls, buckets, pending) in enumerate(results):
            require(not pending, "optimizer.step() ran before the gradients were averaged",
                    hint="call model.finish_gradient_synchronization() after the last backward.")
            require(calls > 0, "the gradients were never averaged over the ranks",
                    hint="the last micro-batch's backward must run outside model.no_sync().")
            wrong = _one_process_step(seed, world, k, float(k))
            for i, (p, e) in enumerate(zip(params, expected)):
                compare(p, e, name=f"rank {rank}'s parameter {i} after the step", known_wrong={
                    f"divide each micro-batch's loss by k = {k}: the accumulated gradient must "
                    "be a mean, not a sum.": wrong[i]})
            require(calls == buckets, f"{calls} all-reduces for {k} micro-batches; one per bucket "
                    f"({buckets}) is enough", hint="wrap the first k-1 forward+backward passes "
                    "in `with model.no_sync():` so only the last one communicates.")
    return (f"{k} micro-batches, {buckets} all-reduces instead of {k * buckets}: "
            f"communication cut {k}x")
