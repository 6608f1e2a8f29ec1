"""Gather a unit's full parameters just in time and free them after: two ways to free.

ZeRO-3 keeps 1/N of every parameter; a unit's full weights must exist while the unit runs in
forward, and again while its backward runs. Between the two they should not exist. Two ways:

1. **Drop every reference.** `register_gather_hooks` sets the weights before forward and drops
   them after; the tensor object goes, and its memory with it. Autograd still holds the weights it
   saved for backward, so `FSDP` also runs forward under saved-tensor hooks that save a "gather me
   again" token instead; backward gathers into a *new* tensor. A teaching device: every step is
   visible in Python.
2. **Keep the tensor objects, free their bytes.** `free_storage(t)` resizes t's storage to 0
   bytes; `gather_into(full, shard, comm)` resizes it back and all-gathers into it. Autograd saves
   the gathered weights as usual: the saved tensors are the same objects, empty between forward
   and backward, whole again once the unit gathers before its backward. This is how torch's FSDP2
   does it: in torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `free_storage` calls
   `tensor.untyped_storage().resize_(0)`, `alloc_storage` resizes back, and
   `FSDPParam.free_unsharded_param` frees every all-gather output that way; the all-gather copies
   into those outputs under `torch.autograd._unsafe_preserve_version_counter`
   (_fsdp_collectives.py), so autograd does not see an in-place change of a saved tensor.
   `shard_by_resize(module, comm)` makes one module such a unit.

Example (inside a rank started by `companion.launch.run`):
    >>> shard, flat = shard_by_resize(layer, Comm())  # layer's own parameters -> one shard
    >>> out = layer(x)                                # doctest: +SKIP
    >>> flat.untyped_storage().nbytes()               # 0: freed, though autograd saved views
    >>> out.sum().backward()                          # gathered again into flat, then freed
    >>> shard.grad                                    # averaged over ranks, 1/N of the elements

Simplified vs PyTorch: one flat unsharded leaf per unit (FSDP2 keeps one `nn.Parameter` per
original parameter, all views of all-gather outputs); the pre-backward hook sits on the unit's
output tensor only (FSDP2 registers it on every forward output); no separate streams.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from companion.zero.comm import Comm
from companion.zero.partition import FlatLayout

__all__ = ["register_gather_hooks", "free_storage", "alloc_storage", "gather_into",
           "shard_by_resize"]


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


def free_storage(tensor: torch.Tensor) -> None:
    """Give `tensor`'s bytes back (its storage shrinks to 0); the tensor and its views stay, and
    must not be read until `alloc_storage` or `gather_into` refills them."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Make `tensor`'s storage large enough for it again (new, uninitialised bytes)."""
    nbytes = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


@torch.no_grad()
def gather_into(full: torch.Tensor, shard: torch.Tensor, comm: Comm) -> None:
    """All-gather every rank's `shard` (s elements) into `full` (N·s, flat), reallocating full's
    bytes first if `free_storage` took them. The version counter is left as it was: autograd's
    saved views of `full` stay valid (they see the same values as before they were freed)."""
    alloc_storage(full)                                      # (N·s,) bytes back
    with torch.autograd._unsafe_preserve_version_counter(full):
        comm.all_gather(full, shard)                         # collective, blocking


def shard_by_resize(module: nn.Module, comm: Comm) -> tuple[nn.Parameter, torch.Tensor]:
    """Shard `module`'s own parameters over the ranks, freeing the gathered ones by resizing.

    The module's parameters become views of one flat leaf `flat` (N·s elements, requires grad)
    whose bytes exist only while the module runs forward and while its backward runs: gathered
    before forward, freed after it (autograd's saved views stay, empty), gathered again when the
    gradient of the module's output arrives, freed when flat's gradient has been reduce-scattered
    into the returned shard. Memory: s elements kept, N·s while the module runs. Traffic: two
    all-gathers and one reduce-scatter per step, as `FSDP`. Returns (shard, flat): the (s,)
    parameter to give the optimizer, and the unsharded (N·s,) tensor whose bytes come and go
    (`flat.untyped_storage().nbytes()` shows when). Rank 0's values are used on every rank.
    """
    names = [n for n, p in module.named_parameters(recurse=False)]
    if not names:
        raise ValueError(f"{type(module).__name__} owns no parameter of its own to shard; call "
                         "shard_by_resize on the modules that do (e.g. each nn.Linear)")
    layout = FlatLayout.of([module._parameters[n] for n in names], comm.world_size)
    flat = layout.flatten([module._parameters[n].detach() for n in names])   # (N·s,) transient
    dist.broadcast(flat, dist.get_global_rank(comm.group, 0) if comm.group else 0,
                   group=comm.group)                       # collective: rank 0's values
    shard = nn.Parameter(layout.chunk(flat, comm.rank).clone())              # (s,) kept
    flat.requires_grad_()                                    # the unsharded leaf
    for n in names:
        del module._parameters[n]
    free_storage(flat)                                       # 0 bytes until forward

    def before(mod: nn.Module, inputs) -> None:
        gather_into(flat, shard.detach(), comm)              # 1. all-gather into flat's bytes
        for n, view in zip(names, layout.views(flat)):
            object.__setattr__(mod, n, view)

    def regather(grad: torch.Tensor) -> torch.Tensor:
        gather_into(flat, shard.detach(), comm)              # 3. before the module's backward
        return grad

    def after(mod: nn.Module, inputs, output) -> None:
        for n in names:
            object.__setattr__(mod, n, None)
        free_storage(flat)                                   # 2. freed; saved views stay, empty
        if not torch.is_grad_enabled():
            return
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"shard_by_resize needs a module that returns one tensor (the hook "
                            f"that gathers its weights again for backward sits on it); "
                            f"{type(mod).__name__} returned a {type(output).__name__}")
        if output.requires_grad:
            output.register_hook(regather)

    def after_backward(leaf: torch.Tensor) -> None:
        out = torch.empty_like(shard)                                       # (s,)
        comm.reduce_scatter(out, leaf.grad.contiguous())     # collective, blocking
        out /= comm.world_size
        shard.grad = out if shard.grad is None else shard.grad.add_(out)
        leaf.grad = None                                     # the (N·s,) gradient goes
        free_storage(flat)                                   # 4. freed again

    flat.register_post_accumulate_grad_hook(after_backward)
    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
    return shard, flat
