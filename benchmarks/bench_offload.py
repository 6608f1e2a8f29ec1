"""Offload: the CPU optimizer step on 10M+ parameters, and the offloaded training step.

1. The host step of `companion.offload.CPUOffloadOptimizer` (PyTorch's fused CPU AdamW over fp32
   masters, as `step` runs it) on `--params` parameters in 8 tensors, against DeepSpeed's
   `DeepSpeedCPUAdam` (AdamW mode) on the same tensors when `import deepspeed` works (its C++ op
   compiles with ninja on first use, a few minutes); beside them a bare
   `torch.optim.AdamW(fused=True)` (the kernel ours calls: the gap between it and DeepSpeed is the
   kernels', the gap between it and ours is our wrapper's), each with and without the copy of the
   weights up (into a second set of host tensors here, as ours copies into the "device" weights),
   and torch's foreach and per-tensor AdamW for context. Goal: ours at most 1.0x
   DeepSpeedCPUAdam's time; the verdict comes from `cost.stats.compare`. Both run on the same
   threads: `--threads` sets torch's, which is the OpenMP runtime's that DeepSpeed's op runs its
   loop on (the script prints both).
2. A whole training step of chapter 08's GPT (sizes from `companion.device.sizes`): plain fused
   AdamW on the device, `CPUOffloadOptimizer` with fp32 and with bf16 weights, with the delayed
   parameter update, and `NVMeOffloadOptimizer` (files in a temporary folder, one group per block).
3. The break-even from `companion.cost.offload_break_even` at the host rate just measured: the
   tokens per step from which, on each GPU class of `companion.cost.gpus`, the gradients' copy hides
   inside backward and (with the delayed update) the host step and copy up hide behind the next
   step's compute, and the offload's share of an exact step at 16k and 64k tokens.

Each comparison runs its settings in rounds of one step each, in rotated order
(`cost.stats.interleave`), `--repeats` rounds, and reports medians of wall time (the kernels use
every core, so thread CPU time would miss their work). No assertions.

Recorded on a 2-core AMD EPYC shared with other jobs (AVX2, no AVX512; torch 2.13.0 CPU; DeepSpeed
0.19.8, its op built with -march=native, so at AVX256), 48M parameters: ours / DeepSpeedCPUAdam
0.79x (95% interval 0.76-0.80: faster) at 1 thread, 0.99x (0.91-1.03: not distinguishable from
1.0x) at 2; fused AdamW alone / DeepSpeedCPUAdam 0.77x and 0.99x; ours / fused AdamW alone 1.02x
(0.98-1.04) and 1.00x (0.94-1.11): the gap is the kernels', none is our wrapper's. An AVX512
machine measured ours at 0.98-1.17x DeepSpeed's time. benchmarks/README.md has the tables.

    python benchmarks/bench_offload.py [--params 48000000] [--repeats 15] [--threads N]
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import tempfile

import torch

from companion import cost
from companion.cost.clock import now
from companion.device import describe, pick_device, sizes
from companion.models import GPT, make_tokens
from companion.nvme import NVMeOffloadOptimizer
from companion.offload import CPUOffloadOptimizer


def _host_tensors(n_params: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n_params // 8, generator=g).requires_grad_() for _ in range(8)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


OURS, OURS_UP = "ours: host step (fused AdamW over the masters)", "ours: host step + copy up"
DS, DS_UP = "DeepSpeedCPUAdam (adamw_mode)", "DeepSpeedCPUAdam + the same copy up"
BARE = "torch AdamW, fused (the kernel ours calls)"


def _optimizers(n_params: int) -> dict:
    """name -> step function, each optimizer over its own copy of the same host tensors."""
    weights = [p.detach().requires_grad_() for p in _host_tensors(n_params)]   # the "device"
    ours = CPUOffloadOptimizer(weights, lr=1e-3, weight_decay=0.01)
    grads = [p.grad for p in _host_tensors(n_params)]
    sum((w * g).sum() for w, g in zip(weights, grads)).backward()   # hooks copy them down
    ours.step()                                             # first step: the state is allocated
    every = list(range(len(ours.master_params)))
    # the host step alone, as `step` runs it (the masters' gradients set, stepped, cleared)
    steps = {OURS: lambda: ours._host_step(every), OURS_UP: lambda: ours._update(every)}
    for name, kwargs in [(BARE, {"fused": True}), ("torch AdamW, foreach", {"foreach": True}),
                         ("torch AdamW, per tensor", {"foreach": False})]:
        steps[name] = torch.optim.AdamW(_host_tensors(n_params), lr=1e-3, weight_decay=0.01,
                                        **kwargs).step
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        params = _host_tensors(n_params)
        opt = DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
        device = [p.detach().clone() for p in params]      # where its weights would go up

        def then_up():
            opt.step()
            for d, p in zip(device, params):
                d.copy_(p.detach())                         # "host -> device", as ours does
        steps[DS], steps[DS_UP] = opt.step, then_up
    except Exception as e:                                  # ImportError, or the op's build
        print(f"DeepSpeedCPUAdam skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]} "
              "(pip install deepspeed; its CPU op compiles with ninja and a C++ compiler)")
    return steps


def _openmp_threads() -> int | None:
    """omp_get_max_threads() of the OpenMP runtime loaded in this process (torch's libgomp, to
    which DeepSpeed's cpu_adam op binds its parallel loop), or None where it cannot be read."""
    try:
        return ctypes.CDLL(None).omp_get_max_threads()
    except (AttributeError, OSError):
        return None


def _goal(c: cost.stats.Comparison) -> str:
    if c.verdict == "slower":
        return "goal (at most 1.0x) not met: slower"
    if c.verdict == "faster":
        return "goal (at most 1.0x) met: faster"
    return "goal (at most 1.0x) met within the noise: not distinguishable from 1.0x"


def _host_steps(n_params: int, repeats: int) -> float:
    """Time the host steps, print the table and the verdicts; returns our host step's median."""
    raw = cost.stats.interleave(_optimizers(n_params), rounds=repeats)
    median = {name: statistics.median(t) for name, t in raw.items()}
    print(f"\n| optimizer step on {n_params / 1e6:.0f}M fp32 parameters | median | / ours |\n"
          "|---|---|---|")
    for name, seconds in median.items():
        print(f"| {name} | {seconds * 1e3:.1f} ms | {seconds / median[OURS]:.2f}x |")
    print()
    for a, b, short, goal in [(OURS, DS, ("ours", "DeepSpeedCPUAdam"), True),
                              (OURS_UP, DS_UP, ("ours + copy up", "DeepSpeed + copy up"), True),
                              (BARE, DS, ("fused AdamW alone", "DeepSpeedCPUAdam"), False),
                              (OURS, BARE, ("ours", "fused AdamW alone"), False)]:
        if a in raw and b in raw:
            c = cost.stats.compare(raw[a], raw[b])
            print(c.sentence(*short) + (f"; {_goal(c)}" if goal else ""))
    return median[OURS]


def _training_steps(device: torch.device, folder: str) -> dict:
    s = sizes(device)
    x, y = (t.to(device) for t in make_tokens(s.offload_batch, s.seq_len, vocab=s.vocab))

    def setup(make, dtype=torch.float32):
        model = GPT(s.vocab, s.seq_len, s.offload_width, s.offload_depth, s.gpt_heads, seed=0,
                    dtype=dtype, device=device)
        opt = make(model)

        def step():
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
        return step

    def nvme(model):
        blocks = [model.tok, model.pos, *model.blocks, model.ln, model.head]
        return NVMeOffloadOptimizer([{"params": list(b.parameters())} for b in blocks],
                                    directory=folder, lr=1e-3)

    return {"plain fused AdamW": setup(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3,
                                                                   fused=True)),
            "CPUOffloadOptimizer": setup(lambda m: CPUOffloadOptimizer(m.parameters(), lr=1e-3)),
            "CPUOffloadOptimizer, bf16 weights": setup(
                lambda m: CPUOffloadOptimizer(m.parameters(), lr=1e-3), torch.bfloat16),
            "CPUOffloadOptimizer, delay=1": setup(
                lambda m: CPUOffloadOptimizer(m.parameters(), lr=1e-3, delay=1)),
            "NVMeOffloadOptimizer": setup(nvme)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=48_000_000,
                        help="parameters of the host-step comparison (48M: a step of 50+ ms)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads, for ours and DeepSpeed alike "
                             "(default: torch's choice)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = pick_device()
    info = describe(device)
    print(f"{info['name']} ({device}), torch {info['torch']}, medians of {args.repeats} "
          f"interleaved rounds; threads: torch {torch.get_num_threads()}, OpenMP "
          f"{_openmp_threads()} (DeepSpeed's op loops on OpenMP, in this process: the same)")
    ours = _host_steps(args.params, args.repeats)
    rate = args.params / ours
    print(f"\nhost AdamW rate (ours): {rate / 1e9:.2f} billion parameters per second")
    print("\n| GPU | attained TFLOP/s | PCIe GB/s | copy down hides from (tokens/step) | "
          "delayed update hides from | exact: offload share at 16k / 64k tokens |\n"
          "|---|---|---|---|---|---|")
    for gpu_name in ("T4", "V100", "RTX 4090", "A100 80GB", "H100 SXM", "B200"):
        dtype = "fp16" if gpu_name in ("T4", "V100") else "bf16"
        sp = cost.Speeds.for_gpu(gpu_name, dtype)
        even = cost.offload_break_even(sp.matmul_flops, sp.host_bandwidth, rate)
        per_param = 1 / rate + 2 / sp.host_bandwidth            # host step + copy up, seconds
        shares = [per_param / (per_param + 6 * t / sp.matmul_flops) for t in (16384, 65536)]
        print(f"| {gpu_name} | {sp.matmul_flops / 1e12:.0f} | {sp.host_bandwidth / 1e9:.0f} | "
              f"{even['backward']:,.0f} | {even['delayed']:,.0f} | "
              f"{shares[0]:.0%} / {shares[1]:.0%} |")
    with tempfile.TemporaryDirectory() as folder:
        raw = cost.stats.interleave(_training_steps(device, folder), rounds=args.repeats,
                                    clock=functools.partial(now, device))   # host-device sync
    steps = {name: statistics.median(t) for name, t in raw.items()}
    plain = steps["plain fused AdamW"]
    s = sizes(device)
    print(f"\n| training step, GPT {s.offload_depth} x {s.offload_width} ({device.type}) | median "
          "| / plain |\n|---|---|---|")
    for name, seconds in steps.items():
        print(f"| {name} | {seconds * 1e3:.1f} ms | {seconds / plain:.2f}x |")


if __name__ == "__main__":
    main()
