"""Checks for chapter 04, gradient checkpointing.

Modules, one per exercise, in the notebook's order: `saved_bytes`, `checkpoint_function`,
`selective_policy`, `checkpoint_plan`."""
from companion.checks.ch04.saved_bytes import check_saved_bytes
from companion.checks.ch04.checkpoint_function import check_checkpoint_function
from companion.checks.ch04.selective_policy import check_selective_policy
from companion.checks.ch04.checkpoint_plan import check_checkpoint_plan

__all__ = ["check_saved_bytes", "check_checkpoint_function", "check_selective_policy",
           "check_checkpoint_plan"]
