"""Checks for chapter 12, activations under a byte budget, in the notebook's order: a selective
checkpointing policy that meets a byte budget with the least recompute, one chunk of the fused
linear cross-entropy, and keep / recompute / offload when copies hide behind compute.

Modules, one per exercise, in the notebook's order: `budget_policy`, `fused_chunk`,
`remat_choice`."""
from companion.checks.ch12.budget_policy import check_budget_policy
from companion.checks.ch12.fused_chunk import check_fused_chunk
from companion.checks.ch12.remat_choice import check_choose_remat

__all__ = ["check_budget_policy", "check_fused_chunk", "check_choose_remat"]
