"""Measure the machine at hand in under 20 seconds: the speeds every step-time model reads.

`calibrate()` times, each over interleaved repeats and with its spread (lower and upper quartile):
- matmul throughput by dtype and size: the roofline (attainable FLOP/s against arithmetic
  intensity: a small matmul moves more bytes per FLOP and cannot reach the peak);
- copy bandwidth (bytes read + written per second by `Tensor.copy_`) and the fixed cost of one
  operator (a one-element add: dispatch and, on a GPU, the kernel launch);
- host <-> device bandwidth, from pinned and from pageable host memory (GPU only: on a CPU there
  is no second memory to copy to);
- the host AdamW rate in parameters per second, for the for-loop, foreach and fused versions
  (what ZeRO-Offload's host step runs at);
- on a CPU, a training step of a small GPT block: the FLOP/s it reaches in fp32 (`step_flops`:
  attention's kernel, GELU and LayerNorm included, as a model's step runs), and how much faster
  it runs under bf16 (and fp16) autocast (`autocast`): the rate a 16-bit step reaches, casts
  and the operators autocast keeps in fp32 included, which the matmul peak does not say (an
  AMX CPU's bf16 matmul peaks 7x fp32's while its autocast step ran 0.84x fp32's speed, its
  bf16 attention backward 5x slower; without bf16 units it is far slower), and the bytes/s a
  LoRA adapter's passes reach (`adapter_bandwidth`: its thin matmuls, scale and add, forward
  and backward, ~40·N·out + 24·N·in bytes, timed as a LoRALinear's step over its frozen
  Linear's at two sizes: the bytes' rate and a fixed cost per adapted Linear, `adapter_seconds`), and the course's 8-bit Adam's step
  in parameters/s and seconds per tensor (`adam8bit`, `adam8bit_tensor`: compute-bound on a
  CPU, 51-74 M/s here where fused AdamW runs ~1,400 M/s: its 260 bytes a parameter under-count
  it), and the bytes/s activation offload's copies reach in that block's step
  (`activation_offload`: its saved-tensor hooks' bytes down and up over the time they add);
- α and β of a gloo process group of 2 ranks (the `launch` module's workers), one fit per round,
  and each collective's curve (seconds against bytes), on 2 ranks and on 1 (a gloo group of one
  rank still hands every collective to a worker thread: DDP on one rank pays it per bucket);
- collectives at once (`collective_lanes`, `link_sharing`): gloo runs each collective on one of
  its worker threads (2 by default), so an all-reduce started while another is in flight runs
  beside it; two all-reduces started together against one alone, at 1, 4 and 16 MiB, give the
  share of their transfers that queue on the link (the fixed cost, the curve's smallest time,
  overlaps; 2 ranks here: a median of 0.58 in one calibration, 0.99 in another, so the
  transfers mostly share the link; on a busy machine a collective whose peer thread is not
  running waits a scheduler slice, which neither this nor the curves capture);
- on a CPU, what gradients allocated afresh cost (`first_touch`): `zero_grad()` sets them to None,
  the memory goes back to the system once enough is free at once (glibc trims its heap), and the
  next backward faults it in page by page. A backward with freed gradients against one with kept
  ones, 8 to 64 MiB of them (measured here on a quiet machine: nothing up to 16 MiB, 4-8 ms at
  32 MiB, 20-30 ms at 64 MiB beyond the kept backward's accumulation; about twice that at a load
  of 3-4, and it moves from one calibration to the next with the heap's and the VM's state);
- on a CPU, what a unit of the course's FSDP costs beyond the model's price of its compute and
  collectives (`unit_seconds`: hooks, saved-tensor packing), on one rank, from a narrow MLP at
  two depths;
- on a CPU, torch's for-loop SGD and AdamW in parameters per second out of cache
  (`optimizer_rates`: AdamW's passes and temporaries ran 3-6x the time of its 28 bytes a
  parameter at copy bandwidth here);
- how 2 ranks share the machine: a training step with both ranks stepping against one alone
  (`shared_compute`: CPU ranks share caches and memory bandwidth), and the share of an all-reduce
  that hides behind a step running at the same time (`overlap`: on a CPU the two compete for the
  same cores; NCCL on a GPU runs beside the kernels).

`DeviceProfile.speeds(dtype)` turns it into the `Speeds` of `companion.cost.step`.

Example:
    >>> profile = calibrate()                       # doctest: +SKIP
    >>> profile.matmul["float32"][-1]               # (side, Measured FLOP/s) of the largest
    >>> profile.speeds(torch.float32)
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import math
import time
from typing import Any, Callable, Sequence

import torch

from companion.cost import network
from companion.cost.stats import spread
from companion.cost.speeds import Speeds
from companion.cost.clock import now

__all__ = ["Measured", "DeviceProfile", "calibrate"]


@dataclasses.dataclass(frozen=True)
class Measured:
    """A measured figure: the median of `repeats` and the quartiles around it."""

    median: float
    low: float
    high: float
    repeats: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Measured":
        med, q1, q3 = spread(values)
        return cls(med, q1, q3, len(values))

    def __format__(self, spec: str) -> str:
        spec = spec or ".3g"
        return f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}})"


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What `calibrate` measured on one device (see the module docstring for each field)."""

    device: str
    name: str
    threads: int
    matmul: dict[str, list[tuple[int, Measured]]]    # dtype -> [(side n, FLOP/s of n x n @ n x n)]
    grid: dict[str, list[tuple[tuple[int, int, int], Measured]]]   # dtype -> [((m, k, n), FLOP/s)]
    linear: dict[str, list[tuple[tuple[int, int, int], Measured, Measured]]]
    # dtype -> [((rows m, in k, out n), forward seconds, backward seconds)] of F.linear
    copy_bandwidth: Measured                          # bytes/s, read + write
    op_seconds: Measured                              # seconds per tiny operator
    layer_seconds: Measured                           # a tiny layer's cost beyond its Linear
    adamw: dict[str, Measured]                        # "for-loop"/"foreach"/"fused" -> params/s
    host_to_device: dict[str, Measured] | None = None  # "pinned"/"pageable" -> bytes/s
    device_to_host: dict[str, Measured] | None = None
    alpha: Measured | None = None                     # seconds per message (gloo, 2 ranks)
    beta: Measured | None = None                      # seconds per byte
    collectives: dict[str, list[tuple[int, Measured]]] | None = None  # kind -> [(bytes, s)]
    shared_compute: Measured | None = None            # a step with 2 ranks at once over alone
    overlap: Measured | None = None                   # share of an all-reduce hidden by compute
    collectives_one: dict[str, list[tuple[int, Measured]]] | None = None  # the same, on 1 rank
    collective_lanes: int = 1                         # collectives in flight at once (gloo: 2)
    link_sharing: Measured | None = None              # share of concurrent transfers that queue
    first_touch: list[tuple[int, Measured]] | None = None   # CPU: (gradient bytes, extra s)
    optimizer_rates: dict[str, Measured] | None = None     # CPU: "sgd"/"adamw" -> params/s
    unit_seconds: Measured | None = None              # a ZeRO-3 unit beyond the model's price,
                                                      # on one rank
    autocast: dict[str, Measured] | None = None       # CPU: dtype -> a block's training step,
                                                      # fp32 seconds over autocast's (>1: faster)
    step_flops: Measured | None = None                # CPU: that block's fp32 step, FLOP/s
    adapter_bandwidth: Measured | None = None         # CPU: bytes/s of a LoRA adapter's passes
    adapter_seconds: Measured | None = None           # and its fixed seconds per adapted Linear
    adam8bit: Measured | None = None                  # CPU: lowbit.Adam8bit, parameters/s
    adam8bit_tensor: Measured | None = None           # and seconds per tensor beyond those
    activation_offload: Measured | None = None        # CPU: bytes/s of activation offload's
                                                      # copies (down and up) in a block's step
    world_size: int = 2                               # ranks the collectives were timed on
    seconds: float = 0.0                              # how long calibrate took

    def peak_flops(self, dtype: torch.dtype | str = torch.float32) -> float:
        """The best median FLOP/s over the sizes timed in `dtype`."""
        rows = self.matmul.get(_name(dtype))
        if not rows:
            raise ValueError(f"no matmul timed in {_name(dtype)}; timed: {sorted(self.matmul)}")
        return max(m.median for _, m in rows)

    def speeds(self, dtype: torch.dtype | str = torch.float32, *, overlap: float | None = None,
               adamw: str = "for-loop") -> Speeds:
        """The step models' `Speeds`: peak matmul FLOP/s in `dtype` (and the grids), copy
        bandwidth, the cost of an operator and a layer, α–β and each collective's curve, how
        ranks share the machine (`shared_compute`, `overlap`: measured, else 1 and full
        overlap; pass overlap= to override), pinned host bandwidth and the host AdamW rate; on a
        CPU, gloo's collectives at once (`collective_lanes`, `link_sharing`), the cost of
        gradients allocated afresh and the for-loop optimizers' rates."""
        host = (self.host_to_device or {}).get("pinned")
        rate = self.adamw.get(adamw)
        if rate is None:
            raise ValueError(f"adamw must be one of {sorted(self.adamw)}, got {adamw!r}")
        table = tuple((tuple(mkn), m.median) for mkn, m in self.grid.get(_name(dtype), ()))
        linear = tuple((tuple(mkn), f.median, b.median)
                       for mkn, f, b in self.linear.get(_name(dtype), ()))
        return Speeds(matmul_flops=self.peak_flops(dtype),
                      layer_seconds=self.layer_seconds.median, matmul_table=table,
                      linear_table=linear,
                      dtype_bytes=2 if _name(dtype) in ("bfloat16", "float16") else 4,
                      memory_bandwidth=self.copy_bandwidth.median,
                      op_seconds=self.op_seconds.median,
                      alpha=self.alpha.median if self.alpha else 0.0,
                      beta=self.beta.median if self.beta else 0.0,
                      host_bandwidth=host.median if host else math.inf,
                      host_adam_rate=rate.median,
                      overlap=(overlap if overlap is not None else
                               min(1.0, max(0.0, self.overlap.median)) if self.overlap else 1.0),
                      shared_compute=max(1.0, self.shared_compute.median)
                      if self.shared_compute else 1.0,
                      collective_table=tuple(
                          (kind, world, _fitted([(n, m.median) for n, m in rows]))
                          for world, curves in ((self.world_size, self.collectives),
                                                (1, self.collectives_one))
                          for kind, rows in (curves or {}).items()),
                      concurrent_collectives=self.collective_lanes,
                      link_sharing=min(1.0, max(0.0, self.link_sharing.median))
                      if self.link_sharing else 1.0,
                      first_touch=tuple((n, max(0.0, m.median))
                                        for n, m in (self.first_touch or ())),
                      optimizer_rates=tuple((k, m.median)
                                            for k, m in (self.optimizer_rates or {}).items()),
                      unit_seconds=max(0.0, self.unit_seconds.median) if self.unit_seconds
                      else 0.0)

    def to_json(self) -> str:
        """The profile as JSON (a recorded GPU run keeps it; `from_json` reads it back)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        d = json.loads(text)
        m = lambda v: None if v is None else Measured(**v)
        md = lambda v: None if v is None else {k: Measured(**x) for k, x in v.items()}
        curves = lambda v: None if v is None else {
            k: [(n, Measured(**x)) for n, x in rows] for k, rows in v.items()}
        return cls(device=d["device"], name=d["name"], threads=d["threads"],
                   matmul={k: [(n, Measured(**x)) for n, x in rows]
                           for k, rows in d["matmul"].items()},
                   grid={k: [(tuple(mkn), Measured(**x)) for mkn, x in rows]
                         for k, rows in d["grid"].items()},
                   linear={k: [(tuple(mkn), Measured(**f), Measured(**b)) for mkn, f, b in rows]
                           for k, rows in d["linear"].items()},
                   copy_bandwidth=m(d["copy_bandwidth"]), op_seconds=m(d["op_seconds"]),
                   layer_seconds=m(d["layer_seconds"]),
                   adamw=md(d["adamw"]), host_to_device=md(d["host_to_device"]),
                   device_to_host=md(d["device_to_host"]), alpha=m(d["alpha"]),
                   beta=m(d["beta"]), seconds=d["seconds"], world_size=d["world_size"],
                   shared_compute=m(d["shared_compute"]), overlap=m(d["overlap"]),
                   autocast=md(d.get("autocast")), step_flops=m(d.get("step_flops")),
                   adapter_bandwidth=m(d.get("adapter_bandwidth")),
                   adapter_seconds=m(d.get("adapter_seconds")), adam8bit=m(d.get("adam8bit")),
                   adam8bit_tensor=m(d.get("adam8bit_tensor")),
                   activation_offload=m(d.get("activation_offload")),
                   collectives=curves(d["collectives"]),
                   collectives_one=curves(d.get("collectives_one")),
                   collective_lanes=d.get("collective_lanes", 1),
                   link_sharing=m(d.get("link_sharing")),
                   first_touch=None if d.get("first_touch") is None else [
                       (n, Measured(**x)) for n, x in d["first_touch"]],
                   optimizer_rates=md(d.get("optimizer_rates")),
                   unit_seconds=m(d.get("unit_seconds")))


def _fitted(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """A collective's measured curve replaced by its own two-number fit, A + B·bytes, at the same
    sizes: each collective keeps its own latency and slope (gloo's reduce-scatter is no half of
    its all-reduce), while a size that stalled in this run (the transport waiting while other
    work held the cores) does not carry its stall into every prediction made at that size."""
    sizes, seconds = [n for n, _ in points], [t for _, t in points]
    a, b = network.fit_alpha_beta(sizes, seconds)
    a, b = max(a, min(seconds) / 2), max(b, 0.0)
    return tuple((n, a + b * n) for n in sorted(sizes))


def _name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "tf32": "tf32"}
    return names.get(dtype, dtype)


def _times(fn: Callable[[], Any], device: torch.device, repeats: int, inner: int = 1) -> list[float]:
    """Seconds per call of fn, `repeats` times (each the mean of `inner` calls), after a warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        start = now(device)                                         # host-device sync
        for _ in range(inner):
            fn()
        out.append((now(device) - start) / inner)                   # host-device sync
    return out


def _matmul(device: torch.device, dtypes: Sequence[str], sides: Sequence[int], repeats: int,
            slowest: float) -> dict[str, list[tuple[int, Measured]]]:
    out: dict[str, list[tuple[int, Measured]]] = {}
    for name in dtypes:
        tf32 = name == "tf32"
        dtype = torch.float32 if tf32 else getattr(torch, name)
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            rows, last = [], 0.0
            for n in sides:
                if rows and last * (n / rows[-1][0]) ** 3 > slowest:
                    break                                   # the next size would take too long
                a = torch.randn(n, n, device=device).to(dtype)
                b = torch.randn(n, n, device=device).to(dtype)
                last = _times(lambda: a @ b, device, 1)[0]
                if last > slowest:                                  # too slow here: stop
                    break
                inner = max(1, int(0.02 / max(last, 1e-7)))
                flops = [2 * n**3 / t for t in _times(lambda: a @ b, device, repeats, inner)]
                rows.append((n, Measured.of(flops)))
            out[name] = rows
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    return out


def _grid(device: torch.device, name: str, sides: Sequence[int], repeats: int,
          pool_bytes: int) -> list[tuple[tuple[int, int, int], Measured]]:
    """FLOP/s of (m, k) @ (k, n) for every m, k, n in `sides`. Each call takes the next of a pool
    of distinct operands larger than the caches (`pool_bytes`), as a model's layers do: timing one
    matrix again and again measures the cache, not the memory the weights live in."""
    dtype = getattr(torch, name)
    out = []
    for m in sides:
        for k in sides:
            for n in sides:
                each = (m * k + k * n) * dtype.itemsize
                copies = max(2, min(64, pool_bytes // each))
                a = [torch.randn(m, k, device=device).to(dtype) for _ in range(copies)]
                b = [torch.randn(k, n, device=device).to(dtype) for _ in range(copies)]
                turn = iter(range(10**9))

                def call():
                    i = next(turn) % copies
                    return a[i] @ b[i]
                one = _times(call, device, 1)[0]
                inner = max(1, min(copies, int(0.004 / max(one, 1e-7))))
                flops = [2 * m * k * n / t for t in _times(call, device, repeats, inner)]
                out.append(((m, k, n), Measured.of(flops)))
    return out


def _backward_call(device: torch.device, repeats: int) -> float:
    """Median seconds of the fixed cost of one `backward()` call (the autograd engine starting
    and ending a pass), timed on a one-element graph: a layer in a deep model does not pay it,
    so the timings of a lone layer's backward below take it off."""
    leaf = torch.ones(1, device=device, requires_grad=True)

    def call():
        (leaf * 2).sum().backward()
        leaf.grad = None
    return statistics.median(_times(call, device, repeats, inner=20))


def _linear_grid(device: torch.device, name: str, rows: Sequence[int], widths: Sequence[int],
                 repeats: int, pool_bytes: int) -> list[tuple[tuple[int, int, int], Measured, Measured]]:
    """Forward and backward seconds of F.linear (x (m, k) times a weight (n, k), the input's and
    the weight's gradients in backward) for m in `rows`, k and n in `widths`: the kernels, memory
    layouts and per-call costs a Linear layer really runs (a transposed operand is not as fast as
    the plain matmul the grid times), over a pool of weights larger than the caches. The fixed
    cost of the `backward()` call itself is taken off: in a model, one call covers every layer."""
    dtype = getattr(torch, name)
    call = _backward_call(device, repeats)
    out = []
    for m in rows:
        for k in widths:
            for n in widths:
                copies = max(2, min(32, pool_bytes // (n * k * dtype.itemsize)))
                ws = [torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
                      for _ in range(copies)]
                x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
                g = torch.randn(m, n, device=device, dtype=dtype)
                turn = iter(range(10**9))

                def forward():
                    with torch.no_grad():
                        return torch.nn.functional.linear(x, ws[next(turn) % copies])

                def both():
                    w = ws[next(turn) % copies]
                    torch.nn.functional.linear(x, w).backward(g)
                    w.grad = x.grad = None
                one = _times(both, device, 1)[0]
                inner = max(1, min(copies, int(0.004 / max(one, 1e-7))))
                fwd = _times(forward, device, repeats, inner)
                total = _times(both, device, repeats, inner)
                out.append(((m, k, n), Measured.of(fwd),
                            Measured.of([max(t - statistics.median(fwd) - call, 0.1 * t)
                                         for t in total])))
    return out


def _layer_seconds(device: torch.device, repeats: int) -> Measured:
    """Seconds per layer of forward + backward through 64 Linear(8, 8) + ReLU layers, less a lone
    Linear(8, 8)'s forward and backward: what a layer costs beyond its matmul (the activation,
    the autograd engine's bookkeeping), nearly without arithmetic."""
    from torch import nn

    depth = 64
    net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(8, 8), nn.ReLU())])
    net.to(device)
    x, y = torch.randn(16, 8, device=device), torch.randn(16, 8, device=device)
    lone = _linear_grid(device, "float32", [16], [8], repeats, 0)[0]

    def step():
        nn.functional.mse_loss(net(x), y).backward()
        for p in net.parameters():
            p.grad = None
    per_layer = _times(step, device, repeats, inner=3)
    return Measured.of([max(t / depth - lone[1].median - lone[2].median, 0.0)
                        for t in per_layer])


def _adamw_rates(repeats: int) -> dict[str, Measured]:
    """Parameters per second of one AdamW step on the host (CPU tensors), 2^20 parameters in 8
    tensors, for each implementation this torch offers."""
    out = {}
    for impl, options in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}),
                          ("fused", {"fused": True})):
        params = [torch.zeros(2**17, requires_grad=True) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, **options)
            opt.step()
        except (RuntimeError, TypeError, ValueError):              # not built in this torch
            continue
        out[impl] = Measured.of([2**20 / t for t in _times(opt.step, torch.device("cpu"),
                                                            repeats)])
    return out


def _optimizer_rates(repeats: int, op_seconds: float) -> dict[str, Measured]:
    """Parameters per second of torch's for-loop SGD and AdamW (what `torch.optim` runs on CPU
    tensors by default, and `validate` asks for) over 2^22 parameters in 16 tensors with their
    gradients and state (80 MiB for AdamW: out of cache, as a model's are), each step's seconds
    less its operators per tensor at `op_seconds` (the step models add those per tensor)."""
    from companion.cost.step import _OPTIMIZER_OPS

    out = {}
    for name, make in (("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3, foreach=False)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False))):
        params = [torch.zeros(2**18, requires_grad=True) for _ in range(16)]
        for p in params:
            p.grad = torch.randn_like(p)
        fixed = 16 * _OPTIMIZER_OPS[name] * op_seconds
        out[name] = Measured.of([2**22 / max(t - fixed, t / 2) for t in _times(
            make(params).step, torch.device("cpu"), repeats)])
    return out


def _first_touch(device: torch.device, repeats: int,
                 sizes_mib: Sequence[int] = (8, 16, 32, 64)) -> list[tuple[int, Measured]]:
    """Per size, the seconds a backward pays beyond a kept-gradient one when its gradients were
    freed (`zero_grad(set_to_none=True)`, torch's default): MLPs of Linear(512, 512) layers
    without bias (1 MiB of weight gradient each) on 8 rows, one freeing its gradients after each
    backward (timed with it) and one zeroing them in place (not timed: the step models count no
    zeroing), alternating, in rounds, the sizes one after another from the smallest (what is
    faulted in again depends on the heap's state, which a larger free changes). The kept one adds
    each new gradient into the old one (3 passes over its bytes at copy bandwidth), which the
    step models do not count: that is added back. Seconds per round, its median per size."""
    from torch import nn

    x = torch.randn(8, 512, device=device)
    big = torch.empty(8 * 2**20, device=device)
    copy = torch.empty_like(big)
    bandwidth = statistics.median(2 * big.numel() * 4 / t for t in _times(
        lambda: copy.copy_(big), device, repeats))
    del big, copy

    def net(mib: int) -> nn.Module:
        return nn.Sequential(*[m for _ in range(mib) for m in
                               (nn.Linear(512, 512, bias=False), nn.ReLU())]).to(device)

    def backward(model: nn.Module, fresh: bool) -> float:
        loss = model(x).square().mean()
        start = now(device)                                         # host-device sync
        loss.backward()
        if fresh:                                   # freeing them is part of the cost
            for p in model.parameters():
                p.grad = None
        seconds = now(device) - start                               # host-device sync
        if not fresh:
            for p in model.parameters():
                p.grad.zero_()
        return seconds
    extra: dict[int, list[float]] = {}
    for mib in sorted(sizes_mib):           # the smaller first: a larger free changes the heap
        pair = {True: net(mib), False: net(mib)}
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(repeats + 1):        # round 0: warm-up (the kept gradients exist)
            for fresh in (True, False) if r % 2 else (False, True):
                seconds = backward(pair[fresh], fresh)
                if r:
                    times[fresh].append(seconds)
        extra[mib] = [f - k + 3 * mib * 2**20 / bandwidth
                      for f, k in zip(times[True], times[False])]
        del pair
    return [(mib * 2**20, Measured.of(extra[mib])) for mib in sorted(sizes_mib)]


def _one_rank_worker(rank: int, world_size: int, sizes: Sequence[int], repeats: int) -> tuple:
    """A worker for `launch.run` on one rank: the gloo group's own collectives
    (`network.time_collectives`), `_first_touch` in a fresh process (whose heap starts as a
    training rank's does; the calibrating one has already allocated and freed much) and
    `_unit_worker`'s steps."""
    return (network.time_collectives(rank, world_size, sizes, repeats),
            _first_touch(torch.device("cpu"), repeats),
            _unit_worker(rank, world_size, 32, [4, 20], repeats))


def _adam8bit_rate(repeats: int) -> tuple[Measured, Measured]:
    """`lowbit.Adam8bit`'s step (AdamW's decay, as the planner runs it) on the host: parameters
    per second and seconds per tensor (its unfused operators cost per tensor too), from 2^20
    parameters in 8 tensors and in 64, each round fitted on its own."""
    from companion import lowbit

    def step_of(count: int):
        params = [torch.zeros(2**20 // count, requires_grad=True) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        return lowbit.Adam8bit(params, weight_decay=0.01, decoupled_weight_decay=True).step
    few, many = step_of(8), step_of(64)
    rounds = [tuple(_times(s, torch.device("cpu"), 1, 2)[0] for s in (few, many))
              for _ in range(repeats)]

    def fit(t8: float, t64: float) -> tuple[float, float]:     # (parameters/s, s per tensor)
        each = max((t64 - t8) / 56, 0.0)
        return 2**20 / max(t8 - 8 * each, 1e-7), each
    # the fastest rounds' fit (another job on a shared machine only adds time); the rounds'
    # own fits give the spread
    rate, each = fit(min(t for t, _ in rounds), min(t for _, t in rounds))
    fits = [fit(*r) for r in rounds]
    return _around(rate, [f[0] for f in fits]), _around(each, [f[1] for f in fits])


def _around(median: float, values: list[float]) -> Measured:
    """`median` with the quartiles of `values` as its spread (widened to hold it)."""
    _, low, high = spread(values)
    return Measured(median, min(low, median), max(high, median), len(values))


def _adapters(device: torch.device, repeats: int) -> tuple[Measured, Measured]:
    """A rank-8 LoRA adapter's own passes on a 128 -> 384 Linear (a LoRALinear's forward and
    backward less its frozen base's) at 16 x 64 and 4 x 64 tokens (B, T, C) inputs, as in a
    model: the bytes/s those passes reach (`predict_seconds`' 40·N·out + 24·N·in in fp32) and
    their fixed seconds per adapted Linear (a dozen operators beyond the bytes), fitted on the
    two sizes' median differences (a difference is not helped by the minimum); the rounds' own
    fits give the spread."""
    from torch import nn

    from companion.lora import LoRALinear

    i, o = 128, 384
    frozen = nn.Linear(i, o).to(device).requires_grad_(False)
    adapted = LoRALinear(nn.Linear(i, o), 8).to(device)

    def extra(B: int) -> tuple[float, float]:                  # (bytes, seconds) of one round
        x = torch.randn(B, 64, i, device=device, requires_grad=True)
        g = torch.randn(B, 64, o, device=device)

        def step(layer):
            layer(x).backward(g)
            layer.zero_grad(set_to_none=True)
            x.grad = None
        seconds = (_times(lambda: step(adapted), device, 1, 10)[0]
                   - _times(lambda: step(frozen), device, 1, 10)[0])
        return (40 * o + 24 * i) * B * 64, seconds

    rounds = [(extra(16), extra(4)) for _ in range(repeats)]

    def fit(big: tuple[float, float], small: tuple[float, float]) -> tuple[float, float]:
        rate = (big[0] - small[0]) / max(big[1] - small[1], 1e-7)
        return rate, max(small[1] - small[0] / rate, 0.0)
    (big, _), (small, _) = rounds[0]
    rate, fixed = fit((big, statistics.median(r[0][1] for r in rounds)),   # differences: the
                      (small, statistics.median(r[1][1] for r in rounds)))  # medians
    fits = [fit(big, small) for big, small in rounds]
    return _around(rate, [f[0] for f in fits]), _around(fixed, [f[1] for f in fits])


def _block_steps(device: torch.device, dtypes: Sequence[str],
                 repeats: int) -> tuple[Measured, dict[str, Measured]]:
    """A training step (forward and backward) of one course GPT block (width C = 128, 4 heads,
    16 x 64 tokens, fused attention): its fp32 FLOP/s (3 x (2·N·12·C² + 4·N·T·C), the
    planner's count), and for each 16-bit dtype of `dtypes` fp32's seconds over autocast's,
    one ratio per interleaved round."""
    from companion.models.gpt import Block

    B, T, C = 16, 64, 128
    block = Block(C, 4, fused_attention=True).to(device)
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    flops = 3 * (2 * B * T * 12 * C * C + 4 * B * T * T * C)
    out = {}

    def step(dtype=None):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            y = block(x)
        y.float().square().mean().backward()
        block.zero_grad(set_to_none=True)
        x.grad = None
    for name in [d for d in dtypes if d in ("bfloat16", "float16")]:
        try:
            step(getattr(torch, name))
        except RuntimeError:                                 # not supported on this device
            continue
        rounds = [(_times(step, device, 1, 3)[0],
                   _times(lambda: step(getattr(torch, name)), device, 1, 3)[0])
                  for _ in range(repeats)]
        # the fastest rounds' ratio (another job on a shared machine only adds time, and one
        # burst swung a single round's ratio to 1.2-1.7); the rounds' own ratios for the spread
        out[name] = _around(min(f for f, _ in rounds) / min(h for _, h in rounds),
                            [f / h for f, h in rounds])
    fp32 = Measured.of([flops / t for t in _times(step, device, repeats, 3)])
    return fp32, out


def _activation_offload(device: torch.device, repeats: int) -> Measured:
    """The bytes/s activation offload's copies reach in a training step of one course GPT block
    (the `_block_steps` block, 16 x 64 tokens): the bytes its saved-tensor hooks move (down in
    forward, up in backward: `OffloadActivations`' counters) over the seconds the step takes
    beyond the plain one, one ratio per interleaved round (on a CPU the copies are memcpy's and
    the hooks' own work; `predict_seconds` prices 2·A bytes a micro-batch at this rate)."""
    from companion.activation_offload import OffloadActivations
    from companion.models.gpt import Block

    B, T, C = 16, 64, 128
    block = Block(C, 4, fused_attention=True).to(device)
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    moved = []

    def step(offload: bool):
        hooks = OffloadActivations(min_bytes=0)
        with hooks if offload else contextlib.nullcontext():
            y = block(x)
            y.square().mean().backward()
        block.zero_grad(set_to_none=True)
        x.grad = None
        if offload:
            moved.append(hooks.bytes_to_host + hooks.bytes_to_device)
    step(True)
    rates = []
    for _ in range(repeats):
        plain, offloaded = _times(lambda: step(False), device, 1, 3)[0], \
            _times(lambda: step(True), device, 1, 3)[0]
        rates.append(moved[-1] / max(offloaded - plain, 1e-7))
    return Measured.of(rates)


def _host_copies(device: torch.device, repeats: int) -> tuple[dict, dict]:
    nbytes = 64 * 2**20
    gpu = torch.empty(nbytes // 4, device=device)
    down, up = {}, {}
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes // 4, pin_memory=pin)
        up[kind] = Measured.of([nbytes / t for t in _times(
            lambda: gpu.copy_(host, non_blocking=pin), device, repeats)])
        down[kind] = Measured.of([nbytes / t for t in _times(
            lambda: host.copy_(gpu, non_blocking=pin), device, repeats)])
    return up, down


def _alpha_beta(repeats: int) -> tuple[Measured, Measured, dict]:
    """α and β of a 2-rank gloo group, one fit of the ring formula to all_reduce per interleaved
    round; and each collective's measured time per size (its curve: a transport that switches
    protocol with size follows no two-number fit everywhere)."""
    from companion import launch

    sizes = [4**k for k in range(4, 13)]                             # 256 B .. 64 MiB
    repeats = max(repeats, 9)                  # the small sizes scatter: more rounds than the rest
    rounds = launch.run(network.time_collectives, 2, sizes, repeats, timeout=120)[0]
    ring = [network.fit_all_reduce(sizes, [rounds["all_reduce"][k][r]
                                           for k in range(len(sizes))], 2)
            for r in range(repeats)]
    curves = {kind: [(n, Measured.of(row)) for n, row in zip(sizes, rows)]
              for kind, rows in rounds.items()}
    return Measured.of([a for a, _ in ring]), Measured.of([b for _, b in ring]), curves


def _concurrency_worker(rank: int, world_size: int, sizes: Sequence[int],
                        repeats: int) -> tuple[int, list[list[tuple[float, float]]]]:
    """A worker for `launch.run`: the collectives this backend runs at once (gloo: its worker
    threads, `ProcessGroupGloo::Options::threads`, 2 unless set; NCCL: 1, one stream), and per
    size (bytes of float32) and round, (one all-reduce alone, two started together and both
    waited for), the slowest rank's, in interleaved rounds after a warm-up."""
    import torch.distributed as dist

    from companion.cost import stats
    from companion.launch import rank_device

    lanes, device = 1, rank_device()
    if dist.get_backend() == "gloo":
        lanes = int(getattr(dist.ProcessGroupGloo._Options(), "_threads", 2))
    pairs = [(torch.ones(n // 4, device=device), torch.ones(n // 4, device=device))
             for n in sizes]

    def one(a, b):
        dist.all_reduce(a)                                               # collective

    def both(a, b):
        first = dist.all_reduce(a, async_op=True)                        # collective, async
        second = dist.all_reduce(b, async_op=True)                       # beside the first
        first.wait(), second.wait()                                      # sync point
    calls = [(i, fn) for i in range(len(sizes)) for fn in (one, both)]
    times = [[] for _ in calls]
    for r in range(repeats + 1):
        for c in stats.round_order(len(calls), r):                      # same order everywhere
            i, fn = calls[c]
            dist.barrier()                                               # start together
            start = now(device)                                          # host-device sync
            fn(*pairs[i])
            if r:
                times[c].append(now(device) - start)                     # host-device sync
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)                       # collective
    rows = slowest.tolist()
    return lanes, [list(zip(rows[2 * i], rows[2 * i + 1])) for i in range(len(sizes))]


def _link_sharing(rounds: list[list[tuple[float, float]]], latency: float) -> Measured:
    """The share of two concurrent transfers that queue on the link, from (one, two at once)
    per size and round: one = latency + transfer, and two started together take
    latency + (1 + sharing)·transfer (`network.link_schedule`), so
    sharing = (two - latency) / (one - latency) - 1, clipped to [0, 1]."""
    values = [min(1.0, max(0.0, (two - latency) / (one - latency) - 1))
              for row in rounds for one, two in row if one > 2 * latency]
    return Measured.of(values if len(values) >= 2 else [1.0, 1.0])


def _unit_worker(rank: int, world_size: int, width: int, depths: Sequence[int],
                 repeats: int) -> list[list[float]]:
    """A worker for `launch.run`: per depth, the seconds of a training step (forward, backward,
    finish; no optimizer) of the course's FSDP over an MLP of `depth` Linear(width, width) units
    without bias on 8 rows, each round interleaved, the slowest rank's."""
    import torch.distributed as dist
    from torch import nn

    from companion.zero import FSDP

    torch.manual_seed(0)
    x, y = torch.randn(8, width), torch.randn(8, width)

    def step_of(depth: int):
        model = FSDP(nn.Sequential(*[m for _ in range(depth) for m in
                                     (nn.Linear(width, width, bias=False), nn.ReLU())]))

        def step():
            nn.functional.mse_loss(model(x), y).backward()
            model.finish_gradient_synchronization()
            for p in model.parameters():
                p.grad = None
        return step
    steps = [step_of(d) for d in depths]
    times = [[] for _ in depths]
    for r in range(repeats + 1):
        for i, step in enumerate(steps):
            dist.barrier()                                               # start together
            start = now("cpu")                                           # gloo ranks on CPU
            step()
            if r:
                times[i].append(now("cpu") - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)                       # collective
    return slowest.tolist()


def _unit_seconds(profile: "DeviceProfile", rounds: list[list[float]], width: int = 32,
                  depths: tuple[int, int] = (4, 20)) -> Measured:
    """What one ZeRO-3 unit costs per micro-batch beyond what `zero_step` prices (its layer's
    compute and its collectives, from `profile`), on one rank: a narrow MLP (width 32, nearly
    nothing to compute or send) trained by the course's FSDP at two depths; per round, the
    measured difference between them less the model's (its layers and, on one rank, the gloo
    group's own collectives: two gathers and a reduce-scatter per unit), over the units added.
    It holds the hooks, the saved tensors packed and unpacked and the gather's autograd
    function: Python on the compute thread (measured here: about 0.5 ms per unit, 30 times a
    plain layer's bookkeeping). On 2 ranks a unit measured 3 ms more than the curves price
    (blocking collectives whose hand-offs between the ranks' threads cost more than the
    barrier-started ones timed for the curves); that part is not priced."""
    from companion.cost.speeds import mlp_layers
    from companion.cost.step import zero_step

    speeds = profile.speeds()
    nbytes = width * width * 4
    per_unit = (2 * speeds.collective_seconds("all_gather", nbytes, 1)
                + speeds.collective_seconds("reduce_scatter", nbytes, 1))

    def priced(depth: int) -> float:
        t = zero_step(mlp_layers(width, depth, 8, bias=False), speeds, 1, 3)
        return t.total - t.optimizer + depth * per_unit
    model = priced(depths[1]) - priced(depths[0])
    units = depths[1] - depths[0]
    return Measured.of([(big - small - model) / units for small, big in zip(*rounds)])


def _sharing_worker(rank: int, world_size: int, repeats: int) -> tuple[list, list]:
    """A worker for `launch.run`: in interleaved rounds, rank 0 times an MLP's training step
    alone (the others wait), with every rank stepping at once, an all-reduce of 16 MiB alone, and
    the step with that all-reduce in flight. Returns per round (both at once / alone) and the
    share of the shorter of step and all-reduce that hid behind the other."""
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(512, 512), nn.ReLU())])
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    flat = torch.ones(4 * 2**20)

    def step():
        nn.functional.mse_loss(net(x), y).backward()
        for p in net.parameters():
            p.grad = None

    def timed(fn, who=None):
        dist.barrier()
        start = now("cpu")                                 # this worker runs on the CPU
        if who is None or rank == who:
            fn()
        seconds = now("cpu") - start
        dist.barrier()
        return seconds

    def both():
        work = dist.all_reduce(flat, async_op=True)          # collective, asynchronous
        step()
        work.wait()
    shared, hidden = [], []
    for r in range(repeats + 1):
        alone = timed(step, who=0)
        together = timed(step)
        link = timed(lambda: dist.all_reduce(flat))          # collective
        overlapped = timed(both)
        if r:
            shared.append(together / alone)
            hidden.append((together + link - overlapped) / min(together, link))
    return shared, hidden


def _per_rank(device: torch.device, dtypes: Sequence[str], repeats: int) -> dict:
    """What one rank measures: matmuls (squares and the shape grid), copies, operator and layer
    costs, the host AdamW rate, and host copies on a GPU."""
    cuda = device.type == "cuda"
    sides = [256, 512, 1024] + ([2048, 4096, 8192] if cuda else [])
    big = torch.empty(32 * 2**20 // 4, device=device)
    dst = torch.empty_like(big)
    one = torch.zeros(1, device=device)
    out = {"matmul": _matmul(device, dtypes, sides, repeats, slowest=0.05),
           "grid": {name: _grid(device, name, [64, 1024, 16384] if cuda else [16, 128, 1024],
                                repeats, (256 if cuda else 96) * 2**20)
                    for name in (["float32", "bfloat16"] if cuda else ["float32"])},
           "linear": {name: _linear_grid(device, name, [256, 1024, 4096, 16384] if cuda
                                         else [16, 64, 256, 1024],
                                         [1024, 4096, 16384] if cuda else [64, 256, 1024],
                                         repeats, (256 if cuda else 96) * 2**20)
                      for name in (["float32", "bfloat16"] if cuda else ["float32"])},
           "copy_bandwidth": Measured.of([2 * big.numel() * 4 / t for t in _times(
               lambda: dst.copy_(big), device, repeats)]),
           "op_seconds": Measured.of(_times(lambda: one.add_(1), device, repeats, inner=1000)),
           "layer_seconds": _layer_seconds(device, repeats),
           "adamw": _adamw_rates(repeats), "host_to_device": None, "device_to_host": None,
           "step_flops": None, "autocast": None, "adapter_bandwidth": None, "adapter_seconds": None,
           "adam8bit": None,
           "adam8bit_tensor": None, "activation_offload": None, "optimizer_rates": None,
           "first_touch": None}
    if not cuda:
        out["step_flops"], out["autocast"] = _block_steps(device, dtypes, repeats)
        out["adapter_bandwidth"], out["adapter_seconds"] = _adapters(device, repeats)
        out["adam8bit"], out["adam8bit_tensor"] = _adam8bit_rate(repeats)
        out["activation_offload"] = _activation_offload(device, repeats)
        out["optimizer_rates"] = _optimizer_rates(repeats, out["op_seconds"].median)
    if cuda:
        out["host_to_device"], out["device_to_host"] = _host_copies(device, repeats)
    return out


def _per_rank_worker(rank: int, world_size: int, dtypes: Sequence[str], repeats: int) -> dict:
    import torch.distributed as dist

    dist.barrier()                                  # every rank measures at the same time
    return _per_rank(torch.device("cpu"), dtypes, repeats)


def calibrate(device: torch.device | str | None = None, *, threads: int | None = None,
              dtypes: Sequence[str] | None = None, repeats: int = 5, process_group: bool = True,
              concurrent: int = 1) -> DeviceProfile:
    """Measure `device` (the picked one when None) as the module docstring says. `threads`: the
    CPU threads to time with (ranks of `launch.run` use 1; None keeps torch's setting). dtypes:
    the matmul dtypes (default: float32, bfloat16 and float16, plus tf32 on a GPU).
    process_group=False skips the α–β fit (the 2-rank launch takes a few seconds).
    concurrent=N (CPU only): measure in N single-threaded processes at once, as N gloo ranks on
    this machine run, sharing its caches and memory bandwidth (rank 0's figures are kept)."""
    from companion.device import describe, pick_device

    start = time.perf_counter()                                     # host clock
    device = pick_device() if device is None else torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("calibrate('cuda') needs a CUDA device; this torch sees none")
    if not isinstance(repeats, int) or repeats < 3:
        raise ValueError(f"repeats must be an int of at least 3 (for quartiles), got {repeats!r}")
    if not isinstance(concurrent, int) or concurrent < 1 or (concurrent > 1 and
                                                             device.type != "cpu"):
        raise ValueError(f"concurrent must be a positive int (above 1 on a CPU only), got "
                         f"{concurrent!r}")
    if dtypes is None:
        dtypes = ["float32", "bfloat16", "float16"] + (["tf32"] if device.type == "cuda" else [])
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if concurrent > 1:
            from companion import launch

            parts = launch.run(_per_rank_worker, concurrent, list(dtypes), repeats,
                               timeout=120)[0]
            threads_used = 1
        else:
            parts = _per_rank(device, dtypes, repeats)
            threads_used = torch.get_num_threads()
        alpha = beta = curves = shared = overlap = one_rank = sharing = None
        lanes = 1
        if process_group:
            alpha, beta, curves = _alpha_beta(repeats)
            from companion import launch

            ratios, hidden = launch.run(_sharing_worker, 2, max(repeats, 9), timeout=120)[0]
            shared, overlap = Measured.of(ratios), Measured.of(hidden)
            lanes, pairs = launch.run(_concurrency_worker, 2, [2**20, 2**22, 2**24],
                                      max(repeats, 9), timeout=120)[0]
            latency = min(_fitted([(n, m.median) for n, m in curves["all_reduce"]]))[1]
            sharing = _link_sharing(pairs, latency)
        units = None
        if process_group and device.type == "cpu":  # the differences scatter: more rounds
            sizes = [4**k for k in range(4, 13)]
            alone, parts["first_touch"], units = launch.run(
                _one_rank_worker, 1, sizes, repeats + 4, timeout=120)[0]
            one_rank = {kind: [(n, Measured.of(row)) for n, row in zip(sizes, rows)]
                        for kind, rows in alone.items()}
        measured = DeviceProfile(device=str(device), name=str(describe(device).get("name")),
                                 threads=threads_used, alpha=alpha, beta=beta,
                                 collectives=curves, shared_compute=shared, overlap=overlap,
                                 collectives_one=one_rank, collective_lanes=lanes,
                                 link_sharing=sharing, **parts)
        if units is not None:
            measured = dataclasses.replace(measured, unit_seconds=_unit_seconds(measured, units))
        return dataclasses.replace(measured, seconds=time.perf_counter() - start)  # host clock
    finally:
        torch.set_num_threads(old_threads)
