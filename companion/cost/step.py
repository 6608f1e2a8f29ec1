"""How long a training step takes: compute, recomputation, communication and transfers, by part.

Every model here is a schedule on two resources, the compute stream and the link, built from a few
measured speeds (`Speeds`, in `companion.cost.speeds`: from `calibrate()` on the learner's machine,
or from a GPU in `companion.cost.gpus`). A model is a list of layers (`Layer`, same module); a
layer's forward takes its matmuls' time at their own shapes + other_bytes / memory_bandwidth +
ops · op_seconds, and its backward the matmuls' gradients and twice the rest.

The step models return a `StepTime`, whose parts a chart can stack:
- `single_step`: k micro-batches on one device, the optimizer after them;
- `ddp_step`: buckets all-reduced as backward completes them, on the link's lanes (PyTorch
  DDP's design: Li et al. 2020, "PyTorch Distributed", VLDB 13(12)), so only what is left when
  backward ends is exposed; with `no_sync` accumulation, only the last micro-batch
  communicates;
- `zero_step`: ZeRO-1 (reduce-scatter after backward, all-gather after the step), ZeRO-2 (bucketed
  reduce-scatters during every micro-batch's backward), ZeRO-3 (each unit gathered before its
  forward and again before its backward, unless kept, its gradient reduce-scattered; `prefetch`
  units gathered ahead while the current one computes);
- `offload_step`: gradients to the host, AdamW there, weights back (ZeRO-Offload's schedule),
  optionally with its delayed parameter update; `offload_ladder` times every rung of
  `OFFLOAD_RUNGS` (optimizer state, gradients, parameters, NVMe), `offload_traffic` counts their
  bytes and `offload_break_even` the tokens (per micro-batch for the gradients' copy, per step
  for the delayed update) at which the offload hides behind compute.

Simplified vs a real run: one link per rank at one speed (the measured curve of each collective,
or α–β), carrying `Speeds.concurrent_collectives` collectives at once (NCCL: one after another
on its stream; gloo: one per worker thread, 2 by default, their fixed costs overlapping and their
transfers sharing the link as `Speeds.link_sharing` says), communication that does not slow the
compute it overlaps (on a CPU the two share cores: `Speeds.overlap` says how much of the link's
time can hide), ranks that slow each other's compute by one measured factor
(`Speeds.shared_compute`), no Python overhead beyond the measured per-layer, per-operator and
per-ZeRO-3-unit costs, and of the allocator only what `Speeds.first_touch` measures: on a CPU,
gradients freed by zero_grad (set_to_none) are given back to the system once enough is free,
and the next backward faults them in again page by page (here nothing up to 16 MiB of them,
tens of ms at 32-64 MiB, more on a busy machine); CUDA's caching allocator keeps its blocks.
How far that carries is measured, not assumed: `companion.cost.validate` runs each model against
real gloo ranks and `benchmarks/bench_cost.py` reports the errors.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from companion.cost import network
from companion.cost.speeds import (Layer, Speeds, gpt_layers, mlp_layers,  # noqa: F401
                                   training_flops)      # re-exported: the models' inputs

__all__ = ["Speeds", "Layer", "StepTime", "mlp_layers", "gpt_layers", "training_flops",
           "single_step", "ddp_step", "zero_step", "offload_step", "zero_traffic",
           "tokens_to_hide_gathers", "exposed_link", "OPTIMIZER_BYTES", "OFFLOAD_RUNGS",
           "offload_traffic", "offload_ladder", "offload_break_even"]

# bytes an optimizer step reads and writes per parameter (fp32): SGD reads w, g and writes w;
# AdamW also reads and writes both moments
OPTIMIZER_BYTES = {"sgd": 12, "adamw": 28}
_OPTIMIZER_OPS = {"sgd": 1, "adamw": 12}          # operators per tensor in the for-loop form


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by part. Parts add up to `total`: nothing counted twice."""

    compute: float = 0.0          # forward and backward of every micro-batch
    recompute: float = 0.0        # forwards run again under checkpointing
    communication: float = 0.0    # link time not hidden behind compute (exposed)
    transfers: float = 0.0        # host <-> device copies not hidden (offload)
    host_step: float = 0.0        # the optimizer on the host (offload)
    optimizer: float = 0.0        # the optimizer on the device
    bucketing: float = 0.0        # gradients copied into and out of communication buffers
    first_touch: float = 0.0      # gradients allocated afresh each step (`Speeds.first_touch`)
    traffic: float = 0.0          # bytes this rank sent (not a time: a record of the volume)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.communication + self.transfers
                + self.host_step + self.optimizer + self.bucketing + self.first_touch)

    def parts(self) -> dict[str, float]:
        """{part: seconds} of the non-zero parts, for a stacked bar."""
        names = ("compute", "recompute", "communication", "transfers", "host_step", "optimizer",
                 "bucketing", "first_touch")
        return {n: getattr(self, n) for n in names if getattr(self, n)}


def _check_ranks(world_size: int, k: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (micro-batches per step) must be a positive int, got {k!r}")


def _optimizer_seconds(layers: Sequence[Layer], s: Speeds, optimizer: str, share: float,
                       tensors: int | None = None) -> float:
    """The optimizer's bytes at memory bandwidth, or its parameters at the rate measured for it
    (`Speeds.optimizer_rates`: torch's for-loop AdamW makes several passes and temporaries where
    28 bytes a parameter count one), plus its operators per tensor: every parameter tensor
    (share 1), or `tensors` flat shards (ZeRO steps one flat tensor per bucket or unit)."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_BYTES)}, got {optimizer!r}")
    params = sum(l.params for l in layers if l.trainable) * share
    if tensors is None:
        tensors = sum(l.tensors for l in layers if l.trainable)
    rate = dict(s.optimizer_rates).get(optimizer)       # measured on this machine, if it was
    stream = params / rate if rate else OPTIMIZER_BYTES[optimizer] * params / s.memory_bandwidth
    return stream + _OPTIMIZER_OPS[optimizer] * tensors * s.op_seconds


def single_step(layers: Sequence[Layer], s: Speeds, *, k: int = 1, optimizer: str = "sgd",
                recompute: float = 0.0, fresh_gradients: float = 1.0,
                grad_bytes: int = 4) -> StepTime:
    """One device, k micro-batches, then the optimizer. `recompute`: the share of the forward
    run again in backward (checkpointing: (segments-1)/segments of the blocks).
    `fresh_gradients`: the share of the gradients that `zero_grad()` frees (set_to_none, its
    default) and the first backward allocates again, priced by `Speeds.fresh_seconds`."""
    _check_ranks(1, k)
    forward = sum(l.forward_seconds(s) for l in layers)
    backward = sum(l.backward_seconds(s) for l in layers)
    fresh = fresh_gradients * sum(l.params for l in layers if l.trainable) * grad_bytes
    return StepTime(compute=k * (forward + backward), recompute=k * recompute * forward,
                    optimizer=_optimizer_seconds(layers, s, optimizer, 1.0),
                    first_touch=s.fresh_seconds(fresh))


def _buckets(layers: Sequence[Layer], cap_bytes: float, grad_bytes: int) -> list[tuple[int, float]]:
    """Buckets in backward order, as `network.buckets` makes them (at most cap_bytes each), as
    (index of the layer whose gradient completes it, bytes)."""
    order = [i for i in reversed(range(len(layers))) if layers[i].trainable]
    return [(order[j], size) for j, size in
            network.buckets([layers[i].params * grad_bytes for i in order], cap_bytes)]


def _backward_ends(layers: Sequence[Layer], s: Speeds) -> list[float]:
    """When each layer's backward ends, from the start of backward (the last layer goes first)."""
    ends, t = [0.0] * len(layers), 0.0
    for i in reversed(range(len(layers))):
        t += layers[i].backward_seconds(s)
        ends[i] = t
    return ends


def _link(messages: Sequence[tuple[float, float, float]], s: Speeds,
          lanes: int | None = None) -> float:
    """When the link finishes messages (ready, latency, transfer) issued in that order: up to
    `lanes` at once (default `Speeds.concurrent_collectives`), their transfers sharing the link
    (`network.link_schedule`)."""
    lanes = s.concurrent_collectives if lanes is None else lanes
    ends = network.link_schedule(messages, lanes=lanes, sharing=s.link_sharing)
    return max(ends, default=0.0)


def _exposed(link_end: float, compute_end: float, s: Speeds, link_busy: float) -> float:
    """Link time left after the compute ends; with partial overlap, (1 - overlap) of the link's
    busy time that did hide is charged back."""
    left = max(0.0, link_end - compute_end)
    return left + (1 - s.overlap) * (link_busy - left)


def _copies(layers: Sequence[Layer], s: Speeds, grad_bytes: int, passes: float) -> float:
    """`passes` reads-and-writes of every trainable gradient, one operator per tensor each."""
    nbytes = sum(l.params for l in layers if l.trainable) * grad_bytes
    tensors = sum(l.tensors for l in layers if l.trainable)
    return passes * (2 * nbytes / s.memory_bandwidth + tensors * s.op_seconds)


def ddp_step(layers: Sequence[Layer], s: Speeds, world_size: int, *, bucket_bytes: float = 25 * 2**20,
             k: int = 1, no_sync: bool = True, optimizer: str = "sgd",
             grad_bytes: int = 4, bucket_view: bool = False) -> StepTime:
    """DDP: each bucket (cap `bucket_bytes`, filled in backward order) all-reduced as soon as its
    last gradient is ready and the previous bucket is done. With no_sync, micro-batches 1..k-1
    only accumulate; without it, every micro-batch all-reduces. `bucket_view`
    (`gradient_as_bucket_view=True`): the gradients are views of buckets that live from step to
    step, so no copy in or out and no gradient allocated afresh; the buckets are divided by N
    and, after `zero_grad()`, zeroed at the next forward."""
    _check_ranks(world_size, k)
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
    s = s.ranks(world_size)
    base = single_step(layers, s, k=k, optimizer=optimizer, grad_bytes=grad_bytes,
                       fresh_gradients=0.0 if bucket_view else 1.0)
    syncing = 1 if no_sync else k
    # each synchronised backward copies the gradients into the buckets, divides them by N and
    # copies the averages back (`companion.ddp.DDP`); with bucket views only the division is
    # left, and a write of zeros (half a read-and-write pass) once a step
    passes = syncing * (1 if bucket_view else 3) + (0.5 if bucket_view else 0)
    base = dataclasses.replace(base, bucketing=_copies(layers, s, grad_bytes, passes))
    ends = _backward_ends(layers, s)
    buckets = _buckets(layers, bucket_bytes, grad_bytes)
    # every bucket's all-reduce (asynchronous), up to `concurrent_collectives` at once; on one
    # rank a gloo group still runs each (a measured curve of world size 1, else nothing)
    messages = [(ends[i], *s.collective_parts("all_reduce", b, world_size)) for i, b in buckets]
    busy = sum(a + b for _, a, b in messages)
    if busy == 0:
        return base
    exposed = _exposed(_link(messages, s), ends[0], s, busy)
    sent = 2 * (world_size - 1) / world_size * sum(b for _, b in buckets)
    return dataclasses.replace(base, communication=syncing * exposed, traffic=syncing * sent)


def zero_traffic(stage: int, k: int, world_size: int, param_bytes: float, *,
                 reshard_after_forward: bool = True, gather_bytes: float | None = None) -> float:
    """Bytes one rank sends per optimizer step (ring shares), for a model whose every parameter is
    sharded (`companion.zero.predicted_traffic` is exact for the course's code, which keeps 1-D
    parameters whole and does not gather the first unit again): DDP (stage 0, no_sync) and ZeRO-1
    2·(N-1)/N·Ψ; ZeRO-2 (k+1)·(N-1)/N·Ψ (a reduce-scatter every micro-batch, one all-gather);
    ZeRO-3 (N-1)/N·(2k·Ψg + k·Ψ) with Ψg the gathered bytes (2k gathers, k reduce-scatters), or
    (N-1)/N·(k·Ψg + k·Ψ) when gathered weights are kept from forward to backward."""
    _check_ranks(world_size, k)
    share = (world_size - 1) / world_size
    g = param_bytes if gather_bytes is None else gather_bytes
    if stage in (0, 1):
        return 2 * share * param_bytes
    if stage == 2:
        return (k + 1) * share * param_bytes
    if stage == 3:
        return share * ((2 if reshard_after_forward else 1) * k * g + k * param_bytes)
    raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")


def zero_step(layers: Sequence[Layer], s: Speeds, world_size: int, stage: int, *, k: int = 1,
              bucket_bytes: float = 25 * 2**20, prefetch: int = 0,
              reshard_after_forward: bool = True, optimizer: str = "adamw",
              grad_bytes: int = 4, gather_bytes_per_param: int = 4) -> StepTime:
    """ZeRO on `world_size` ranks, k micro-batches, layers as units. Stage 1: reduce-scatter all
    buckets after the last backward, step the shard, all-gather it. Stage 2: each micro-batch's
    buckets reduce-scatter during its backward (one in flight), then step and all-gather. Stage 3:
    each unit's weights gathered before its forward and (unless kept) before its backward, with
    `prefetch` units gathered ahead while one computes; gradients reduce-scattered per unit."""
    _check_ranks(world_size, k)
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int, got {prefetch!r}")
    N = world_size
    shard = 1.0 / N
    s = s.ranks(world_size)
    # stage 1 keeps its flat gradient buffer; stages 2 and 3 free the full gradients as soon as
    # they are reduced, and zero_grad frees the shards' (1/N of them)
    base = single_step(layers, s, k=k, optimizer=optimizer, grad_bytes=grad_bytes,
                       fresh_gradients=0.0 if stage == 1 else shard)
    flat = (len(_buckets(layers, bucket_bytes, grad_bytes)) if stage in (1, 2)
            else sum(l.trainable for l in layers))      # one flat shard per bucket or unit
    base = dataclasses.replace(base, optimizer=_optimizer_seconds(layers, s, optimizer, shard,
                                                                  flat))
    if N == 1:
        return base
    psi = sum(l.params for l in layers if l.trainable) * grad_bytes
    rs = lambda nbytes: s.collective_parts("reduce_scatter", nbytes, N)     # (latency, transfer)
    ag = lambda nbytes: s.collective_parts("all_gather", nbytes, N)
    ends = _backward_ends(layers, s)
    buckets = _buckets(layers, bucket_bytes, grad_bytes)
    # after the step every bucket's all-gather is started at once, then waited for
    gather_after_step = _link([(0.0, *ag(size)) for _, size in buckets], s)
    traffic = zero_traffic(stage, k, N, psi, reshard_after_forward=reshard_after_forward,
                           gather_bytes=psi / grad_bytes * gather_bytes_per_param)
    if stage in (1, 2):                 # gradients into flat buckets (2: every micro-batch)
        base = dataclasses.replace(base, bucketing=_copies(layers, s, grad_bytes,
                                                           2 * (k if stage == 2 else 1)))
    if stage == 1:                      # every reduce-scatter started at once, after backward
        return dataclasses.replace(base, traffic=traffic, communication=_link(
            [(0.0, *rs(size)) for _, size in buckets], s) + gather_after_step)
    if stage == 2:                      # the course's ShardedOptimizer: one in flight
        messages = [(ends[i], *rs(size)) for i, size in buckets]
        busy = sum(a + b for _, a, b in messages)
        per_micro = _exposed(_link(messages, s, lanes=1), ends[0], s, busy)
        return dataclasses.replace(base, traffic=traffic,
                                   communication=k * per_micro + gather_after_step)
    if stage != 3:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    units = [i for i, l in enumerate(layers)]
    gather = [ag(l.params * gather_bytes_per_param) for l in layers]
    scatter = [rs(l.params * grad_bytes) if l.trainable else 0.0 for l in layers]
    # each unit's fixed cost beyond its compute and collectives (`Speeds.unit_seconds`), a third
    # in forward and two in backward as a layer's (`Layer.forward_seconds`)
    fwd = [l.forward_seconds(s) + s.unit_seconds / 3 for l in layers]
    bwd = [l.backward_seconds(s) + 2 * s.unit_seconds / 3 for l in layers]
    base = dataclasses.replace(base, compute=base.compute + k * len(layers) * s.unit_seconds)
    lanes = dict(lanes=s.concurrent_collectives, sharing=s.link_sharing,
                 one_after=s.concurrent_collectives > 1)
    again = gather if reshard_after_forward else [0.0] * len(layers)
    # every micro-batch's forward and backward are scheduled alike
    exposed_total = k * (exposed_link(units, gather, fwd, prefetch, s.overlap, **lanes)
                         + exposed_link(list(reversed(units)), again, bwd, prefetch, s.overlap,
                                        after=scatter, **lanes))
    # each gather copies the shards into the full flat buffer and hands out views of it; each
    # unit's gradients are flattened for the reduce-scatter: passes over the bytes, per micro-batch
    gathered = (2 if reshard_after_forward else 1) * gather_bytes_per_param / grad_bytes
    return dataclasses.replace(base, traffic=traffic, communication=exposed_total,
                               bucketing=_copies(layers, s, grad_bytes, k * (gathered + 1)))


def exposed_link(order: Sequence[int], gather: Sequence, compute: Sequence[float],
                 prefetch: int, overlap: float = 1.0, after: Sequence | None = None, *,
                 lanes: int = 1, sharing: float = 1.0, one_after: bool = False) -> float:
    """Exposed link time of running units in `order`, unit i needing gather[i] first: with
    prefetch d, the gather of the unit d ahead is issued when a unit starts computing. One link:
    gathers and (in backward) each unit's reduce-scatter (`after`) queue on it in issue order.
    What the compute stream waits for, the link's tail after the last unit, and (1 - overlap) of
    the link time that hid (`Speeds.overlap`: 1 where the link runs beside the compute, as NCCL
    on its own stream; 0 where each collective blocks it). The planner's `predict_seconds`
    prices ZeRO-3's gathers (FSDP's prefetch of one unit) and every stage's gradient
    reductions with it.

    A time in `gather` or `after` is seconds, or (latency, transfer); `lanes` > 1 lets that many
    run at once (gloo: a gather beside the last reduce-scatter), latencies overlapping and
    transfers sharing the link (`network.link_schedule`). `one_after`: a unit's reduce-scatter
    waits, holding up the compute, until the previous one is done (the course's FSDP keeps one
    in flight)."""
    messages: list[tuple[float, float, float]] = []
    issued_as: dict[int, int] = {}                      # unit's place in order -> its gather
    last_after = None
    clock, issued = 0.0, 0

    def send(at: float, cost) -> int:
        latency, transfer = cost if isinstance(cost, tuple) else (0.0, cost)
        messages.append((at, latency, transfer))
        return len(messages) - 1

    done: list[float] = []

    def ends() -> list[float]:      # later messages are issued after the time asked about
        if lanes > 1:
            return network.link_schedule(messages, lanes=lanes, sharing=sharing)
        for ready, latency, transfer in messages[len(done):]:      # one at a time: extend
            done.append(max(done[-1] if done else 0.0, ready) + latency + transfer)
        return done

    for j, unit in enumerate(order):
        while issued <= min(j + prefetch, len(order) - 1):
            issued_as[issued] = send(clock, gather[order[issued]])
            issued += 1
        start = max(clock, ends()[issued_as[j]])         # wait for this unit's weights
        clock = start + compute[unit]
        if after is not None and after[unit]:           # its gradient leaves when it is done
            if one_after and last_after is not None:
                clock = max(clock, ends()[last_after])  # the previous one must finish first
            last_after = send(clock, after[unit])
    link = max(ends(), default=0.0)
    busy = sum(a + b for _, a, b in messages)
    compute_only = sum(compute[u] for u in order)
    waited = clock - compute_only                       # time the compute stream stood still
    tail = max(0.0, link - clock)                       # the last reduce-scatter, after compute
    hidden = busy - waited - tail
    return waited + tail + (1 - overlap) * max(0.0, hidden)


def offload_step(layers: Sequence[Layer], s: Speeds, *, k: int = 1, weight_bytes: int = 2,
                 grad_bytes: int = 2, overlap_copies: bool = True, pipelined: bool = True,
                 delay: int = 0) -> StepTime:
    """ZeRO-Offload on one device: gradients copied to the host as backward makes them (hidden
    behind the rest of backward when `overlap_copies`; else all after backward), AdamW on the
    host over every trainable parameter, one layer's group at a time, and the updated weights
    copied back up (the next forward needs them). `pipelined`: group g's copy up runs while the
    host steps group g+1 (the course's `CPUOffloadOptimizer`), so only what the host step cannot
    cover shows; else every copy waits for the whole host step.

    `delay=1` is the delayed parameter update (ZeRO-Offload §5): the host step and the copy up of
    step t run beside step t+1's forward and backward, so only what exceeds that compute shows."""
    _check_ranks(1, k)
    if delay not in (0, 1):
        raise ValueError(f"delay must be 0 (exact) or 1 (delayed parameter update), got {delay!r}")
    base = single_step(layers, s, k=k, optimizer="sgd", fresh_gradients=0.0)
    trainable = [l for l in layers if l.trainable]
    params = sum(l.params for l in trainable)
    ends = _backward_ends(layers, s)
    forward = sum(l.forward_seconds(s) for l in layers)
    micro = forward + ends[0]                   # one micro-batch's forward and backward
    # every micro-batch's gradients go down as its backward makes them, one copy at a time
    copies = [(j * micro + forward + ends[i], l.params * grad_bytes / s.host_bandwidth)
              for j in range(k) for i, l in reversed(list(enumerate(layers))) if l.trainable]
    busy = sum(t for _, t in copies)
    if overlap_copies:
        down = _exposed(_link([(at, 0.0, t) for at, t in copies], s, lanes=1), k * micro,
                        dataclasses.replace(s, overlap=1.0), busy)
    else:                                       # accumulated on the device, sent once after
        down = busy / k
    host = params / s.host_adam_rate
    ups = [l.params * weight_bytes / s.host_bandwidth for l in trainable]
    if pipelined:                               # two-stage flow shop: host step, then link up
        stepped = sent = 0.0
        for l, u in zip(trainable, ups):
            stepped += l.params / s.host_adam_rate
            sent = max(sent, stepped) + u
        up = sent - host
    else:
        up = sum(ups)
    if delay:                                   # hidden behind the next step's compute
        room = base.compute
        host, room = max(0.0, host - room), max(0.0, room - host)
        up = max(0.0, up - room)
    moved = offload_traffic(params, "gradients" if overlap_copies else "optimizer", k=k,
                            weight_bytes=weight_bytes, grad_bytes=grad_bytes)
    return dataclasses.replace(base, optimizer=0.0, transfers=down + up, host_step=host,
                               traffic=moved["down"] + moved["up"])


# The offload ladder, least offloaded first: where the model states live on each rung.
OFFLOAD_RUNGS = ("none", "optimizer", "gradients", "parameters", "nvme")


def offload_traffic(params: int, rung: str, *, k: int = 1, weight_bytes: int = 2,
                    grad_bytes: int = 2) -> dict[str, float]:
    """Bytes one optimizer step moves on each rung of `OFFLOAD_RUNGS`: "down" (device to host),
    "up" (host to device) and "disk" (read + written), for `params` parameters, `k` micro-batches.

    - "optimizer": gradients accumulate on the device and go down once after the last backward;
      the updated weights go up (weight_bytes each);
    - "gradients": each micro-batch's gradients stream down during its backward (k times);
    - "parameters": the weights live on the host and are fetched before each layer's forward and
      again before its backward (2k times), with no copy up after the step;
    - "nvme": as "parameters", and the fp32 master and both moments (12 bytes) are read from and
      written back to disk every step."""
    _check_rung(rung)
    _check_ranks(1, k)
    P = params
    if rung == "none":
        return {"down": 0.0, "up": 0.0, "disk": 0.0}
    if rung == "optimizer":
        return {"down": P * grad_bytes, "up": P * weight_bytes, "disk": 0.0}
    if rung == "gradients":
        return {"down": k * P * grad_bytes, "up": P * weight_bytes, "disk": 0.0}
    fetched = {"down": k * P * grad_bytes, "up": 2 * k * P * weight_bytes, "disk": 0.0}
    if rung == "nvme":
        fetched["disk"] = 2 * 12 * P
    return fetched


def offload_ladder(layers: Sequence[Layer], s: Speeds, *, k: int = 1, weight_bytes: int = 2,
                   grad_bytes: int = 2, disk_bandwidth: float | None = None,
                   delay: int = 0) -> dict[str, StepTime]:
    """The step time of each rung of `OFFLOAD_RUNGS` on `layers`, one device:

    - "none": everything on the device, AdamW there at memory bandwidth;
    - "optimizer": the gradients' copy down after backward, exposed; host step; copy up;
    - "gradients": ZeRO-Offload (`offload_step`), `delay` its delayed parameter update;
    - "parameters": ZeRO-Infinity's parameter offload: every layer fetched over the link before
      its forward and its backward, one layer ahead of the compute (prefetch), so only the link
      time beyond the forward's compute, and beyond the backward's (which also sends the
      gradients down, the other direction), shows, plus the first layer's fetch;
    - "nvme": "parameters" plus 24 bytes per parameter of disk traffic at `disk_bandwidth`,
      pipelined against the host step group by group (ZeRO-Infinity's overlap; the course's
      `NVMeOffloadOptimizer` pages in and out without it)."""
    _check_ranks(1, k)
    trainable = [l for l in layers if l.trainable]
    P = sum(l.params for l in trainable)
    out = {"none": single_step(layers, s, k=k, optimizer="adamw", fresh_gradients=0.0)}
    out["optimizer"] = offload_step(layers, s, k=k, weight_bytes=weight_bytes,
                                    grad_bytes=grad_bytes, overlap_copies=False, delay=delay)
    out["gradients"] = offload_step(layers, s, k=k, weight_bytes=weight_bytes,
                                    grad_bytes=grad_bytes, delay=delay)
    base = single_step(layers, s, k=k, optimizer="sgd", fresh_gradients=0.0)
    moved = offload_traffic(P, "parameters", k=k, weight_bytes=weight_bytes,
                            grad_bytes=grad_bytes)
    forward = sum(l.forward_seconds(s) for l in layers)
    backward = sum(l.backward_seconds(s) for l in layers)
    fetch = sum(l.params for l in layers) * weight_bytes / s.host_bandwidth
    down = P * grad_bytes / s.host_bandwidth
    # per micro-batch: the weights come up during forward, and again during backward while the
    # gradients go down (the other direction, at the same time)
    exposed = k * (max(0.0, fetch - forward) + max(0.0, max(fetch, down) - backward))
    first = layers[0].params * weight_bytes / s.host_bandwidth
    params_rung = dataclasses.replace(base, optimizer=0.0, host_step=P / s.host_adam_rate,
                                      transfers=first + exposed,
                                      traffic=moved["up"] + moved["down"])
    out["parameters"] = params_rung
    if disk_bandwidth is not None:
        if not disk_bandwidth > 0:
            raise ValueError(f"disk_bandwidth must be positive (bytes/s), got {disk_bandwidth!r}")
        disk = 24 * P / disk_bandwidth
        out["nvme"] = dataclasses.replace(
            params_rung, transfers=params_rung.transfers + max(0.0, disk - params_rung.host_step))
    return out


def offload_break_even(flops: float, host_bandwidth: float, host_adam_rate: float, *,
                       weight_bytes: int = 2, grad_bytes: int = 2) -> dict[str, float]:
    """Tokens (per GPU) above which ZeRO-Offload's costs hide behind compute. A model of P
    parameters computes 6·P FLOPs per token (4·P of them in backward) at `flops` FLOP/s; P
    cancels:

        gradients down, during each micro-batch's backward (tokens per micro-batch):
                                          tokens ≥ flops · grad_bytes / (4 · bandwidth)
        host step + copy up, beside the next step's compute (delayed; tokens per step):
                                          tokens ≥ flops · (1/rate + weight_bytes/bandwidth) / 6

    Without the delayed update the host step and the copy up never hide: they add
    P · (1/rate + weight_bytes/bandwidth) seconds to every step, a share of the step that falls
    as 1/tokens ("exact_overhead_at": the tokens at which that share is 10%)."""
    for name, v in (("flops", flops), ("host_bandwidth", host_bandwidth),
                    ("host_adam_rate", host_adam_rate)):
        if not v > 0 or math.isinf(v):
            raise ValueError(f"{name} must be positive and finite, got {v!r}")
    backward = flops * grad_bytes / (4 * host_bandwidth)
    per_param = 1 / host_adam_rate + weight_bytes / host_bandwidth
    delayed = flops * per_param / 6
    return {"backward": backward, "delayed": delayed, "tokens": max(backward, delayed),
            "exact_overhead_at": flops * per_param * (1 - 0.1) / (6 * 0.1)}


def _check_rung(rung: str) -> None:
    if rung not in OFFLOAD_RUNGS:
        raise ValueError(f"rung must be one of {OFFLOAD_RUNGS}, got {rung!r}")


def tokens_to_hide_gathers(flops: float, link_bandwidth: float, world_size: int, *,
                           gather_bytes: int = 2, reduce_bytes: int = 4) -> dict[str, float]:
    """Tokens per GPU per micro-batch at which ZeRO-3's communication of a layer hides behind its
    compute (the Ultra-Scale Playbook's ZeRO-3 analysis): a layer of P parameters computes
    2·P·tokens FLOPs forward while its gather moves (N-1)/N·P·gather_bytes; backward computes
    4·P·tokens while it gathers again and reduce-scatters (N-1)/N·P·reduce_bytes. P cancels:

        forward:  tokens ≥ flops · (N-1)/N · gather_bytes / (2 · bandwidth)
        backward: tokens ≥ flops · (N-1)/N · (gather_bytes + reduce_bytes) / (4 · bandwidth)
    """
    if flops <= 0 or link_bandwidth <= 0:
        raise ValueError("flops and link_bandwidth must be positive")
    share = (world_size - 1) / world_size
    forward = flops * share * gather_bytes / (2 * link_bandwidth)
    backward = flops * share * (gather_bytes + reduce_bytes) / (4 * link_bandwidth)
    return {"forward": forward, "backward": backward, "tokens": max(forward, backward)}
