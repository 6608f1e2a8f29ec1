"""Chapter 11, exercise 5: which layout of a model's states fits a GPU (bf16 with an fp32
master down to QLoRA), counted tensor by tensor."""
from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Iterator

import torch
from torch import nn

from companion import models
from companion.checks.core import CheckFailed, call, exercise, fresh_seeds


CHOICES = ("bf16+master", "fp32+adam8bit", "bf16+kahan", "bf16", "bf16+adam8bit", "qlora")


def _nf4_bytes(n: int) -> int:
    """One weight of n values in NF4 with double quantization (blocks of 64): the codes, one 8-bit
    code per block's absmax, one fp32 scale per 256 of those, and their fp32 mean."""
    blocks = -(-n // 64)
    return -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4


def layout_bytes(layout: str, model: nn.Module, rank: int) -> int:
    """The reference's count of `model`'s states with Adam in `layout`, as `layouts.predict`
    counts them: 8-bit moments only for tensors of 4096 values or more (fp32 below, as
    bitsandbytes), each with a 4-byte absmax per block of 256; QLoRA's Linear weights in NF4, every
    other weight frozen in fp32, rank-`rank` adapters on each Linear at 16 bytes each."""
    sizes = [p.numel() for p in model.parameters()]
    n = sum(sizes)
    if layout == "qlora":
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        dense = sum(m.weight.numel() for m in linears)
        adapters = sum(rank * (m.in_features + m.out_features) for m in linears)
        return (sum(_nf4_bytes(m.weight.numel()) for m in linears) + 4 * (n - dense)
                + 16 * adapters)
    moments8 = sum(2 * (k + 4 * -(-k // 256)) if k >= 4096 else 8 * k for k in sizes)
    return {"bf16+master": 16 * n, "fp32+adam8bit": 8 * n + moments8, "bf16+kahan": 10 * n,
            "bf16": 8 * n, "bf16+adam8bit": 4 * n + moments8}[layout]


def pick_layout(model, rank, gpu_bytes, other_bytes):
    """The reference: the first of CHOICES whose states and `other_bytes` fit, else None."""
    for layout in CHOICES:
        if layout_bytes(layout, model, rank) + other_bytes <= gpu_bytes:
            return layout
    return None


@functools.lru_cache(maxsize=None)
def _needs(model: nn.Module, rank: int) -> dict[str, int]:
    """layout_bytes of every layout, once per model of the check's own (built once, never changed:
    the answer gets copies) and rank."""
    return {c: layout_bytes(c, model, rank) for c in CHOICES}


def _want(model: nn.Module, rank: int, gpu: int, other: int) -> str | None:
    """pick_layout on the counts of _needs."""
    return next((c for c, need in _needs(model, rank).items() if need + other <= gpu), None)


@functools.lru_cache(maxsize=None)
def _gpt(vocab: int, seq_len: int, width: int, depth: int) -> nn.Module:
    """A GPT on the meta device, built once per shape (the answer gets copies: `call`)."""
    with torch.random.fork_rng(devices=[]):            # GPT seeds the global generator
        return models.GPT(vocab, seq_len, width, depth, max(1, width // 128), device="meta")


@functools.lru_cache(maxsize=None)
def _narrow_mlp(depth: int) -> nn.Module:
    """Many Linear layers of 60 x 60: every tensor under 4096 values."""
    with torch.random.fork_rng(devices=[]):
        return models.MLP(512, 60, depth, 10, device="meta")


@functools.lru_cache(maxsize=None)
def _probe() -> nn.Module:
    """A 0.34B model of few tensors (cheap to copy), sizes chosen so that every part of every
    layout's count moves it by more than _PAD: big tensors (a block's absmax, the NF4 scales), a
    non-Linear weight (frozen fp32 in QLoRA), tensors of exactly 4095 and 4096 values (fp32 and
    8-bit moments), small ones (fp32 moments, 8 bytes a value)."""
    with torch.device("meta"):
        return nn.Sequential(nn.Embedding(50000, 4096), nn.LayerNorm(4096),
                             nn.Linear(4096, 16384), nn.Linear(16384, 4096), nn.Linear(63, 65),
                             nn.Linear(4096, 1000))


_PAD = 64      # bytes: more than whole bytes and per-weight bits differ by on _probe (20 for QLoRA)


def _bits_count(layout: str, model: nn.Module, rank: int) -> float:
    """layout_bytes counted in bits per value (no block rounded up, no NF4 mean): the honest
    variant the exercise's reference writes."""
    sizes = [p.numel() for p in model.parameters()]
    n = sum(sizes)
    if layout == "qlora":
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        dense = sum(m.weight.numel() for m in linears)
        adapters = sum(rank * (m.in_features + m.out_features) for m in linears)
        return dense * (4 + 8 / 64 + 32 / (64 * 256)) / 8 + 4 * (n - dense) + 16 * adapters
    moments8 = sum(2 * k * (1 + 4 / 256) if k >= 4096 else 8 * k for k in sizes)
    return {"bf16+master": 16 * n, "fp32+adam8bit": 8 * n + moments8, "bf16+kahan": 10 * n,
            "bf16": 8 * n, "bf16+adam8bit": 4 * n + moments8}[layout]


def _boundary_cases() -> list[tuple]:
    """First and cheap: for each layout, _probe on a budget _PAD bytes under the least and over the
    most of its two honest counts. A count off by a byte a value, a block's absmax, an NF4 scale's
    bits, a frozen weight's bytes or the 4096 line gives another answer on one of the two. Last, a
    budget of exactly one layout's bytes: states that fill the GPU to the byte fit."""
    model, rank, other = _probe(), 8, 2**30
    cases = []
    for c in CHOICES:
        counts = (_needs(model, rank)[c], _bits_count(c, model, rank))
        lo, hi = math.floor(min(counts)), math.ceil(max(counts))
        cases += [(model, rank, other + lo - _PAD, other, f"{_PAD} bytes under {c}'s bytes"),
                  (model, rank, other + hi + _PAD, other, f"{_PAD} bytes over {c}'s bytes")]
    exact = _needs(model, rank)["bf16"]                     # 8 bytes a value: every count agrees
    return cases + [(model, rank, other + exact, other, "exactly bf16's bytes: it fits")]


def _fixed_cases() -> list[tuple]:
    """(model, rank, gpu_bytes, other_bytes, what it decides), each a few budgets placed where a
    count that leaves out one part of a layout's bytes gives another answer."""
    return _boundary_cases() + _model_cases()


def _model_cases() -> list[tuple]:
    """The fixed cases on GPT-shaped models (the review's: QLoRA's need, tensors of 4096)."""
    cases = []
    gpt, rank = _gpt(32000, 2048, 4096, 32), 16                       # 6.7B
    need = _needs(gpt, rank)["qlora"]
    linears = [m for m in gpt.modules() if isinstance(m, nn.Linear)]
    dense = sum(m.weight.numel() for m in linears)
    n = sum(p.numel() for p in gpt.parameters())
    parts = [sum(_nf4_bytes(m.weight.numel()) for m in linears) - dense / 2,      # the scales
             16 * rank * sum(m.in_features + m.out_features for m in linears),   # the adapters
             dense * (4.5 - 4.127) / 8,                                 # double quantization
             2 * (n - dense)]                                           # fp32, not bf16
    margin = int(0.01 * min(parts))
    other = 20 * 2**30 - need
    cases += [(gpt, rank, need + other - margin, other, "a budget just under one layout's bytes"),
              (gpt, rank, need + other + margin, other, "a budget just over one layout's bytes")]
    small = _gpt(50257, 1024, 1024, 24)                                 # small tensors: 9·C a block
    bf16, kahan = (_needs(small, 8)[c] for c in ("bf16+adam8bit", "bf16+kahan"))
    flat = sum(p.numel() for p in small.parameters())
    other = 12 * 2**30
    cases += [(small, 8, other + (kahan + 10.0315 * flat) // 2, other, "a budget between two layouts' bytes"),
              (small, 8, other + (bf16 + 6.0315 * flat) // 2 - 4, other, "a budget between two counts of one layout")]
    mlp = _narrow_mlp(30)                                               # 0.14M values, all small
    other = 12 * 2**30 - 13 * sum(p.numel() for p in mlp.parameters())
    cases.append((mlp, 4, 12 * 2**30, other, "a model of 30 narrow layers"))
    tiny = _gpt(50257, 1024, 768, 12)                                   # everything fits
    cases.append((tiny, 8, 141 * 2**30, 2**30, "a large GPU"))
    # width 4096: LayerNorms and some biases hold exactly 4096 values, 8-bit from 4096 on
    at = sum(p.numel() for p in gpt.parameters() if p.numel() == 4096)
    six = _needs(gpt, rank)["bf16+adam8bit"]
    cases.append((gpt, rank, 14 * 2**30 + six + 3 * at, 14 * 2**30,
                  "tensors of exactly 4096 values"))
    return cases


def _random_cases(rng: random.Random, count: int) -> Iterator[tuple]:
    """GPT-shaped models from 0.4B to 65B parameters on GPUs of 12 to 141 GiB, each kept 0.2% or more from a
    boundary between two answers."""
    shapes = [(50257, 1024, 1024, 24), (32000, 2048, 2048, 24), (32000, 4096, 4096, 32),
              (128256, 8192, 5120, 40), (32000, 4096, 8192, 80)]
    made = 0
    while made < count:
        vocab, seq_len, width, depth = rng.choice(shapes)
        model = _gpt(vocab, seq_len, width, depth)
        rank = rng.choice([4, 8, 16, 64])
        gpu = rng.choice([12, 16, 24, 40, 48, 80, 141]) * 2**30
        other = int(gpu * rng.uniform(0.02, 0.3))
        sizes = [need + other for need in _needs(model, rank).values()]
        if all(abs(s - gpu) > 0.002 * gpu for s in sizes):
            made += 1
            yield model, rank, gpu, other, "a random model and GPU"


def _layout_hint(got, want) -> str:
    if {got, want} <= {"qlora", None}:
        return ("QLoRA's bytes for this model are off: count every part of its frozen base and "
                "of its trained adapters, Linear layer by Linear layer.")
    if "fp32+adam8bit" in (got, want) or "bf16+adam8bit" in (got, want):
        return ("8-bit Adam's bytes for this model are off: the course GPT's row measured above "
                "is not 10.03 bytes per parameter, and the text says why; count tensor by "
                "tensor.")
    return _ORDER_HINT


_ORDER_HINT = ("count each layout's bytes for this model, add the other bytes, and take the first "
               "choice in the order of the exercise that fits; None when none does.")


@exercise(points=2, timeout=30.0,
          reference=("companion.checks.ch11.layout_choice.pick_layout", "companion.checks.ch11.layout_choice.layout_bytes",
                     "companion.checks.ch11.layout_choice._nf4_bytes", "companion.lowbit.layouts.predict",
                     "companion.lowbit.layouts.measure", "companion.estimate.model_states",
                     "companion.estimate.nf4_bytes"))
def check_pick_layout(answer) -> str:
    """answer(model, rank, gpu_bytes, other_bytes) -> one of CHOICES or None."""
    rng = random.Random(fresh_seeds(1)[0])
    # built as they are reached: a wrong count stops at the first cheap _probe case it fails
    cases = itertools.chain(_boundary_cases(), _model_cases(), _random_cases(rng, 6),
                            [(_gpt(32000, 4096, 8192, 80), 16, 16 * 2**30, 2**30, "nothing fits")])
    count = 0
    for model, rank, gpu, other, what in cases:
        count += 1
        want = _want(model, rank, gpu, other)
        got = call(answer, model, rank, gpu, other)
        if got != want:
            n = sum(p.numel() for p in model.parameters())
            fitting = [c for c, need in _needs(model, rank).items() if need + other <= gpu]
            skipped = got in fitting and fitting.index(got) > 1      # past the next that fits
            shown = ", ".join(f"{c} {_needs(model, rank)[c] / 2**30:.3f}"
                              for c in CHOICES if c in (got, want))
            raise CheckFailed(f"a {type(model).__name__} of {n / 1e9:.3f}B parameters, adapters of "
                              f"rank {rank}, on {gpu / 2**30:.3f} GiB with {other / 2**30:.3f} GiB "
                              f"of other memory ({what}): expected {want!r}, got {got!r} (GiB of "
                              f"model states: {shown or 'none fits'})",
                              expected=want, got=got, hint=_ORDER_HINT if skipped else
                              _layout_hint(got, want))
    return (f"the right layout for {count} models and GPUs, from 0.01B to 65B parameters, "
            "some budgets within 0.1% of a layout's bytes")
