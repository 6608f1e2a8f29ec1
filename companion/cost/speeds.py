"""What one rank does per second, and what a model asks of it: the inputs of the step models.

`Speeds` holds a machine's measured (or datasheet) speeds: matmul FLOP/s (with a table of measured
shapes, and of Linear layers' forward and backward, interpolated in log-size), memory bandwidth,
the fixed cost of an operator and of a layer, the link (α–β, or each collective's own fit), host
copies, the host AdamW rate, and how ranks of one machine share it. `Layer` is one unit of a model
as the step models see it: its Linear matmuls, its matmuls of two activations (attention's), the
bytes its other operators move, their count, and its parameters. `mlp_layers` and `gpt_layers`
build the course's models; `training_flops` counts 6N per token plus attention.

Where a matmul has no measured shape nearby, it follows the roofline, min(peak, intensity · memory
bandwidth) (Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4)): a matmul with a small
dimension moves many bytes per FLOP and cannot reach the peak.
"""
from __future__ import annotations

import dataclasses
import math

from companion.cost import network

__all__ = ["Speeds", "Layer", "mlp_layers", "gpt_layers", "training_flops"]


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
    concurrent_collectives: int = 1   # collectives in flight at once: NCCL runs a communicator's
                                  # one after another (1); gloo one per worker thread (2)
    link_sharing: float = 1.0     # share of concurrent transfers that queue on the link (1: two
                                  # take twice one; 0: each lane a link of its own), measured
    first_touch: tuple = ()       # ((bytes, seconds), ...): what a backward whose gradients were
                                  # freed (zero_grad's set_to_none) pays to allocate them afresh
    optimizer_rates: tuple = ()   # (("sgd" | "adamw", parameters/s), ...) of torch's for-loop
                                  # optimizers out of cache, measured (else bytes / bandwidth)
    unit_seconds: float = 0.0     # a ZeRO-3 unit's fixed cost per micro-batch beyond its compute
                                  # and collectives (the course's FSDP: hooks, saved-tensor
                                  # packing), measured on one rank
    # seconds already worked out for a shape: a step model asks for the same layers many times
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def linear_seconds(self, m: int, k: int, n: int) -> tuple[float, float]:
        """(forward, backward) seconds of a Linear on (m, k) inputs with n outputs: interpolated
        in log-size between the shapes of `linear_table` (as FLOP/s), or, without a table, the
        matmuls' times: (m, k) @ (k, n) forward, (m, n) @ (n, k) and (k, m) @ (m, n) backward."""
        if ("linear", m, k, n) not in self._memo:
            self._memo["linear", m, k, n] = self._linear_seconds(m, k, n)
        return self._memo["linear", m, k, n]

    def _linear_seconds(self, m: int, k: int, n: int) -> tuple[float, float]:
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
        world size when there is one (interpolated in log-log, extended by its last slope; a
        gloo group of one rank still hands each collective to a worker thread), else the ring
        formula at α and β (nothing on one rank)."""
        for k, world, curve in self.collective_table:
            if k == kind and world == world_size:
                return _along(curve, nbytes)
        if world_size == 1:
            return 0.0
        ring = {"all_reduce": network.all_reduce_seconds,
                "reduce_scatter": network.reduce_scatter_seconds,
                "all_gather": network.all_gather_seconds}
        if kind not in ring:
            raise ValueError(f"kind must be one of {sorted(ring)}, got {kind!r}")
        return ring[kind](nbytes, world_size, alpha=self.alpha, beta=self.beta)

    def collective_parts(self, kind: str, nbytes: float, world_size: int) -> tuple[float, float]:
        """(latency, transfer) of `collective_seconds`: the fixed cost every message pays (the
        measured curve's value at its smallest size, or the ring's steps of α), which overlaps
        with other collectives in flight, and the rest, which shares the link with them."""
        total = self.collective_seconds(kind, nbytes, world_size)
        fixed = next((min(curve)[1] for k, world, curve in self.collective_table
                      if k == kind and world == world_size), None)
        if fixed is None:
            steps = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}.get(kind, 1)
            fixed = steps * (world_size - 1) * self.alpha
        return min(fixed, total), total - min(fixed, total)

    def fresh_seconds(self, nbytes: float) -> float:
        """Seconds a backward pays beyond its compute when `nbytes` of gradients held from one
        step to the next were freed and are allocated again (`first_touch`, measured:
        interpolated in bytes, 0 below its first point, its last rate per byte beyond it)."""
        pts = sorted(self.first_touch)
        if not pts or nbytes <= 0:
            return 0.0
        if nbytes >= pts[-1][0]:
            return pts[-1][1] * nbytes / pts[-1][0]
        for (x0, y0), (x1, y1) in zip([(0.0, 0.0)] + pts, pts):
            if x0 <= nbytes <= x1:
                return y0 + (nbytes - x0) * (y1 - y0) / (x1 - x0)
        raise AssertionError("unreachable")

    def __post_init__(self):
        for name in ("matmul_flops", "memory_bandwidth", "host_bandwidth", "host_adam_rate"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Speeds.{name} must be positive, got {value!r}")
        for name in ("op_seconds", "alpha", "beta", "layer_seconds", "unit_seconds"):
            value = getattr(self, name)
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"Speeds.{name} must be finite and non-negative, got {value!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"Speeds.overlap must lie in [0, 1], got {self.overlap!r}")
        if not isinstance(self.concurrent_collectives, int) or self.concurrent_collectives < 1:
            raise ValueError(f"Speeds.concurrent_collectives must be a positive int, got "
                             f"{self.concurrent_collectives!r}")
        if not 0 <= self.link_sharing <= 1:
            raise ValueError(f"Speeds.link_sharing must lie in [0, 1], got {self.link_sharing!r}")
        if any(not (b > 0 and t >= 0) for b, t in self.first_touch):
            raise ValueError(f"Speeds.first_touch needs (bytes > 0, seconds >= 0) points, got "
                             f"{self.first_touch!r}")
        if any(not r > 0 for _, r in self.optimizer_rates):
            raise ValueError(f"Speeds.optimizer_rates must be positive, got "
                             f"{self.optimizer_rates!r}")
        if not 1 <= self.shared_compute < math.inf:
            raise ValueError(f"Speeds.shared_compute must be at least 1, got {self.shared_compute!r}")

    def ranks(self, world_size: int) -> "Speeds":
        """These speeds for one of `world_size` ranks running at once: compute (and what runs on
        the compute thread: first touches, the optimizer, a unit's bookkeeping) slowed by
        `shared_compute` when there is more than one (the link's speeds were measured so)."""
        if world_size == 1 or self.shared_compute == 1:
            return self
        f = self.shared_compute
        return dataclasses.replace(
            self, shared_compute=1.0, matmul_flops=self.matmul_flops / f,
            memory_bandwidth=self.memory_bandwidth / f, op_seconds=self.op_seconds * f,
            layer_seconds=self.layer_seconds * f, unit_seconds=self.unit_seconds * f,
            matmul_table=tuple((mkn, v / f) for mkn, v in self.matmul_table),
            linear_table=tuple((mkn, a * f, b * f) for mkn, a, b in self.linear_table),
            first_touch=tuple((n, t * f) for n, t in self.first_touch),
            optimizer_rates=tuple((name, r / f) for name, r in self.optimizer_rates))

    @classmethod
    def for_gpu(cls, name: str, dtype: str = "bf16", *, world_size: int = 8,
                network: float | None = None, alpha: float = 20e-6) -> "Speeds":
        """The speeds of a GPU of `companion.cost.gpus` on paper, as one of `world_size` ranks:
        its dense `dtype` FLOP/s times `gpus.efficiency` (the cited fraction training reaches),
        HBM bandwidth, the ring's link (`gpus.ring_link`: one direction of NVLink inside an
        NVLink domain, PCIe inside a server otherwise, and across servers the slower of that and
        the server's network cards together, `network` or the cited DGX's), and PCIe to the
        host. Assumed, not cited: `alpha`, 20 µs per step of a collective (NCCL inside one
        machine is of the order of ten microseconds; fit yours as chapter 06 does), and 5 µs
        per operator (a kernel launch)."""
        from companion.cost import gpus

        g = gpus.gpu(name)
        link = gpus.ring_link(g, world_size, network=network)[1]
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
        if ("matmul", m, k, n) in self._memo:
            return self._memo["matmul", m, k, n]
        flops = 2 * m * k * n
        if not self.matmul_table:
            seconds = flops / self.attainable(_matmul_intensity(m, k, n, self.dtype_bytes))
        else:
            seconds = flops / _interpolate(self.matmul_table, (m, k, n))
        self._memo["matmul", m, k, n] = seconds
        return seconds


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
