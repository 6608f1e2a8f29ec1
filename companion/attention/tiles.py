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

`choose_tiles` takes two levers the shipped kernels use: `programs_per_sm` programs share one
SM's shared memory (so that one's loads overlap another's arithmetic), and `min_block_k` keeps
each step's matrix products wide enough for the tensor cores. `SHIPPED` lists what FlashAttention-2
and -3 actually launch at head dimension 128, from their source, to hold the model against.

Simplified vs a real kernel: FlashAttention keeps S and the output accumulator in registers, not
shared memory (FA2's "128 x 32 (48 KB smem)" counts only the Q, K and V tiles), so registers are a
second budget this model folds into the first; the number of warps, the pipelining stages (FA3
double-buffers K and V) and occupancy are not modelled; tensor-core shapes round tiles to
multiples of 16; autotuners and hand-made tables settle the rest by timing.
"""
from __future__ import annotations

from companion.cost.gpus import GPUS

__all__ = ["SRAM_PER_SM", "SHIPPED", "tile_sram_bytes", "forward_hbm_bytes", "fitting_tiles",
           "choose_tiles"]

_ENTRIES = {"V100": "V100", "T4": "T4", "A100": "A100 40GB", "A10": "A10", "RTX 4090": "RTX 4090",
            "L4": "L4", "H100": "H100 SXM", "H200": "H200", "B200": "B200"}   # one per SM design
# name: shared memory per SM usable by programs (bytes), compute capability, source
SRAM_PER_SM: dict[str, dict] = {
    short: {"bytes": GPUS[key].shared_memory_per_sm, "cc": GPUS[key].compute_capability,
            "source": GPUS[key].source("sram")}
    for short, key in _ENTRIES.items()}

_FA2 = ("flash-attention csrc/flash_attn/src/flash_fwd_launch_template.h, run_mha_fwd_hdim128 "
        "(commit 01afd16d, FlashAttention-2)")
_FA3 = ("flash-attention hopper/tile_size.h, tile_size_fwd_sm90 (commit 07602adc, "
        "FlashAttention-3)")
# What the kernels launch for 16-bit inputs at head dimension 128, without dropout. FA2's A10 rows
# are its `is_sm8x` branch (compute capability 8.x but not 8.0): sm86 and sm89 alike, so an L4 or an
# RTX 4090 (the same 100 KiB per SM) gets the same tiles. The newer unified code
# (hopper/tile_size.h, tile_size_fwd_sm8x, commit 07602adc) picks 128 x 128 with 8 warps and Q
# held in registers for sm86/89 at d = 128 instead.
# (kernel, GPU, causal (None: both), (block_q, block_k), what the source's code or comment says,
# source)
SHIPPED: list[tuple[str, str, bool | None, tuple[int, int], str, str]] = [
    ("FA2", "A100", None, (128, 64), "sm80: one tile for causal and not", _FA2),
    ("FA2", "H100", None, (128, 64), "sm90 runs FA2's sm80 path", _FA2),
    ("FA2", "A10", False, (128, 32), "why: see Exercise 5", _FA2),
    ("FA2", "A10", True, (64, 64), "square tiles for causal", _FA2),
    ("FA3", "H100", True, (128, 128), "causal or local: 128 keys", _FA3),
    ("FA3", "H100", False, (128, 176), "128 x 192 hits the smem limit", _FA3),
]


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


def choose_tiles(sram_bytes: int, head_dim: int, dtype_bytes: int, *, programs_per_sm: int = 1,
                 min_block_k: int = 16) -> tuple[int, int] | None:
    """The tiles with the least forward HBM traffic, then the fewest key-tile steps, among those
    whose program fits when `programs_per_sm` programs share the SM and whose block_k is at least
    `min_block_k`; None when none does."""
    for name, value in (("programs_per_sm", programs_per_sm), ("min_block_k", min_block_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    fits = [(bq, bk) for bq, bk in fitting_tiles(sram_bytes // programs_per_sm, head_dim,
                                                 dtype_bytes) if bk >= min_block_k]
    return max(fits) if fits else None
