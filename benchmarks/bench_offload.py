"""Offload: the CPU optimizer step on 10M+ parameters, and the offloaded training step.

1. The host step of `companion.offload.CPUOffloadOptimizer` (PyTorch's fused CPU AdamW over fp32
   masters) on `--params` parameters in 8 tensors, against DeepSpeed's `DeepSpeedCPUAdam` (AdamW
   mode) on the same tensors when `import deepspeed` works (its C++ op compiles with ninja on first
   use, a few minutes), and against torch's foreach and per-tensor AdamW for context. Goal: ours
   at most 1.0x DeepSpeedCPUAdam's time.
2. A whole training step of chapter 08's GPT (sizes from `companion.device.sizes`): plain fused
   AdamW on the device, `CPUOffloadOptimizer` with fp32 and with bf16 weights, with the delayed
   parameter update, and `NVMeOffloadOptimizer` (files in a temporary folder, one group per block).
3. The break-even from `companion.cost.offload_break_even` at the host rate just measured: the
   tokens per step from which, on each GPU class of `companion.cost.gpus`, the gradients' copy hides
   inside backward and (with the delayed update) the host step and copy up hide behind the next
   step's compute, and the offload's share of an exact step at 16k and 64k tokens.

Each comparison runs its settings in turn, one step each, `--repeats` times, and reports medians
of wall time (the kernels use every core, so thread CPU time would miss their work). No assertions.

    python benchmarks/bench_offload.py [--params 16000000] [--repeats 15] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from companion import cost
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


def _optimizers(n_params: int) -> dict:
    """Each optimizer over its own copy of the same host tensors, gradients set."""
    weights = [p.detach().requires_grad_() for p in _host_tensors(n_params)]   # the "device"
    ours = CPUOffloadOptimizer(weights, lr=1e-3, weight_decay=0.01)
    grads = [p.grad for p in _host_tensors(n_params)]
    sum((w * g).sum() for w, g in zip(weights, grads)).backward()   # hooks copy them down
    ours.step()                                             # first step: the state is allocated
    every = list(range(len(ours.master_params)))
    # the host step alone, as `step` runs it (the masters' gradients set, stepped, cleared)
    setups = {"ours: host step (fused AdamW over the masters)":
              (lambda: ours._host_step(every), ours),
              "ours: host step + copy up": (lambda: ours._update(every), ours)}
    for name, kwargs in [("torch AdamW, foreach", {"foreach": True}),
                         ("torch AdamW, per tensor", {"foreach": False})]:
        opt = torch.optim.AdamW(_host_tensors(n_params), lr=1e-3, weight_decay=0.01, **kwargs)
        setups[name] = (opt.step, opt)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(_host_tensors(n_params), lr=1e-3, weight_decay=0.01,
                               adamw_mode=True)
        setups["DeepSpeedCPUAdam (adamw_mode)"] = (opt.step, opt)
    except Exception as e:                                  # ImportError, or the op's build
        print(f"DeepSpeedCPUAdam skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]} "
              "(pip install deepspeed; its CPU op compiles with ninja and a C++ compiler)")
    return setups


def _interleaved(calls: dict, repeats: int, sync=lambda: None,
                 samples: dict | None = None) -> dict[str, float]:
    times = {name: [] for name in calls} if samples is None else samples
    times.update({name: [] for name in calls})
    for name, call in calls.items():
        call()                                              # warm-up: allocates the state
    for _ in range(repeats):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            call()
            sync()                                          # host-device sync
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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
    parser.add_argument("--params", type=int, default=16_000_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = pick_device()
    info = describe(device)
    print(f"{info['name']} ({device}), torch {info['torch']}, {torch.get_num_threads()} threads, "
          f"medians of {args.repeats} interleaved steps")
    setups = _optimizers(args.params)
    raw: dict[str, list[float]] = {}
    times = _interleaved({name: call for name, (call, _) in setups.items()}, args.repeats,
                         samples=raw)
    ours = times["ours: host step (fused AdamW over the masters)"]
    print(f"\n| optimizer step on {args.params / 1e6:.0f}M fp32 parameters | median | "
          "/ ours |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.1f} ms | {seconds / ours:.2f}x |")
    theirs = times.get("DeepSpeedCPUAdam (adamw_mode)")
    if theirs is not None:
        print(f"\nours / DeepSpeedCPUAdam: {ours / theirs:.2f}x (goal: at most 1.0x); "
              + cost.stats.compare(raw["ours: host step (fused AdamW over the masters)"],
                                   raw["DeepSpeedCPUAdam (adamw_mode)"]).sentence(
                  "ours", "DeepSpeedCPUAdam"))
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
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as folder:
        steps = _interleaved(_training_steps(device, folder), args.repeats, sync)
    plain = steps["plain fused AdamW"]
    s = sizes(device)
    print(f"\n| training step, GPT {s.offload_depth} x {s.offload_width} ({device.type}) | median "
          "| / plain |\n|---|---|---|")
    for name, seconds in steps.items():
        print(f"| {name} | {seconds * 1e3:.1f} ms | {seconds / plain:.2f}x |")


if __name__ == "__main__":
    main()
