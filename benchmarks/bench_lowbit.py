"""Fewer bits: companion.lowbit against bitsandbytes on the CPU, as ratios measured in one run.

1. Optimizer state bytes of `Adam8bit` over a model of `--params` parameters (8 weight matrices)
   against bitsandbytes' `Adam8bit`. Goal: ours / theirs <= 1.0.
2. One optimizer step of each, interleaved, `--repeats` rounds. Goal: ours / theirs <= 2x.
3. A QLoRA layer's forward + backward (`QLoRALinear`, NF4 base with double quantization and a
   rank-`--rank` adapter) against bitsandbytes' `Linear4bit` (NF4, the same blocks) with the same
   adapter, on a (`--tokens`, `--width`) input: time, and the peak bytes of the step (tracked).
   Reported, no goal.
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
from companion.memory import format_bytes, track


def _weights(n_params: int, seed: int = 0) -> list[torch.nn.Parameter]:
    side = int((n_params // 8) ** 0.5)
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(side, side, generator=g) * 0.02) for _ in range(8)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if torch.is_tensor(t))


def optimizers(n_params: int, repeats: int, bnb) -> None:
    ours_params, theirs_params = _weights(n_params), _weights(n_params)
    ours = lowbit.Adam8bit(ours_params, lr=1e-3)
    theirs = bnb.optim.Adam8bit(theirs_params, lr=1e-3)
    ours.step()
    theirs.step()                                        # states exist after the first step
    n = sum(p.numel() for p in ours_params)
    ratio = _state_bytes(ours) / _state_bytes(theirs)
    print(f"state bytes, {n:,} parameters: ours {format_bytes(_state_bytes(ours))} "
          f"({_state_bytes(ours) / n:.3f} B/param), bitsandbytes "
          f"{format_bytes(_state_bytes(theirs))}: ratio {ratio:.3f} (goal <= 1.0)")
    times = interleave({"ours": ours.step, "bitsandbytes": theirs.step}, rounds=repeats)
    result = compare(times["ours"], times["bitsandbytes"])
    print(f"optimizer step: ours {statistics.median(times['ours']) * 1e3:.1f} ms, bitsandbytes "
          f"{statistics.median(times['bitsandbytes']) * 1e3:.1f} ms: "
          f"{result.sentence('ours', 'bitsandbytes')} (goal <= 2x)")


def qlora(width: int, tokens: int, rank: int, repeats: int, bnb) -> None:
    torch.manual_seed(0)
    dense = torch.nn.Linear(width, width)
    ours = lowbit.QLoRALinear.from_linear(dense, rank=rank, double_quant=True)
    base = bnb.nn.Linear4bit(width, width, quant_type="nf4", compress_statistics=True)
    base.load_state_dict(dense.state_dict())
    base = base.to("cpu")                                # quantizes the weight, as .cuda() does
    A, B = (torch.nn.Parameter(t.detach().clone()) for t in (ours.A, ours.B))

    def theirs(x):
        return base(x) + (x @ A.T @ B.T) * ours.scale

    x = torch.randn(tokens, width, requires_grad=True)
    steps = {"ours": lambda: ours(x).sum().backward(), "bitsandbytes": lambda: theirs(x).sum()
             .backward()}
    peaks = {}
    for name, step in steps.items():
        step()                                           # warm-up
        with track("cpu") as t:
            step()
        peaks[name] = t.peak
    times = interleave(steps, rounds=repeats)
    result = compare(times["ours"], times["bitsandbytes"])
    print(f"QLoRA layer {width}x{width}, rank {rank}, {tokens} tokens, forward + backward: ours "
          f"{statistics.median(times['ours']) * 1e3:.1f} ms (peak {format_bytes(peaks['ours'])}), "
          f"bitsandbytes Linear4bit + the same adapter "
          f"{statistics.median(times['bitsandbytes']) * 1e3:.1f} ms (peak "
          f"{format_bytes(peaks['bitsandbytes'])}): {result.sentence('ours', 'bitsandbytes')}")
    print(f"  base weight: ours {ours.base.bits_per_value():.3f} bits per value")


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
    import bitsandbytes as bnb
    print(f"torch {torch.__version__}, bitsandbytes {bnb.__version__}, "
          f"{torch.get_num_threads()} threads")
    optimizers(args.params, args.repeats, bnb)
    qlora(args.width, args.tokens, args.rank, args.repeats, bnb)
    bf16_products(args.repeats)


if __name__ == "__main__":
    main()
