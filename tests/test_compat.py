"""companion.compat: the calls newer than torch 2.11 fall back to the older names. Each test hides
the newer call (as torch 2.11 lacks it) and runs the code that uses it."""
import torch
import torch.distributed as dist

from companion import launch
from companion.zero import Comm

NEWER = ("reduce_scatter_single", "all_gather_single")


def _without_the_newer_names(rank, world_size):
    for name in NEWER:                              # torch 2.11 has only the older names
        if hasattr(dist, name):
            delattr(dist, name)
    comm = Comm()
    full = torch.arange(4.0 * world_size) * (rank + 1)
    shard, gathered = torch.empty(4), torch.empty(4 * world_size)
    comm.reduce_scatter(shard, full)
    comm.all_gather(gathered, shard)
    want = full.clone()
    dist.all_reduce(want)
    return torch.equal(gathered, want), [hasattr(dist, n) for n in NEWER], dict(comm.payload)


def test_zero_collectives_run_on_torch_2_11_names():
    for ok, still_there, payload in launch.run(_without_the_newer_names, 2, timeout=30):
        assert ok and still_there == [False, False]
        assert payload == {"reduce_scatter": 4 * 8, "all_gather": 4 * 8}
