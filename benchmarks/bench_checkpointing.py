"""Gradient checkpointing at √n segments against none: activation memory and step time.

For a deep MLP and a GPT-style stack (sizes from `companion.device.sizes`), one forward + backward
with `companion.checkpointing.checkpoint_sequential` at s = 1 (nothing checkpointed) and at the
s near √n that `sqrt_segments` picks, in both designs: the reentrant Function and the
saved-tensor hooks (`use_reentrant=False`). Memory: the most bytes saved for backward at once, and
the step's whole peak, measured by `companion.memory.track` (reentrant design). Time: the three
settings interleaved so that all see the same machine load, median of `--steps` each. One run, no
assertions. Goals: saved activations at most 2/√n of the baseline's, step time at most 1.4x in
both designs.

    python benchmarks/bench_checkpointing.py [--steps 10]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from companion import checkpointing
from companion.device import describe, pick_device, sizes
from companion.memory import format_bytes
from companion.models import GPT, MLP, make_tokens


def _mlp_step(s, device):
    mlp = MLP(s.width, s.width, s.ckpt_depth, 10, seed=0, device=device)
    blocks = [mlp.net[i:i + 2] for i in range(0, 2 * s.ckpt_depth, 2)]
    x = torch.randn(s.ckpt_batch, s.width, device=device)
    y = torch.randint(10, (s.ckpt_batch,), device=device)

    def step(segments, use_reentrant=True):
        out = checkpointing.checkpoint_sequential(blocks, segments, x, use_reentrant=use_reentrant)
        F.cross_entropy(mlp.net[-1](out), y).backward()
    return step, s.ckpt_depth


def _gpt_step(s, device):
    gpt = GPT(s.vocab, s.seq_len, s.gpt_width, s.ckpt_gpt_depth, s.gpt_heads, seed=0, device=device)
    tokens, targets = (t.to(device) for t in make_tokens(s.ckpt_gpt_batch, s.seq_len, vocab=s.vocab))
    positions = torch.arange(s.seq_len, device=device)

    def step(segments, use_reentrant=True):
        hidden = gpt.tok(tokens) + gpt.pos(positions)
        hidden = checkpointing.checkpoint_sequential(list(gpt.blocks), segments, hidden,
                                                     use_reentrant=use_reentrant)
        logits = gpt.head(gpt.ln(hidden))
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return step, s.ckpt_gpt_depth


def _interleaved_medians(step, settings, steps, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {k: [] for k in settings}
    for k in settings:
        step(*k)                                                   # warm-up
    for _ in range(steps):
        for k in settings:
            sync()
            start = time.perf_counter()
            step(*k)
            sync()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = pick_device()
    s = sizes(device)
    info = describe(device)
    print(f"{info['name']} ({device}), torch {info['torch']}, median of {args.steps} interleaved steps")
    print("| model | n | √n segments | saved peak, none | saved peak, √n | ratio | goal 2/√n "
          "| step peak ratio | time ratio, Function | time ratio, hooks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, build in [("deep MLP", _mlp_step), ("GPT stack", _gpt_step)]:
        step, n = build(s, device)
        k = checkpointing.sqrt_segments(n)
        plain, ckpt = checkpointing.profile_segments(step, [1, k], device=device, repeats=1)
        times = _interleaved_medians(step, [(1, True), (k, True), (k, False)], args.steps, device)
        print(f"| {name} | {n} | {k} | {format_bytes(plain.activation_bytes)} | "
              f"{format_bytes(ckpt.activation_bytes)} | "
              f"{ckpt.activation_bytes / plain.activation_bytes:.3f} | {2 / math.sqrt(n):.3f} | "
              f"{ckpt.peak_bytes / plain.peak_bytes:.3f} | {times[k, True] / times[1, True]:.2f}x | "
              f"{times[k, False] / times[1, True]:.2f}x |")


if __name__ == "__main__":
    main()
