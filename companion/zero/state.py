"""A ZeRO optimizer's shards put back together: the state dict of one unsharded optimizer."""
from __future__ import annotations

import torch

__all__ = ["consolidate"]


def consolidate(optimizer, shards: list[dict]) -> dict:
    """The state dict an unsharded `optimizer_cls` over `optimizer`'s parameters would have, from
    every rank's inner state dict (`shards`, in rank order): each moment's slices concatenated
    and cut back into per-parameter tensors, step counters and options as they are."""
    index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state: dict[int, dict] = {}
    for b, bucket in enumerate(optimizer.buckets):
        keys = shards[0]["state"].get(b, {})
        for key, value in keys.items():
            if torch.is_tensor(value) and value.dim() > 0 and \
                    value.numel() == bucket.layout.shard:       # not a step counter
                full = torch.cat([s["state"][b][key] for s in shards])       # (N·s,)
                pieces = [v.clone() for v in bucket.layout.views(full)]
            else:
                pieces = [value.clone() if torch.is_tensor(value) else value
                          for _ in bucket.params]
            for p, piece in zip(bucket.params, pieces):
                state.setdefault(index[p], {})[key] = piece
    inner = {b.group: g for b, g in zip(optimizer.buckets, shards[0]["param_groups"])}
    groups = [dict({k: v for k, v in inner.get(i, optimizer._options(i)).items()
                    if k != "params"}, params=[index[p] for p in g["params"]])
              for i, g in enumerate(optimizer.param_groups)]
    return {"state": state, "param_groups": groups}
