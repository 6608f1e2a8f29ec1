"""Attention's memory and time: ours (FlashAttentionTorch; on a GPU FlashAttentionTriton) against
written-out attention and SDPA's flash backend, measured in one run.

    python benchmarks/bench_attention.py            # T = 1k, 4k, 16k on this device

Reports, per T: bytes saved for backward and peak memory of each kind, the ratios ours / naive
and ours / SDPA flash (goals: peak within 1.1x of SDPA flash, <= 1/10 of naive at 4k), and the
median time of forward + backward as ours / SDPA flash (on a GPU, goal <= 1.5x for Triton).
"""
from __future__ import annotations

from statistics import median

import torch

from companion.attention.measure import attention_memory, attention_seconds, available


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ours = "flash_triton" if "flash_triton" in available(device) else "flash"
    shape = dict(batch=1, heads=8 if device.type == "cuda" else 4, head_dim=64, dtype=dtype,
                 device=device)
    print(f"{device}, {dtype}, ours = {ours}, {shape['heads']} heads, head_dim 64, causal")
    for T in (1024, 4096, 16384):
        kinds = [ours, "sdpa_flash"] + (["naive"] if T <= 4096 else [])
        mem = {k: attention_memory(k, T, block=256 if k == "flash" else None, **shape)
               for k in kinds}
        line = f"T = {T:>5}: peak ours / SDPA flash {mem[ours]['peak'] / mem['sdpa_flash']['peak']:.2f}x"
        line += f", saved ours / SDPA flash {mem[ours]['saved'] / mem['sdpa_flash']['saved']:.2f}x"
        if "naive" in mem:
            line += (f", peak ours / naive {mem[ours]['peak'] / mem['naive']['peak']:.3f}x, saved "
                     f"ours / naive {mem[ours]['saved'] / mem['naive']['saved']:.5f}x")
        if T <= (16384 if device.type == "cuda" else 4096):
            times = attention_seconds([ours, "sdpa_flash"], T, repeats=5, **shape)
            line += (f", time ours / SDPA flash {median(times[ours]) / median(times['sdpa_flash']):.2f}x"
                     f" ({1e3 * median(times[ours]):.1f} ms against "
                     f"{1e3 * median(times['sdpa_flash']):.1f} ms, medians of 5 interleaved)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
