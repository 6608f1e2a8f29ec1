"""Shapes and comparisons shared by the attention tests: the PyTorch kernel in-process, and the
Triton kernels in a process of their own (`python tests/attention_cases.py triton cpu` runs them
under TRITON_INTERPRET=1, which the calling test sets for that child only)."""
from __future__ import annotations

import sys

import torch

from companion.attention import naive_attention

# (q shape, k shape, causal): lengths not multiples of the tile, Nq != Nk both ways, GQA, MQA.
CASES = [
    ((2, 37, 16), (2, 53, 16), False),
    ((2, 37, 16), (2, 53, 16), True),
    ((1, 3, 53, 32), (1, 3, 37, 32), True),          # Nq > Nk: the first 16 queries see no key
    ((2, 4, 40, 24), (2, 2, 40, 24), True),          # grouped-query: 2 query heads per kv head
    ((1, 4, 33, 16), (1, 1, 70, 16), False),         # multi-query: one kv head
    ((2, 2, 2, 20, 8), (2, 2, 2, 20, 8), True),      # two leading dimensions before the heads
]

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def inputs(q_shape, k_shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    make = lambda shape: torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    q, k, v = make(q_shape), make(k_shape), make(k_shape)
    grad_out = make(q_shape)
    return [t.requires_grad_() for t in (q, k, v)], grad_out


def reference(q, k, v, grad_out, causal):
    """(o, lse, dq, dk, dv) of the written-out attention in fp64, bottom-right causal mask."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = naive_attention(q, k, v, causal, return_lse=True)
    grads = torch.autograd.grad(o, (q, k, v), grad_out.double())
    return (o.detach(), lse, *grads)


def run(kernel, q, k, v, grad_out, causal, **options):
    """(o, lse, dq, dk, dv) of an autograd Function with FlashAttention's contract."""
    args = [options.pop(name, None) for name in ("scale", "block_q", "block_k")]
    o = kernel.apply(q, k, v, causal, *args)
    (lse,) = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    grads = torch.autograd.grad(o, (q, k, v), grad_out)
    return (o.detach(), lse.detach(), *grads)


def max_errors(got, want) -> list[float]:
    """Largest |got - want| of each of (o, lse, dq, dk, dv), relative to the largest |want|;
    -inf log-sum-exps must match exactly."""
    out = []
    for g, w in zip(got, want):
        g, w = g.double().cpu(), w.double().cpu()
        if not torch.equal(torch.isinf(g), torch.isinf(w)) or torch.isnan(g).any():
            return [float("inf")]
        finite = torch.isfinite(w)
        out.append(float((g[finite] - w[finite]).abs().max() / w[finite].abs().max().clamp_min(1)))
    return out


def triton_main(device: str) -> int:
    from companion.attention import FlashAttentionTriton, triton_available
    assert triton_available(device), f"Triton cannot run on {device} in this process"
    failures = 0
    for dtype in (torch.float32, torch.bfloat16):
        for i, (qs, ks, causal) in enumerate(CASES):
            (q, k, v), do = inputs(qs, ks, dtype, seed=i, device=device)
            errors = max_errors(run(FlashAttentionTriton, q, k, v, do, causal, block_q=16,
                                    block_k=32), reference(q, k, v, do, causal))
            ok = max(errors) <= TOLERANCE[dtype]
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {dtype} q{qs} k{ks} causal={causal}: "
                  f"{', '.join(f'{e:.2g}' for e in errors)}")
    return failures


if __name__ == "__main__":
    sys.exit(triton_main(sys.argv[2]) if sys.argv[1] == "triton" else 2)
