"""Loss scaling when the gradients are sharded (ZeRO, FSDP): the ranks must agree to skip a step.

With sharded gradients (chapter 07's `FSDP` keeps each rank's chunk, `ShardedOptimizer` steps
each rank's slice) every rank checks only its own part for inf/NaN. An overflow that lands in
rank 1's shard alone would make rank 1 skip its step while rank 0 takes its own: the shards of one
model would step from different scales and drift apart. `ShardedGradScaler.unscale_` therefore
all-reduces the inf flag (MAX) over the group, so every rank skips, or steps, together, and every
rank's scale follows the same trajectory.

Memory: one more float32 per optimizer. Communication: one all-reduce of 4 bytes per step
(collective: every rank calls `unscale_`, or `step`, together).

Example (inside a rank, gradients sharded by FSDP):
    >>> scaler = ShardedGradScaler("cpu")
    >>> scaler.scale(loss_fn(model(x), y)).backward()
    >>> model.finish_gradient_synchronization()
    >>> scaler.step(opt); scaler.update()               # skipped on every rank, or on none

Simplified vs PyTorch (`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`): the flag
is all-reduced synchronously (PyTorch's asynchronously, waiting before the step); the rest is
`companion.amp.GradScaler`'s.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from companion.amp.scaler import GradScaler

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """`GradScaler` whose inf check is agreed by every rank of `process_group` (default: the
    whole world). Other arguments as `GradScaler`'s."""

    def __init__(self, device: str = "cpu", *, process_group=None, **kwargs):
        super().__init__(device, **kwargs)
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients, then take the largest inf flag of all ranks."""
        super().unscale_(optimizer)
        if not self._enabled:
            return
        state = self._state(optimizer)
        flag = state["found_inf"]
        if flag is None:                  # this rank holds no gradient: it still votes
            flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)     # collective
        state["found_inf"] = flag
