"""A data-parallel training script as torchrun launches it, for chapter 06:

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m companion.ddp.torchrun_demo

torchrun starts one process per rank and hands each its place in the environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); `init_process_group` reads them. Each rank reads
its own shard of a small dataset through `DistributedSampler`, trains torch's
`DistributedDataParallel` for two epochs of one step each, and prints one line per epoch; rank 0
then prints whether every rank ends with the same weights. gloo on CPUs, NCCL when each rank has a
GPU of its own (LOCAL_RANK picks it)."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)                         # the same data on every rank; DDP broadcasts
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10.0).unsqueeze(1))
    sampler = DistributedSampler(data, shuffle=True, seed=0)        # rank and size from the group
    loader = DataLoader(data, batch_size=5, sampler=sampler)
    torch.manual_seed(rank)                      # different weights per rank: DDP must fix that
    model = DistributedDataParallel(nn.Linear(1, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                     "MASTER_ADDR"))
    for epoch in range(2):
        sampler.set_epoch(epoch)                 # a new permutation each epoch
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            rows = [int(v) for v in x.flatten().tolist()]
            sys.stdout.write(f"[{env}] epoch {epoch}: rows {rows}, loss {loss.item():.2f}\n")
            sys.stdout.flush()                          # one write: ranks' lines stay whole
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    if rank == 0:
        same = all(torch.equal(gathered[0], g) for g in gathered)
        print(f"rank 0: the {world} ranks' weights after training are "
              f"{'identical' if same else 'DIFFERENT'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
