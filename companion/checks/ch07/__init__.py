"""Checks for chapter 07 (ZeRO), one module per exercise: `flat_partition`, `prefetch`,
`gather_hooks` (forward and backward), `model_states` (memory per rank) and `choose_zero` (the
plan) run here; `reduce_scatter` runs in real gloo worker processes and stays for workbooks that
still use it (the chapter's exercise on communication is now `check_prefetch`). Shared helpers:
`_common`. Imported in the exercises' order, which is the registry's."""
from companion.checks.ch07.flat_partition import check_flat_partition
from companion.checks.ch07.reduce_scatter import check_ring_reduce_scatter
from companion.checks.ch07.prefetch import check_prefetch
from companion.checks.ch07.gather_hooks import check_gather_hooks
from companion.checks.ch07.model_states import check_per_rank_model_states
from companion.checks.ch07.choose_zero import check_choose_zero

__all__ = ["check_flat_partition", "check_ring_reduce_scatter", "check_prefetch",
           "check_gather_hooks", "check_per_rank_model_states", "check_choose_zero"]
