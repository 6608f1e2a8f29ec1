"""The host side of a FlashAttention-2 forward kernel written in Triton: layout, grid, strides
and pointers, so that a kernel (chapter 10's Triton exercise) can be launched on any shapes.

`launch_forward(kernel, q, k, v, is_causal, block_q, block_k)` runs `kernel` with the signature

    kernel(Q, K, V, O, L,
           stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on, stride_lh,
           n_q, n_k, d, scale,
           IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_D: tl.constexpr)

on a grid of (⌈Nq / BLOCK_Q⌉, batch·heads) programs. Q, K, V and O are (batch·heads, N, d)
matrices, element (h, n, i) at `ptr + h·stride_h + n·stride_n + i` (the last dimension is
contiguous); K and V share their strides; L is (batch·heads, Nq) fp32 at `L + h·stride_lh + n`.
BLOCK_D is d rounded up to a power of two, at least 16 (tl.dot's smallest tile), so a kernel
masks the dimensions past d as it masks the rows past Nq and the keys past Nk.

The strides are not those of a packed tensor: each head's rows sit in a buffer padded to whole
tiles, the padding (and 16 elements past the end) holds NaN, and O is laid out (Nq, heads, d) as
SDPA lays out its output. A kernel that reads past Nk without a mask gets NaN, not another
process's memory, and one that computes offsets from Nq·d instead of the strides it is given
reads the wrong rows.

On CUDA tensors the kernel is compiled; on CPU tensors it runs under Triton's interpreter, made
here from the kernel's Python function (`TRITON_INTERPRET=1` need not be set, and @triton.jit
helpers the kernel calls are interpreted with it).

Example:
    >>> o, lse = launch_forward(my_kernel, q, k, v, True, 16, 16)   # q (B, Nq, d), k, v (B, Nk, d)
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Iterator

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["launch_forward", "interpreted_kernel"]


def _padded(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """t (H, N, d) copied into a (H, rows, d) view of a buffer filled with `fill`, with 16
    spare elements past its end; the view's first N rows of each head are t."""
    h, n, d = t.shape
    buffer = torch.full((h * rows * d + 16,), fill, dtype=t.dtype, device=t.device)
    view = buffer[:h * rows * d].view(h, rows, d)
    view[:, :n] = t
    return view[:, :n]


def _jit_functions(fn, visited: set) -> Iterator[tuple[dict, str, JITFunction]]:
    """(namespace, name, JITFunction) for each @triton.jit function `fn` can reach: in its
    globals, in its helpers' globals, and in Triton's own library (tl.zeros, tl.max, ... are
    @triton.jit functions that call each other). Each namespace is read once."""
    spaces = [fn.__globals__] + [vars(m) for name, m in list(sys.modules.items())
                                 if name.startswith("triton.language") and m is not None]
    for space in spaces:
        if id(space) in visited:
            continue
        visited.add(id(space))
        for name, value in list(space.items()):
            if isinstance(value, JITFunction):
                yield space, name, value
                yield from _jit_functions(value.fn, visited)


@contextlib.contextmanager
def interpreted_kernel(kernel) -> Iterator[InterpretedFunction]:
    """`kernel` (a @triton.jit function, compiled or interpreted) as an interpreted one, in a
    process where TRITON_INTERPRET was not set when Triton was imported: while the block runs,
    the knob is on and every @triton.jit function the kernel can reach (its helpers, Triton's
    library) is interpreted; both are restored afterwards."""
    if isinstance(kernel, InterpretedFunction):
        yield kernel
        return
    fn = kernel.fn if isinstance(kernel, JITFunction) else kernel
    swapped = list(_jit_functions(fn, set()))
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    for space, name, jitted in swapped:
        space[name] = InterpretedFunction(jitted.fn)
    try:
        yield InterpretedFunction(fn)
    finally:
        for space, name, jitted in swapped:
            space[name] = jitted
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def launch_forward(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   is_causal: bool = False, block_q: int = 16, block_k: int = 16
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) from `kernel` on q (..., Nq, d), k and v (..., Nk, d): o in q's dtype (fp32 when
    interpreted), lse fp32 (..., Nq). Scale 1/√d; causal masks align bottom-right."""
    if q.ndim < 3 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or \
            q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (..., Nq, d) and k, v (..., Nk, d) with the same leading "
                         f"dimensions, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two of at least 16 (tl.dot's smallest "
                             f"tile), got {b!r}")
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    on_gpu = q.device.type == "cuda"
    dtype = q.dtype if on_gpu else torch.float32          # the interpreter computes in fp32
    pad = lambda n, b: triton.cdiv(max(n, 1), b) * b
    q3 = _padded(q.reshape(-1, n_q, d).to(dtype), pad(n_q, block_q), math.nan)
    k3 = _padded(k.reshape(-1, n_k, d).to(dtype), pad(n_k, block_k), math.nan)
    v3 = _padded(v.reshape(-1, n_k, d).to(dtype), pad(n_k, block_k), math.nan)
    heads = q3.shape[0]
    o = torch.full((pad(n_q, block_q), heads, d), math.nan, dtype=dtype,
                   device=q.device).transpose(0, 1)        # (H, Nq_padded, d), heads-last memory
    lse = torch.full((heads, pad(n_q, block_q)), math.nan, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(n_q, block_q), heads)
    args = (q3, k3, v3, o, lse, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
            o.stride(0), o.stride(1), lse.stride(0), n_q, n_k, d, 1 / math.sqrt(d))
    options = dict(IS_CAUSAL=bool(is_causal), BLOCK_Q=block_q, BLOCK_K=block_k,
                   BLOCK_D=max(16, triton.next_power_of_2(d)))
    if on_gpu:
        kernel[grid](*args, **options)
    else:
        with interpreted_kernel(kernel) as run:
            run[grid](*args, **options)
    return (o[:, :n_q].reshape(q.shape).to(q.dtype if on_gpu else torch.float32),
            lse[:, :n_q].reshape(q.shape[:-1]))
