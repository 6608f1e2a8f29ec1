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

`SRAM_PER_SM` lists the shared memory one SM can give its programs, by GPU (NVIDIA CUDA C++
Programming Guide, "Technical Specifications per Compute Capability", maximum shared memory per
SM; the architecture whitepapers give the combined L1/shared size in brackets):

Simplified vs a real kernel: registers are a second limit (the accumulator lives in registers on
NVIDIA GPUs), two programs often share an SM to hide latency, and tensor-core shapes round tiles
to multiples of 16; autotuners (Triton's, FlashAttention's tables) settle the rest by timing.
"""
from __future__ import annotations

__all__ = ["SRAM_PER_SM", "tile_sram_bytes", "forward_hbm_bytes", "fitting_tiles", "choose_tiles"]

KIB = 1024

SRAM_PER_SM: dict[str, dict] = {
    # name: shared memory per SM usable by programs (bytes), compute capability, source
    "V100": {"bytes": 96 * KIB, "cc": "7.0", "source": "CUDA Guide cc 7.0 (128 KB L1+shared)"},
    "T4": {"bytes": 64 * KIB, "cc": "7.5", "source": "CUDA Guide cc 7.5 (96 KB L1+shared)"},
    "A100": {"bytes": 164 * KIB, "cc": "8.0", "source": "CUDA Guide cc 8.0; A100 whitepaper "
             "(192 KB L1+shared)"},
    "A10": {"bytes": 100 * KIB, "cc": "8.6", "source": "CUDA Guide cc 8.6 (128 KB L1+shared)"},
    "RTX 4090": {"bytes": 100 * KIB, "cc": "8.9", "source": "CUDA Guide cc 8.9 (128 KB)"},
    "L4": {"bytes": 100 * KIB, "cc": "8.9", "source": "CUDA Guide cc 8.9 (128 KB L1+shared)"},
    "H100": {"bytes": 228 * KIB, "cc": "9.0", "source": "CUDA Guide cc 9.0; H100 whitepaper "
             "(256 KB L1+shared)"},
    "H200": {"bytes": 228 * KIB, "cc": "9.0", "source": "the H100's SM (GH100), CUDA Guide cc 9.0"},
    "B200": {"bytes": 228 * KIB, "cc": "10.0", "source": "CUDA Guide cc 10.0"},
}


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
