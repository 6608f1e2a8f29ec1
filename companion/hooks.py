"""Gradient hooks owned by one object at a time, so that re-running a cell cannot stack them.

DDP and ZeRO stage 2 act when a parameter's gradient is complete (`register_post_accumulate_grad_hook`).
Such a hook lives on the parameter, not on the object that registered it: build a second
`ShardedOptimizer` over the same parameters (a notebook cell run twice, a resumed run) and both
sets of hooks fire in every backward, the old one moving each gradient away before the new one
sees it. `OwnedHooks` gives each parameter one owner per kind of object: a newer owner removes the
older one's hooks and marks it `replaced`, and an owner that is garbage-collected takes its hooks
with it (the hooks hold it weakly).

Example:
    >>> self.hooks = OwnedHooks(self, model.parameters(), "_on_grad_ready")
    >>> if self.hooks.replaced: raise RuntimeError("...")     # in the old owner's methods
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["OwnedHooks"]

# parameter -> {kind of owner: the OwnedHooks that holds it}; weak on both sides, so it keeps
# neither a parameter nor an owner alive.
_HELD: WeakIdKeyDictionary = WeakIdKeyDictionary()


class OwnedHooks:
    """Post-accumulate-grad hooks that call `owner.<method>(param)`, one owner per parameter.

    Args:
        owner: the object the hooks call (held weakly: when it is collected, they are removed).
        params: the parameters to hook.
        method: the name of owner's method to call with the parameter; None hooks nothing but
            still takes the parameters over (ZeRO stage 1 re-flattens them without hooks).
        kind: owners of the same kind replace each other (default: the owner's class).
    """

    def __init__(self, owner: object, params: Iterable[torch.Tensor], method: str | None, *,
                 kind: str | None = None):
        self.kind = kind or type(owner).__qualname__
        self.replaced = False
        self._handles: dict[int, object] = {}
        ref = weakref.ref(owner)
        for p in params:
            held = _HELD.setdefault(p, {})
            previous = held.get(self.kind)
            if previous is not None and previous is not self:
                previous._give_up(p)                           # 1. the older owner lets go
            held[self.kind] = self
            if method is not None:                             # 2. our hook, holding us weakly
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(
                    _Call(ref, method))
        weakref.finalize(owner, _remove, list(self._handles.values()))

    def _give_up(self, param: torch.Tensor) -> None:
        handle = self._handles.pop(id(param), None)
        if handle is not None:
            handle.remove()
        self.replaced = True

    def remove(self) -> None:
        """Remove every hook this owner still holds."""
        _remove(list(self._handles.values()))
        self._handles.clear()


class _Call:
    """The hook: call the owner's method if the owner still exists."""

    def __init__(self, owner: weakref.ref, method: str):
        self.owner, self.method = owner, method

    def __call__(self, param: torch.Tensor) -> None:
        owner = self.owner()
        if owner is not None:
            getattr(owner, self.method)(param)


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
