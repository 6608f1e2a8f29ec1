"""ZeRO stages 1 and 2: shard the optimizer state (and the gradients) over data-parallel ranks.

Data parallelism keeps weights, gradients and optimizer state whole on every rank: 16Ψ bytes per
rank for fp32 Adam, whatever N is. ZeRO (Rajbhandari et al., 2020) notes that each rank only needs
to *update* 1/N of the parameters:

- Stage 1 (P_os): rank r keeps the optimizer state of its slice only. After backward the
  gradients are reduce-scattered (rank r receives the averaged gradient of its slice), rank r
  steps its slice, and an all-gather sends every updated slice to every rank. Memory per rank:
  4Ψ + 4Ψ + 8Ψ/N (fp32 Adam). Traffic: reduce-scatter + all-gather, one all-reduce's volume: 2Ψ.
- Stage 2 (P_os+g): the same, but each bucket of gradients is reduce-scattered *during backward*
  as soon as it is complete, and a bucket's full buffer is freed once its reduce-scatter is done,
  which `_launch` waits for before starting the next one: a rank keeps 4Ψ/N of gradients plus at
  most one bucket in flight (and one filling). Same traffic.

Example (inside a rank started by `companion.launch.run`, no DDP wrapper needed):
    >>> opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    >>> loss_fn(model(x_mine), y_mine).backward()     # stage 2: buckets reduce-scatter here
    >>> opt.step()                                     # own slice steps, then all-gather
    >>> opt.zero_grad()

Gradient clipping: `clip_grad_norm_(max_norm)` between backward and step clips by the global norm
over every rank's shard (`companion.zero.clip`), as torch.nn.utils.clip_grad_norm_ would on the
unsharded model.

Simplified vs PyTorch/DeepSpeed: the inner optimizer sees one flat tensor per bucket, so it must
work element by element (SGD, Adam, AdamW do; LAMB or Adafactor, which use per-tensor norms, would
not); a parameter that gets no gradient is stepped with zeros; no fp16 loss scaling, no overlap of
the all-gather with the next forward. Stage 2 keeps at most one reduce-scatter in flight, and with
gradient accumulation every micro-batch's backward reduce-scatters (there is no `no_sync`: no
full gradients are kept to accumulate into), (k+1)Ψ per step instead of 2Ψ, as in DeepSpeed's
stage 2 (`companion.zero.traffic`). `state_dict()` is this rank's shard (torch's
ZeroRedundancyOptimizer needs `consolidate_state_dict()` first and returns the whole; ours does
that on request). A newer ShardedOptimizer over the same parameters takes them over (a cell run
twice works); stepping the older one then raises.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from companion.hooks import OwnedHooks
from companion.zero.clip import clip_grad_norm_
from companion.zero.comm import Comm
from companion.zero.partition import FlatLayout, check_devices, split_buckets, unique_params
from companion.zero.state import consolidate

__all__ = ["ShardedOptimizer"]


@dataclasses.dataclass(eq=False)
class _Bucket:
    group: int                        # which of the outer param_groups its parameters belong to
    params: list[nn.Parameter]
    layout: FlatLayout
    flat: torch.Tensor                # (N·s,) the parameters; each param.data is a view of it
    master: torch.Tensor              # flat's chunk r: what the inner optimizer steps
    grads: torch.Tensor | None = None  # (N·s,) full gradients (stage 1: always; 2: in backward)
    ready: set = dataclasses.field(default_factory=set)
    work: Any = None                  # reduce-scatter in flight (stage 2)
    out: torch.Tensor | None = None   # (s,) where it lands


class ShardedOptimizer(torch.optim.Optimizer):
    """Run `optimizer_cls` on this rank's balanced slice of the parameters only (ZeRO stage 1/2).

    Args:
        params: parameters or param-group dicts, as for any torch optimizer. Frozen parameters
            are kept out of the shards; a parameter listed twice (tied weights) counts once.
        optimizer_cls: a torch optimizer class that works element by element (SGD, Adam, AdamW).
        stage: 1 reduce-scatters gradients in `step`; 2 during backward, keeping only the shard.
        bucket_cap_mb: stage 2's bucket size in MiB (stage 1 uses one bucket per param group);
            25 by default, the default of torch DDP's bucket_cap_mb too (DeepSpeed's
            reduce_bucket_size defaults to 5e8 elements instead). A bucket's full gradients live
            until its reduce-scatter is done: keep it well below the model's size, or stage 2
            holds as much gradient as stage 1 until step().
        process_group: the data-parallel group (default: the whole world).
        ring: communicate on companion.collectives' ring, counting every byte sent.
        **defaults: options of `optimizer_cls` (lr, weight_decay, ...).
    """

    def __init__(self, params: Iterable, optimizer_cls: type, *, stage: int = 1,
                 bucket_cap_mb: float = 25.0, process_group=None, ring: bool = False,
                 **defaults):
        if not (isinstance(optimizer_cls, type)
                and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch optimizer class such as "
                            f"torch.optim.AdamW (the class, not an instance), "
                            f"got {optimizer_cls!r}")
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (stage 3 shards the parameters: use FSDP), "
                             f"got {stage!r}")
        super().__init__(unique_params(params), defaults)                     # outer, unsharded groups
        self.stage, self.comm = stage, Comm(process_group, ring=ring)
        self._cap = float("inf") if stage == 1 else bucket_cap_mb * 2**20
        self.buckets, self._slot = [], {}
        trainable = [(i, p) for i, g in enumerate(self.param_groups) for p in g["params"]
                     if p.requires_grad]
        if not trainable:
            raise ValueError("no parameter requires grad: nothing to optimize")
        buckets = self._shard(trainable)                                # 1. flatten
        self.optim = optimizer_cls([dict(self._options(b.group), params=[b.master])  # 2. inner
                                    for b in buckets], **defaults)
        for group in self.param_groups:                 # every option of the inner class
            self._fill(group)                           # (betas, eps, ...), as torch's ZeRO
        self._next, self._synchronized = 0, False
        self._hooks = [OwnedHooks(self, list(self._slot),               # 3. one hook each
                                  "_on_grad_ready" if stage == 2 else None)]

    def _shard(self, trainable: list[tuple[int, nn.Parameter]]) -> list[_Bucket]:
        """Flatten `trainable` (group index, parameter) into new buckets, in backward's order for
        stage 2, and record where each parameter sits."""
        check_devices([p for _, p in trainable] + [p for b in self.buckets for p in b.params])
        FlatLayout.of([p for _, p in trainable], self.comm.world_size)  # more ranks than elements?
        order = trainable if self.stage == 1 else trainable[::-1]
        buckets = [self._bucket(i, ps) for i, ps in split_buckets(order, self._cap)]
        self.buckets += buckets
        self._slot.update({p: (b, i) for b in buckets for i, p in enumerate(b.params)})
        return buckets

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters, as on any torch optimizer: they are sharded and stepped
        like the others (their buckets come after the existing ones, on every rank alike)."""
        if not hasattr(self, "optim"):                  # torch.optim.Optimizer.__init__'s groups
            return super().add_param_group(param_group)
        super().add_param_group(unique_params([param_group])[0])   # checks duplicates, fills defaults
        index = len(self.param_groups) - 1
        trainable = [(index, p) for p in self.param_groups[index]["params"] if p.requires_grad]
        if not trainable:
            return
        self._fill(self.param_groups[index])
        for bucket in self._shard(trainable):
            self.optim.add_param_group(dict(self._options(index), params=[bucket.master]))
        self._hooks.append(OwnedHooks(self, [p for _, p in trainable],
                                      "_on_grad_ready" if self.stage == 2 else None))

    def _fill(self, group: dict) -> None:
        for key, value in self.optim.defaults.items():
            group.setdefault(key, value)

    def _options(self, group: int) -> dict:
        return {k: v for k, v in self.param_groups[group].items() if k != "params"}

    def _bucket(self, group: int, params: list[nn.Parameter]) -> _Bucket:
        """Copy `params` into one padded flat buffer and make each parameter a view of it."""
        layout = FlatLayout(tuple(p.shape for p in params), self.comm.world_size)
        flat = layout.flatten([p.detach() for p in params])    # (N·s,) 4·N·s bytes in fp32
        for p, view in zip(params, layout.views(flat)):
            p.data = view                                       # the old storage is freed
        bucket = _Bucket(group, params, layout, flat, layout.chunk(flat, self.comm.rank))
        if self.stage == 1:                # gradients accumulate straight into one flat buffer
            bucket.grads = torch.zeros_like(flat)
            self._point_grads(bucket)
            bucket.master.grad = layout.chunk(bucket.grads, self.comm.rank)
        return bucket

    @staticmethod
    def _point_grads(bucket: _Bucket) -> None:
        """Stage 1: make every .grad a view of the bucket's flat gradients (copying a gradient
        that autograd or zero_grad(set_to_none) put elsewhere)."""
        for p, view in zip(bucket.params, bucket.layout.views(bucket.grads)):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    # ------------------------------------------------------------ stage 2: backward hooks

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Hook: move param.grad into its bucket and free it; launch every complete bucket."""
        bucket, index = self._slot[param]
        self._wait(bucket)                              # a previous backward's, not yet stepped
        if bucket.grads is None:
            bucket.grads = torch.zeros_like(bucket.flat)                  # (N·s,) transient
        bucket.layout.views(bucket.grads)[index].copy_(param.grad)
        param.grad = None                               # freed; its copy is in the bucket
        bucket.ready.add(param)
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])      # in bucket order, the same on every rank
            self._next += 1
        if self._next == len(self.buckets):             # all launched: the next backward
            self._next = 0                              # starts a new round

    def _launch(self, bucket: _Bucket) -> None:
        """Start the bucket's reduce-scatter once the one in flight has finished."""
        for earlier in self.buckets:                    # at most one in flight: finishing one
            if earlier is not bucket and earlier.work is not None:   # frees its (N·s,) grads
                self._wait(earlier)
        bucket.out = torch.empty_like(bucket.master)                      # (s,)
        bucket.work = self.comm.reduce_scatter(bucket.out, bucket.grads,
                                               async_op=True)   # collective, asynchronous
        bucket.ready.clear()

    def _wait(self, bucket: _Bucket) -> None:
        """Finish the bucket's reduce-scatter; add its average into the shard's gradient."""
        if bucket.work is None:
            return
        bucket.work.wait()                              # sync point: communication done
        bucket.out /= self.comm.world_size
        if bucket.master.grad is None:
            bucket.master.grad = bucket.out
        else:
            bucket.master.grad += bucket.out
        bucket.work = bucket.out = bucket.grads = None  # free the full gradients

    # ------------------------------------------------------------ the step

    def _synchronize_gradients(self) -> None:
        """Leave the averaged gradient of this rank's slice in every bucket's master.grad."""
        if self.stage == 2:
            for bucket in self.buckets:                 # buckets backward left incomplete
                if bucket.work is None and bucket.grads is not None:     # (unused: zeros)
                    self._launch(bucket)
            self._next = 0
            for bucket in self.buckets:
                self._wait(bucket)
            return
        works = []
        for bucket in self.buckets:
            self._point_grads(bucket)
            works.append(self.comm.reduce_scatter(bucket.master.grad, bucket.grads,
                                                  async_op=True))  # collective, in place
        for bucket, work in zip(self.buckets, works):
            work.wait()                                 # sync point
            bucket.master.grad /= self.comm.world_size

    @torch.no_grad()
    def step(self, closure=None):
        """1. average gradients onto the shards, 2. step the shards, 3. all-gather them."""
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure; run "
                             "forward and backward before step()")
        self._check_not_replaced()
        if not self._synchronized:                   # clip_grad_norm_ may have done it
            self._synchronize_gradients()                                 # 1. reduce-scatter
        self._synchronized = False
        for inner, bucket in zip(self.optim.param_groups, self.buckets):
            inner.update(self._options(bucket.group))   # an LR scheduler changes the outer ones
        self.optim.step()                                                 # 2. own slice only
        works = [self.comm.all_gather(b.flat, b.master, async_op=True)    # 3. collective
                 for b in self.buckets]
        for work in works:
            work.wait()                                 # sync point: parameters whole again

    def _check_not_replaced(self) -> None:
        if any(h.replaced for h in self._hooks):
            raise RuntimeError("a newer ShardedOptimizer has taken over these parameters (it "
                               "re-flattened them and moved their gradient hooks): step the new "
                               "optimizer, not this one")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Average the gradients onto the shards now, then clip them to the global norm
        `max_norm` over all ranks' shards; return that norm. Collective. Call after backward,
        right before step() (which then steps the clipped shards)."""
        if not self._synchronized:
            self._synchronize_gradients()                                 # reduce-scatter
            self._synchronized = True
        return clip_grad_norm_([b.master for b in self.buckets], max_norm, norm_type,
                               group=self.comm.group, error_if_nonfinite=error_if_nonfinite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. Stage 1 zeroes its flat buffer in place (the .grad views stay)."""
        self._synchronized = False
        for bucket in self.buckets:
            if self.stage == 1:
                bucket.grads.zero_()
                self._point_grads(bucket)
            elif set_to_none:
                bucket.master.grad = None
            elif bucket.master.grad is not None:
                bucket.master.grad.zero_()

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """This rank's shard only: the inner optimizer's state, where the shard sits, and every
        group's options (lr, betas, ...), which load_state_dict restores."""
        return {"shard": self.optim.state_dict(), "rank": self.comm.rank,
                "world_size": self.comm.world_size, "stage": self.stage,
                "param_groups": [self._options(i) for i in range(len(self.param_groups))]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a shard saved by `state_dict()` on the same rank of the same world size."""
        if (state_dict.get("rank"), state_dict.get("world_size")) != \
                (self.comm.rank, self.comm.world_size):
            raise ValueError(f"this shard was saved by rank {state_dict.get('rank')} of "
                             f"{state_dict.get('world_size')}; load it on that rank of that many, "
                             "or consolidate_state_dict() and load the result into an unsharded "
                             "optimizer")
        groups = state_dict.get("param_groups")
        if groups is not None and len(groups) != len(self.param_groups):
            raise ValueError(f"the saved state has {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}: build it over the same groups")
        self.optim.load_state_dict(state_dict["shard"])
        for i, outer in enumerate(self.param_groups):  # the options, as torch optimizers restore
            saved = groups[i] if groups is not None else next(    # (older files: the inner ones)
                (inner for b, inner in zip(self.buckets, self.optim.param_groups)
                 if b.group == i), {})
            outer.update({k: v for k, v in saved.items() if k != "params"})

    def consolidate_state_dict(self, to: int = 0) -> dict | None:
        """Collect every rank's shard on rank `to` and return the state dict an unsharded
        `optimizer_cls` over the same parameters would have (None on the other ranks)."""
        shards = [None] * self.comm.world_size if self.comm.rank == to else None
        dist.gather_object(self.optim.state_dict(), shards, dst=dist.get_global_rank(
            self.comm.group, to) if self.comm.group else to, group=self.comm.group)  # collective
        if self.comm.rank != to:
            return None
        return consolidate(self, shards)
