"""Checks for chapter 10, attention without the T×T matrix, in the notebook's order: two partial
softmaxes merged, the forward tile loop, one tile's backward, the forward kernel in Triton, and
the tiles FlashAttention-2 would pick.

Modules, one per exercise, in the notebook's order: `merge`, `forward_tiles`, `tile_grads`,
`triton_kernel`, `tile_sizes`."""
from companion.checks.ch10.merge import check_merge
from companion.checks.ch10.forward_tiles import check_forward_tiles
from companion.checks.ch10.tile_grads import check_tile_backward, tile_backward  # noqa: F401
from companion.checks.ch10.triton_kernel import check_triton_forward
from companion.checks.ch10.tile_sizes import check_choose_tiles, smem_tiles  # noqa: F401

# The checks; tile_backward and smem_tiles (two references) stay importable from here too.
__all__ = ["check_merge", "check_forward_tiles", "check_tile_backward", "check_triton_forward",
           "check_choose_tiles"]
