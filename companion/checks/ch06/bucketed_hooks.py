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
from companion.cost import network
from companion.checks import _ranks
from companion.checks._collective_guard import point_to_point_only, ring_direction
from companion.checks.core import CheckFailed, compare, exercise, fresh_seeds, require

__all__ = ["check_ring_all_reduce", "check_bucketed_hooks", "check_bucket_cap"]


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


def _ring_on_ranks(world: int, packed: bytes, seed: int, lengths: list[int], timeout: float):
    """The ring worker on `world` ranks; ranks that hang fail with what makes a ring hang."""
    try:
        return _ranks.on_ranks(_ring_worker, world, packed, seed, lengths, timeout=timeout)
    except CheckFailed as e:
        if "did not finish" not in e.summary:
            raise
        raise CheckFailed(f"{e.summary} (on {world} ranks)", hint=(
            "a blocking dist.send or dist.recv returns only once the neighbour has posted the "
            "matching call (gloo holds a send until its receiver is ready, and NCCL may): if "
            "every rank sends first, or every rank receives first, each waits for a neighbour "
            "that is doing the same; if one side skips an empty chunk that the other still "
            "sends or receives, that rank waits forever. Start each step's send without waiting "
            "(dist.isend, wait() after the recv; or dist.batch_isend_irecv), or let even ranks "
            "send first while odd ranks receive first.")) from None


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
                                             "companion.collectives.naive_all_reduce",
                                             "companion.collectives.ring_reduce_scatter",
                                             "companion.collectives.ring_all_gather"))
def check_ring_all_reduce(answer, *, worker_timeout: float = 20.0) -> str:
    """answer(tensor, group=None): sum `tensor` over all ranks in place, with a ring of sends."""
    packed, seed = _ranks.packed(answer), fresh_seeds(1)[0]
    lengths = [1001, 12, 5, 2, 1]           # the long one first: its failure says most
    for world in (2, 3):
        per_rank = _ring_on_ranks(world, packed, seed, lengths, worker_timeout)
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


# ---------------------------------------------------------------- exercise 3: choose the cap

def _cap_case(seed: int) -> dict:
    """A model's gradients in backward order (bytes, backward seconds each), N and a fit: uniform
    stacks, a huge embedding gradient arriving last, a huge output layer first, fast and slow
    backward passes, gloo-like and NCCL-like latencies."""
    import random

    rng = random.Random(seed)
    kind = rng.choice(["uniform", "embedding last", "head first", "mixed"])
    layers = rng.randint(12, 48)
    each = rng.choice([2**18, 2**20, 4 * 2**20])
    grads = [float(each * rng.choice([1, 1, 1, 2]) if kind == "mixed" else each)
             for _ in range(layers)]
    if kind == "embedding last":
        grads.append(float(rng.randint(layers // 2, 2 * layers) * each))
    if kind == "head first":
        grads.insert(0, float(rng.randint(layers // 2, 2 * layers) * each))
    world = rng.choice([2, 4, 8, 64])
    alpha = rng.choice([8e-6, 3e-5, 2e-4, 1e-3])
    beta = 1 / rng.choice([1e9, 10e9, 50e9, 200e9])
    one = network.all_reduce_seconds(sum(grads), world, alpha=alpha, beta=beta)
    backward = one * rng.choice([0.2, 1.0, 3.0, 10.0])           # comm-bound .. compute-bound
    weights = [g ** rng.choice([0.5, 1.0]) for g in grads]
    times = [backward * w / sum(weights) for w in weights]
    return {"kind": kind, "grads": grads, "times": times, "world": world, "alpha": alpha,
            "beta": beta}


def _exposed_at(case: dict, cap: float) -> float:
    return network.bucketed_exposed(case["grads"], case["times"], case["world"],
                                    alpha=case["alpha"], beta=case["beta"], cap_bytes=cap)


def _best_cap(case: dict) -> tuple[float, float]:
    """(cap, exposed seconds) of the best cap: every bucketing a cap can make is made by a cap
    equal to the bytes of some run of consecutive gradients."""
    g = case["grads"]
    caps = {sum(g[i:j]) for i in range(len(g)) for j in range(i + 1, len(g) + 1)}
    return min(((c, _exposed_at(case, c)) for c in caps), key=lambda x: (x[1], x[0]))


def _judge_cap(case: dict, cap: float,
               best: tuple[float, float] | None = None) -> tuple[bool, float, float, float]:
    """(good enough, the cap's exposed seconds, the best cap, its exposed seconds; `best`: the
    best (cap, exposed seconds), when found already): good enough is at most 1.5x the best's
    exposure plus 5% of one whole all-reduce (a search over powers of two passed all of 300 fixed
    cases, and fails about 3 check calls in 100 on fresh ones)."""
    best, best_exposed = best or _best_cap(case)
    mine = _exposed_at(case, cap)
    one = network.all_reduce_seconds(sum(case["grads"]), case["world"], alpha=case["alpha"],
                                     beta=case["beta"])
    return mine <= 1.5 * best_exposed + 0.05 * one, mine, best, best_exposed


# Fixed cases (seeds of _cap_case), where a schedule that takes a bucket as ready at its first
# gradient and equal buckets of network.best_bucket_count's count both leave at least 1.56x the
# exposure the judgement allows, and a search over powers of two passes: a uniform stack of 24,
# an early large head (31) and another uniform stack of 28 (tests/test_checks_ch06.py checks it).
_FIXED_CAP_SEEDS = (55, 60, 89)

# Small fixed cases, judged first (they cost microseconds): a schedule that takes a bucket as
# ready one gradient early or late, or a search that leaves out the caps of single gradients or
# of the runs that start at the first gradient, leaves 1.19x to 4.6x the exposure the judgement
# allows in at least one of them (tests/test_checks_ch06.py checks it). One per gradient is best
# in the first two; the third is latency-bound (64 ranks, α = 1 ms), where one bucket is best;
# the fourth has one gradient (a model of one tensor), where a search must still find a cap.
_MiB = 2.0**20
_SMALL_CAP_CASES = (
    {"kind": "small", "grads": [8 * _MiB, 1 * _MiB], "times": [20e-3, 20e-3], "world": 2,
     "alpha": 1e-6, "beta": 1e-9},
    {"kind": "small", "grads": [16 * _MiB, 1 * _MiB, 17 * _MiB], "times": [1e-3, 100e-3, 0.1e-3],
     "world": 8, "alpha": 1e-6, "beta": 1e-9},
    {"kind": "small", "grads": [4 * _MiB, 1 * _MiB], "times": [250e-3, 2.5e-3], "world": 64,
     "alpha": 1e-3, "beta": 5e-12},
    {"kind": "small", "grads": [4 * _MiB], "times": [1e-3], "world": 4, "alpha": 3e-5,
     "beta": 1e-10},
)


@exercise(points=2, timeout=60.0, reference=("companion.cost.network.bucketed_exposed",))
def check_bucket_cap(answer) -> str:
    """answer(grad_bytes, backward_seconds, world_size, alpha, beta) -> a bucket cap in bytes.
    grad_bytes[i] is the i-th gradient backward makes (in that order) and backward_seconds[i]
    the time backward spends making it; buckets hold at most the cap (one larger gradient gets a
    bucket of its own), each is all-reduced by a ring as soon as it is complete and the link is
    free. Judged by the communication left after backward ends: at most 1.5x the best cap's
    plus 5% of one whole all-reduce, on models, world sizes and links the notebook does not
    show."""
    from companion.checks.core import call

    cases = [(None, dict(c)) for c in _SMALL_CAP_CASES]
    cases += [(seed, _cap_case(seed)) for seed in _FIXED_CAP_SEEDS + tuple(fresh_seeds(12))]
    for seed, case in cases:
        best = _best_cap(case)
        got = call(answer, list(case["grads"]), list(case["times"]), case["world"],
                   case["alpha"], case["beta"])
        require(isinstance(got, (int, float)) and not isinstance(got, bool) and
                math.isfinite(got) and got > 0,
                f"expected a positive number of bytes, got {got!r}",
                hint="return the cap itself, e.g. 8 * 2**20 for 8 MiB.")
        good, mine, best, best_exposed = _judge_cap(case, float(got), best)
        if not good:
            n_mine = len(network.buckets(case["grads"], float(got)))
            n_best = len(network.buckets(case["grads"], best))
            raise CheckFailed(
                f"{case['kind']} model, {len(case['grads'])} gradients, N = {case['world']}, "
                f"α = {case['alpha'] * 1e6:.0f} µs, {1 / case['beta'] / 1e9:.0f} GB/s, backward "
                f"{sum(case['times']) * 1e3:.2f} ms: your cap of {got:,.0f} B makes {n_mine} "
                f"bucket(s) and leaves {mine * 1e3:.3f} ms exposed; a cap of {best:,.0f} B "
                f"({n_best} bucket(s)) leaves {best_exposed * 1e3:.3f} ms",
                seed=seed, hint="the answer depends on when each gradient is ready and what "
                "each bucket costs on the link: try the caps that change the bucketing and "
                "keep the one whose last all-reduce ends soonest after backward.")
    return (f"within 1.5x of the best cap's exposed communication on {len(cases)} models (small "
            "ones, uniform, a late embedding gradient, an early large head, mixed sizes) at N "
            "from 2 to 64 and links from gloo-like to NCCL-like")
