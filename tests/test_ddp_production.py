"""companion.ddp.production: torch DDP's bucket rebuild, its communication hooks and the data
sampler, measured on gloo ranks and checked against what torch 2.13's source says they do."""
import math
import subprocess
import sys

import pytest

from companion import launch
from companion.ddp import production


@pytest.mark.parametrize("length,world", [(10, 3), (12, 4), (5, 2), (2, 3)])
def test_each_rank_reads_every_nth_index_of_one_permutation_padded_from_its_start(length, world):
    shards = production.sampler_shards(length, world, epoch=0)
    per_rank = math.ceil(length / world)
    assert [len(s) for s in shards] == [per_rank] * world
    order = [shards[i % world][i // world] for i in range(per_rank * world)]    # interleave back
    assert sorted(order[:length]) == list(range(length))                       # one permutation
    assert order[length:] == (order[:length] * world)[:per_rank * world - length]   # padding


def test_set_epoch_changes_the_permutation_and_drop_last_cuts():
    assert production.sampler_shards(10, 3, epoch=0) != production.sampler_shards(10, 3, epoch=1)
    assert production.sampler_shards(10, 3, epoch=2) == production.sampler_shards(10, 3, epoch=2)
    cut = production.sampler_shards(10, 3, drop_last=True)
    assert [len(s) for s in cut] == [3, 3, 3] and len({i for s in cut for i in s}) == 9
    assert production.sampler_shards(6, 2, shuffle=False) == [[0, 2, 4], [1, 3, 5]]


def test_torch_ddp_starts_with_one_bucket_and_rebuilds_in_arrival_order():
    width, depth = 64, 12                                   # 16 KiB weights
    out = launch.run(production.torch_buckets, 2, width, depth, 4, 0.04)[0]   # cap 41,943 B
    weight = 4 * width * width
    assert out["initial"] == [depth * weight]              # one bucket before the first step
    assert sum(out["rebuilt"]) == depth * weight
    # closed once a bucket reaches the cap: 3 weights (49,152 B) each, the first one too (a
    # cap given by hand is also the first bucket's)
    assert out["rebuilt"] == [3 * weight] * 4
    assert out["indices"][0] == [11, 10, 9]                  # the last layer's gradient first
    default = launch.run(production.torch_buckets, 2, 512, 3, 4)[0]        # 1 MiB weights
    assert default["first_cap"] == 2**20 and default["rebuilt"] == [2**20, 2 * 2**20]


def test_comm_hooks_bytes_and_errors():
    out = launch.run(production.comm_hooks, 2, 64, 3, 32, 3)[0]
    params = out["parameters"]
    fp32, bf16, fp16 = (out[h] for h in ("fp32 allreduce_hook", "bf16 compress",
                                         "fp16_compress_hook"))
    assert fp32["bytes"] == 4 * params and fp32["error"] < 1e-6
    assert bf16["bytes"] == fp16["bytes"] == 2 * params
    assert 1e-4 < bf16["error"] < 2**-7 and fp16["error"] < bf16["error"]    # 8 against 11 bits
    assert 0 <= fp32["below_fp16_normal"] <= 1
    for rank in (1, 4):
        p = out[f"PowerSGD rank {rank}"]
        assert p["bytes"] < fp32["bytes"] / 2 and p["error"] > bf16["error"]


def test_an_unknown_hook_is_named():
    with pytest.raises(Exception, match="unknown hook"):
        launch.run(production.comm_hooks, 1, 8, 2, 4, 3, ("zip",))


def test_the_torchrun_script_trains_identical_replicas():
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", "-m", "companion.ddp.torchrun_demo"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "weights after training are identical" in run.stdout
    assert run.stdout.count("epoch 0:") == 2 and run.stdout.count("epoch 1:") == 2
    assert "[RANK=0 " in run.stdout and "[RANK=1 " in run.stdout
