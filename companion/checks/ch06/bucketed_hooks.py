"""Chapter 06, exercise 2: gradient hooks that all-reduce buckets while backward runs, on 2
gloo ranks."""
from __future__ import annotations

import contextlib
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

from companion.checks import _ranks
from companion.checks.core import compare, exercise, fresh_seeds, require

__all__ = ["check_bucketed_hooks"]


_ARRIVALS = [(0, 1, 1, 0, 2, 2), (1, 0, 2, 1, 0, 2), (1, 1, 0, 2, 0, 2)]   # bucket of each
# gradient, in the order they arrive: bucket 1 is complete before bucket 0, 2 completes last


class _Branches(nn.Module):
    """Bias-free linear branches side by side, run in `order`: backward makes their gradients in
    the reverse of that order, which is not the order they were registered in."""

    def __init__(self, widths: list[int], order: list[int]):
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(7, w, bias=False) for w in widths)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = [None] * len(self.branches)
        for k in self.order:
            out[k] = torch.tanh(self.branches[k](x))
        return torch.cat(out, dim=1)                                       # (B, sum of widths)


def _bucket_case(kind: str, seed: int) -> tuple[nn.Module, list[list[nn.Parameter]]]:
    """A model and its 3 buckets, each of its own size. "mlp": the gradients arrive bucket after
    bucket, last layer first. "shuffled": they arrive as _ARRIVALS[seed % 3] says (as in DDP,
    whose buckets follow the parameters backwards until it rebuilds them from a step's order)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 9), nn.Tanh(),
                              nn.Linear(9, 3))
        last, middle, first = model[4], model[2], model[0]
        return model, [[last.bias, last.weight, middle.bias], [middle.weight],
                       [first.bias, first.weight]]
    pattern, sums = _ARRIVALS[seed % len(_ARRIVALS)], []
    order = torch.randperm(6, generator=g).tolist()
    arriving = order[::-1]                              # the branch of the j-th gradient
    while len(set(sums)) < 3:                           # buckets are told apart by their size
        widths = (torch.randperm(12, generator=g)[:6] + 1).tolist()       # one per branch
        sums = [sum(widths[k] for k, b in zip(arriving, pattern) if b == i) for i in range(3)]
    model = _Branches(widths, order)
    return model, [[model.branches[k].weight for k, b in zip(arriving, pattern) if b == i]
                   for i in range(3)]


_CASES = {"mlp": "an MLP", "shuffled": "a model whose gradients arrive out of bucket order"}


def _bucket_loss(model: nn.Module, seed: int, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * rank + 977 * step)
    out = model(torch.randn(5, 7, generator=g))                          # (5, outputs)
    return nn.functional.mse_loss(out, torch.randn(out.shape, generator=g))


class _WatchedWork:
    """An all-reduce's Work, wrapped: each wait() notes whether backward was still running, and
    that bucket `which`'s work was waited for (wait(), or get_future() to wait on)."""

    def __init__(self, work: Any, waits: list[bool], which: int, waited: set):
        self._work, self._waits, self._which, self._waited = work, waits, which, waited

    def wait(self, *args, **kwargs):
        self._waits.append(torch._C._current_graph_task_id() != -1)
        self._waited.add(self._which)
        return self._work.wait(*args, **kwargs)

    def get_future(self, *args, **kwargs):
        self._waited.add(self._which)
        return self._work.get_future(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def _watched_all_reduce(buckets: list[list[nn.Parameter]], events: list, waits: list[bool],
                        waited: set | None = None):
    """Inside, dist.all_reduce (also as distributed_c10d.all_reduce, and as imported by `from
    torch.distributed import all_reduce` inside the block) appends ("launch", bucket, async, in
    backward) to `events` and returns its Work wrapped in a `_WatchedWork` (which adds the bucket
    to `waited` once it is waited for). Yields `adopt(obj)`,
    which also watches the all_reduce that obj's module imported by name before the block (a
    worker may have imported it already, e.g. with the parent's __main__), or inside an earlier
    one (whose watcher it would otherwise still call), and restores it afterwards."""
    real, sizes = c10d.all_reduce, [sum(p.numel() for p in b) for b in buckets]
    waited = set() if waited is None else waited

    def watched(tensor, *args, **kwargs):
        which = sizes.index(tensor.numel()) if tensor.numel() in sizes else -1
        async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        events.append(("launch", which, async_op, torch._C._current_graph_task_id() != -1))
        work = real(tensor, *args, **kwargs)
        return _WatchedWork(work, waits, which, waited) if work is not None else None

    watched.watches = real
    rebound: list[tuple[dict, str]] = []

    def adopt(obj: Any) -> Any:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        for name, value in list(vars(module).items()) if module else []:
            if value is real or getattr(value, "watches", None) is real:
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
    """Per case: build the learner's averager on its model, run `steps` backward + finish, and
    record per step, in order, every gradient's arrival (the check's own hooks, registered first,
    so they run before the learner's) and every all-reduce started, and whether a wait() ran
    while backward did."""
    observed = []
    for kind in _CASES:
        model, buckets = _bucket_case(kind, seed)
        events: list = []
        for i, bucket in enumerate(buckets):
            for param in bucket:
                param.register_post_accumulate_grad_hook(
                    lambda p, i=i: events.append(("grad", i)))
        grads, per_step, waits, waited = [], [], [], set()
        with _watched_all_reduce(buckets, events, waits, waited) as adopt:
            averager = adopt(pickle.loads(packed))(buckets)   # imported after patching if not yet
            for step in range(steps):
                model.zero_grad(set_to_none=False)
                _bucket_loss(model, seed, rank, step).backward()
                averager.finish()
                grads.append([p.grad.clone() for p in model.parameters()])
                launched = {e[1] for e in events if e[0] == "launch" and e[2]}
                per_step.append((list(events), any(waits), sorted(launched - waited)))
                del events[:], waits[:]
                waited.clear()
        observed.append((grads, per_step))
    return observed


def _early_launch(events: list, need: list[int]) -> str | None:
    """What the first all-reduce started before its bucket was complete found; None if every
    bucket was complete when it started. need: gradients per bucket."""
    done = [0] * len(need)
    for kind, which, *_ in events:
        if kind == "grad":
            done[which] += 1
        elif 0 <= which < len(need) and done[which] < need[which]:
            return f"bucket {which}'s all-reduce started with {done[which]} of its {need[which]} " \
                   "gradients in"
    return None


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


def _bucket_local_grads(kind: str, seed: int, rank: int, step: int) -> list[torch.Tensor]:
    model, _ = _bucket_case(kind, seed)
    _bucket_loss(model, seed, rank, step).backward()
    return [p.grad for p in model.parameters()]


def _judge_launches(where: str, events: list, need: list[int], waited_in_backward: bool) -> None:
    """One rank's step: one asynchronous all-reduce per bucket, in bucket order, each launched
    from the hooks once the bucket was complete and before the next gradient arrived, and no
    wait() while backward runs."""
    launches, count = [e[1:] for e in events if e[0] == "launch"], len(need)
    order = [w for w, _, _ in launches]
    require(len(launches) <= count, f"{where} {len(launches)} all-reduces started for {count} "
            "buckets; expected one per bucket", hint="all-reduce a bucket's flat buffer once, "
            "when its last gradient is in.")
    missing = [i for i in range(count) if i not in order]
    require(not missing, f"{where} bucket(s) {missing} never all-reduced", hint="launch every "
            "bucket once it is complete (one hook call may have several buckets to launch); "
            "reset what you count in finish() for the next step.")
    require(order == list(range(count)), f"{where} buckets all-reduced in the order {order}",
            hint="launch bucket 0, then 1, then 2, on every rank: all-reduces pair up across "
                 "ranks in the order they start, and gradients need not become ready in bucket "
                 "order, nor in the same order on every rank.")
    require(all(a for _, a, _ in launches), f"{where} an all-reduce blocked backward",
            hint="start it with dist.all_reduce(flat, async_op=True) and keep the returned work; "
                 "wait for it in finish().")
    early = _early_launch(events, need)
    require(early is None, f"{where} {early}", hint="a bucket is complete when every one of its "
            "own gradients is in: count them per bucket (other buckets' gradients arrive in "
            "between).")
    require(all(b for _, _, b in launches), f"{where} a bucket's all-reduce started after "
            "backward had finished", hint="launch it from the hook, as soon as the bucket's last "
            "gradient arrives: that is the overlap DDP is for.")
    late = _late_launch(events, need)
    require(late is None, f"{where} bucket {late} was complete, but a gradient of a later bucket "
            "arrived before its all-reduce started", hint="launch each bucket from the hook call "
            "that completes it (and every bucket before it), not later: one hook call may have "
            "several buckets to launch, and a bucket held back until the last hook overlaps "
            "nothing with backward.")
    require(not waited_in_backward, f"{where} an all-reduce's work.wait() ran while backward "
            "was still running", hint="keep the work and wait for it in finish(): a wait() in the "
            "hook stops backward until the communication is done, so nothing overlaps.")


@exercise(points=3, timeout=90.0, reference=("companion.ddp.DDP",
                                             "companion.ddp.average_gradients"))
def check_bucketed_hooks(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(buckets) -> an object whose parameters' post-accumulate-grad hooks average the
    gradients over the ranks, one asynchronous all-reduce per bucket launched during backward, in
    bucket order, as soon as the bucket and those before it are complete, and whose finish()
    waits for every one of them (gloo completes all-reduces out of order: waiting on the last
    says nothing of the others) and leaves the averages in every param.grad. Run on an MLP and on a model whose
    gradients become ready out of bucket order."""
    packed, world, steps = _ranks.packed(answer), 2, 2
    for seed in fresh_seeds(2):
        results = _ranks.on_ranks(_bucket_worker, world, packed, seed, steps,
                                  timeout=worker_timeout)
        for c, kind in enumerate(_CASES):
            need = [len(b) for b in _bucket_case(kind, seed)[1]]
            local = [[_bucket_local_grads(kind, seed, r, step) for r in range(world)]
                     for step in range(steps)]
            for rank in range(world):
                grads, per_step = results[rank][c]
                for step, (events, waited_in_backward, unwaited) in enumerate(per_step):
                    where = f"rank {rank}, step {step + 1} ({_CASES[kind]}):"
                    _judge_launches(where, events, need, waited_in_backward)
                    require(not unwaited, f"{where} finish() returned without waiting for "
                            f"bucket(s) {unwaited}'s all-reduce: their buffers may still hold "
                            "this rank's own gradients",
                            hint="wait for every work you launched: all-reduces need not finish "
                                 "in the order they started (gloo runs several at once, so a "
                                 "small late bucket can finish before a large early one), and "
                                 "one finished says nothing of the others.")
                    for i, g in enumerate(grads[step]):
                        want = sum(grad[i] for grad in local[step]) / world
                        compare(g, want, name=f"{where} gradient {i}", known_wrong={
                            "divide by the world size: all_reduce sums.": want * world,
                            "each rank still has its own gradient: copy the averaged bucket "
                            "back into param.grad in finish().": local[step][rank][i]})
    return (f"3 buckets on 2 ranks, in {' and in '.join(_CASES.values())}: each all-reduced "
            "once, asynchronously, in bucket order, launched from the hook that completed it "
            "(and the buckets before it) while backward was still running, and waited for only "
            "in finish(); every rank left with the average")
