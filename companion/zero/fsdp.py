"""ZeRO stage 3 (FSDP): shard the parameters too, and gather each layer's only while it runs.

Stages 1 and 2 still keep every weight on every rank (4Ψ in fp32). Stage 3 keeps 1/N of them: each
module's matrix-shaped parameters (2-D and up, nearly all of Ψ) are flattened into one padded
buffer and rank r keeps chunk r as an fp32 *shard*. Around the module's forward:

1. before it runs, all-gather the shards into the full flat tensor (in `compute_dtype` if given)
   and hand the module views of it;
2. right after, drop them: the tensors autograd saves for backward are packed as "gather me
   again" tokens (saved-tensor hooks) instead of references, so the full weights are freed;
3. in backward, unpacking a token all-gathers the weights again; the full gradient that arrives
   is reduce-scattered at once (rank r keeps the average of its chunk) and freed.

1-D parameters (biases, norm weights) stay whole on every rank and are all-reduced like DDP: they
are few. Memory per rank (fp32 Adam): 16Ψ/N plus one module's full weights and gradients at a
time. Traffic: all-gather in forward, again in backward, reduce-scatter: 3Ψ, 1.5x DDP's 2Ψ.

Example (inside a rank started by `companion.launch.run`):
    >>> model = FSDP(GPT(...), compute_dtype=torch.bfloat16)   # doctest: +SKIP
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # fp32 shards + replicated 1-D
    >>> loss_fn(model(x_mine), y_mine).backward()
    >>> model.finish_gradient_synchronization()                # before optimizer.step()
    >>> opt.step(); opt.zero_grad()

Simplified vs PyTorch's FSDP2 (`fully_shard`): one unit per module that owns parameters (FSDP2
groups whatever you wrap); no prefetching of the next unit's gather; at most one reduce-scatter in
flight; frozen parameters stay whole; every rank must use the same parameters in each step.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from companion.zero.comm import Comm
from companion.zero.partition import FlatLayout, check_devices

__all__ = ["FSDP", "register_gather_hooks"]


def register_gather_hooks(module: nn.Module, names: list[str], gather):
    """ZeRO-3's core in two hooks, the naive version of what `FSDP` does for every module.

    Before `module` runs, set each attribute in `names` to `gather(name)` (the full tensor, e.g.
    all-gathered from the ranks' shards); right after, set it to None, so that the full tensor can
    be freed. The parameters must already be gone from `module._parameters`. Returns the two
    hooks' handles (`.remove()` them to stop). Memory: a full weight exists only while its module
    runs (and while autograd holds it for backward; `FSDP` packs those as tokens instead).
    """
    def before(mod: nn.Module, inputs) -> None:
        for name in names:
            object.__setattr__(mod, name, gather(name))      # 1. the full tensor, just in time

    def after(mod: nn.Module, inputs, output) -> None:
        for name in names:
            object.__setattr__(mod, name, None)              # 2. dropped right after

    return module.register_forward_pre_hook(before), module.register_forward_hook(after)


@dataclasses.dataclass(eq=False)
class _Group:
    names: list[str]                  # full names, as in module.named_parameters()
    layout: FlatLayout
    live: Any = None                  # weakref to the full flat tensor while it exists


@dataclasses.dataclass(eq=False)
class _Slot:
    attr: str                         # attribute name on the owning module
    group: int | None                 # sharded: index of its _Group, with offset and shape
    index: int                        # position in group's layout, or in self.replicated


class _Gather(torch.autograd.Function):
    """Forward: all-gather a shard into the full flat tensor. Backward: reduce-scatter its
    gradient (handed to FSDP, which adds it to the shard's .grad)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, fsdp: "FSDP", group: int) -> torch.Tensor:
        ctx.fsdp, ctx.group = fsdp, group
        return fsdp._all_gather(group)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.fsdp._reduce_scatter(ctx.group, grad_full)
        return None, None, None


class FSDP(nn.Module):
    """Fully sharded data parallel: parameters, gradients and optimizer state split over ranks.

    Args:
        module: the model, built the same way on every rank; rank 0's initial values are
            broadcast to all.
            Create the optimizer *after* wrapping, over `FSDP.parameters()`.
        compute_dtype: gather and compute in this dtype (torch.bfloat16, torch.float16); the
            shards and the gradients the optimizer sees stay fp32.
        process_group: the data-parallel group (default: the whole world).
        ring: communicate on companion.collectives' ring, counting every byte sent.
    """

    def __init__(self, module: nn.Module, *, compute_dtype: torch.dtype | None = None,
                 process_group=None, ring: bool = False):
        super().__init__()
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise TypeError(f"compute_dtype must be a floating torch dtype such as "
                            f"torch.bfloat16, got {compute_dtype!r}")
        self.module, self.compute_dtype = module, compute_dtype
        self.comm = Comm(process_group, ring=ring)
        params = dict(module.named_parameters())                 # tied weights: first name once
        check_devices(list(params.values()))
        with torch.no_grad():
            for p in params.values():                            # same start on every rank
                dist.broadcast(p, dist.get_global_rank(process_group, 0) if process_group else 0,
                               group=process_group)              # collective
        self.groups: list[_Group] = []
        self.shards, self.replicated = nn.ParameterList(), nn.ParameterList()
        self.replicated_names: list[str] = []
        self._names = list(params)                               # the order to return them in
        self._slots = self._shard(module, params)
        if not self.groups:
            raise ValueError("the module has no trainable matrix-shaped (2-D or more) parameter "
                             "to shard; use companion.ddp.DDP instead")
        self._pending, self._in_flight, self._outer = False, None, None
        self._guard = register_optimizer_step_pre_hook(
            functools.partial(_check_synchronized, weakref.ref(self)))

    def __del__(self) -> None:
        guard = getattr(self, "_guard", None)             # absent if __init__ raised
        if guard is not None:
            guard.remove()

    def _shard(self, module: nn.Module, params: dict) -> dict:
        """Replace each module's parameters by slots; keep this rank's chunk of the matrices."""
        name_of = {p: n for n, p in params.items()}
        where: dict[nn.Parameter, tuple[int | None, int]] = {}
        slots: dict[nn.Module, list[_Slot]] = {}
        for prefix, owner in module.named_modules(remove_duplicate=False):
            mine = [(a, p) for a, p in owner._parameters.items() if p is not None]
            new = [p for _, p in mine if p not in where and p.requires_grad and p.dim() >= 2]
            if new:                                          # 1. one flat group per module
                layout = FlatLayout.of(new, self.comm.world_size)
                flat = layout.flatten([p.detach() for p in new])        # (N·s,) fp32, transient
                self.shards.append(nn.Parameter(layout.chunk(flat, self.comm.rank).clone()))
                self.groups.append(_Group([name_of[p] for p in new], layout))
                where.update({p: (len(self.groups) - 1, i) for i, p in enumerate(new)})
            for _, p in mine:                                # 2. the rest stays whole
                if p not in where:
                    self.replicated.append(p)
                    self.replicated_names.append(name_of[p])
                    where[p] = (None, len(self.replicated) - 1)
            if mine:
                slots[owner] = [_Slot(a, *where[p]) for a, p in mine]
                for a, _ in mine:
                    del owner._parameters[a]                 # 3. the module holds none now
                owner.register_forward_pre_hook(functools.partial(self._before, slots[owner]))
                owner.register_forward_hook(functools.partial(self._after, slots[owner]))
        return slots

    # ------------------------------------------------------------ forward

    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.compute_dtype)
        self._outer = _outer_hooks()                     # e.g. companion.memory.track's
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _before(self, slots: list[_Slot], owner: nn.Module, inputs) -> None:
        """Pre-forward hook: gather the owner's sharded parameters, hand it every parameter."""
        full: dict[int, torch.Tensor] = {}
        for slot in slots:
            if slot.group is None:
                p = self.replicated[slot.index]
                value = p if self.compute_dtype is None else p.to(self.compute_dtype)
            else:
                if slot.group not in full:                   # all-gather (collective)
                    full[slot.group] = _Gather.apply(self.shards[slot.group], self, slot.group)
                    self.groups[slot.group].live = weakref.ref(full[slot.group])
                value = self.groups[slot.group].layout.views(full[slot.group])[slot.index]
            object.__setattr__(owner, slot.attr, value)      # a plain attribute, not registered

    def _after(self, slots: list[_Slot], owner: nn.Module, inputs, output) -> None:
        """Post-forward hook: drop the full weights (saved tensors hold tokens, not them)."""
        for slot in slots:
            if slot.group is not None:
                object.__setattr__(owner, slot.attr, None)
                self.groups[slot.group].live = None

    def _all_gather(self, group: int) -> torch.Tensor:
        """The group's full flat tensor, (N·s,) in compute dtype: every rank's shard."""
        shard = self.shards[group].detach()
        if self.compute_dtype is not None:
            shard = shard.to(self.compute_dtype)                 # (s,) 2 bytes each in bf16
        full = torch.empty(self.groups[group].layout.padded, dtype=shard.dtype,
                           device=shard.device)
        self.comm.all_gather(full, shard)                        # collective, blocking
        return full

    # ------------------------------------------------------------ saved tensors

    def _pack(self, t: torch.Tensor) -> Any:
        """A saved tensor that is a view of gathered weights becomes a token to gather again."""
        where = t.untyped_storage().data_ptr()
        for g, group in enumerate(self.groups):
            full = group.live() if group.live is not None else None
            if full is not None and where == full.untyped_storage().data_ptr():
                return ("gather", g, t.storage_offset(), t.shape, t.stride())
        if self._outer is not None:                              # someone else's hooks, e.g. track
            return ("outer", self._outer[0](t), self._outer[1])
        return ("tensor", t.detach())

    def _unpack(self, packed: tuple) -> torch.Tensor:
        kind = packed[0]
        if kind == "tensor":
            return packed[1]
        if kind == "outer":
            return packed[2](packed[1])
        _, g, offset, shape, stride = packed
        full = self.groups[g].live() if self.groups[g].live is not None else None
        if full is None:                                         # 3. gather again for backward
            full = self._all_gather(g)
            self.groups[g].live = weakref.ref(full)
        return full.as_strided(shape, stride, offset)

    # ------------------------------------------------------------ gradients

    def _reduce_scatter(self, group: int, grad_full: torch.Tensor) -> None:
        """Average the full gradient of a group over ranks into this rank's chunk (async)."""
        self._finish_in_flight()                 # at most one: bounds full-gradient memory
        grad = grad_full.to(torch.float32).contiguous()          # (N·s,) reduced in fp32
        out = torch.empty_like(self.shards[group])               # (s,)
        work = self.comm.reduce_scatter(out, grad, async_op=True)  # collective, asynchronous
        self._in_flight, self._pending = (group, out, grad, work), True

    def _finish_in_flight(self) -> None:
        if self._in_flight is None:
            return
        group, out, _, work = self._in_flight
        work.wait()                                              # sync point
        out /= self.comm.world_size
        shard = self.shards[group]
        shard.grad = out if shard.grad is None else shard.grad.add_(out)
        self._in_flight = None                                   # frees the full gradient

    def finish_gradient_synchronization(self) -> None:
        """Wait for the last reduce-scatter; all-reduce the replicated parameters' gradients.
        Call after backward, before optimizer.step()."""
        self._finish_in_flight()
        trainable = [p for p in self.replicated if p.requires_grad]
        if trainable:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in trainable])               # (Ψ_1d,) small
            self.comm.all_reduce(flat)                           # collective, blocking
            flat /= self.comm.world_size
            for p, g in zip(trainable, torch.split(flat, [p.numel() for p in trainable])):
                p.grad = g.view_as(p).clone()
        self._pending = False

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, fp32, keyed like the module's named_parameters(). Collective:
        every rank must call it."""
        out: dict[str, torch.Tensor] = {}
        for g, group in enumerate(self.groups):
            full = torch.empty(group.layout.padded, dtype=self.shards[g].dtype,
                               device=self.shards[g].device)
            self.comm.all_gather(full, self.shards[g].detach(), count=False)   # collective
            out.update({n: v.clone() for n, v in zip(group.names, group.layout.views(full))})
        for name, p in zip(self.replicated_names, self.replicated):
            out[name] = p.detach().clone()
        return {name: out[name] for name in self._names}


def _check_synchronized(ref: weakref.ref, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer pre-step hook: refuse to step an FSDP's shards before their gradients are in."""
    fsdp = ref()
    if fsdp is None or not fsdp._pending:
        return
    mine = {id(p) for p in fsdp.parameters()}
    if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError("optimizer.step() before the gradients were synchronized: call "
                           "model.finish_gradient_synchronization() after backward, then step.")


def _outer_hooks():
    """The saved-tensor hooks active outside ours (private torch API; None if absent), so that
    tensors we do not replace still go through them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _cast(tree, dtype: torch.dtype):
    """Floating tensors in nested tuples/lists/dicts cast to dtype (inputs of the root forward)."""
    if torch.is_tensor(tree):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_cast(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    return tree
