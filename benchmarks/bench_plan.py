"""Does the planner's cost model rank plans as this machine does? The capstone GPT's plans, timed.

    python benchmarks/bench_plan.py                 # ten plans, 7 interleaved rounds
    python benchmarks/bench_plan.py --wide          # and 13 more (QLoRA, the chunked loss...)

Builds chapter 09's GPT at this device's sizes (`companion.device.sizes`: vocab, seq_len,
cap_width, cap_depth, gpt_heads; `cap_batch` sequences a step), times one optimizer step of each
plan of `plan.verify.default_plans` (plain, micro-batches, recompute, optimizer and activation
offload, LoRA, 8-bit Adam, bf16 autocast, three levers at once) in `--rounds` interleaved rounds
without the memory tracker, and sets the medians beside `predict_seconds` under two cost models
on the same timings: `CostModel.for_device(device.type)` (fixed speeds) and
`CostModel.from_profile(cost.calibrate())` (this machine's, measured first: on a CPU the FLOP/s a
GPT block's fp32 step reaches, bf16 autocast's step over fp32's, a LoRA adapter's passes and the
8-bit Adam step, each at the rate calibrate times, not at the matmul peak). For each it prints
the table, Spearman's rank correlation with a bootstrap interval (goal: >= 0.9) and the median
error |predicted / measured - 1|, over every plan and over the fp32 ones. A benchmark, not a test:
nothing asserts on time. The figures of a run are in benchmarks/README.md.
"""
from __future__ import annotations

import argparse

import torch

from companion import cost
from companion.device import describe, pick_device, sizes
from companion.plan import Candidate, CostModel, GPTShape, capstone_model
from companion.plan.verify import RankCheck, default_plans, rank_check


def _more_plans(batch: int, depth: int) -> list[Candidate]:
    """Plans beyond the ten, for --wide: QLoRA, the chunked loss, more micro-batch sizes and
    combinations, bf16 weights, and bf16 with recompute."""
    quarter, eighth = max(1, batch // 4), max(1, batch // 8)
    more = [Candidate(batch, lora_rank=8, nf4_base=True), Candidate(batch, chunked_loss=8),
            Candidate(batch // 2, 2), Candidate(batch, segments=2),
            Candidate(batch, precision="mixed"), Candidate(eighth, batch // eighth, offload=True),
            Candidate(1, batch, segments=depth), Candidate(1, batch, offload=True),
            Candidate(quarter, batch // quarter, segments=depth, offload=True),
            Candidate(batch, lora_rank=8, segments=depth),
            Candidate(quarter, batch // quarter, lora_rank=8),
            Candidate(quarter, batch // quarter, state_bits=8),
            Candidate(batch, segments=depth, precision="autocast")]
    return [c for c in dict.fromkeys(more) if c.segments <= depth]


def _report(name: str, check: RankCheck) -> None:
    print(f"\n### {name}\n")
    print(check.table())
    print(f"\nall plans: {check.summary()}")
    exact = check.subset(lambda c: c.precision == "fp32")
    print(f"fp32 plans only: {exact.summary()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (>= 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (default 1, as the CPU notebooks run)")
    parser.add_argument("--wide", action="store_true", help="time 13 more plans")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = pick_device()
    S = sizes(device)
    model_fn = capstone_model(S)
    shape = GPTShape.of(model_fn)
    plans = default_plans(shape, S.cap_batch)
    if args.wide:
        plans += [c for c in _more_plans(S.cap_batch, S.cap_depth) if c not in plans]
    info = describe(device)
    print(f"{info['name']} ({device}), torch {info['torch']}, {torch.get_num_threads()} "
          f"thread(s); GPT of {shape.depth} blocks x {shape.width}, {shape.n_params:,} "
          f"parameters, {S.cap_batch} x {shape.seq_len} tokens a step; {len(plans)} plans, "
          f"{args.rounds} interleaved rounds")
    profile = cost.calibrate(device, threads=args.threads, process_group=False)
    calibrated = CostModel.from_profile(profile)
    adapters = calibrated.adapter_bandwidth or calibrated.memory_bandwidth
    eight = f"{calibrated.adam8bit_rate / 1e6:.0f} M/s" if calibrated.adam8bit_rate else "-"
    print(f"calibrated in {profile.seconds:.0f} s: fp32 {calibrated.flops / 1e9:.1f} GFLOP/s, "
          f"bf16 / fp32 {calibrated.half_speedup:.3f}, layer {calibrated.layer_seconds * 1e3:.2f}"
          f" ms, copies {calibrated.memory_bandwidth / 1e9:.1f} GB/s, host AdamW "
          f"{calibrated.host_memory_bandwidth / 1e9:.1f} GB/s, LoRA adapters "
          f"{adapters / 1e9:.1f} GB/s, 8-bit Adam {eight} parameters")
    fixed = CostModel.for_device(device.type)
    check = rank_check(model_fn, S.cap_batch, plans, cost=fixed, rounds=args.rounds,
                       device=device, progress=True)
    _report(f"CostModel.for_device({device.type!r})", check)
    _report("CostModel.from_profile(cost.calibrate())", check.with_cost(calibrated))


if __name__ == "__main__":
    main()
