"""Checks for chapter 06 (data parallelism). Every answer runs in real gloo worker processes.

The learner's function must be importable by the workers: in the notebook the exercise cell starts
with `%%worker_module NAME`, which writes it to a module. A rank that raises, hangs or returns
garbage becomes a CheckFailed that names the rank.

Modules, one per exercise, in the notebook's order: `ring` (the ring all-reduce),
`bucketed_hooks` (buckets rebuilt from the first step's gradient order, then all-reduced from the
hooks while backward runs), `bucket_cap` (the cap that leaves the least communication exposed)."""
from companion.checks.ch06.ring import check_ring_all_reduce
from companion.checks.ch06.bucketed_hooks import check_bucketed_hooks
from companion.checks.ch06.bucket_cap import check_bucket_cap

__all__ = ["check_ring_all_reduce", "check_bucketed_hooks", "check_bucket_cap"]
