"""Workers for `companion.launch.run` that measure ZeRO per rank: memory, traffic, step time.

Each returns plain numbers, so the notebook and `benchmarks/bench_zero.py` only print and plot.
Options are positional, since `launch.run(fn, N, *args)` passes them on that way.
Memory is measured with `companion.memory.track` inside the rank (model states at the end of a
step, before `zero_grad`); torch's FSDP2 keeps DTensors that the CPU ledger cannot see into, so for
the FSDP comparison both sides are counted the same way instead: the distinct storages behind the
parameters, gradients and optimizer state (`state_bytes`). Traffic is counted by `Comm` (with
`ring=True`, at every send) or, to compare with torch, by wrapping torch's collectives.

Example:
    >>> from companion import launch
    >>> launch.run(stage_report, 2, [0, 1, 2, 3], 256, 4, 8)   # width, depth, batch; doctest: +SKIP
"""
from __future__ import annotations

import collections
import contextlib
import statistics
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from companion.estimate import ModelStates, model_states
from companion.memory import track
from companion.models import MLP
from companion.zero.comm import Comm
from companion.zero.fsdp import FSDP
from companion.zero.optimizer import ShardedOptimizer

__all__ = ["predicted_model_states", "stage_report", "imbalance_report", "fsdp_comparison",
           "state_bytes", "count_collectives"]

_OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
               "sgd_momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9})}


def predicted_model_states(n_sharded: int, n_replicated: int = 0, *, stage: int, world_size: int,
                           optimizer: str = "adamw") -> ModelStates:
    """`estimate.model_states` per rank, fp32, with `n_replicated` parameters (our FSDP's 1-D
    ones) kept whole at stage 3; at stages 0-2 every parameter is in `n_sharded`."""
    main = model_states(n_sharded, optimizer=optimizer, zero_stage=stage, world_size=world_size)
    rest = model_states(n_replicated, optimizer=optimizer)
    return ModelStates(*(a + b for a, b in zip((main.params, main.grads, main.optimizer),
                                                (rest.params, rest.grads, rest.optimizer))))


def _device() -> torch.device:
    """This rank's GPU under NCCL (launch.run gives each rank its own), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _data(rank: int, world_size: int, width: int, batch: int, classes: int):
    """This rank's slice (batch rows) of a global batch of world_size·batch rows."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(world_size * batch, width, generator=g)
    y = torch.randint(classes, (world_size * batch,), generator=g)
    mine = slice(rank * batch, (rank + 1) * batch)
    return x[mine].to(_device()), y[mine].to(_device())


def _sample(params: list[torch.Tensor]) -> torch.Tensor:
    """Every 97th element of the flattened parameters: enough to compare runs cheaply."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in params])[::97].clone()


def _wrap(stage: int, model: nn.Module, opt: str, ring: bool, bucket_cap_mb: float | None):
    """(network to call, optimizer, Comm, what to call between backward and step) for a stage."""
    cls, kw = _OPTIMIZERS[opt]
    if stage == 0:                                 # data parallel: all-reduce every gradient
        comm = Comm(ring=ring)
        return model, cls(model.parameters(), **kw), comm, lambda: _average(model, comm)
    if stage in (1, 2):                            # 2: by default buckets of about a quarter
        quarter_mb = sum(4 * p.numel() for p in model.parameters()) / 4 / 2**20
        sharded = ShardedOptimizer(model.parameters(), cls, stage=stage, ring=ring,
                                   bucket_cap_mb=bucket_cap_mb or quarter_mb, **kw)
        return model, sharded, sharded.comm, lambda: None
    fsdp = FSDP(model, ring=ring)
    return fsdp, cls(fsdp.parameters(), **kw), fsdp.comm, fsdp.finish_gradient_synchronization


def _average(model: nn.Module, comm: Comm) -> None:
    for p in model.parameters():
        comm.all_reduce(p.grad)                                           # collective
        p.grad /= comm.world_size


def _gradient_bytes(net: nn.Module, opt) -> int:
    """Bytes of the distinct storages holding gradients now: every parameter's .grad, and
    ShardedOptimizer's live bucket buffers and shard gradients, or FSDP's reduce-scatter in flight
    (the tracker files bucket buffers under temporaries, so they are counted here instead)."""
    tensors = [p.grad for p in net.parameters()]
    for bucket in getattr(opt, "buckets", []):
        tensors += [bucket.grads, bucket.master.grad]
    if isinstance(net, FSDP) and net._in_flight is not None:
        tensors.append(net._in_flight[2])                 # (N·s,) the full gradient
    return _storage_bytes(t for t in tensors if t is not None)


def stage_report(rank: int, world_size: int, stages: list[int], width: int, depth: int,
                 batch: int, steps: int = 2, optimizer: str = "adamw", ring: bool = True,
                 classes: int = 16, *, bucket_cap_mb: float | None = None) -> list[dict]:
    """For each stage (0 = data parallel, 1, 2, 3 = FSDP), train the course MLP for `steps` steps
    and return this rank's model states in bytes (tracked, after the last step), the gradient bytes
    alive right after the last backward, its peak, the bytes it sent in the last step, the payload
    of each collective and the median step time. Stage 2's buckets hold `bucket_cap_mb` MiB
    (default: about a quarter of the model)."""
    x, y = _data(rank, world_size, width, batch, classes)
    reports = []
    for stage in stages:
        comm = None
        with track(_device()) as t:
            model = MLP(width, width, depth, classes, seed=0, device=_device())
            n_1d = sum(p.numel() for p in model.parameters() if p.dim() < 2)
            n = sum(p.numel() for p in model.parameters())
            net, opt, comm, sync = _wrap(stage, model, optimizer, ring, bucket_cap_mb)
            seconds = []
            for step in range(steps):
                comm.reset()
                start = time.perf_counter()
                F.cross_entropy(net(x), y).backward()
                after_backward = _gradient_bytes(net, opt)
                sync()
                opt.step()
                seconds.append(time.perf_counter() - start)
                if step < steps - 1:
                    opt.zero_grad()              # the last step's gradients stay, to be measured
        kinds = t.breakdown("current")
        final = net.gather_full_params().values() if stage == 3 else model.parameters()
        reports.append({"stage": stage, "n_params": n, "n_replicated": n_1d,
                        "sample": _sample(list(final)),
                        "params": kinds["parameters"], "grads": kinds["gradients"],
                        "optimizer_state": kinds["optimizer_state"], "peak": t.peak,
                        "grads_after_backward": after_backward,
                        "buckets": len(getattr(opt, "buckets", [])),
                        "sent_bytes": comm.traffic.sent_bytes, "payload": dict(comm.payload),
                        "seconds": statistics.median(seconds)})
        del model, net, opt, comm
    return reports


class _Imbalanced(nn.Module):
    """One large matrix (an embedding table) and a few small layers: whole-tensor partitions
    cannot balance it."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, 8)
        g = torch.Generator().manual_seed(0)         # the same weights on every rank
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def imbalance_report(rank: int, world_size: int, vocab: int, width: int) -> dict:
    """Optimizer-state bytes (tracked), elements owned on this rank and the payload of each kind
    of collective in the step (`count_collectives`), after one AdamW step with ours and with
    torch's ZeroRedundancyOptimizer (which assigns whole tensors to ranks, and broadcasts them)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    g = torch.Generator().manual_seed(rank)
    tokens, labels = torch.randint(vocab, (16,), generator=g), torch.randint(8, (16,), generator=g)
    tokens, labels = tokens.to(_device()), labels.to(_device())
    out = {}
    for name in ("ours", "torch"):
        with track(_device()) as t:
            model = _Imbalanced(vocab, width).to(_device())
            if name == "ours":
                opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
                owned = opt.buckets[0].layout.shard
            else:
                opt = ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.AdamW, lr=1e-3)
            with count_collectives() as payload:
                F.cross_entropy(model(tokens), labels).backward()
                if name == "torch":              # torch's expects averaged gradients (DDP)
                    for p in model.parameters():
                        dist.all_reduce(p.grad)                           # collective
                        p.grad /= world_size
                    owned = sum(p.numel() for g_ in opt.optim.param_groups for p in g_["params"])
                opt.step()                       # torch's: broadcasts (collective)
        out[name] = {"optimizer_state": t.breakdown("current")["optimizer_state"],
                     "owned": owned, "payload": dict(payload)}
    out["n_params"] = sum(p.numel() for p in _Imbalanced(vocab, width).parameters())
    return out


@contextlib.contextmanager
def count_collectives() -> Iterator[collections.Counter]:
    """Inside, torch's all-gather, reduce-scatter, all-reduce and broadcast add the bytes of the
    full tensor they move (payload) to the yielded Counter, by kind. Works on any code that calls
    them through `torch.distributed` (ours with ring=False, FSDP2, ZeroRedundancyOptimizer)."""
    counter: collections.Counter = collections.Counter()
    full = {"all_gather_single": (0, "output_tensor", "all_gather"),       # where the full
            "all_gather_into_tensor": (0, "output_tensor", "all_gather"),  # tensor is passed
            "reduce_scatter_single": (1, "input", "reduce_scatter"),
            "reduce_scatter_tensor": (1, "input", "reduce_scatter"),
            "all_reduce": (0, "tensor", "all_reduce"),
            "broadcast": (0, "tensor", "broadcast")}
    saved = {n: getattr(dist, n) for n in full if hasattr(dist, n)}

    def counted(original, position, keyword, kind):
        def call(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs[keyword]
            counter[kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(fn, *full[name]))
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def state_bytes(params: list, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the distinct storages behind parameters, gradients and optimizer state (the local
    shard of a DTensor), counted without the tracker."""
    state = [v for s in optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0]
    inner = getattr(optimizer, "optim", None)                 # ShardedOptimizer's shard
    if inner is not None:
        state += [v for s in inner.state.values() for v in s.values()
                  if torch.is_tensor(v) and v.dim() > 0]
    return {"params": _storage_bytes(params),
            "grads": _storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer_state": _storage_bytes(state)}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local shard)."""
    storages = {}
    for t in tensors:
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def fsdp_comparison(rank: int, world_size: int, width: int, depth: int, batch: int,
                    steps: int, classes: int = 16) -> dict:
    """Our FSDP against torch's FSDP2 (`fully_shard` on every Linear and the root), steps
    interleaved: median seconds per step, model-state bytes, collective payload per step."""
    from torch.distributed.fsdp import fully_shard

    x, y = _data(rank, world_size, width, batch, classes)
    ours = FSDP(MLP(width, width, depth, classes, seed=0, device=_device()))
    theirs = MLP(width, width, depth, classes, seed=0, device=_device())
    for layer in theirs.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(theirs)
    runs = {"ours": (ours, torch.optim.AdamW(ours.parameters(), lr=1e-3)),
            "torch": (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3))}
    seconds = {name: [] for name in runs}
    payload = {}
    for step in range(steps + 1):                                 # step 0 warms up
        for name, (net, opt) in runs.items():
            with count_collectives() as counter:
                dist.barrier()
                start = time.perf_counter()
                F.cross_entropy(net(x), y).backward()
                if name == "ours":
                    net.finish_gradient_synchronization()
                opt.step()
                elapsed = time.perf_counter() - start
            if step:
                seconds[name].append(elapsed)
                payload[name] = dict(counter)
            if step < steps:
                opt.zero_grad()                  # the last step's gradients stay, to be counted
    return {name: {"seconds": statistics.median(seconds[name]), "payload": payload[name],
                   **state_bytes(list(net.parameters()), opt)}
            for name, (net, opt) in runs.items()}
