"""Why tiles, and which: the on-chip memory a FlashAttention program needs, against a GPU's.

A GPU's streaming multiprocessor (SM) has a small, fast on-chip memory (shared memory, carved out
of the same SRAM as the L1 cache) beside its registers; the large HBM is an order of magnitude
slower to reach. FlashAttention keeps one tile of queries, one tile of keys and values, the
tile's scores and the running output in SRAM, and reads each key/value tile from HBM once per
query tile. `tile_sram_bytes` counts what a forward program holds (e bytes per input value, the
scores and accumulators in fp32):

    Q tile  block_q·d·e      K, V tiles  2·block_k·d·e      S or P tile  block_q·block_k·4
    output accumulator  block_q·d·4      running max and sum  2·block_q·4

and `forward_hbm_bytes` the traffic of the forward pass: Q read and O written once, K and V
read once per query tile, so larger query tiles mean fewer passes over K and V.

`SRAM_PER_SM` lists the shared memory one SM can give its programs, by GPU, read from the one
cited table, `companion.cost.gpus` (`GPU.shared_memory_per_sm`, from the NVIDIA CUDA C++
Programming Guide's "Compute Capabilities"; `GPU.sram_per_sm` is the combined L1/shared size).

Simplified vs a real kernel: registers are a second limit (the accumulator lives in registers on
NVIDIA GPUs), two programs often share an SM to hide latency, and tensor-core shapes round tiles
to multiples of 16; autotuners (Triton's, FlashAttention's tables) settle the rest by timing.
"""
from __future__ import annotations

from companion.cost.gpus import GPUS

__all__ = ["SRAM_PER_SM", "tile_sram_bytes", "forward_hbm_bytes", "fitting_tiles", "choose_tiles"]

_ENTRIES = {"V100": "V100", "T4": "T4", "A100": "A100 40GB", "A10": "A10", "RTX 4090": "RTX 4090",
            "L4": "L4", "H100": "H100 SXM", "H200": "H200", "B200": "B200"}   # one per SM design
# name: shared memory per SM usable by programs (bytes), compute capability, source
SRAM_PER_SM: dict[str, dict] = {
    short: {"bytes": GPUS[key].shared_memory_per_sm, "cc": GPUS[key].compute_capability,
            "source": GPUS[key].source("sram")}
    for short, key in _ENTRIES.items()}


def tile_sram_bytes(block_q: int, block_k: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one forward program keeps on chip for tiles of block_q queries and block_k keys."""
    inputs = (block_q + 2 * block_k) * head_dim * dtype_bytes       # Q, K, V tiles
    return inputs + 4 * block_q * block_k + 4 * block_q * head_dim + 8 * block_q


def forward_hbm_bytes(n_queries: int, n_keys: int, head_dim: int, dtype_bytes: int,
                      block_q: int) -> int:
    """HBM bytes the forward pass moves for one head: Q in, O out, K and V once per query tile,
    and the fp32 log-sum-exp."""
    passes = -(-n_queries // block_q)
    return (2 * n_queries + 2 * n_keys * passes) * head_dim * dtype_bytes + 4 * n_queries


def fitting_tiles(sram_bytes: int, head_dim: int, dtype_bytes: int, *,
                  sizes: tuple[int, ...] = (16, 32, 64, 128, 256)) -> list[tuple[int, int]]:
    """Every (block_q, block_k) from `sizes` whose program fits in `sram_bytes`."""
    return [(bq, bk) for bq in sizes for bk in sizes
            if tile_sram_bytes(bq, bk, head_dim, dtype_bytes) <= sram_bytes]


def choose_tiles(sram_bytes: int, head_dim: int, dtype_bytes: int) -> tuple[int, int] | None:
    """The fitting tiles with the least forward HBM traffic, then the fewest key-tile steps;
    None when not even 16 x 16 fits."""
    fits = fitting_tiles(sram_bytes, head_dim, dtype_bytes)
    return max(fits) if fits else None
