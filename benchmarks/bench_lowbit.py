"""Fewer bits: companion.lowbit against bitsandbytes on the CPU, as ratios measured in one run.

Parts 1-3 are `companion.lowbit.versus.against_bitsandbytes` (chapter 11 runs it at small sizes):
1. Optimizer state bytes of `Adam8bit` over a model of `--params` parameters (8 weight matrices)
   against bitsandbytes' `Adam8bit`. Goal: ours / theirs <= 1.0.
2. One optimizer step of each, interleaved, `--repeats` rounds. Goal: ours / theirs <= 2x.
3. A QLoRA layer's forward + backward (`QLoRALinear`, NF4 base with double quantization and a
   rank-`--rank` adapter) against bitsandbytes' `Linear4bit` (NF4, the same blocks, bias frozen)
   with the same adapter, on a (`--tokens`, `--width`) input: the peak bytes of one step
   (`companion.memory.track`) and the time. Goals: peak <= 1.1x, time <= 2x.
4. The course GPT's bf16 training step (chapter 11's pure-bf16 runs) with `fp32_products` against
   PyTorch's own bf16 GEMMs, and the fp32 step beside them. Goal on a CPU without bf16 matrix
   instructions: ours / PyTorch's bf16 <= 0.5; the losses of the two agree to bf16 rounding.

Each time is a median of interleaved rounds; the verdict and its 95% interval come from
`companion.cost.stats.compare`. No assertions: a benchmark, not a test.

    python benchmarks/bench_lowbit.py [--params 4194304] [--repeats 15] [--width 2048]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from companion import lowbit
from companion.cost.stats import compare, interleave
from companion.lowbit.versus import against_bitsandbytes

GOALS = {"QLoRA peak": 1.1, "QLoRA time": 2.0, "Adam8bit state bytes": 1.0, "Adam8bit step": 2.0}


def goals(v) -> None:
    """One line per goal: the measured ratio, met or not (a time's at its median, its interval
    beside it)."""
    measured = {"QLoRA peak": (v.qlora_peak_ratio, None), "QLoRA time": (v.qlora_time.ratio,
                                                                         v.qlora_time),
                "Adam8bit state bytes": (v.state_bytes_ratio, None),
                "Adam8bit step": (v.adam_time.ratio, v.adam_time)}
    for name, (ratio, c) in measured.items():
        interval = f" (95% interval {c.low:.2f}-{c.high:.2f})" if c is not None else ""
        print(f"  {name}: {ratio:.3f}x{interval}, goal <= {GOALS[name]}x: "
              f"{'met' if ratio <= GOALS[name] else 'NOT met'}")


def bf16_products(repeats: int) -> None:
    from companion import models
    from companion.device import sizes
    S = sizes("cpu")
    x, y = models.make_tokens(8, S.seq_len, vocab=S.vocab, seed=0)
    make = lambda dtype: models.GPT(S.vocab, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads,
                                    seed=0).to(dtype)
    nets = {"fp32_products": make(torch.bfloat16), "torch bf16": make(torch.bfloat16),
            "fp32": make(torch.float32)}

    def step(name):
        net = nets[name]
        with lowbit.fp32_products() if name == "fp32_products" else contextlib.nullcontext():
            loss = net.loss(x, y)
            loss.backward()
        net.zero_grad(set_to_none=True)
        return loss.item()

    losses = {name: step(name) for name in nets}
    times = interleave({name: (lambda n=name: step(n)) for name in nets}, rounds=repeats)
    result = compare(times["fp32_products"], times["torch bf16"])
    print(f"course GPT forward + backward, bf16: fp32_products "
          f"{statistics.median(times['fp32_products']) * 1e3:.1f} ms, PyTorch's bf16 GEMMs "
          f"{statistics.median(times['torch bf16']) * 1e3:.1f} ms, fp32 "
          f"{statistics.median(times['fp32']) * 1e3:.1f} ms: "
          f"{result.sentence('fp32_products', 'torch bf16')} (goal <= 0.5 without bf16 units); "
          f"losses {losses['fp32_products']:.4f} and {losses['torch bf16']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4 * 2**20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    print(f"torch {torch.__version__}")
    v = against_bitsandbytes(width=args.width, tokens=args.tokens, rank=args.rank,
                             params=args.params, rounds=args.repeats)
    if v is not None:
        print(v)
        goals(v)
    bf16_products(args.repeats)


if __name__ == "__main__":
    main()
