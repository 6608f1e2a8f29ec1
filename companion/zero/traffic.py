"""Bytes each rank sends per optimizer step, with gradient accumulation over k micro-batches.

One collective over all Ψ parameters sends (N-1)/N of them per rank on a ring (an all-reduce
twice that). Per optimizer step of k micro-batches:

    DDP (no_sync)  2Ψ          accumulate locally, all-reduce once at the last micro-batch
    ZeRO-1         2Ψ          full gradients kept: accumulate locally, reduce-scatter once in
                               step(), all-gather the updated parameters
    ZeRO-2         (k + 1)Ψ    no full gradient buffer to accumulate into: every micro-batch's
                               backward reduce-scatters into the shard; all-gather after step()
    ZeRO-3         3kΨ         every micro-batch gathers each unit for forward, again for
                               backward, and reduce-scatters its gradient (2kΨ if the units are
                               not resharded after forward)

so accumulation, free for DDP and ZeRO-1, multiplies ZeRO-2's and ZeRO-3's traffic.

What the libraries do about it:
- DeepSpeed (deepspeed/runtime/engine.py, `allreduce_gradients`): "ZeRO stage >= 2 communicates
  during non gradient accumulation boundaries as well": stage 2 reduces each micro-batch's
  gradients as backward produces them (buckets of `reduce_bucket_size` elements, 5e8 by default,
  deepspeed/runtime/zero/config.py) and accumulates the result into its partition; stages 0 and 1
  "communicate only at gradient accumulation boundaries".
- FSDP2: `model.set_requires_gradient_sync(False)` on the micro-batches before the last
  ("gradient accumulation *without communication* ... the equivalence of `no_sync` in FSDP1",
  torch/distributed/fsdp/_fully_shard/_fully_shard.py) skips the reduce-scatter and keeps each
  parameter's *unsharded* gradient across micro-batches (accumulated in `reduce_dtype`): the
  memory of the full gradients, 4Ψ, which stage 3 was meant to shard. The all-gathers still run
  every micro-batch unless `set_reshard_after_backward(False)` keeps the unsharded parameters
  between micro-batches ("trade off higher memory for reduced communication") and
  `reshard_after_forward=False` keeps them from forward to backward.
"""
from __future__ import annotations

__all__ = ["predicted_traffic"]


def _count(name: str, value, *, least: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def predicted_traffic(stage: int, k: int, world_size: int, n_params: int, *,
                      n_replicated: int = 0, n_skipped: int = 0,
                      reshard_after_forward: bool = True, param_bytes: int = 4,
                      reduce_bytes: int = 4) -> float:
    """Bytes one rank sends in one optimizer step of `k` micro-batches, on a ring of N ranks.

    With share = (N-1)/N, Ψ = n_params, P = param_bytes (parameters gathered), R = reduce_bytes
    (gradients reduced):

        stage 0 (DDP, no_sync)  share · 2RΨ
        stage 1                 share · (RΨ + PΨ)
        stage 2                 share · (kRΨ + PΨ)
        stage 3                 share · (k · (PΨs + PΨb + RΨs) + 2RΨ₁)

    where at stage 3 Ψ₁ = n_replicated (1-D parameters kept whole, all-reduced once per step),
    Ψs = Ψ - Ψ₁ (sharded) and Ψb = Ψs - n_skipped the elements gathered again in backward (0 with
    reshard_after_forward=False). n_skipped: sharded elements backward never gathers again, the
    root unit's (kept after forward) and those of a unit whose weights backward does not read
    (the first Linear, whose input needs no gradient). Exact for this package's ShardedOptimizer
    and FSDP when every flat buffer's size is a multiple of N; otherwise each flat buffer adds up
    to N-1 padding elements to its collectives.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    _count("k (micro-batches per step)", k, least=1)
    _count("world_size", world_size, least=1)
    for name, value in (("n_params", n_params), ("n_replicated", n_replicated),
                        ("n_skipped", n_skipped)):
        _count(name, value)
    _count("param_bytes (bytes per gathered element)", param_bytes, least=1)
    _count("reduce_bytes (bytes per reduced element)", reduce_bytes, least=1)
    if stage < 3 and (n_replicated or n_skipped):
        raise ValueError("n_replicated and n_skipped describe stage 3 (FSDP) only; at stages "
                         "0-2 every parameter takes part in every collective")
    sharded = n_params - n_replicated
    if sharded < 0 or n_skipped > sharded:
        raise ValueError(f"n_replicated ({n_replicated}) and n_skipped ({n_skipped}) must be "
                         f"parts of n_params ({n_params}): n_skipped <= n_params - n_replicated")
    share = (world_size - 1) / world_size
    if stage == 0:
        return share * 2 * reduce_bytes * n_params
    if stage == 1:
        return share * (reduce_bytes + param_bytes) * n_params
    if stage == 2:
        return share * (k * reduce_bytes + param_bytes) * n_params
    again = sharded - n_skipped if reshard_after_forward else 0
    per_micro = param_bytes * sharded + param_bytes * again + reduce_bytes * sharded
    return share * (k * per_micro + 2 * reduce_bytes * n_replicated)
