"""Calls whose name depends on the torch version, in one place (the package supports 2.4 and later;
GPU machines often have an older torch than the pinned 2.13).

The list comes from looking up, by name, every torch, dist, F and nn attribute the repository
uses in torch 2.11.0's own Python sources and stubs: only these two collectives are missing there
(torch 2.13's names; it deprecates the older ones). A name check: a keyword argument added since
2.11 would not show, and the first GPU session's smoke run is the test of that. `tests/test_compat.py` hides them to run the fallbacks and
fails any call to them outside this module.

Each is looked up at call time, so that a patched `torch.distributed` (a byte counter, a test that
hides the newer name) sees it.

Example:
    >>> reduce_scatter_tensor(shard, full, group=group)   # reduce_scatter_single on torch 2.13
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["reduce_scatter_tensor", "all_gather_tensor"]


def reduce_scatter_tensor(output, input, **kwargs):
    """`dist.reduce_scatter_single` (torch 2.13's name), else `dist.reduce_scatter_tensor`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, **kwargs)                              # collective


def all_gather_tensor(output, input, **kwargs):
    """`dist.all_gather_single` (torch 2.13's name), else `dist.all_gather_into_tensor`."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, **kwargs)                               # collective
