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
    nbytes: int
    is_parameter: bool   # a parameter is stored anyway; only the rest is activation memory
    storage: int         # address of its storage: tensors saved twice, or views, share one


def saved_for_backward(fn: Callable, *args) -> list[SavedTensor]:
    """Run `fn(*args)` and list every tensor autograd saves for backward, in the order saved.

    A tensor saved twice (``x * x`` saves x twice) is listed twice; its storage exists once.
    Uses `torch.autograd.graph.saved_tensors_hooks`, which sees each tensor as it is packed.
    """
    params: set[int] = set()
    if isinstance(fn, torch.nn.Module):
        params = {p.untyped_storage().data_ptr() for p in fn.parameters()}
    seen: list[SavedTensor] = []

    def pack(t: torch.Tensor):
        storage = t.untyped_storage().data_ptr()
        seen.append(SavedTensor(tuple(t.shape), t.dtype, t.numel() * t.element_size(),
                                storage in params, storage))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return seen


def activation_bytes(fn: Callable, *args) -> int:
    """Bytes of activation memory `fn(*args)` keeps for backward: saved tensors that are not
    parameters of `fn` (a module), each storage counted once."""
    first: dict[int, int] = {}
    for t in saved_for_backward(fn, *args):
        if not t.is_parameter:
            first.setdefault(t.storage, t.nbytes)
    return sum(first.values())


