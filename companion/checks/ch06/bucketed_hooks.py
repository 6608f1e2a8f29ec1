"""Chapter 06, exercise 2: buckets rebuilt from the order backward makes the gradients (as
PyTorch's Reducer does after its first step), then all-reduced from the hooks while backward runs,
on 2 and 3 gloo ranks.

How the check watches (`_Watch`): every dist.all_reduce is recorded with the parameters its tensor
holds (matched by value against the gradients at that moment), whether it was asynchronous and
whether backward was running; the ranks compare those contents before the real call (on a side
group), so ranks that disagree fail with a message, not a gloo crash. An asynchronous all-reduce
runs on a copy of the tensor, and the result lands in the learner's tensor only when its work is
waited for (wait(), is_completed() true, or the future from get_future() done): gloo completes
all-reduces out of order, so a buffer read without waiting for its own work may still hold this
rank's values; here it always does, and a wrong answer fails on every run, not by a timing's luck.
A tensor changed between launch and wait (dividing it in flight) is noted too.
"""
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
from companion.checks.core import CheckFailed, compare, exercise, fresh_seeds, require

__all__ = ["check_bucketed_hooks"]

_STEPS = 3


class _TiedLM(nn.Module):
    """A language model whose output layer is its embedding (tied weights): the embedding is
    registered near the front, but its gradient is final only when backward reaches the input."""

    def __init__(self, vocab: int, dim: int, hidden: int):
        super().__init__()
        self.head_bias = nn.Parameter(torch.zeros(vocab))
        self.embed = nn.Embedding(vocab, dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)                                            # (B, T, dim)
        h = h + self.down(torch.tanh(self.up(h)))
        return h @ self.embed.weight.T + self.head_bias                   # (B, T, vocab)


class _Branches(nn.Module):
    """Bias-free linear branches side by side, run in `order` (set before each forward, as a
    router would): backward makes their gradients in the reverse of that order."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(7, w, bias=False) for w in widths)
        self.order = list(range(len(widths)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = [None] * len(self.branches)
        for k in self.order:
            out[k] = torch.tanh(self.branches[k](x))
        return torch.cat(out, dim=1)                                      # (B, sum of widths)


def _buckets_by_cap(sizes: list[int], order: list[int], cap: int) -> list[tuple[int, ...]]:
    """The course's rule: parameters (indices into sizes, in `order`) fill a bucket until the
    next one would take it past cap bytes; one larger than the cap gets a bucket of its own."""
    buckets, size = [], 0
    for k in order:
        if not buckets or size + sizes[k] > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(k)
        size += sizes[k]
    return [tuple(b) for b in buckets]


def _good_caps(sizes: list[int], first: list[int], others: list[list[int]], *,
               short: int = 0) -> list[int]:
    """Caps, each `short` bytes under a sum of a run of `first`'s sizes, that give 3+ buckets,
    other buckets than every order in `others` (and than sizes counted in elements), and a tie
    at the boundary: with short=0 a bucket filled to the cap exactly (a rule with >= splits
    it), with short=1 other buckets than at cap + 1 (a rule that lets a bucket hold one byte
    more)."""
    caps = sorted({sum(sizes[k] for k in first[i:j]) - short for i in range(len(first))
                   for j in range(i + 2, len(first) + 1)})
    good = []
    for cap in caps:
        want = _buckets_by_cap(sizes, first, cap)
        tie = any(len(b) > 1 and sum(sizes[k] for k in b) == cap for b in want) if not short \
            else want != _buckets_by_cap(sizes, first, cap + short)
        if len(want) >= 3 and tie and want != _buckets_by_cap(sizes, first, 4 * cap) and \
                all(want != _buckets_by_cap(sizes, o, cap) for o in others):
            good.append(cap)
    return good


def _case(kind: str, seed: int, world: int) -> dict:
    """One model, its cap, and the forward order of each (rank, step) for the branches. "tied":
    a tied-embedding LM, its gradients in a fixed order that is not the registration order, one
    early bucket of about 1 MiB (still in flight on gloo when later small ones finish), a cap that
    one bucket fills exactly. "branches": the order changes with the rank in the first step and
    again in the second; a cap one byte short of a bucket's worth. The caller's random state is
    left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)                          # the models' initial weights
        return _draw_case(kind, torch.Generator().manual_seed(seed), world)


def _draw_case(kind: str, g: torch.Generator, world: int) -> dict:
    if kind == "tied":
        vocab, dim = 64 + int(torch.randint(64, (), generator=g)), 192 + 64 * int(
            torch.randint(2, (), generator=g))
        model = _TiedLM(vocab, dim, 4 * dim + int(torch.randint(1, 64, (), generator=g)))
        sizes = [p.numel() * p.element_size() for p in model.parameters()]
        arrival = [0, 5, 4, 3, 2, 1]     # head_bias, down.{bias,weight}, up.{bias,weight}, embed
        caps = _good_caps(sizes, arrival, [list(range(6)), list(range(6))[::-1]])
        return dict(kind=kind, model=model, cap=caps[int(torch.randint(len(caps), (),
                                                                       generator=g))],
                    orders=None, sizes=sizes, arrival=arrival)
    while True:
        widths = (torch.randperm(14, generator=g)[:6] + 1).tolist()
        sizes = [7 * w * 4 for w in widths]
        orders = [[torch.randperm(6, generator=g).tolist() for _ in range(_STEPS)]
                  for _ in range(world)]
        for rank in range(1, world):
            orders[rank][1:] = orders[0][1:]   # from the second step on, one order on all ranks
        first = orders[0][0][::-1]
        others = [list(range(6)), list(range(6))[::-1], orders[0][1][::-1]] + \
                 [orders[r][0][::-1] for r in range(1, world)]
        for cap in _good_caps(sizes, first, others, short=1):
            want = _buckets_by_cap(sizes, first, cap)
            second = orders[0][1][::-1]                  # the second step's arrival order
            done = [max(second.index(k) for k in b) for b in want]
            if any(done[i + 1] < done[i] for i in range(len(want) - 1)) and \
                    any(len(b) > 1 for b in want):                   # out of bucket order
                return dict(kind=kind, model=_Branches(widths), cap=cap, orders=orders,
                            sizes=sizes, arrival=first)


def _loss(case: dict, seed: int, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * rank + 977 * step)
    model = case["model"]
    if case["kind"] == "tied":
        tokens = torch.randint(model.vocab, (3, 5), generator=g)
        logits = model(tokens)                                            # (3, 5, vocab)
        return nn.functional.cross_entropy(logits.reshape(-1, model.vocab),
                                           torch.randint(model.vocab, (15,), generator=g))
    model.order = case["orders"][rank][step]
    out = model(torch.randn(5, 7, generator=g))                           # (5, sum of widths)
    return nn.functional.mse_loss(out, torch.randn(out.shape, generator=g))


_KINDS = {"tied": "a language model with tied embeddings",
          "branches": "a model of branches run in an order that changes"}


def _contents(tensor: torch.Tensor, params: list[nn.Parameter], world: int):
    """The parameters (indices) whose gradients, one after another, make up `tensor` (each
    as it is, or divided by the world size), or None when it is not made of gradients."""
    flat, found, offset = tensor.detach().reshape(-1), [], 0
    while offset < flat.numel():
        for k, p in enumerate(params):
            n = p.numel()
            if k in found or p.grad is None or offset + n > flat.numel():
                continue
            piece, grad = flat[offset:offset + n], p.grad.reshape(-1)
            if torch.equal(piece, grad) or torch.allclose(piece, grad / world, rtol=1e-6,
                                                          atol=1e-30):
                found.append(k)
                offset += n
                break
        else:
            return None
    return tuple(found)


class _WatchedWork:
    """An asynchronous all-reduce of a copy of the learner's tensor: the result is written into
    the tensor when the work is waited for (see the module's doc)."""

    def __init__(self, work: Any, watch: "_Watch", index: int, tensor, sent, buffer):
        self._work, self._watch, self._index = work, watch, index
        self._tensor, self._sent, self._buffer, self._landed = tensor, sent, buffer, False

    def _land(self) -> None:
        if not self._landed:
            self._landed = True
            if not torch.equal(self._tensor, self._sent):
                self._watch.changed.add(self._index)
            self._tensor.copy_(self._buffer)
        self._watch.waited.add(self._index)

    def wait(self, *args, **kwargs):
        self._watch.waits_in_backward |= torch._C._current_graph_task_id() != -1
        result = self._work.wait(*args, **kwargs)
        self._land()
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._land()
        return done

    def get_future(self):
        return self._work.get_future().then(lambda fut: (self._land(), fut.value())[1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Watch:
    """Watches dist.all_reduce on one rank (see the module's doc); `events` holds ("grad", k)
    from the check's own hooks and ("launch", contents, async, in backward, index)."""

    def __init__(self, params: list[nn.Parameter], names: list[str], side):
        self.params, self.names, self.side = params, names, side
        self.real = c10d.all_reduce
        self._start()

    def _start(self) -> None:
        self.events: list = []
        self.waits_in_backward = False
        self.launched, self.waited, self.changed = set(), set(), set()

    def take(self) -> tuple:
        """This step's record (events, a wait() in backward, launches not waited for, launches
        whose tensor changed in flight); starts the next step's."""
        record = (self.events, self.waits_in_backward, sorted(self.launched - self.waited),
                  sorted(self.changed))
        self._start()
        return record

    def all_reduce(self, tensor, *args, **kwargs):
        world = dist.get_world_size()
        async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        held = _contents(tensor, self.params, world)
        seen = [None] * world
        dist.all_gather_object(seen, (held, tensor.numel()), group=self.side)
        if any(s != seen[0] for s in seen):
            said = "; ".join(f"rank {r}: " + (", ".join(self.names[k] for k in h) if h else
                                              f"{n} elements, not gradients")
                             for r, (h, n) in enumerate(seen))
            raise RuntimeError(f"the ranks all-reduce different tensors at once ({said})")
        index = len(self.launched)
        self.events.append(("launch", held, async_op, torch._C._current_graph_task_id() != -1,
                            index))
        if not async_op:
            return self.real(tensor, *args, **kwargs)
        self.launched.add(index)
        sent, buffer = tensor.detach().clone(), tensor.detach().clone()
        work = self.real(buffer, *args, **kwargs)
        return _WatchedWork(work, self, index, tensor, sent, buffer)

    @contextlib.contextmanager
    def installed(self):
        """dist.all_reduce (also imported by name, before or inside the block) is watched inside.
        Yields adopt(obj): also rebinds the all_reduce that obj's module imported by name."""
        real, rebound = self.real, []

        def watched(*args, **kwargs):
            return self.all_reduce(*args, **kwargs)

        watched.watches = real

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


def _bucket_worker(rank: int, world_size: int, packed: bytes, seed: int):
    """Per model: the learner's averager over 3 steps of backward + finish(); per step, every
    gradient's arrival (the check's hooks, registered first) and every all-reduce, the waits."""
    side = dist.new_group(backend="gloo")
    observed = []
    for kind in _KINDS:
        case = _case(kind, seed, world_size)
        model = case["model"]
        names = [n for n, _ in model.named_parameters()]
        params = list(model.parameters())
        watch = _Watch(params, names, side)
        for k, param in enumerate(params):
            param.register_post_accumulate_grad_hook(
                lambda p, k=k: watch.events.append(("grad", k)))
        grads, steps = [], []
        with watch.installed() as adopt:
            averager = adopt(pickle.loads(packed))(params, case["cap"])
            for step in range(_STEPS):
                model.zero_grad(set_to_none=False)
                _loss(case, seed, rank, step).backward()
                averager.finish()
                grads.append([p.grad.clone() for p in params])
                steps.append(watch.take())
        observed.append((grads, steps))
    return observed


def _local_grads(kind: str, seed: int, world: int, rank: int, step: int) -> list[torch.Tensor]:
    case = _case(kind, seed, world)
    _loss(case, seed, rank, step).backward()
    return [p.grad for p in case["model"].parameters()]


def _late_launch(events: list, buckets: list[tuple[int, ...]]) -> int | None:
    """The first bucket not launched as soon as it (and every bucket before it) was complete,
    before the next gradient arrived; None if every launch was on time."""
    bucket_of = {k: i for i, b in enumerate(buckets) for k in b}
    done, launched, next_bucket = [0] * len(buckets), 0, 0
    for event in events:
        if event[0] == "launch":
            launched += 1
            continue
        while next_bucket < len(buckets) and done[next_bucket] == len(buckets[next_bucket]):
            if launched <= next_bucket:
                return next_bucket                  # a gradient arrived; this one still waits
            next_bucket += 1
        done[bucket_of[event[1]]] += 1
    return None


def _judge_step(where: str, record: tuple, want: list[tuple[int, ...]], names: list[str],
                cap: int) -> None:
    """From the second step on: one asynchronous all-reduce per bucket of `want`, in order,
    each from the hook that completed it, waited for only in finish() and left alone in flight."""
    events, waited_in_backward, unwaited, changed = record
    launches = [e for e in events if e[0] == "launch"]
    show = lambda b: "[" + ", ".join(names[k] for k in b) + "]"      # noqa: E731
    require(launches and all(e[2] and e[3] for e in launches), f"{where} "
            + ("no all-reduce started" if not launches else "an all-reduce was not launched "
               "asynchronously while backward ran"), hint="from the second step on the buckets "
            "are known: launch each one from the hooks, as soon as it is complete, with "
            "async_op=True (the overlap with backward is what the buckets are for), and reset "
            "what you count per step in finish().")
    got = [e[1] for e in launches]
    held = [set(b) if b else None for b in got]
    require(len(got) >= len(want) or held != [set(b) for b in want[:len(got)]],
            f"{where} the buckets {', '.join(show(b) for b in want[len(got):])} were never "
            "all-reduced", hint="the hook call that completes a bucket may have to launch later "
            "buckets too, which were complete and waiting for it: no other hook call may come.")
    require([set(b) if b else None for b in got] == [set(b) for b in want],
            f"{where} the all-reduces held " + ", ".join(show(b) if b else "something not "
                                                         "made of this step's gradients"
                                                         for b in got)
            + f"; the buckets are {', '.join(show(b) for b in want)} (cap {cap} bytes)",
            hint="build the buckets once, after the first step, from the order rank 0's "
                 "gradients arrived in that step (not the order of model.parameters(), and "
                 "not again in later steps), filling each until the next gradient would take "
                 "it past cap_bytes; launch them in that order, each once all its gradients "
                 "are in.")
    late = _late_launch(events, want)
    require(late is None, f"{where} bucket {late} {show(want[late]) if late is not None else ''} "
            "was complete, and so were those before it, but another gradient arrived before "
            "its all-reduce started", hint="gradients need not arrive in bucket order: the hook "
            "call that completes a bucket may have to launch later buckets too, which were "
            "complete and waiting for it.")
    require(not waited_in_backward, f"{where} an all-reduce's work.wait() ran while backward "
            "was still running", hint="keep the work and wait for it in finish(): a wait() in the "
            "hook stops backward until the communication is done, so nothing overlaps.")
    require(not changed, f"{where} bucket(s) {changed}'s buffer changed while its all-reduce "
            "was in flight", hint="an asynchronous all-reduce reads and writes its tensor until "
            "its work is done: touch the buffer only after wait().")
    require(not unwaited, f"{where} finish() returned without waiting for bucket(s) "
            f"{unwaited}'s all-reduce: their buffers may still hold this rank's own gradients",
            hint="all-reduces need not finish in the order they started (gloo runs several at "
                 "once: a small late bucket can finish before a large early one), and one "
                 "finished says nothing of the others.")


def _run(packed, world: int, seed: int, timeout: float) -> list:
    try:
        return _ranks.on_ranks(_bucket_worker, world, packed, seed, timeout=timeout)
    except CheckFailed as e:
        if "different tensors at once" not in e.summary:
            raise
        raise CheckFailed(f"{e.summary} (on {world} ranks)", hint=(
            "all-reduces pair up across ranks in the order they start, so every rank must "
            "launch the same buckets in the same order; the gradients of one step need not "
            "arrive in the same order on every rank (here the first step's order differs "
            "between ranks): every rank must take one rank's order.")) from None


@exercise(points=3, timeout=120.0, reference=("companion.ddp.DDP",
                                              "companion.ddp.average_gradients"))
def check_bucketed_hooks(answer, *, worker_timeout: float = 30.0) -> str:
    """answer(params, cap_bytes) -> an averager whose finish() leaves the average over the
    ranks in every param.grad, each step; it learns the gradients' arrival order in the first
    step (rank 0's), builds buckets from it once, and from the second step on all-reduces
    each bucket asynchronously from the hooks during backward. Run on 2 and 3 ranks, 3 steps,
    on a tied-embedding LM and on branches whose order changes with the rank and the step."""
    packed = _ranks.packed(answer)
    for world, seed in zip((2, 3), fresh_seeds(2)):
        results = _run(packed, world, seed, worker_timeout)
        for c, kind in enumerate(_KINDS):
            case = _case(kind, seed, world)
            names = [n for n, _ in case["model"].named_parameters()]
            want = _buckets_by_cap(case["sizes"], case["arrival"], case["cap"])
            for step in range(_STEPS):
                local = [_local_grads(kind, seed, world, r, step) for r in range(world)]
                for rank in range(world):
                    grads, records = results[rank][c]
                    where = f"rank {rank} of {world}, step {step + 1} ({_KINDS[kind]}):"
                    if step:
                        _judge_step(where, records[step], want, names, case["cap"])
                    for i, g in enumerate(grads[step]):
                        mean = sum(grad[i] for grad in local) / world
                        compare(g, mean, name=f"{where} the gradient of {names[i]}", known_wrong={
                            "divide by the world size: all_reduce sums.": mean * world,
                            "each rank still has its own gradient: write the averages into "
                            "param.grad in finish().": local[rank][i]})
    return (f"2 and 3 ranks, 3 steps, {' and '.join(_KINDS.values())}: buckets built once from "
            "rank 0's first-step order (3 or more each time), each all-reduced "
            "asynchronously from the hook that completed it while backward ran, waited for in "
            "finish(); every rank left with the average every step")
