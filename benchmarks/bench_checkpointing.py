"""Gradient checkpointing at √n segments against none: activation memory and step time.

For a deep MLP and a GPT-style stack (sizes from `companion.device.sizes`), one forward + backward
with `companion.checkpointing.checkpoint_sequential` at s = 1 (nothing checkpointed) and at the
s near √n that `sqrt_segments` picks, in both designs: the reentrant Function and the
saved-tensor hooks (`use_reentrant=False`). Memory: the most bytes saved for backward at once, and
the step's whole peak, measured by `companion.memory.track` (reentrant design). Time: the three
settings interleaved (`companion.cost.stats.interleave`) so that all see the same machine load,
`--steps` rounds, each ratio of medians with its 95% bootstrap interval and verdict
(`companion.cost.stats.compare`). Then Korthikanti et al.'s selective recomputation (only the
attention core) on the GPT stack: kept bytes per block against their formula adapted to the
block, and time against none and full recomputation. One run, no assertions. Goals: saved activations at most 2/√n of the baseline's, step time at most 1.4x in
both designs.

    python benchmarks/bench_checkpointing.py [--steps 10]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from companion import checkpointing
from companion.cost.stats import compare, interleave
from companion.device import describe, pick_device, sizes
from companion.memory import format_bytes, track
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


def _timings(step, settings, steps, device):
    """Seconds of each setting's steps, interleaved (`companion.cost.stats.interleave`)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(k):
        sync()                                                     # host-device sync
        step(*k)
        sync()                                                     # host-device sync
    return interleave({k: (lambda k=k: timed(k)) for k in settings}, rounds=steps)


def _verdict(a, b) -> str:
    c = compare(a, b)
    return f"{c.ratio:.2f}x [{c.low:.2f}, {c.high:.2f}] {c.verdict}"


def _korthikanti(s, device, steps) -> str:
    """One table row: the GPT stack with only the attention core recomputed (Korthikanti et al.
    2022) against none and full recomputation; its kept bytes per block against the formula."""
    gpt = GPT(s.vocab, s.seq_len, s.gpt_width, s.ckpt_gpt_depth, s.gpt_heads, seed=0, device=device)
    tokens, targets = (t.to(device) for t in make_tokens(s.ckpt_gpt_batch, s.seq_len, vocab=s.vocab))
    positions = torch.arange(s.seq_len, device=device)
    modes = {"none": lambda b, h: b(h), "core": checkpointing.selective_block,
             "full": lambda b, h: checkpointing.checkpoint(b, h, use_reentrant=False)}

    def step(mode):
        hidden = gpt.tok(tokens) + gpt.pos(positions)
        for block in gpt.blocks:
            hidden = modes[mode](block, hidden)
        F.cross_entropy(gpt.head(gpt.ln(hidden)).flatten(0, 1), targets.flatten()).backward()
    times = _timings(step, [("none",), ("core",), ("full",)], steps, device)
    B, T, C, a = s.ckpt_gpt_batch, s.seq_len, s.gpt_width, s.gpt_heads
    x = torch.randn(B, T, C, device=device, requires_grad=True)
    with track(device) as t:
        out = checkpointing.selective_block(gpt.blocks[0], x)
        kept = t.current - out.untyped_storage().nbytes() + x.nbytes
    formula = checkpointing.block_activation_bytes(B, T, C, a, recompute_core=True)
    return (f"| GPT stack, attention core recomputed | {kept:,} B | {formula:,} B | "
            f"{_verdict(times['core',], times['none',])} | {_verdict(times['core',], times['full',])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = pick_device()
    s = sizes(device)
    info = describe(device)
    print(f"{info['name']} ({device}), torch {info['torch']}, {args.steps} interleaved rounds")
    print("| model | n | √n segments | saved peak, none | saved peak, √n | ratio | goal 2/√n "
          "| step peak ratio | time ratio, Function | time ratio, hooks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, build in [("deep MLP", _mlp_step), ("GPT stack", _gpt_step)]:
        step, n = build(s, device)
        k = checkpointing.sqrt_segments(n)
        plain, ckpt = checkpointing.profile_segments(step, [1, k], device=device, repeats=1)
        times = _timings(step, [(1, True), (k, True), (k, False)], args.steps, device)
        print(f"| {name} | {n} | {k} | {format_bytes(plain.activation_bytes)} | "
              f"{format_bytes(ckpt.activation_bytes)} | "
              f"{ckpt.activation_bytes / plain.activation_bytes:.3f} | {2 / math.sqrt(n):.3f} | "
              f"{ckpt.peak_bytes / plain.peak_bytes:.3f} | {_verdict(times[k, True], times[1, True])} | "
              f"{_verdict(times[k, False], times[1, True])} |")
    print("\n| selective | kept per block, measured | formula | time vs none | time vs full |")
    print("|---|---|---|---|---|")
    print(_korthikanti(s, device, args.steps))


if __name__ == "__main__":
    main()
