"""ZeRO per rank, ours against torch's: model-state bytes and step time.

1. Stage 1 on a model with one large matrix: our ShardedOptimizer (balanced by elements) against
   torch's ZeroRedundancyOptimizer (whole tensors), optimizer-state bytes per rank (tracked).
   Goals: our largest rank at most theirs; our max/min rank ratio <= 1.05.
2. Stage 3 on the course MLP: our FSDP against torch's FSDP2 (`fully_shard` on every Linear and
   the root), 2 gloo ranks, steps interleaved: model-state bytes per rank (distinct storages),
   collective payload per step, median step time. Goals: bytes at most theirs, time <= 1.5x.

Run: python benchmarks/bench_zero.py
"""
import torch

from companion import launch
from companion.device import sizes
from companion.memory import format_bytes
from companion.zero import experiments

STEPS = 20


def balance(vocab: int, width: int) -> None:
    print(f"Stage 1, Embedding({vocab}, {width}) + 2 small Linear, AdamW, optimizer state "
          "per rank:")
    for world in (2, 4):
        results = launch.run(experiments.imbalance_report, world, vocab, width, timeout=600)
        for impl, name in (("ours", "ShardedOptimizer"), ("torch", "ZeroRedundancyOptimizer")):
            per_rank = [r[impl]["optimizer_state"] for r in results]
            print(f"  {world} ranks, {name:>23}: " + ", ".join(map(format_bytes, per_rank)) +
                  f" | max/min {max(per_rank) / min(per_rank):.2f}")


def fsdp(width: int, depth: int, batch: int) -> None:
    results = launch.run(experiments.fsdp_comparison, 2, width, depth, batch, STEPS, timeout=600)
    print(f"\nStage 3, MLP {depth} x {width}, {batch} rows per rank, 2 gloo ranks, median of "
          f"{STEPS} interleaved steps (slowest rank):")
    for impl, name in (("ours", "FSDP (ours)"), ("torch", "FSDP2 fully_shard")):
        r = results[0][impl]
        seconds = max(res[impl]["seconds"] for res in results)
        payload = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(r["payload"].items()))
        print(f"  {name:>17}: params {format_bytes(r['params'])}, grads {format_bytes(r['grads'])}"
              f", optimizer {format_bytes(r['optimizer_state'])} | {1e3 * seconds:.1f} ms | "
              f"{payload}")
    ours, theirs = (sum(results[0][i][k] for k in ("params", "grads", "optimizer_state"))
                    for i in ("ours", "torch"))
    time_ratio = max(r["ours"]["seconds"] for r in results) / \
        max(r["torch"]["seconds"] for r in results)
    n_1d = results[0]["ours"]["payload"].get("all_reduce", 0) // 4    # our replicated 1-D params
    verdict = "met" if ours <= theirs else (
        f"missed by {ours - theirs:,} bytes: our replicated 1-D parameters, "
        f"16 B·(1-1/N)·Ψ1D = {16 * n_1d * (len(results) - 1) // len(results):,}")
    print(f"  model states ours / theirs: {ours / theirs:.4f} (goal <= 1: {verdict}) | step time "
          f"ours / theirs: {time_ratio:.2f}x (goal <= 1.5x: "
          f"{'met' if time_ratio <= 1.5 else 'missed'})")


def main() -> None:
    s = sizes("cpu")                 # gloo ranks on this machine, whatever GPU it has
    print(f"torch {torch.__version__}, gloo, 1 thread per rank")
    balance(s.zero_vocab, 64)
    fsdp(s.zero_width, s.zero_depth, s.zero_batch)


if __name__ == "__main__":
    main()
