"""Bytes and seconds of one attention forward and backward, for each implementation at hand.

`KINDS` names them: "naive" (written out), "flash" (`FlashAttentionTorch`), "flash_triton"
(`FlashAttentionTriton`, where Triton runs), and SDPA with one backend forced: "sdpa_flash",
"sdpa_efficient" (CUDA only) and "sdpa_math". `available(device)` lists those this device runs.

Example:
    >>> attention_memory("flash", 4096, batch=1, heads=4, head_dim=32, device="cpu")
    {'saved': ..., 'peak': ...}
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from companion.attention.flash import FlashAttentionTorch
from companion.attention.naive import naive_attention
from companion.cost.clock import now
from companion.memory import track

__all__ = ["KINDS", "available", "attention_fn", "attention_memory", "attention_seconds",
           "triton_interpreted"]

KINDS = ("naive", "flash", "flash_triton", "sdpa_flash", "sdpa_efficient", "sdpa_math")
_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient":
             SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}


def available(device: torch.device | str) -> list[str]:
    """The kinds that run on `device`: on a CPU no memory-efficient SDPA backend, and Triton only
    under its interpreter (too slow to measure, so left out)."""
    device = torch.device(device)
    kinds = ["naive", "flash", "sdpa_flash", "sdpa_math"]
    if device.type == "cuda":
        from companion.attention import triton_available
        kinds.insert(2, "sdpa_efficient")
        if _has_triton() and triton_available(device):
            kinds.insert(2, "flash_triton")
    return kinds


def _has_triton() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def attention_fn(kind: str, *, block: int | None = None) -> Callable:
    """attention(q, k, v, is_causal) for one kind (see KINDS); `block`: our kernels' tile size."""
    if kind == "naive":
        return lambda q, k, v, c: naive_attention(q, k, v, c)
    if kind == "flash":
        return lambda q, k, v, c: FlashAttentionTorch.apply(q, k, v, c, None, block or 128,
                                                            block or 128)
    if kind == "flash_triton":
        from companion.attention import FlashAttentionTriton
        return lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c, None, block, block)
    if kind in _BACKENDS:
        def sdpa(q, k, v, c):
            with sdpa_kernel(_BACKENDS[kind]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=c)
        return sdpa
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def _inputs(T, batch, heads, head_dim, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(batch, heads, T, head_dim, generator=g, device=device, dtype=dtype,
                        requires_grad=True) for _ in range(3)]


def attention_memory(kind: str, T: int, *, batch: int = 1, heads: int = 4, head_dim: int = 32,
                     dtype: torch.dtype = torch.float32, device="cpu", causal: bool = True,
                     block: int | None = None) -> dict[str, int]:
    """{"saved": bytes kept between forward and backward beyond q, k, v and the output's own
    storage, "peak": the most bytes live at once during forward and backward, above q, k, v}."""
    device = torch.device(device)
    q, k, v = _inputs(T, batch, heads, head_dim, dtype, device)
    fn = attention_fn(kind, block=block)
    with track(device) as t:
        o = fn(q, k, v, causal)
        saved = t.current - o.untyped_storage().nbytes()
        o.backward(torch.ones_like(o))
    return {"saved": saved, "peak": t.peak}


def attention_seconds(kinds: list[str], T: int, *, repeats: int = 5, batch: int = 1,
                      heads: int = 4, head_dim: int = 32, dtype: torch.dtype = torch.float32,
                      device="cpu", causal: bool = True, block: int | None = None
                      ) -> dict[str, list[float]]:
    """Seconds of forward + backward for each kind, `repeats` interleaved rounds (one of each
    kind per round, so a slow spell of the machine hits all of them), after one warm-up each."""
    device = torch.device(device)
    q, k, v = _inputs(T, batch, heads, head_dim, dtype, device)
    fns = {kind: attention_fn(kind, block=block) for kind in kinds}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(repeats + 1):
        for kind, fn in fns.items():
            start = now(device)                          # host-device sync, then the clock
            fn(q, k, v, causal).backward(torch.ones(q.shape, device=device, dtype=dtype))
            if round_:                                   # round 0 warms up
                times[kind].append(now(device) - start)  # host-device sync
            q.grad = k.grad = v.grad = None
    return times


_CHILD = """
import torch
from companion.attention import FlashAttentionTorch, FlashAttentionTriton
for qs, ks, causal in (((1, 4, 70, 32), (1, 2, 70, 32), True), ((2, 45, 16), (2, 77, 16), False)):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, requires_grad=True) for s in (qs, ks, ks))
    outs = []
    for kernel in (FlashAttentionTorch, FlashAttentionTriton):
        o = kernel.apply(q, k, v, causal)
        outs.append((o, *torch.autograd.grad(o, (q, k, v), torch.ones_like(o))))
    diff = max(float((a - b).abs().max()) for a, b in zip(*outs))
    print(f"q {qs}, k {ks}, causal={causal}: Triton (interpreted) vs PyTorch, largest "
          f"difference in o, dq, dk, dv: {diff:.1e}")
"""


def triton_interpreted(timeout: float = 300.0) -> str:
    """Run the Triton kernels on CPU tensors under Triton's interpreter, in a child process
    (TRITON_INTERPRET=1 is set there only), against FlashAttentionTorch; return what it printed,
    or why it could not run."""
    import os
    import subprocess
    import sys
    if not _has_triton():
        return ("Triton is not installed here: `tasks.py lab` installs it on Linux x86_64, where "
                "its wheels exist; elsewhere the Triton cells have nothing to run.")
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TRITON_INTERPRET": "1"})
    if done.returncode:
        return f"the interpreted run failed:\n{done.stderr[-2000:]}"
    return done.stdout.strip()
