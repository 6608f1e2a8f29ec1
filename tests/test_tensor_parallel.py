"""companion.tensor_parallel: a block split over t gloo ranks equals the whole block (outputs and
gradients), sends the formula's bytes and keeps the formula's activation bytes, to the byte."""
import pytest
import torch
from torch import nn

from companion import launch, memory, models
from companion import tensor_parallel as tp


def _split_block(rank, world, block, x, grad_out, sequence_parallel):
    """A worker: this rank's share of block; its output, gradients, bytes sent and bytes kept."""
    comm = tp.TPComm()
    split = tp.TensorParallelBlock(block, rank, world, comm=comm,
                                   sequence_parallel=sequence_parallel)
    if sequence_parallel:
        x, grad_out = (tp.sequence_shard(t, rank, world) for t in (x, grad_out))
    x = x.clone().requires_grad_()
    with memory.track(launch.rank_device()) as tracker:
        y = split(x)
        kept = tracker.current - y.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    forward = comm.traffic.sent_bytes
    y.backward(grad_out)
    backward = comm.traffic.sent_bytes - forward
    if sequence_parallel:
        tp.all_reduce_sequence_parallel_grads(split, comm)
    grads = {name: p.grad for name, p in split.named_parameters()}
    return y.detach(), x.grad, grads, kept, forward, backward


def _whole(block, x, grad_out):
    x = x.clone().requires_grad_()
    y = block(x)
    y.backward(grad_out)
    return y.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


def _expected_shard(name, grads, rank, world):
    """The whole block's gradient of the parameter that `name` shards on `rank`."""
    layer = {"qkv": "qkv", "proj": "proj", "mlp.0": "fc", "mlp.2": "out"}
    prefix, kind = name.rsplit(".", 1)
    if prefix not in layer:                                   # LayerNorms: whole
        return grads[name]
    full = grads[f"{layer[prefix]}.{kind}"]
    if prefix in ("qkv", "mlp.0"):                            # column-parallel: rows
        return tp.column_shard(full, rank, world, parts=3 if prefix == "qkv" else 1)
    return tp.row_shard(full, rank, world) if kind == "weight" else full


def _case(batch, seq, width, heads, dtype, seed=0, attention=None):
    torch.manual_seed(seed)
    block = models.Block(width, heads, dtype=dtype, attention=attention)
    x = torch.randn(batch, seq, width, dtype=dtype)
    return block, x, torch.randn(batch, seq, width, dtype=dtype)


@pytest.mark.parametrize("world, sequence_parallel, attention", [
    (2, False, None), (2, True, None), (2, True, "sdpa"), (4, True, None)])
def test_split_block_equals_the_whole_block(world, sequence_parallel, attention):
    block, x, grad_out = _case(3, 8, 16, 4, torch.float64, attention=attention)
    y, x_grad, grads = _whole(block, x, grad_out)
    results = launch.run(_split_block, world, block, x, grad_out, sequence_parallel)
    close = {"rtol": 1e-12, "atol": 1e-12}
    for rank, (y_r, x_grad_r, grads_r, *_) in enumerate(results):
        mine = (lambda t: tp.sequence_shard(t, rank, world)) if sequence_parallel else (lambda t: t)
        torch.testing.assert_close(y_r, mine(y), **close)
        torch.testing.assert_close(x_grad_r, mine(x_grad), **close)
        assert len(grads_r) == len(grads)
        for name, g in grads_r.items():
            torch.testing.assert_close(g, _expected_shard(name, grads, rank, world), **close)
