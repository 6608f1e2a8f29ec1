"""Mutation testing of the exercise checks (issue 54): every exercise's reference solution
rewritten one mistake at a time (`mutate`), in the namespace its notebook gives it
(`exercises`), and its check run on each mutant under fixed seeds (`run`).
`benchmarks/bench_mutants.py` runs them all and prints the report."""
from .exercises import Chapter, Target, chapters
from .mutate import KINDS, Mutant, mutants
from .run import SEEDS, Outcome, Report, equivalent_table, run_target, select

__all__ = ["Chapter", "Target", "chapters", "KINDS", "Mutant", "mutants", "SEEDS", "Outcome",
           "Report", "equivalent_table", "run_target", "select"]
