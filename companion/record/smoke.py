"""A quick check that every device code path of the companion runs: `record --smoke`.

On a GPU machine, before a long recording (or after installing a new PyTorch), it runs in well
under a minute: the tracker against the caching allocator, `memory_budget` through the allocator's
cap, checkpointing's RNG replay, accumulation and the batch-size search, the GradScaler against
torch's, our DDP and ring all-reduce on real ranks (NCCL, one rank per GPU) and gloo with CUDA
tensors, then every chapter's recorded experiment at tiny sizes (`smoke_sizes`), its output checked
against the results schema. Nothing is written. On a CPU the same code runs on the CPU paths.

Example:
    >>> rows = smoke("cuda")                  # [(name, passed, seconds, note), ...]
    >>> all(passed for _, passed, _, _ in rows)
"""
from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from companion import amp, collectives, launch
from companion.accumulation import find_max_batch_size, gradient_gap
from companion.checkpointing import checkpoint
from companion.ddp import DDP
from companion.device import sizes
from companion.memory import format_bytes, memory_budget, track
from companion.models import GPT, MLP, make_classification
from companion.record.common import SizesRead
from companion.record.parallel import ranks

__all__ = ["SMOKE_SIZES", "smoke_sizes", "smoke", "check_names"]

SMOKE_SIZES = dataclasses.replace(
    sizes("cpu"), batch=8, width=32, depth=2, seq_len=16, n_examples=64, epochs=2, steps=1,
    gpt_width=32, gpt_depth=1, gpt_heads=2, vocab=64, ckpt_depth=4, ckpt_batch=16,
    ckpt_gpt_depth=2, ckpt_gpt_batch=2, ddp_width=32, ddp_depth=4, ddp_batch=4, zero_width=32,
    zero_depth=2, zero_batch=4, zero_vocab=256, offload_width=32, offload_depth=1,
    offload_batch=1, act_offload_batch=2, amp_gpt_batch=2, amp_width=32, amp_depth=2,
    amp_batch=32, amp_accum=4, amp_steps=8, amp_matmul=64, anatomy_gpt_batch=2, attn_heads=2,
    attn_head_dim=16, attn_max_len=512, attn_naive_max_len=256, attn_gpt_len=64,
    attn_gpt_batch=2)


def smoke_sizes(device: torch.device | str):
    """`SMOKE_SIZES`, with chapter 09's capstone sized against the CUDA caching allocator on a
    GPU. There a budget is a cap on the allocator's segments (2 MiB small, 20 MiB large,
    `companion.allocator`), so the CPU's 8 MiB is below one segment: a tenth of the GPU's budget
    stays above the allocator's headroom, and the model is wide enough that the
    unconstrained run still does not fit it (tests/test_record.py checks both)."""
    if torch.device(device).type != "cuda":
        return SMOKE_SIZES
    return dataclasses.replace(SMOKE_SIZES, cap_width=768, cap_budget=256 * 2**20)


def _tracker(device: torch.device) -> str:
    with track(device) as t:
        a = torch.empty(2**20, device=device)              # 4 MiB
        view = a.view(1024, 1024)                           # a view: no new storage
        b = torch.empty(2**18, device=device)               # 1 MiB, freed inside the block
        del b
    assert (t.current, t.peak) == (2**22, 5 * 2**20), f"current {t.current}, peak {t.peak}"
    with track(device) as step:
        model = GPT(64, 16, 32, 1, 2, device=device)
        x = torch.randint(64, (2, 16), device=device)
        model.loss(x, x).backward()
    end = step.breakdown("current")
    params = sum(p.nbytes for p in model.parameters())
    assert end["parameters"] == end["gradients"] == params, f"{end} against {params} B"
    del view
    return f"4 MiB live, 5 MiB peak; a GPT step's weights and gradients: {format_bytes(params)}"


def _budget(device: torch.device) -> str:
    try:
        with memory_budget("8 MiB", device):
            torch.empty(2**22, device=device)               # 16 MiB
    except torch.OutOfMemoryError as e:
        message = str(e).splitlines()[0][:70]
    else:
        raise AssertionError("16 MiB fit under an 8 MiB budget")
    torch.empty(2**22, device=device)                       # the cap is gone on exit
    return f"16 MiB under 8 MiB: {message}"


def _checkpointing(device: torch.device) -> str:
    block = torch.nn.Sequential(GPT(64, 16, 32, 1, 2, device=device).blocks[0],
                                torch.nn.Dropout(0.3))
    h = torch.randn(2, 16, 32, device=device)
    grads = []
    for run in (block, lambda x: checkpoint(block, x),
                lambda x: checkpoint(block, x, use_reentrant=False)):
        block.zero_grad(set_to_none=True)
        x = h.clone().requires_grad_()
        torch.manual_seed(0)                                # the same dropout masks
        run(x).square().mean().backward()
        grads.append([x.grad] + [p.grad for p in block.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return "both designs equal plain autograd, dropout replayed"


def _accumulation(device: torch.device) -> str:
    x, y = (t.to(device) for t in make_classification(64, 8, 4))
    gap = gradient_gap(lambda: MLP(8, 16, 2, 4, device=device), F.cross_entropy, x, y,
                       accum_steps=4)
    assert gap < 1e-5, f"4 micro-batches differ from one batch by {gap:.1e}"
    model = MLP(8, 512, 2, 4, device=device)

    def step(b: int) -> None:
        model.loss(torch.randn(b, 8, device=device),
                   torch.zeros(b, dtype=torch.long, device=device)).backward()

    step(1)                         # gradients and cuBLAS's workspace exist before the budget
    with memory_budget("4 MiB", device):
        largest = find_max_batch_size(step, device=device, limit=2**14)
    assert 1 <= largest < 2**14, f"largest batch {largest}"
    return f"k = 4 within {gap:.1e}; the largest batch under 4 MiB: {largest}"


def _scaler(device: torch.device) -> str:
    models = [MLP(8, 16, 2, 4, device=device) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scalers = [amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=3),
               torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=3)]
    x, y = (t.to(device) for t in make_classification(16, 8, 4))
    for i in range(12):
        for model, opt, scaler in zip(models, opts, scalers):
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = model.loss(x, y)
            (scaler.scale(loss) * (float("inf") if i % 5 == 2 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale(), "the scales differ"
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q)
    return f"same scale as torch.amp.GradScaler after 12 steps ({scalers[0].get_scale():g})"


def ddp_worker(rank: int, world_size: int, on_device: bool) -> float:
    """A rank of the DDP check: our ring all-reduce against dist.all_reduce, and our DDP's
    averaged gradients against the mean of every rank's own; returns the largest difference."""
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cuda" if on_device else "cpu")
    t = torch.arange(12.0, device=device) * (rank + 1)
    theirs = t.clone()
    dist.all_reduce(theirs)                                          # collective
    if dist.get_backend() == "nccl" or not on_device:                # gloo: send/recv on CPU only
        collectives.ring_all_reduce(t)                               # collective (ring)
        torch.testing.assert_close(t, theirs)
    model = MLP(8, 16, 2, 4, device=device)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(device)
    y = torch.arange(4, device=device)
    model.loss(x, y).backward()
    local = torch.cat([p.grad.flatten() for p in model.parameters()])
    mean = local.clone()
    dist.all_reduce(mean)                                            # collective
    mean /= world_size
    model.zero_grad(set_to_none=True)
    wrapped = DDP(model, bucket_cap_mb=0.001)                        # several buckets
    F.cross_entropy(wrapped(x), y).backward()
    wrapped.finish_gradient_synchronization()                        # sync point
    ours = torch.cat([p.grad.flatten() for p in model.parameters()])
    return float((ours - mean).abs().max())


def _ddp(device: torch.device) -> str:
    world, backend = ranks(device)
    gaps = launch.run(ddp_worker, world, device.type == "cuda", backend=backend, timeout=120)
    assert max(gaps) < 1e-5, f"DDP's gradients differ from the mean by {max(gaps):.1e}"
    return f"{world} {backend} rank(s): ring == all_reduce, DDP == mean (within {max(gaps):.1e})"


def _gloo_on_device(device: torch.device) -> str:
    gaps = launch.run(ddp_worker, 2, True, backend="gloo", timeout=120)
    assert max(gaps) < 1e-5, f"DDP's gradients differ from the mean by {max(gaps):.1e}"
    return "2 gloo ranks on CUDA tensors: all_reduce and our DDP"


def check_names(device: torch.device | str) -> list[str]:
    """The code-path checks `smoke` runs on `device`, before the chapters' experiments."""
    return list(_checks(torch.device(device)))


def _checks(device: torch.device) -> dict[str, Callable[[torch.device], str]]:
    checks = {"memory.track": _tracker, "memory_budget": _budget, "checkpointing": _checkpointing,
              "accumulation": _accumulation, "GradScaler": _scaler, "DDP and collectives": _ddp}
    if device.type == "cuda":
        checks["gloo with CUDA tensors"] = _gloo_on_device
    return checks


def smoke(device: torch.device | str, *, chapters: list[str] | None = None,
          checks: list[str] | None = None, progress: bool = True) -> list[tuple]:
    """Run the checks (all, or those named) and the chapters' experiments at `smoke_sizes`;
    return [(name, passed, seconds, note or the error)], printing one line each."""
    from companion.record.runner import CHAPTERS, validate

    device = torch.device(device)
    jobs = {name: fn for name, fn in _checks(device).items() if checks is None or name in checks}
    for chapter in CHAPTERS if chapters is None else chapters:
        jobs[f"chapter {chapter}"] = lambda d, c=chapter: _chapter(CHAPTERS[c], c, d, validate)
    rows = []
    for name, fn in jobs.items():
        start = time.perf_counter()  # host clock
        try:
            row = (name, True, fn(device))
        except Exception as e:
            row = (name, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
        rows.append((row[0], row[1], time.perf_counter() - start, row[2]))  # host clock
        if progress:
            print(f"{'ok' if row[1] else 'FAILED':>6}  {name:<24} {rows[-1][2]:6.1f} s  {row[2]}",
                  flush=True)
    return rows


def _chapter(experiment: Callable, chapter: str, device: torch.device, validate) -> str:
    S = SizesRead(smoke_sizes(device))
    run = experiment(S, device, repeats=1)
    validate({"machine": "smoke", "device": device.type, "torch": torch.__version__, "cuda": None,
              "date": "", "chapters": {chapter: {**run, "date": "", "seconds": 0.0,
                                                 "sizes": S.read}}})
    return f"{len(run['measured'])} measured, {len(run['predicted'])} predicted"
