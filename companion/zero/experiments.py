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

import random
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from companion.estimate import ModelStates, model_states
from companion.memory import track
from companion.models import MLP
from companion.zero.comm import Comm, count_collectives
from companion.zero.fsdp import FSDP
from companion.zero.optimizer import ShardedOptimizer
from companion.cost.clock import now
from companion.launch import rank_device

__all__ = ["predicted_model_states", "stage_report", "imbalance_report", "fsdp_comparison",
           "traffic_with_accumulation", "fsdp_memory_report", "state_bytes", "count_collectives"]

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
    return rank_device()


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


def _wrap(stage: int, model: nn.Module, opt: str, ring: bool, bucket_cap_mb: float | None,
          **fsdp_options):
    """(network to call, optimizer, Comm, what to call between backward and step) for a stage;
    `fsdp_options` go to FSDP at stage 3."""
    cls, kw = _OPTIMIZERS[opt]
    if stage == 0:                                 # data parallel: all-reduce every gradient
        comm = Comm(ring=ring)
        return model, cls(model.parameters(), **kw), comm, lambda: _average(model, comm)
    if stage in (1, 2):                            # 2: by default buckets of about a quarter
        quarter_mb = sum(4 * p.numel() for p in model.parameters()) / 4 / 2**20
        sharded = ShardedOptimizer(model.parameters(), cls, stage=stage, ring=ring,
                                   bucket_cap_mb=bucket_cap_mb or quarter_mb, **kw)
        return model, sharded, sharded.comm, lambda: None
    fsdp = FSDP(model, ring=ring, **fsdp_options)
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
    alive right after the last backward, the activation bytes alive right after the last forward
    (what autograd saved for backward), its peak, the bytes it sent in the last step, the payload
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
                start = now(_device())                                   # host-device sync
                loss = F.cross_entropy(net(x), y)
                activations = t.breakdown("current")["activations"]
                loss.backward()
                del loss
                after_backward = _gradient_bytes(net, opt)
                sync()
                opt.step()
                seconds.append(now(_device()) - start)                   # host-device sync
                if step < steps - 1:
                    opt.zero_grad()              # the last step's gradients stay, to be measured
        kinds = t.breakdown("current")
        final = net.gather_full_params().values() if stage == 3 else model.parameters()
        reports.append({"stage": stage, "n_params": n, "n_replicated": n_1d,
                        "sample": _sample(list(final)),
                        "params": kinds["parameters"], "grads": kinds["gradients"],
                        "optimizer_state": kinds["optimizer_state"], "peak": t.peak,
                        "grads_after_backward": after_backward,
                        "activations_after_forward": activations,
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
    interleaved in an order shuffled each step (the same on every rank): each step's seconds and
    their median, model-state bytes, collective payload per step."""
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
        order = sorted(runs)
        random.Random(step).shuffle(order)                        # the same order on every rank
        for name in order:
            net, opt = runs[name]
            with count_collectives() as counter:
                dist.barrier()
                start = now(_device())                                   # host-device sync
                F.cross_entropy(net(x), y).backward()
                if name == "ours":
                    net.finish_gradient_synchronization()
                opt.step()
                elapsed = now(_device()) - start                         # host-device sync
            if step:
                seconds[name].append(elapsed)
                payload[name] = dict(counter)
            if step < steps:
                opt.zero_grad()                  # the last step's gradients stay, to be counted
    return {name: {"seconds": statistics.median(seconds[name]), "times": seconds[name],
                   "payload": payload[name],
                   **state_bytes(list(net.parameters()), opt)}
            for name, (net, opt) in runs.items()}


def traffic_with_accumulation(rank: int, world_size: int, stages: list[int], ks: list[int],
                              width: int, depth: int, batch: int, ring: bool = True,
                              classes: int = 16, *, param_dtype: torch.dtype | None = None,
                              reduce_dtype: torch.dtype | None = None,
                              reshard_after_forward: bool = True, prefetch: int = 0
                              ) -> list[dict]:
    """Bytes this rank sends in one optimizer step of k micro-batches (`batch` rows each), for
    each stage (0 = DDP, accumulating locally and all-reducing once, as under no_sync) and each k
    in `ks`. One dict per (stage, k): the bytes sent (on the ring, counted at every send), the
    payload of each kind of collective, and what `traffic.predicted_traffic` takes: n_params,
    and at stage 3 n_replicated (FSDP's 1-D parameters) and n_skipped (the first Linear's weight:
    its input is the data, so backward never gathers it again). The keyword options go to FSDP.

    Stages 0 and 1 send the same for any k; stage 2 reduce-scatters every micro-batch, as
    DeepSpeed's stage 2 does ("ZeRO stage >= 2 communicates during non gradient accumulation
    boundaries as well", deepspeed/runtime/engine.py); stage 3 gathers twice and reduce-scatters
    every micro-batch. FSDP2 skips the reduce-scatter with set_requires_gradient_sync(False), at
    the memory of the unsharded gradients. The cited facts: `companion.zero.traffic`.
    """
    fsdp = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                reshard_after_forward=reshard_after_forward, prefetch=prefetch)
    reports = []
    for stage in stages:
        for k in ks:
            x, y = _data(rank, world_size, width, k * batch, classes)
            model = MLP(width, width, depth, classes, seed=0, device=_device())
            counts = {"n_params": sum(p.numel() for p in model.parameters()),
                      "n_replicated": 0, "n_skipped": 0}
            if stage == 3:
                counts["n_replicated"] = sum(p.numel() for p in model.parameters() if p.dim() < 2)
                counts["n_skipped"] = model.net[0].weight.numel()
            net, opt, comm, sync = _wrap(stage, model, "adamw", ring, None,
                                         **(fsdp if stage == 3 else {}))
            comm.reset()
            for x_micro, y_micro in zip(x.chunk(k), y.chunk(k)):
                (F.cross_entropy(net(x_micro).float(), y_micro) / k).backward()
            sync()                                    # DDP: the one all-reduce of the step
            opt.step()
            reports.append({"stage": stage, "k": k, "sent_bytes": comm.traffic.sent_bytes,
                            "payload": dict(comm.payload), **counts})
    return reports


def fsdp_memory_report(rank: int, world_size: int, width: int, depth: int, batch: int,
                       settings: list[tuple[bool, int]], classes: int = 16) -> list[dict]:
    """For each (reshard_after_forward, prefetch) in `settings`, one step of the course MLP under
    FSDP, measured with `track`: the peak bytes allocated during forward and during backward
    (above what was alive when each began), what forward left alive, how much of it is gathered
    weights kept for backward, each unit's gathered bytes in forward order and whether it is kept
    (`prefetch.predicted_gathered_peak` takes both), the shards' bytes, the payload per step and
    a sample of the gradients. On the counting ring, which is synchronous: a prefetched gather
    lands at once, so the memory is what an asynchronous one holds, the overlap is not measured.
    """
    x, y = _data(rank, world_size, width, batch, classes)
    reports = []
    for reshard, prefetch in settings:
        model = FSDP(MLP(width, width, depth, classes, seed=0, device=_device()),
                     reshard_after_forward=reshard, prefetch=prefetch, ring=True)
        with track(_device()) as forward:
            out = model(x)
        order = model._forward_order
        unit_bytes = [model.groups[g].layout.padded * model.shards[g].element_size()
                      for g in order]
        keep = [model.groups[g].root or not reshard for g in order]
        kept = sum(b for b, g in zip(unit_bytes, order) if model.groups[g].kept is not None)
        with track(_device()) as backward:
            F.cross_entropy(out, y).backward()
            model.finish_gradient_synchronization()
        reports.append({"reshard_after_forward": reshard, "prefetch": prefetch,
                        "unit_bytes": unit_bytes, "keep": keep,
                        "forward_peak": forward.peak, "after_forward": forward.current,
                        "kept_after_forward": kept, "backward_peak": backward.peak,
                        "shard_bytes": _storage_bytes(model.parameters()),
                        "payload": dict(model.comm.payload),
                        "grads": _sample([p.grad for p in model.parameters()])})
        del model, out
    return reports
