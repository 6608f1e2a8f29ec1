"""Our DDP (companion.ddp) against torch's DistributedDataParallel on the same MLP; on 2+ GPUs also
torch.nn.DataParallel against DDP.

Goal: our step time within 1.2x of torch's. Run: python benchmarks/bench_ddp.py
"""
import time

import torch
from torch import nn

from companion import ddp, launch
from companion.device import sizes

WORLD, STEPS = 2, 10


def _mean_step(impl: str, width: int, depth: int, batch: int) -> float:
    out = launch.run(ddp.time_training_step, WORLD, impl, width, depth, batch, STEPS, 25.0,
                     timeout=600)
    return max(r["seconds"] for r in out)


def _data_parallel_step(width: int, depth: int, batch: int) -> float:
    """torch.nn.DataParallel over WORLD GPUs, WORLD·batch rows per step (same work as DDP)."""
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    parallel = nn.DataParallel(model.cuda(), device_ids=list(range(WORLD)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(WORLD * batch, width, device="cuda")
    seconds = []
    for _ in range(STEPS + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        nn.functional.mse_loss(parallel(x), x).backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return sum(seconds[1:]) / STEPS


def main() -> None:
    gpus = torch.cuda.device_count() >= WORLD
    s = sizes("cuda" if gpus else "cpu")
    width, depth, batch = s.width, s.depth // 2, s.batch
    print(f"MLP {depth} x Linear({width}, {width}), {batch} rows per rank, {WORLD} ranks, "
          f"{'NCCL' if gpus else 'gloo'}, mean of {STEPS} steps")
    times = {impl: _mean_step(impl, width, depth, batch) for impl in ("ours", "torch", "naive")}
    for impl, t in times.items():
        print(f"{impl:>6}: {1e3 * t:7.2f} ms per step")
    print(f"ours / torch: {times['ours'] / times['torch']:.2f}x (goal <= 1.2x)")
    if gpus:
        dp_time = _data_parallel_step(width, depth, batch)
        print(f"nn.DataParallel: {1e3 * dp_time:7.2f} ms per step; torch DDP is "
              f"{dp_time / times['torch']:.2f}x faster")
    else:
        print("nn.DataParallel against DDP: needs 2 GPUs, skipped")


if __name__ == "__main__":
    main()
