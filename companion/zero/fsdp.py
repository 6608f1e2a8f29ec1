"""ZeRO stage 3 (FSDP): shard the parameters too, and gather each layer's only while it runs.

Stages 1 and 2 still keep every weight on every rank (4Ψ in fp32). Stage 3 keeps 1/N of them: each
module's matrix-shaped parameters (2-D and up, nearly all of Ψ) are flattened into one padded
buffer, a *unit*, and rank r keeps chunk r as an fp32 *shard*. Around the module's forward:

1. before it runs, all-gather the shards into the full flat tensor (in `param_dtype` if given)
   and hand the module views of it;
2. right after, drop them: the tensors autograd saves for backward are packed as "gather me
   again" tokens (saved-tensor hooks) instead of references, so the full weights are freed
   (torch's FSDP2 frees the bytes instead, see `companion.zero.gather`);
3. in backward, unpacking a token all-gathers the weights again; the full gradient that arrives
   is reduce-scattered at once (in `reduce_dtype`; rank r keeps the average of its chunk) and
   freed.

1-D parameters (biases, norm weights) stay whole on every rank and are all-reduced like DDP: they
are few. Memory per rank (fp32 Adam): 16Ψ/N plus one module's full weights and gradients at a
time, (1 + prefetch) modules' with `prefetch`, all of them with `reshard_after_forward=False`.
Traffic per micro-batch: all-gather in forward, again in backward, reduce-scatter: 3Ψ, 1.5x
DDP's 2Ψ; 2Ψ with `reshard_after_forward=False`. With k micro-batches per step every one of them
pays it, 3kΨ (`companion.zero.traffic`).

Example (inside a rank started by `companion.launch.run`):
    >>> model = FSDP(GPT(...), param_dtype=torch.bfloat16, prefetch=1)   # doctest: +SKIP
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # fp32 shards + replicated 1-D
    >>> loss_fn(model(x_mine), y_mine).backward()
    >>> model.finish_gradient_synchronization()                # before optimizer.step()
    >>> model.clip_grad_norm_(1.0)                             # optional: the global norm
    >>> opt.step(); opt.zero_grad()

Simplified vs PyTorch's FSDP2 (`fully_shard`): one unit per module that owns parameters (FSDP2
groups whatever you wrap); prefetching follows the previous forward's order, not a recorded
schedule per module; at most one reduce-scatter in flight; frozen parameters stay whole; every
rank must use the same parameters in each step. A module can be wrapped once (its parameters
become shards): wrapping it again raises and says to build the model again.
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

from companion.zero.clip import clip_grad_norm_
from companion.zero.comm import Comm
from companion.zero.partition import FlatLayout, check_devices
from companion.zero.prefetch import ahead

__all__ = ["FSDP"]


@dataclasses.dataclass(eq=False)
class _Group:
    names: list[str]                  # full names, as in module.named_parameters()
    layout: FlatLayout
    root: bool = False                # owned by the wrapped module itself: kept after forward
    live: Any = None                  # weakref to the full flat tensor while it exists
    kept: Any = None                  # the full flat tensor, from forward until its backward


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
        return fsdp._take(group, fsdp._forward_order, fsdp._taken)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.fsdp._reduce_scatter(ctx.group, grad_full)
        return None, None, None


def _floating(name: str, dtype) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{name} must be a floating torch dtype such as torch.bfloat16, "
                        f"got {dtype!r}")


# Modules an FSDP has sharded (weakly held): wrapping one again would find no parameters.
_WRAPPED: weakref.WeakSet = weakref.WeakSet()


class FSDP(nn.Module):
    """Fully sharded data parallel: parameters, gradients and optimizer state split over ranks.

    Args:
        module: the model, built the same way on every rank; rank 0's initial values are
            broadcast to all.
            Create the optimizer *after* wrapping, over `FSDP.parameters()`.
        param_dtype: gather and compute in this dtype (torch.bfloat16, torch.float16): the
            gathers move 2 bytes per element instead of 4; the shards and the gradients the
            optimizer sees stay fp32 (as FSDP2's MixedPrecisionPolicy(param_dtype=...)).
        reduce_dtype: reduce-scatter (and all-reduce) gradients in this dtype (default: the
            shards' own, fp32). FSDP2's default is param_dtype instead.
        reshard_after_forward: free each unit's gathered parameters after its forward (True) or
            keep them until its backward (False: no gather in backward, 2Ψ instead of 3Ψ per
            micro-batch, at the memory of all the full parameters). The root unit (the wrapped
            module's own parameters) is never resharded after forward: backward starts right
            after it. FSDP2 does so under its default None; in torch 2.13 an explicit True
            reshards its root too (pytorch PRs #154704, #155319).
        prefetch: gather the next `prefetch` units asynchronously while one computes, in
            forward and in backward (`companion.zero.prefetch`); memory: 1 + prefetch units.
            The order is the previous forward's; the first forward guesses the order the
            modules were registered in (a wrong guess wastes a gather, never a result).
        compute_dtype: the older name of param_dtype.
        process_group: the data-parallel group (default: the whole world).
        ring: communicate on companion.collectives' ring, counting every byte sent.
    """

    def __init__(self, module: nn.Module, *, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                 prefetch: int = 0, compute_dtype: torch.dtype | None = None,
                 process_group=None, ring: bool = False):
        super().__init__()
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                            ("compute_dtype", compute_dtype)):
            _floating(name, dtype)
        if None not in (param_dtype, compute_dtype) and param_dtype != compute_dtype:
            raise ValueError(f"compute_dtype is the older name of param_dtype: give one "
                             f"(got {param_dtype} and {compute_dtype})")
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be True or False, "
                            f"got {reshard_after_forward!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch is how many units to gather ahead, an int >= 0 "
                             f"(0: none), got {prefetch!r}")
        self.module, self.param_dtype = module, param_dtype or compute_dtype
        self.compute_dtype, self.reduce_dtype = self.param_dtype, reduce_dtype
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        if module in _WRAPPED:
            raise ValueError("this module is already wrapped by an FSDP, which replaced its "
                             "parameters by shards: keep using that wrapper, or build the model "
                             "again (in the same cell) before wrapping it")
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
        self._ahead: dict[int, tuple] = {}                      # prefetched: group -> (full, work)
        self._forward_order = list(range(len(self.groups)))      # guess: registration order
        self._backward_order: list[int] = []
        self._taken: list[int] = []
        self._packed: list[int] = []
        self._guard = register_optimizer_step_pre_hook(
            functools.partial(_check_synchronized, weakref.ref(self)))
        _WRAPPED.add(module)

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
                self.groups.append(_Group([name_of[p] for p in new], layout, owner is module))
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
        if self.param_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.param_dtype)
        self._outer = _outer_hooks()                     # e.g. companion.memory.track's
        self._taken, self._packed = [], []               # this forward's order of units
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        self._forward_order, self._backward_order = self._taken, self._packed[::-1]
        self._drain()                                    # prefetched, but not run this time
        return out

    def _before(self, slots: list[_Slot], owner: nn.Module, inputs) -> None:
        """Pre-forward hook: gather the owner's sharded parameters, hand it every parameter."""
        full: dict[int, torch.Tensor] = {}
        for slot in slots:
            if slot.group is None:
                p = self.replicated[slot.index]
                value = p if self.param_dtype is None else p.to(self.param_dtype)
            else:
                if slot.group not in full:                   # all-gather (collective)
                    full[slot.group] = _Gather.apply(self.shards[slot.group], self, slot.group)
                    self.groups[slot.group].live = weakref.ref(full[slot.group])
                value = self.groups[slot.group].layout.views(full[slot.group])[slot.index]
            object.__setattr__(owner, slot.attr, value)      # a plain attribute, not registered

    def _after(self, slots: list[_Slot], owner: nn.Module, inputs, output) -> None:
        """Post-forward hook: drop the full weights (saved tensors hold tokens, not them), or
        keep them for backward (the root unit; every unit if not reshard_after_forward)."""
        for slot in slots:
            if slot.group is not None:
                group = self.groups[slot.group]
                if torch.is_grad_enabled() and (group.root or not self.reshard_after_forward):
                    group.kept = group.live()                # whole until its backward
                else:
                    group.live = None
                object.__setattr__(owner, slot.attr, None)

    def _take(self, group: int, order: list[int], seen: list[int]) -> torch.Tensor:
        """The group's full flat tensor: its prefetched gather (waited) or one now. Then start
        the gathers of the `prefetch` groups that follow it in `order` (asynchronously)."""
        if group not in seen:
            seen.append(group)
        if group in self._ahead:
            full, work = self._ahead.pop(group)
            work.wait()                                          # sync point: prefetched
        else:
            full = self._all_gather(group)                       # collective, blocking
        for later in ahead(order, group, self.prefetch):
            if later not in self._ahead and self._live(later) is None:
                self._ahead[later] = self._all_gather(later, async_op=True)   # collective
        return full

    def _live(self, group: int) -> torch.Tensor | None:
        ref = self.groups[group].live
        return ref() if ref is not None else None

    def _all_gather(self, group: int, *, async_op: bool = False):
        """The group's full flat tensor, (N·s,) in param dtype: every rank's shard; with
        async_op, (that tensor, the work to wait for before reading it)."""
        shard = self.shards[group].detach()
        if self.param_dtype is not None:
            shard = shard.to(self.param_dtype)                   # (s,) 2 bytes each in bf16
        full = torch.empty(self.groups[group].layout.padded, dtype=shard.dtype,
                           device=shard.device)
        work = self.comm.all_gather(full, shard, async_op=async_op)      # collective
        return (full, work) if async_op else full

    def _drain(self) -> None:
        """Finish and drop prefetched gathers nobody took (the order changed)."""
        for _, work in self._ahead.values():
            work.wait()                                          # sync point
        self._ahead.clear()

    # ------------------------------------------------------------ saved tensors

    def _pack(self, t: torch.Tensor) -> Any:
        """A saved tensor that is a view of gathered weights becomes a token to gather again."""
        where = t.untyped_storage().data_ptr()
        for g, group in enumerate(self.groups):
            full = group.live() if group.live is not None else None
            if full is not None and where == full.untyped_storage().data_ptr():
                if g not in self._packed:
                    self._packed.append(g)                       # backward needs it, in reverse
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
        full = self._live(g)
        if full is None:                                         # 3. gather again for backward
            full = self._take(g, self._backward_order, [])
            self.groups[g].live = weakref.ref(full)
        return full.as_strided(shape, stride, offset)

    # ------------------------------------------------------------ gradients

    def _reduce_scatter(self, group: int, grad_full: torch.Tensor) -> None:
        """Average the full gradient of a group over ranks into this rank's chunk (async)."""
        self.groups[group].kept = None           # backward is done with the full weights
        self._finish_in_flight()                 # at most one: bounds full-gradient memory
        dtype = self.reduce_dtype or self.shards[group].dtype
        grad = grad_full.to(dtype).contiguous()                  # (N·s,) reduced in reduce dtype
        out = torch.empty(self.shards[group].shape, dtype=dtype, device=grad.device)   # (s,)
        work = self.comm.reduce_scatter(out, grad, async_op=True)  # collective, asynchronous
        self._in_flight, self._pending = (group, out, grad, work), True

    def _finish_in_flight(self) -> None:
        if self._in_flight is None:
            return
        group, out, _, work = self._in_flight
        work.wait()                                              # sync point
        out /= self.comm.world_size
        shard = self.shards[group]
        out = out.to(shard.dtype)                                # (s,) no copy if the same
        shard.grad = out if shard.grad is None else shard.grad.add_(out)
        self._in_flight = None                                   # frees the full gradient

    def finish_gradient_synchronization(self) -> None:
        """Wait for the last reduce-scatter; all-reduce the replicated parameters' gradients.
        Call after backward, before optimizer.step()."""
        self._drain()
        self._finish_in_flight()
        trainable = [p for p in self.replicated if p.requires_grad]
        if trainable:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in trainable])               # (Ψ_1d,) small
            flat = flat.to(self.reduce_dtype or flat.dtype)
            self.comm.all_reduce(flat)                           # collective, blocking
            flat /= self.comm.world_size
            for p, g in zip(trainable, torch.split(flat, [p.numel() for p in trainable])):
                p.grad = g.view_as(p).to(p.dtype, copy=True)
        self._pending = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the whole model's gradient to the global norm `max_norm` (shards and replicated
        parameters), as torch.nn.utils.clip_grad_norm_ on the unsharded model; return the norm.
        Collective. Call after finish_gradient_synchronization(), before optimizer.step()."""
        if self._pending:
            raise RuntimeError("clip_grad_norm_() before the gradients were synchronized: call "
                               "model.finish_gradient_synchronization() first, then clip.")
        return clip_grad_norm_(list(self.shards), max_norm, norm_type,
                               replicated=[p for p in self.replicated if p.requires_grad],
                               group=self.comm.group, error_if_nonfinite=error_if_nonfinite)

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
