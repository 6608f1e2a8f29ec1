"""companion.lowbit against bitsandbytes, measured in one run: the ratios chapter 11 prints and
`benchmarks/bench_lowbit.py` reports (the same layer, 4x the Adam parameters, 15 rounds).

Two comparisons, each side given the same weights and inputs:
1. a QLoRA layer's forward + backward: `QLoRALinear` (NF4 base with double quantization, a rank-r
   adapter) against bitsandbytes' `Linear4bit` (NF4, blocks of 64, compressed statistics, its
   bias frozen) with the same adapter added as PEFT adds it. The peak is `companion.memory.track`'s
   of one step; the times are medians of interleaved rounds.
2. `Adam8bit` against bitsandbytes' `Adam8bit`: the bytes of their optimizer states after one
   step, and the time of a step (interleaved).
Each ratio is ours / bitsandbytes', and each time ratio comes with `companion.cost.stats.compare`'s
interval and verdict: on a shared machine a ratio alone can be one slow minute.

What the tracker sees: every storage a torch operator returns. A custom operator's own temporaries
are inside it: bitsandbytes 0.50's CPU `gemm_4bit` dequantizes the whole weight inside, so its
forward shows only its output; its backward's `dequantize_4bit` returns the dense weight, which
the tracker counts, and that is its peak (forward's would be the same weight, with less beside it).

Example:
    >>> v = against_bitsandbytes()          # 15 s on a loaded 2-core CPU
    >>> print(v)                            # one line per ratio
    >>> v.qlora_peak_ratio, v.qlora_time.ratio, v.adam_time.ratio, v.state_bytes_ratio

Simplified vs a benchmark: one layer and one set of sizes, on the CPU backend only; bitsandbytes is
a test-only dependency, so without it the function says so and returns None.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics

import torch

from companion.cost.stats import Comparison, compare, interleave
from companion.lowbit.adam8bit import Adam8bit
from companion.lowbit.qlora import QLoRALinear
from companion.memory import format_bytes, track

__all__ = ["Versus", "against_bitsandbytes"]


@dataclasses.dataclass(frozen=True)
class Versus:
    """Ours against bitsandbytes: bytes as (ours, theirs), seconds as (ours, theirs) medians."""

    bitsandbytes: str                      # its version
    qlora_sizes: tuple[int, int, int]      # width, tokens, rank
    qlora_peak: tuple[int, int]
    qlora_seconds: tuple[float, float]
    qlora_time: Comparison                 # ours / theirs, forward + backward
    adam_params: int
    state_bytes: tuple[int, int]
    adam_seconds: tuple[float, float]
    adam_time: Comparison                  # ours / theirs, one optimizer step

    @property
    def qlora_peak_ratio(self) -> float:
        return self.qlora_peak[0] / self.qlora_peak[1]

    @property
    def state_bytes_ratio(self) -> float:
        return self.state_bytes[0] / self.state_bytes[1]

    def __str__(self) -> str:
        (w, n, r), ms = self.qlora_sizes, lambda s: f"{s * 1e3:.1f} ms"
        return "\n".join([
            f"against bitsandbytes {self.bitsandbytes} (CPU), {torch.get_num_threads()} threads:",
            f"QLoRA layer {w}x{w}, rank {r}, {n} tokens, forward + backward: peak ours "
            f"{format_bytes(self.qlora_peak[0])}, bitsandbytes {format_bytes(self.qlora_peak[1])}"
            f": {self.qlora_peak_ratio:.2f}x",
            f"  time ours {ms(self.qlora_seconds[0])}, bitsandbytes {ms(self.qlora_seconds[1])}: "
            + self.qlora_time.sentence("ours", "bitsandbytes"),
            f"Adam8bit, {self.adam_params:,} parameters: state ours "
            f"{format_bytes(self.state_bytes[0])}, bitsandbytes "
            f"{format_bytes(self.state_bytes[1])}: {self.state_bytes_ratio:.3f}x",
            f"  step ours {ms(self.adam_seconds[0])}, bitsandbytes {ms(self.adam_seconds[1])}: "
            + self.adam_time.sentence("ours", "bitsandbytes")])


def _import_bitsandbytes():
    """bitsandbytes, or None; its CPU backend's warning about an optional downloadable kernel
    (no network needed for what is measured here) is kept quiet while it loads."""
    quiet = logging.getLogger("bitsandbytes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        return None
    finally:
        quiet.setLevel(level)
    return bitsandbytes


def _qlora(bnb, width: int, tokens: int, rank: int, rounds: int, seed: int):
    torch.manual_seed(seed)
    dense = torch.nn.Linear(width, width)
    ours = QLoRALinear.from_linear(dense, rank=rank, double_quant=True)
    with torch.no_grad():
        ours.B.normal_(std=0.02)                 # a trained adapter, not the zero one
    base = bnb.nn.Linear4bit(width, width, quant_type="nf4", compress_statistics=True)
    base.load_state_dict(dense.state_dict())
    base = base.to("cpu")                        # quantizes the weight, as .cuda() does
    base.bias.requires_grad_(False)              # frozen, as ours
    A, B = (torch.nn.Parameter(t.detach().clone()) for t in (ours.A, ours.B))
    x = torch.randn(tokens, width, requires_grad=True)
    steps = {"ours": lambda: ours(x).sum().backward(),
             "theirs": lambda: (base(x) + (x @ A.T @ B.T) * ours.scale).sum().backward()}
    peaks = {}
    for name, step in steps.items():
        step()                                   # warm-up: tables, buffers, thread pools
        x.grad = None
        with track("cpu") as t:
            step()
        peaks[name] = t.peak
    times = interleave(steps, rounds=rounds)
    return peaks, times


def _adam(bnb, params: int, rounds: int, seed: int):
    side = max(int((params // 8) ** 0.5), 1)
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(side, side, generator=g) * 0.02 for _ in range(8)]
    grads = [torch.randn(side, side, generator=g) * 1e-3 for _ in range(8)]
    sets = []
    for cls in (Adam8bit, bnb.optim.Adam8bit):
        ps = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, grad in zip(ps, grads):
            p.grad = grad.clone()
        opt = cls(ps, lr=1e-3)
        opt.step()                                # the states exist after the first step
        sets.append(opt)
    state = [sum(t.numel() * t.element_size() for s in opt.state.values()
                 for t in s.values() if torch.is_tensor(t)) for opt in sets]
    times = interleave({"ours": sets[0].step, "theirs": sets[1].step}, rounds=rounds)
    return 8 * side * side, state, times


def against_bitsandbytes(*, width: int = 2048, tokens: int = 256, rank: int = 16,
                         params: int = 2**20, rounds: int = 9, seed: int = 0) -> Versus | None:
    """Measure the QLoRA layer (`width` x `width`, `rank`, `tokens` rows of input) and Adam8bit
    (`params` parameters in 8 square matrices) against bitsandbytes, `rounds` interleaved rounds
    each; None, with a message, when bitsandbytes is not installed."""
    for name, value, least in (("width", width, 2), ("tokens", tokens, 1), ("rank", rank, 1),
                               ("params", params, 8), ("rounds", rounds, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    bnb = _import_bitsandbytes()
    if bnb is None:
        print("bitsandbytes is not installed (a test-only dependency): "
              "`pip install bitsandbytes` to compare with it")
        return None
    with torch.random.fork_rng():
        peaks, q_times = _qlora(bnb, width, tokens, rank, rounds, seed)
        n, state, a_times = _adam(bnb, params, rounds, seed)
    med = lambda times: (statistics.median(times["ours"]), statistics.median(times["theirs"]))
    return Versus(bnb.__version__, (width, tokens, rank), (peaks["ours"], peaks["theirs"]),
                  med(q_times), compare(q_times["ours"], q_times["theirs"]), n,
                  (state[0], state[1]), med(a_times), compare(a_times["ours"], a_times["theirs"]))
