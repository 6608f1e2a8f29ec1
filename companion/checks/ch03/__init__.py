"""Checks for chapter 03, batch size and gradient accumulation.

Modules, one per exercise, in the notebook's order: `accumulation`, `token_normalized`,
`batch_search`."""
from companion.checks.ch03.accumulation import check_accumulation_step
from companion.checks.ch03.token_normalized import check_token_normalized_step
from companion.checks.ch03.batch_search import check_batch_size_search

__all__ = ["check_accumulation_step", "check_token_normalized_step", "check_batch_size_search"]
