"""Checks for chapter 09, the capstone, one module per exercise: `budget` (exercise 1: decide a
plan and train within a memory budget) and `plan_search` (exercise 2: the fastest plan that
fits, asking few peaks)."""
from companion.checks.ch09.budget import check_train_within_budget
from companion.checks.ch09.plan_search import check_fastest_fitting

__all__ = ["check_train_within_budget", "check_fastest_fitting"]
