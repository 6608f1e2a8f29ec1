"""Checks for chapter 13, parallelism beyond data. The row-parallel linear's answer runs in real
gloo worker processes: in the notebook its cell starts with `%%worker_module NAME`.

Modules, one per exercise, in the notebook's order: `row_parallel` (the row-parallel linear's
communication, on tensor-parallel groups of gloo ranks), `one_f_one_b` (the 1F1B schedule, on
the pipeline simulator's timeline), `choose_parallel` (t, p, d and ZeRO for a cluster, against
the planner's formulas)."""
from companion.checks.ch13.choose_parallel import check_choose_parallel
from companion.checks.ch13.one_f_one_b import check_one_f_one_b
from companion.checks.ch13.row_parallel import check_row_parallel

__all__ = ["check_row_parallel", "check_one_f_one_b", "check_choose_parallel"]
