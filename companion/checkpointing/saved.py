"""What autograd saves for backward: list the saved tensors of a function, and their bytes."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

__all__ = ["SavedTensor", "saved_for_backward", "activation_bytes"]


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One tensor that autograd saved for backward."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int          # this tensor's own bytes: numel * element_size
    is_parameter: bool   # a parameter is stored anyway; only the rest is activation memory
    storage: int         # address of its storage: tensors saved twice, or views, share one
    storage_nbytes: int  # the whole storage's bytes, which stays alive while any view is saved


def saved_for_backward(fn: Callable, *args) -> list[SavedTensor]:
    """Run `fn(*args)` and list every tensor autograd saves for backward, in the order saved.

    A tensor saved twice (``x * x`` saves x twice) is listed twice; its storage exists once.
    A saved view (q, k and v cut from one fused qkv output) keeps its whole storage alive:
    `storage_nbytes` is that storage's size, `nbytes` only the view's.
    Uses `torch.autograd.graph.saved_tensors_hooks`, which sees each tensor as it is packed.
    """
    params: set[int] = set()
    if isinstance(fn, torch.nn.Module):
        params = {p.untyped_storage().data_ptr() for p in fn.parameters()}
    seen: list[SavedTensor] = []

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen.append(SavedTensor(tuple(t.shape), t.dtype, t.numel() * t.element_size(),
                                storage.data_ptr() in params, storage.data_ptr(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return seen


def activation_bytes(fn: Callable, *args) -> int:
    """Bytes of activation memory `fn(*args)` keeps for backward: the storages of the saved
    tensors that are not parameters of `fn` (a module), each storage counted once and whole.

    Whole, because memory is held per storage: a saved view (attention's q, k and v are views of
    one (B, T, 3C) qkv output) keeps all of its storage alive, not just the bytes it shows.

    Example:
        >>> activation_bytes(lambda t: t * t, torch.randn(4, requires_grad=True))   # x, once
        16
    """
    storages: dict[int, int] = {}
    for t in saved_for_backward(fn, *args):
        if not t.is_parameter:
            storages[t.storage] = t.storage_nbytes
    return sum(storages.values())


