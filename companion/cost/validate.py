"""The step-time models against real ranks: predicted beside measured, per configuration.

A configuration is a dict: kind ("single", "ddp", "zero1", "zero2", "zero3"), the MLP's width,
depth and rows per rank (`batch`), k micro-batches per step, for DDP and ZeRO the bucket cap
in MiB (`bucket_mb`), and for ZeRO-3 the units gathered ahead (`prefetch`, 0 by default); world
size is chosen per call. `measure` trains each configuration on gloo
ranks with the course's own DDP, ShardedOptimizer and FSDP, timing them in interleaved rounds
(round r starts at the r-th configuration), and keeps the slowest rank's time of each step.
`predict` runs the matching model of `companion.cost.step` on a calibrated `Speeds`.

Example:
    >>> speeds = calibrate(threads=1).speeds()                     # doctest: +SKIP
    >>> rows = validate(CONFIGS, speeds, world_size=2)             # doctest: +SKIP
    >>> [(r["kind"], r["error"]) for r in rows]                    # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from companion.cost import step as model
from companion.cost.step import Speeds, StepTime
from companion.cost import stats
from companion.cost.clock import now

__all__ = ["CONFIGS", "predict", "measure", "validate"]

KINDS = ("single", "ddp", "zero1", "zero2", "zero3")

# the configurations benchmarks/bench_cost.py and chapter 06/07 validate on this CPU
CONFIGS = [
    {"kind": "single", "width": 512, "depth": 16, "batch": 64, "k": 1},
    {"kind": "single", "width": 1024, "depth": 8, "batch": 16, "k": 2},
    {"kind": "single", "width": 256, "depth": 32, "batch": 256, "k": 1},
    {"kind": "ddp", "width": 512, "depth": 32, "batch": 16, "k": 1, "bucket_mb": 25},
    {"kind": "ddp", "width": 512, "depth": 32, "batch": 16, "k": 1, "bucket_mb": 2},
    {"kind": "ddp", "width": 1024, "depth": 8, "batch": 64, "k": 4, "bucket_mb": 4},
    {"kind": "zero1", "width": 512, "depth": 16, "batch": 16, "k": 1, "bucket_mb": 25},
    {"kind": "zero1", "width": 1024, "depth": 4, "batch": 64, "k": 2, "bucket_mb": 4},
    {"kind": "zero2", "width": 512, "depth": 16, "batch": 16, "k": 1, "bucket_mb": 4},
    {"kind": "zero2", "width": 512, "depth": 16, "batch": 16, "k": 4, "bucket_mb": 4},
    {"kind": "zero2", "width": 1024, "depth": 4, "batch": 64, "k": 2, "bucket_mb": 25},
    {"kind": "zero3", "width": 512, "depth": 16, "batch": 16, "k": 1},
    {"kind": "zero3", "width": 512, "depth": 16, "batch": 16, "k": 2},
    {"kind": "zero3", "width": 1024, "depth": 4, "batch": 64, "k": 1},
]


def _check(config: dict) -> dict:
    if config.get("kind") not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {config.get('kind')!r}")
    out = {"k": 1, "bucket_mb": 25.0, "prefetch": 0, **config}
    for key in ("width", "depth", "batch", "k"):
        if not isinstance(out.get(key), int) or out[key] < 1:
            raise ValueError(f"{key} must be a positive int, got {out.get(key)!r} in {config}")
    prefetch = out["prefetch"]
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r} in {config}")
    if prefetch and out["kind"] != "zero3":
        raise ValueError(f"prefetch gathers ZeRO-3's units ahead: use it with kind 'zero3', "
                         f"not {out['kind']!r} ({config})")
    return out


def predict(config: dict, speeds: Speeds, world_size: int) -> StepTime:
    """The step-time model of `config` on `world_size` ranks at `speeds`."""
    c = _check(config)
    bias = c["kind"] != "zero3"
    layers = model.mlp_layers(c["width"], c["depth"], c["batch"], bias=bias)
    cap = c["bucket_mb"] * 2**20
    if c["kind"] == "single":              # alone, or beside the other ranks' own steps
        return model.single_step(layers, speeds.ranks(world_size), k=c["k"], optimizer="sgd")
    if c["kind"] == "ddp":
        return model.ddp_step(layers, speeds, world_size, bucket_bytes=cap, k=c["k"])
    stage = int(c["kind"][-1])
    return model.zero_step(layers, speeds, world_size, stage, k=c["k"], bucket_bytes=cap,
                           prefetch=c["prefetch"], optimizer="adamw")


def _build(c: dict):
    """(the training step as a function, what to call it on) for one configuration, on a rank."""
    from companion.ddp import DDP
    from companion.zero import FSDP, ShardedOptimizer

    torch.manual_seed(0)
    bias = c["kind"] != "zero3"
    net = nn.Sequential(*[m for _ in range(c["depth"])
                          for m in (nn.Linear(c["width"], c["width"], bias=bias), nn.ReLU())])
    x = torch.randn(c["batch"], c["width"])
    y = torch.randn(c["batch"], c["width"])
    kind, k = c["kind"], c["k"]
    if kind in ("single", "ddp"):
        wrapped = DDP(net, bucket_cap_mb=c["bucket_mb"]) if kind == "ddp" else net
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)

        def step():
            for i in range(k):
                quiet = kind == "ddp" and i < k - 1
                with wrapped.no_sync() if quiet else contextlib.nullcontext():
                    nn.functional.mse_loss(wrapped(x), y).backward()
            if kind == "ddp":
                wrapped.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
        return step
    if kind == "zero3":
        wrapped = FSDP(net, prefetch=c["prefetch"])
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, foreach=False)

        def step():
            for _ in range(k):
                nn.functional.mse_loss(wrapped(x), y).backward()
            wrapped.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
        return step
    opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, stage=int(kind[-1]),
                           bucket_cap_mb=c["bucket_mb"], lr=1e-4, foreach=False)

    def step():
        for _ in range(k):
            nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def measure(rank: int, world_size: int, configs: Sequence[dict], rounds: int = 7) -> list[list[float]]:
    """A worker for `launch.run`: seconds of each configuration's optimizer step, `rounds` times
    each after one warm-up round, interleaved; the slowest rank's time of each step."""
    steps = [_build(_check(c)) for c in configs]
    times = [[0.0] * rounds for _ in configs]
    for r in range(rounds + 1):
        for i in stats.round_order(len(configs), r):                   # same order on every rank
            dist.barrier()                                              # start together
            start = now("cpu")                  # the validation runs on CPU ranks (gloo)
            steps[i]()
            if r:
                times[i][r - 1] = now("cpu") - start
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)                      # collective
    return slowest.tolist()


def validate(configs: Sequence[dict], speeds: Speeds, *, world_size: int = 2, rounds: int = 7,
             timeout: float = 600.0) -> list[dict]:
    """Each configuration with its predicted parts, predicted and measured seconds (median of
    `rounds`, with the quartiles, and every round's "times") and the relative error
    (predicted - measured) / measured."""
    from companion import launch
    from companion.cost.stats import spread

    checked = [_check(c) for c in configs]
    measured = launch.run(measure, world_size, checked, rounds, timeout=timeout)[0]
    rows = []
    for c, times in zip(checked, measured):
        p = predict(c, speeds, world_size)
        med, low, high = spread(times)
        rows.append({**c, "world_size": world_size, "predicted": p.total, "parts": p.parts(),
                     "measured": med, "low": low, "high": high, "times": times,
                     "error": (p.total - med) / med})
    return rows


def summary(rows: Sequence[dict]) -> dict:
    """The median and the largest absolute relative error over `rows`."""
    errors = [abs(r["error"]) for r in rows]
    return {"median": statistics.median(errors), "worst": max(errors), "configs": len(rows)}
