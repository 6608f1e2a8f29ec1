"""How long a training step takes: compute, recomputation, communication and transfers, by part.

Every model here is a schedule on two resources, the compute stream and the link, built from a few
measured speeds (`Speeds`: from `calibrate()` on the learner's machine, or from a GPU in
`companion.cost.gpus`). A model is a list of layers (`Layer`), each with its forward matmul FLOPs,
the bytes its other operators move, how many operators it launches and how many parameters it
holds; backward costs twice the forward (a gradient for the input and one for the weight).

A layer's forward takes its matmuls' time + other_bytes / memory_bandwidth + ops · op_seconds,
with each matmul timed at its own shape: from FLOP/s measured at nearby shapes, or from the
roofline, min(peak, intensity · memory bandwidth) (Williams, Waterman & Patterson 2009, "Roofline",
CACM 52(4)): a matmul with a small dimension moves many bytes per FLOP and cannot reach the peak.

The step models return a `StepTime`, whose parts a chart can stack:
- `single_step`: k micro-batches on one device, the optimizer after them;
- `ddp_step`: buckets all-reduced as backward completes them, one at a time on the link
  (PyTorch DDP's design: Li et al. 2020, "PyTorch Distributed", VLDB 13(12)), so only what is
  left when backward ends is exposed; with `no_sync` accumulation, only the last micro-batch
  communicates;
- `zero_step`: ZeRO-1 (reduce-scatter after backward, all-gather after the step), ZeRO-2 (bucketed
  reduce-scatters during every micro-batch's backward), ZeRO-3 (each unit gathered before its
  forward and again before its backward, unless kept, its gradient reduce-scattered; `prefetch`
  units gathered ahead while the current one computes);
- `offload_step`: gradients to the host, AdamW there, weights back (ZeRO-Offload's schedule).

Simplified vs a real run: one link per rank at one speed (the measured curve of each collective,
or α–β), communication that does not slow the compute it overlaps (on a CPU the two share cores:
`Speeds.overlap` says how much of the link's time can hide), ranks that do not slow each other's
compute (on a CPU they share caches and memory bandwidth), no Python overhead beyond the measured
per-layer and per-operator costs, and no allocator effects: on a CPU, a gradient allocated afresh
each step (zero_grad's set_to_none) can pay page faults inside the matmul that first writes it
(an MLP of 4 MiB weights measured here: its backward's matmuls 1.5x slower with fresh gradients
than with kept ones), which CUDA's caching allocator avoids.
How far that carries is measured, not assumed: `companion.cost.validate` runs each model against
real gloo ranks and `benchmarks/bench_cost.py` reports the errors.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from companion.cost import network

__all__ = ["Speeds", "Layer", "StepTime", "mlp_layers", "gpt_layers", "training_flops",
           "single_step", "ddp_step", "zero_step", "offload_step", "zero_traffic",
           "tokens_to_hide_gathers", "OPTIMIZER_BYTES"]

# bytes an optimizer step reads and writes per parameter (fp32): SGD reads w, g and writes w;
# AdamW also reads and writes both moments
OPTIMIZER_BYTES = {"sgd": 12, "adamw": 28}
_OPTIMIZER_OPS = {"sgd": 1, "adamw": 12}          # operators per tensor in the for-loop form


@dataclasses.dataclass(frozen=True)
class Speeds:
    """What one rank does per second: the inputs of every step-time model.

    A matmul's time comes from `matmul_table` when there is one (FLOP/s measured per (m, k, n)
    by `calibrate`, interpolated between the shapes timed), else from the roofline:
    min(matmul_flops, intensity · memory_bandwidth)."""

    matmul_flops: float           # peak attainable FLOP/s of large matmuls, compute dtype
    memory_bandwidth: float       # B/s of elementwise operators and the optimizer, on the device
    op_seconds: float             # fixed cost of one operator (dispatch, kernel launch)
    alpha: float = 0.0            # seconds per message between ranks
    beta: float = 0.0             # seconds per byte between ranks
    host_bandwidth: float = math.inf   # B/s between device and host, each way (0 copies: inf)
    host_adam_rate: float = math.inf   # parameters per second AdamW updates on the host
    overlap: float = 1.0          # share of communication that can hide behind compute (1: all)
    layer_seconds: float = 0.0    # fixed cost of one layer's forward + backward (autograd)
    matmul_table: tuple = ()      # ((m, k, n), FLOP/s) measured, for `matmul_seconds`
    dtype_bytes: int = 4          # bytes per element of the compute dtype
    shared_compute: float = 1.0   # compute time of a rank while the others compute too, over
                                  # alone (CPU ranks share caches and memory; 1 on own GPUs)
    collective_table: tuple = ()  # (kind, world size, ((bytes, seconds), ...)), measured
    linear_table: tuple = ()      # ((m, k, n), forward s, backward s) of F.linear, measured

    def linear_seconds(self, m: int, k: int, n: int) -> tuple[float, float]:
        """(forward, backward) seconds of a Linear on (m, k) inputs with n outputs: interpolated
        in log-size between the shapes of `linear_table` (as FLOP/s), or, without a table, the
        matmuls' times: (m, k) @ (k, n) forward, (m, n) @ (n, k) and (k, m) @ (m, n) backward."""
        if not self.linear_table:
            return (self.matmul_seconds(m, k, n),
                    self.matmul_seconds(m, n, k) + self.matmul_seconds(k, m, n))
        flops = 2 * m * k * n
        forward = tuple((mkn, 2 * mkn[0] * mkn[1] * mkn[2] / f) for mkn, f, _ in self.linear_table)
        backward = tuple((mkn, 4 * mkn[0] * mkn[1] * mkn[2] / max(b, 1e-12))
                         for mkn, _, b in self.linear_table)
        return (flops / _interpolate(forward, (m, k, n)),
                2 * flops / _interpolate(backward, (m, k, n)))

    def collective_seconds(self, kind: str, nbytes: float, world_size: int) -> float:
        """Seconds of one collective ("all_reduce", "reduce_scatter", "all_gather") of a whole
        tensor of `nbytes` on `world_size` ranks: the measured curve of that collective at that
        world size when there is one (interpolated in log-log, extended by its last slope),
        else the ring formula at α and β."""
        if world_size == 1:
            return 0.0
        for k, world, curve in self.collective_table:
            if k == kind and world == world_size:
                return _along(curve, nbytes)
        ring = {"all_reduce": network.all_reduce_seconds,
                "reduce_scatter": network.reduce_scatter_seconds,
                "all_gather": network.all_gather_seconds}
        if kind not in ring:
            raise ValueError(f"kind must be one of {sorted(ring)}, got {kind!r}")
        return ring[kind](nbytes, world_size, alpha=self.alpha, beta=self.beta)

    def __post_init__(self):
        for name in ("matmul_flops", "memory_bandwidth", "host_bandwidth", "host_adam_rate"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Speeds.{name} must be positive, got {value!r}")
        for name in ("op_seconds", "alpha", "beta", "layer_seconds"):
            value = getattr(self, name)
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"Speeds.{name} must be finite and non-negative, got {value!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"Speeds.overlap must lie in [0, 1], got {self.overlap!r}")
        if not 1 <= self.shared_compute < math.inf:
            raise ValueError(f"Speeds.shared_compute must be at least 1, got {self.shared_compute!r}")

    def ranks(self, world_size: int) -> "Speeds":
        """These speeds for one of `world_size` ranks running at once: compute slowed by
        `shared_compute` when there is more than one (the link's speeds were measured so)."""
        if world_size == 1 or self.shared_compute == 1:
            return self
        f = self.shared_compute
        return dataclasses.replace(
            self, shared_compute=1.0, matmul_flops=self.matmul_flops / f,
            memory_bandwidth=self.memory_bandwidth / f, op_seconds=self.op_seconds * f,
            layer_seconds=self.layer_seconds * f,
            matmul_table=tuple((mkn, v / f) for mkn, v in self.matmul_table),
            linear_table=tuple((mkn, a * f, b * f) for mkn, a, b in self.linear_table))

    @classmethod
    def for_gpu(cls, name: str, dtype: str = "bf16", *, alpha: float = 20e-6) -> "Speeds":
        """The speeds of a GPU of `companion.cost.gpus` on paper: its dense `dtype` FLOP/s times
        `gpus.efficiency` (the cited fraction training reaches), HBM bandwidth, one direction of
        NVLink between GPUs (half the total NVIDIA quotes), or of PCIe where there is no NVLink,
        and of PCIe to the host. Assumed, not cited: `alpha`, 20 µs per step of a collective
        (NCCL inside one machine is of the order of ten microseconds; fit yours as chapter 06
        does), and 5 µs per operator (a kernel launch)."""
        from companion.cost import gpus

        g = gpus.gpu(name)
        link = g.nvlink_bandwidth / 2 if g.nvlink_bandwidth else g.pcie_bandwidth
        return cls(matmul_flops=g.flops(dtype) * gpus.efficiency(g, dtype)[0],
                   memory_bandwidth=g.hbm_bandwidth, op_seconds=5e-6, alpha=alpha,
                   beta=1 / link, host_bandwidth=g.pcie_bandwidth,
                   dtype_bytes=4 if dtype in ("fp32", "tf32") else 2)

    def attainable(self, intensity: float) -> float:
        """The roofline: FLOP/s of a kernel doing `intensity` FLOPs per byte it moves."""
        return min(self.matmul_flops, intensity * self.memory_bandwidth)

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the roofline turns from memory-bound to compute-bound."""
        return self.matmul_flops / self.memory_bandwidth

    def matmul_seconds(self, m: int, k: int, n: int) -> float:
        """Seconds of an (m, k) @ (k, n) matmul: measured FLOP/s interpolated in log-size between
        the shapes of `matmul_table`, or the roofline when there is no table."""
        flops = 2 * m * k * n
        if not self.matmul_table:
            return flops / self.attainable(_matmul_intensity(m, k, n, self.dtype_bytes))
        return flops / _interpolate(self.matmul_table, (m, k, n))


def _along(curve, x: float) -> float:
    """y at x on a measured curve of (x, y) points: log-log interpolation inside, the first
    point's y below it, the last segment's bytes-per-second slope beyond the last point."""
    pts = sorted(curve)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (x - x1) * max(y1 - y0, 0.0) / (x1 - x0)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    raise AssertionError("unreachable")


def _interpolate(table, shape) -> float:
    """Trilinear interpolation of log FLOP/s in log2 of each dimension over a full grid of
    shapes; outside the grid, the nearest edge."""
    axes = [sorted({s[d] for s, _ in table}) for d in range(3)]
    values = {s: math.log(f) for s, f in table}
    corners, weights = [], []
    for d, x in enumerate(shape):
        grid = axes[d]
        lx = math.log2(min(max(x, grid[0]), grid[-1]))
        hi = next((i for i, g in enumerate(grid) if math.log2(g) >= lx), len(grid) - 1)
        lo = max(hi - 1, 0)
        span = math.log2(grid[hi]) - math.log2(grid[lo])
        t = 0.0 if span == 0 else (lx - math.log2(grid[lo])) / span
        corners.append((grid[lo], grid[hi]))
        weights.append(t)
    total = 0.0
    for bits in range(8):
        point, w = [], 1.0
        for d in range(3):
            up = bits >> d & 1
            point.append(corners[d][up])
            w *= weights[d] if up else 1 - weights[d]
        if w:
            total += w * values[tuple(point)]
    return math.exp(total)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One unit of a model as the cost model sees it (a Linear, a transformer block)."""

    matmuls: tuple          # Linear layers (m rows, k in, n out) for one micro-batch
    other_bytes: float      # bytes the other forward operators read and write
    ops: int                # forward operators launched besides the matmuls
    params: int             # parameters held (elements)
    other_matmuls: tuple = ()   # matmuls of two activations (m, k) @ (k, n): attention's
    trainable: bool = True  # frozen layers compute no weight gradient
    tensors: int = 1        # parameter tensors (the optimizer's for-loop visits each)

    @property
    def flops(self) -> float:
        """Forward matmul FLOPs for one micro-batch."""
        return sum(2 * m * k * n for m, k, n in self.matmuls + self.other_matmuls)

    def _matmuls(self, s: Speeds) -> tuple[float, float]:
        """(forward, backward) seconds of the layer's matmuls. A Linear's backward makes the
        input's gradient and, when trained, the weight's; a matmul of two activations makes
        both inputs' gradients: (m, n) @ (n, k) and (k, m) @ (m, n)."""
        forward = backward = 0.0
        for m, k, n in self.matmuls:
            f, b = s.linear_seconds(m, k, n)
            if not self.trainable:          # the input's gradient only: about one forward
                b = f if s.linear_table else s.matmul_seconds(m, n, k)
            forward, backward = forward + f, backward + b
        for m, k, n in self.other_matmuls:
            forward += s.matmul_seconds(m, k, n)
            backward += s.matmul_seconds(m, n, k) + s.matmul_seconds(k, m, n)
        return forward, backward

    def forward_seconds(self, s: Speeds) -> float:
        matmul = self._matmuls(s)[0]
        return (matmul + self.other_bytes / s.memory_bandwidth + self.ops * s.op_seconds
                + s.layer_seconds / 3)

    def backward_seconds(self, s: Speeds) -> float:
        """The matmuls' gradients (see `_matmuls`); the other operators cost twice the forward."""
        matmul = self._matmuls(s)[1]
        return (matmul + 2 * self.other_bytes / s.memory_bandwidth + 2 * self.ops * s.op_seconds
                + 2 * s.layer_seconds / 3)


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
    traffic: float = 0.0          # bytes this rank sent (not a time: a record of the volume)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.communication + self.transfers
                + self.host_step + self.optimizer + self.bucketing)

    def parts(self) -> dict[str, float]:
        """{part: seconds} of the non-zero parts, for a stacked bar."""
        names = ("compute", "recompute", "communication", "transfers", "host_step", "optimizer",
                 "bucketing")
        return {n: getattr(self, n) for n in names if getattr(self, n)}


def _matmul_intensity(m: int, k: int, n: int, nbytes: int) -> float:
    """FLOPs per byte of (m, k) @ (k, n): 2mkn over reading both and writing the result."""
    return 2 * m * k * n / (nbytes * (m * k + k * n + m * n))


def mlp_layers(width: int, depth: int, batch: int, *, bias: bool = True,
               dtype_bytes: int = 4) -> list[Layer]:
    """The course's MLP of `depth` Linear(width, width) + ReLU layers on `batch` rows, one Layer
    each (the loss's operators are folded into the last one)."""
    for name, v in (("width", width), ("depth", depth), ("batch", batch)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    act = batch * width * dtype_bytes
    layers = [Layer(matmuls=((batch, width, width),),
                    other_bytes=2 * act + (2 * act if bias else 0),     # ReLU, bias add
                    ops=1, params=width * width + (width if bias else 0), tensors=1 + bias)
              for _ in range(depth)]
    last = layers[-1]
    layers[-1] = dataclasses.replace(last, other_bytes=last.other_bytes + 3 * act, ops=last.ops + 3)
    return layers


def gpt_layers(width: int, depth: int, seq_len: int, vocab: int, tokens: int, *,
               dtype_bytes: int = 4, frozen: bool = False) -> list[Layer]:
    """A GPT of `depth` blocks on `tokens` tokens per micro-batch: per block 24·C² matmul FLOPs per
    token (QKV, projection, the 4C MLP) plus attention's 4·T·C (QKᵀ and the weighted sum), and
    the output layer's 2·C·V (Kaplan et al. 2020, "Scaling Laws", Table 1; with attention as
    PaLM's Appendix B counts it). Elementwise bytes: ~16 activations of (tokens, C) per block."""
    C, T = width, seq_len
    act = tokens * C * dtype_bytes
    rows = tokens // T * (C // 64) * T if C >= 64 else tokens     # (batch · heads · T) at d = 64
    d = 64 if C >= 64 else C
    block = Layer(matmuls=((tokens, C, 3 * C), (tokens, C, C), (tokens, C, 4 * C),
                           (tokens, 4 * C, C)), other_matmuls=((rows, d, T), (rows, T, d)),
                  other_bytes=16 * act + 2 * tokens * T * 4, ops=20,
                  params=12 * C * C + 13 * C, trainable=not frozen, tensors=12)
    head = Layer(matmuls=((tokens, C, vocab),), other_bytes=3 * tokens * vocab * 4, ops=6,
                 params=vocab * C + T * C, trainable=not frozen, tensors=2)
    return [block] * depth + [head]


def training_flops(n_params: int, tokens: int, *, depth: int = 0, seq_len: int = 0,
                   width: int = 0, recompute: float = 0.0) -> float:
    """FLOPs of forward + backward on `tokens` tokens: 6·N per token for the weights, plus
    attention's 12·L·T·C (PaLM, Chowdhery et al. 2022, Appendix B), plus `recompute` times a
    forward (1.0 re-runs the whole forward: full checkpointing, 8·N instead of 6·N)."""
    per_token = 6 * n_params + 12 * depth * seq_len * width
    return tokens * per_token * (1 + recompute / 3)


def _check_ranks(world_size: int, k: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (micro-batches per step) must be a positive int, got {k!r}")


def _optimizer_seconds(layers: Sequence[Layer], s: Speeds, optimizer: str, share: float,
                       tensors: int | None = None) -> float:
    """The optimizer's bytes at memory bandwidth plus its operators per tensor: every parameter
    tensor (share 1), or `tensors` flat shards (ZeRO steps one flat tensor per bucket or unit)."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_BYTES)}, got {optimizer!r}")
    params = sum(l.params for l in layers if l.trainable) * share
    if tensors is None:
        tensors = sum(l.tensors for l in layers if l.trainable)
    return OPTIMIZER_BYTES[optimizer] * params / s.memory_bandwidth + \
        _OPTIMIZER_OPS[optimizer] * tensors * s.op_seconds


def single_step(layers: Sequence[Layer], s: Speeds, *, k: int = 1, optimizer: str = "sgd",
                recompute: float = 0.0) -> StepTime:
    """One device, k micro-batches, then the optimizer. `recompute`: the share of the forward
    run again in backward (checkpointing: (segments-1)/segments of the blocks)."""
    _check_ranks(1, k)
    forward = sum(l.forward_seconds(s) for l in layers)
    backward = sum(l.backward_seconds(s) for l in layers)
    return StepTime(compute=k * (forward + backward), recompute=k * recompute * forward,
                    optimizer=_optimizer_seconds(layers, s, optimizer, 1.0))


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


def _link(ready: Sequence[tuple[float, float]], start: float = 0.0) -> float:
    """When the link finishes messages that become ready at `ready[i][0]` and take `ready[i][1]`
    seconds, sent one at a time in that order."""
    end = start
    for at, seconds in ready:
        end = max(end, at) + seconds
    return end


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
             grad_bytes: int = 4) -> StepTime:
    """DDP: each bucket (cap `bucket_bytes`, filled in backward order) all-reduced as soon as its
    last gradient is ready and the previous bucket is done. With no_sync, micro-batches 1..k-1
    only accumulate; without it, every micro-batch all-reduces."""
    _check_ranks(world_size, k)
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
    s = s.ranks(world_size)
    base = single_step(layers, s, k=k, optimizer=optimizer)
    syncing = 1 if no_sync else k
    # each synchronised backward copies the gradients into the buckets, divides them by N and
    # copies the averages back (`companion.ddp.DDP` without gradient_as_bucket_view)
    base = dataclasses.replace(base, bucketing=syncing * _copies(layers, s, grad_bytes, 3))
    if world_size == 1:
        return base
    ends = _backward_ends(layers, s)
    buckets = _buckets(layers, bucket_bytes, grad_bytes)
    messages = [(ends[i], s.collective_seconds("all_reduce", b, world_size)) for i, b in buckets]
    busy = sum(t for _, t in messages)
    exposed = _exposed(_link(messages), ends[0], s, busy)
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
    base = single_step(layers, s, k=k, optimizer=optimizer)
    flat = (len(_buckets(layers, bucket_bytes, grad_bytes)) if stage in (1, 2)
            else sum(l.trainable for l in layers))      # one flat shard per bucket or unit
    base = dataclasses.replace(base, optimizer=_optimizer_seconds(layers, s, optimizer, shard,
                                                                  flat))
    if N == 1:
        return base
    psi = sum(l.params for l in layers if l.trainable) * grad_bytes
    rs = lambda nbytes: s.collective_seconds("reduce_scatter", nbytes, N)
    ag = lambda nbytes: s.collective_seconds("all_gather", nbytes, N)
    ends = _backward_ends(layers, s)
    buckets = _buckets(layers, bucket_bytes, grad_bytes)
    gather_after_step = sum(ag(size) for _, size in buckets)
    traffic = zero_traffic(stage, k, N, psi, reshard_after_forward=reshard_after_forward,
                           gather_bytes=psi / grad_bytes * gather_bytes_per_param)
    if stage in (1, 2):                 # gradients into flat buckets (2: every micro-batch)
        base = dataclasses.replace(base, bucketing=_copies(layers, s, grad_bytes,
                                                           2 * (k if stage == 2 else 1)))
    if stage == 1:
        return dataclasses.replace(base, traffic=traffic, communication=sum(
            rs(size) for _, size in buckets) + gather_after_step)
    if stage == 2:
        messages = [(ends[i], rs(size)) for i, size in buckets]
        busy = sum(t for _, t in messages)
        per_micro = _exposed(_link(messages), ends[0], s, busy)
        return dataclasses.replace(base, traffic=traffic,
                                   communication=k * per_micro + gather_after_step)
    if stage != 3:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    units = [i for i, l in enumerate(layers)]
    gather = [ag(l.params * gather_bytes_per_param) for l in layers]
    scatter = [rs(l.params * grad_bytes) if l.trainable else 0.0 for l in layers]
    fwd = [l.forward_seconds(s) for l in layers]
    bwd = [l.backward_seconds(s) for l in layers]
    exposed_total = 0.0
    for _ in range(k):
        exposed_total += _pipeline(units, gather, fwd, prefetch, s)          # forward
        order = list(reversed(units))
        again = gather if reshard_after_forward else [0.0] * len(layers)
        exposed_total += _pipeline(order, again, bwd, prefetch, s, after=scatter)
    # each gather copies the shards into the full flat buffer and hands out views of it; each
    # unit's gradients are flattened for the reduce-scatter: passes over the bytes, per micro-batch
    gathered = (2 if reshard_after_forward else 1) * gather_bytes_per_param / grad_bytes
    return dataclasses.replace(base, traffic=traffic, communication=exposed_total,
                               bucketing=_copies(layers, s, grad_bytes, k * (gathered + 1)))


def _pipeline(order: Sequence[int], gather: Sequence[float], compute: Sequence[float],
              prefetch: int, s: Speeds, after: Sequence[float] | None = None) -> float:
    """Exposed link time of running units in `order`, unit i needing gather[i] first: with
    prefetch d, the gather of the unit d ahead is issued when a unit starts computing. One link:
    gathers and (in backward) each unit's reduce-scatter queue on it in issue order."""
    link = clock = busy = 0.0
    done: dict[int, float] = {}
    issued = 0

    def issue(j: int, at: float) -> None:
        nonlocal link, busy
        link = max(link, at) + gather[order[j]]
        busy += gather[order[j]]
        done[j] = link

    for j, unit in enumerate(order):
        while issued <= min(j + prefetch, len(order) - 1):
            issue(issued, clock)
            issued += 1
        start = max(clock, done[j])                     # wait for this unit's weights
        clock = start + compute[unit]
        if after is not None and after[unit]:           # its gradient leaves when it is done
            link = max(link, clock) + after[unit]
            busy += after[unit]
    compute_only = sum(compute[u] for u in order)
    waited = clock - compute_only                       # time the compute stream stood still
    tail = max(0.0, link - clock)                       # the last reduce-scatter, after compute
    hidden = busy - waited - tail
    return waited + tail + (1 - s.overlap) * max(0.0, hidden)


def offload_step(layers: Sequence[Layer], s: Speeds, *, k: int = 1, weight_bytes: int = 2,
                 grad_bytes: int = 2, overlap_copies: bool = True) -> StepTime:
    """ZeRO-Offload on one device: gradients copied to the host as backward makes them (hidden
    behind the rest of backward when `overlap_copies`), AdamW on the host over every trainable
    parameter, the updated weights copied back (not hidden: the next forward needs them)."""
    _check_ranks(1, k)
    base = single_step(layers, s, k=k, optimizer="sgd")
    params = sum(l.params for l in layers if l.trainable)
    ends = _backward_ends(layers, s)
    copies = [(ends[i], l.params * grad_bytes / s.host_bandwidth)
              for i, l in reversed(list(enumerate(layers))) if l.trainable]
    busy = sum(t for _, t in copies)
    if overlap_copies:
        down = _exposed(_link(copies), ends[0], dataclasses.replace(s, overlap=1.0), busy)
    else:
        down = busy
    up = params * weight_bytes / s.host_bandwidth
    return dataclasses.replace(base, optimizer=0.0, transfers=down + up,
                               host_step=params / s.host_adam_rate)


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
