"""Chapter 10's recorded experiment: attention's memory and time against the sequence length.

Every kind this device runs (`companion.attention.measure.available`): written-out attention and
SDPA's math backend up to `S.attn_naive_max_len`, our FlashAttention (PyTorch; on a GPU also the
Triton kernels) and SDPA's flash backend up to `S.attn_max_len`. bf16 on a GPU, fp32 on a CPU.

Example:
    >>> out = attention_sweep(sizes("cpu"), torch.device("cpu"), repeats=1)
    >>> out["measured"]["saved_bytes_flash"]["y"]
"""
from __future__ import annotations

from statistics import median

import torch

from companion.attention import flash_saved_bytes, naive_saved_bytes
from companion.attention.measure import attention_memory, attention_seconds, available
from companion.results import curve

__all__ = ["attention_sweep", "lengths", "attention_figures", "QUADRATIC"]

QUADRATIC = ("naive", "sdpa_math")          # kinds that hold (T, T) tensors


def lengths(S, kind: str) -> list[int]:
    """T = 256, 512, ... up to the longest this kind runs at sizes S."""
    top = S.attn_naive_max_len if kind in QUADRATIC else S.attn_max_len
    out, T = [], 256
    while T <= top:
        out.append(T)
        T *= 2
    return out


def attention_figures(memory: dict, seconds: dict | None = None) -> dict:
    """{kind: {T: {"saved", "peak"}}} and {kind: {T: [seconds]}} as the recorded curves."""
    out = {}
    for kind, runs in memory.items():
        T = sorted(runs)
        out[f"saved_bytes_{kind}"] = curve(T, [runs[t]["saved"] for t in T], xlabel="T",
                                           ylabel="bytes saved for backward", xscale="log",
                                           yscale="log", title=f"{kind}: saved for backward")
        out[f"peak_bytes_{kind}"] = curve(T, [runs[t]["peak"] for t in T], xlabel="T",
                                          ylabel="peak bytes, forward + backward", xscale="log",
                                          yscale="log", title=f"{kind}: peak")
    for kind, runs in (seconds or {}).items():
        T = sorted(runs)
        out[f"seconds_{kind}"] = curve(T, [median(runs[t]) for t in T], xlabel="T",
                                       ylabel="seconds, forward + backward (median)",
                                       xscale="log", yscale="log", title=f"{kind}: time")
    return out


def attention_sweep(S, device: torch.device, *, repeats: int = 3) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(batch=S.attn_batch, heads=S.attn_heads, head_dim=S.attn_head_dim, dtype=dtype,
                 device=device)
    kinds = available(device)
    memory = {kind: {T: attention_memory(kind, T, block=256 if kind == "flash" else None,
                                         **shape) for T in lengths(S, kind)} for kind in kinds}
    timed = [k for k in kinds if k not in QUADRATIC]
    T_time = lengths(S, "flash")[:3]
    seconds: dict = {k: {} for k in timed}
    for T in T_time:
        for kind, runs in attention_seconds(timed, T, repeats=repeats, block=None,
                                            **shape).items():
            seconds[kind][T] = runs
    measured = attention_figures(memory, seconds)
    # The formulas count q, k, v (made before the measurement) and, for FlashAttention, the
    # output (left out of "saved"): take them off.
    predicted = {}
    for kind, kept in (("naive", 3), ("flash", 4)):
        T = lengths(S, kind)
        shape = lambda t: (S.attn_batch, S.attn_heads, t, S.attn_head_dim)
        inputs = lambda t: kept * S.attn_batch * S.attn_heads * t * S.attn_head_dim * dtype.itemsize
        formula = (lambda t: naive_saved_bytes(shape(t), shape(t), dtype, is_causal=True)) \
            if kind == "naive" else (lambda t: flash_saved_bytes(shape(t), shape(t), dtype))
        predicted[f"saved_bytes_{kind}"] = dict(measured[f"saved_bytes_{kind}"],
                                                y=[formula(t) - inputs(t) for t in T])
    return {"experiment": f"attention forward + backward against T ({dtype}, causal): "
                          + ", ".join(kinds), "measured": measured, "predicted": predicted}
