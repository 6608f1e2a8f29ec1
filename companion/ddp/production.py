"""What PyTorch's own `DistributedDataParallel` adds around the course's DDP, measured on real ranks:
its buckets before and after the first step, the bytes and the error of its communication hooks,
and the data each rank reads. Workers for `companion.launch.run`, used by chapter 06's deep dive.

- **Bucket rebuild** (torch 2.13, `torch/nn/parallel/distributed.py`, `_BucketCapacityConfig`):
  unless `find_unused_parameters=True`, DDP starts with every parameter in one bucket; at the end
  of the first backward its Reducer rebuilds the buckets in the order the gradients actually arrived,
  the first rebuilt bucket capped at `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB) when
  `bucket_cap_mb` is left at its default and at the cap otherwise, every other bucket closed once it
  reaches `bucket_cap_mb` (25 MiB by default). `torch_buckets` reads both from
  `DistributedDataParallel._get_ddp_logging_data()`.
- **Communication hooks** (`torch.distributed.algorithms.ddp_comm_hooks`): `bf16_compress_hook`
  and `fp16_compress_hook` cast each bucket to 16 bits, all-reduce it and cast the average back
  (the bf16 one demands NCCL, so `bf16_compress` here is the same hook for gloo);
  PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019) all-reduces two thin factors P (n x r) and
  Q (m x r) of each matrix gradient (n x m) instead of the matrix, keeping the error it made for the
  next step (error feedback). `comm_hooks` counts the bytes each hook hands to `dist.all_reduce` and
  the error of the gradients it leaves against the exact fp32 average.
- **Sharding the data**: `torch.utils.data.DistributedSampler` gives rank r every N-th index of
  one permutation (shuffled from `seed + epoch`, so `set_epoch` must be called each epoch or every
  epoch reads the same order), padded by repeating indices from the start until the length divides
  by N (or cut, `drop_last=True`). `sampler_shards` returns each rank's indices.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from companion.launch import rank_device

__all__ = ["torch_buckets", "comm_hooks", "sampler_shards", "bf16_compress", "HOOKS"]

HOOKS = ("fp32 allreduce_hook", "bf16 compress", "fp16_compress_hook", "PowerSGD rank 1",
         "PowerSGD rank 4")


def bf16_compress(group, bucket):
    """A DDP communication hook: all-reduce the bucket in bfloat16 and write the average back in
    the gradients' dtype. torch's `bf16_compress_hook` does the same but refuses anything other
    than NCCL or XCCL (torch 2.13); gloo sums bfloat16 tensors, so this one runs on CPU ranks."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def write_back(done):
        buffer.copy_(done.value()[0])
        return buffer
    return future.then(write_back)


def _mlp(width: int, depth: int, bias: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, bias=bias), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _sizes(text: str) -> list[int]:
    return [int(s) for s in str(text).split(",") if s.strip()]


def torch_buckets(rank: int, world_size: int, width: int, depth: int, batch: int,
                  bucket_cap_mb: float | None = None, steps: int = 3) -> dict:
    """A worker: torch's DDP around an MLP of `depth` bias-free Linears of width `width`; the
    bucket sizes (bytes) it starts with and those it rebuilt after the first step, and the
    parameter indices of each rebuilt bucket (backward reaches the last layer first)."""
    torch.manual_seed(0)
    device = rank_device()
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model = DistributedDataParallel(_mlp(width, depth, bias=False).to(device), **kwargs)
    x = torch.randn(batch, width, device=device)
    initial = _sizes(model._get_ddp_logging_data().get("bucket_sizes", ""))
    for _ in range(steps):
        model(x).square().mean().backward()
    data = model._get_ddp_logging_data()
    rebuilt = data.get("rebuilt_bucket_sizes", "")
    indices = [[int(i) for i in group.split()]
               for group in str(data.get("rebuilt_per_bucket_param_indices", "")).split(",")
               if group.strip()]
    config = getattr(model, "_bucket_config", None)                  # torch 2.13's name
    first = getattr(config, "first_bucket_bytes_cap", None)
    return {"initial": initial, "rebuilt": _sizes(rebuilt), "indices": indices,
            "cap": int(data["bucket_cap_bytes"]), "first_cap": first}


@contextlib.contextmanager
def _count_all_reduce(counter: list[int]):
    """Count the bytes of every tensor handed to `dist.all_reduce` (the hooks call it through the
    module, so patching the module's attribute sees them)."""
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counter.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)
    dist.all_reduce = counting
    try:
        yield
    finally:
        dist.all_reduce = original


def _register(model: DistributedDataParallel, name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if name == "fp32 allreduce_hook":          # the default's Python twin: divide, all-reduce
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "bf16 compress":
        model.register_comm_hook(None, bf16_compress)
    elif name == "fp16_compress_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name.startswith("PowerSGD rank "):
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=int(name.split()[-1]),
                                            start_powerSGD_iter=2, random_seed=0)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"unknown hook {name!r}; one of {HOOKS}")


def comm_hooks(rank: int, world_size: int, width: int, depth: int, batch: int,
               steps: int = 4, hooks=HOOKS) -> dict:
    """A worker: per hook, torch's DDP on the same MLP (with biases), `steps` steps of SGD on each
    rank's own batch; at the last step, the bytes handed to all-reduce per rank and the relative
    error (||g - exact|| / ||exact||, all parameters) of the gradients DDP leaves against the exact
    fp32 average of the ranks' gradients, and the share of that average's entries below fp16's
    smallest normal number (2^-14, where fp16 keeps fewer bits). PowerSGD
    all-reduces plainly for its first 2 steps (`start_powerSGD_iter=2`), then compresses."""
    if steps < 3:
        raise ValueError(f"steps must be at least 3 (PowerSGD compresses from its third), got {steps}")
    device = rank_device()
    out = {}
    for name in hooks:
        torch.manual_seed(0)
        model = DistributedDataParallel(_mlp(width, depth, bias=True).to(device))
        _register(model, name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1000 + rank)
        sent, error, subnormal = [], float("nan"), float("nan")
        for step in range(steps):
            x = torch.randn(batch, width, generator=gen).to(device)
            last = step == steps - 1
            if last:                         # the exact average first: local gradients, fp32 sum
                with model.no_sync():
                    model(x).square().mean().backward()
                exact = [p.grad.detach().clone() for p in model.parameters()]
                for g in exact:
                    dist.all_reduce(g)
                    g /= world_size
                opt.zero_grad(set_to_none=True)
            counter: list[int] = []
            with _count_all_reduce(counter):
                model(x).square().mean().backward()
            if last:
                sent = counter
                num = sum((p.grad - g).float().square().sum() for p, g in
                          zip(model.parameters(), exact))
                den = sum(g.float().square().sum() for g in exact)
                error = float((num / den).sqrt())
                flat = torch.cat([g.flatten() for g in exact]).abs()
                subnormal = float((flat < torch.finfo(torch.float16).tiny).float().mean())
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = {"bytes": sum(sent), "messages": len(sent), "error": error,
                     "below_fp16_normal": subnormal}
    out["parameters"] = sum(p.numel() for p in _mlp(width, depth, bias=True).parameters())
    return out


def sampler_shards(length: int, world_size: int, *, epoch: int = 0, shuffle: bool = True,
                   drop_last: bool = False, seed: int = 0) -> list[list[int]]:
    """The indices each of `world_size` ranks reads from a dataset of `length` items in `epoch`,
    from torch's own `DistributedSampler` (no process group needed: rank and size are given)."""
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(length), num_replicas=world_size, rank=rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards
