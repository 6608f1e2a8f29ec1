"""Distributed data parallel from scratch (`core`: gradient hooks, buckets, overlap with backward,
gradient-as-bucket-view) and the workers that measure it on real ranks (`experiments`).

Example (inside a rank started by `companion.launch.run`):
    >>> model = DDP(make_model(), bucket_cap_mb=1.0)       # doctest: +SKIP
    >>> loss_fn(model(x), y).backward()                      # buckets all-reduce during backward
    >>> model.finish_gradient_synchronization()             # wait for the last ones
    >>> optimizer.step()
"""
from companion.ddp.core import (DDP, BucketTimes, SyncStats, accumulation_step, average_gradients,
                                broadcast_parameters)
from companion.ddp.experiments import (concurrent_all_reduces, profile_buckets, step_memory,
                                      time_training_step)

__all__ = ["DDP", "SyncStats", "BucketTimes", "average_gradients", "broadcast_parameters",
           "accumulation_step", "time_training_step", "profile_buckets", "step_memory",
           "concurrent_all_reduces"]
