"""Gradient accumulation against one big batch of the same effective size: step time.

An Adam step of the course's MLP and GPT (CPU or GPU sizes from `companion.device.sizes`) on an
effective batch B, once as one batch (k = 1) and once as k micro-batches of B/k through
`companion.accumulation.accumulation_step`. The settings are interleaved so that both see the same
machine load; best of `--steps` each. One run, no assertions. Goal: at most 1.1x.

    python benchmarks/bench_accumulation.py [--steps 10] [--k 4]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from companion.accumulation import accumulation_step
from companion.device import describe, pick_device, sizes
from companion.models import GPT, MLP, make_classification, make_tokens


def _token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())     # (B·T, vocab), (B·T,)


def _cases(s, device):
    mlp = MLP(32, s.width, s.depth, 10, seed=0, device=device)
    x, y = make_classification(16 * s.batch, 32, 10, seed=0)
    yield "MLP", mlp, F.cross_entropy, x.to(device), y.to(device)
    gpt = GPT(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth, s.gpt_heads, seed=0, device=device)
    tokens, targets = make_tokens(s.batch, s.seq_len, vocab=s.vocab, seed=0)
    yield "GPT", gpt, _token_loss, tokens.to(device), targets.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    device = pick_device()
    s = sizes(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    info = describe(device)
    print(f"{info['name']} ({device}), torch {info['torch']}, best of {args.steps} interleaved steps")
    print(f"| model | effective batch | k | one batch | k micro-batches | ratio |")
    print("|---|---|---|---|---|---|")
    for name, model, loss_fn, x, y in _cases(s, device):
        opt = torch.optim.Adam(model.parameters())
        best = {1: math.inf, args.k: math.inf}
        for _ in range(args.steps + 1):                     # the first round is a warm-up
            for k in best:
                sync()
                start = time.perf_counter()
                accumulation_step(model, loss_fn, opt, x, y, accum_steps=k)
                sync()
                if _ > 0:
                    best[k] = min(best[k], time.perf_counter() - start)
        print(f"| {name} | {len(x)} | {args.k} | {best[1] * 1e3:.1f} ms | {best[args.k] * 1e3:.1f} ms | "
              f"{best[args.k] / best[1]:.2f}x |")


if __name__ == "__main__":
    main()
