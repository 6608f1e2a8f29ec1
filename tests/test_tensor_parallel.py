"""companion.tensor_parallel: a block split over t gloo ranks equals the whole block (outputs and
gradients), sends the formula's bytes and keeps the formula's activation bytes, to the byte."""
import pytest
import torch
from torch import nn

from companion import checkpointing as ck, launch, memory, models
from companion import tensor_parallel as tp
from companion.parallel_runs import _block_shard, split_block_run as _split_block


def _pair(rank, world, name, xs, grads):
    """A worker: one conjugate pair on this rank's input; its output, input gradient, bytes."""
    comm = tp.TPComm()
    x = xs[rank].clone().requires_grad_()
    y = getattr(tp, name)(x, comm)
    forward = comm.traffic.sent_bytes
    y.backward(grads[rank])
    return y.detach(), x.grad, forward, comm.traffic.sent_bytes - forward


def _whole(block, x, grad_out):
    x = x.clone().requires_grad_()
    y = block(x)
    y.backward(grad_out)
    return y.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


def _case(batch, seq, width, heads, dtype, seed=0, attention=None):
    torch.manual_seed(seed)
    block = models.Block(width, heads, dtype=dtype, attention=attention)
    x = torch.randn(batch, seq, width, dtype=dtype)
    return block, x, torch.randn(batch, seq, width, dtype=dtype)


@pytest.mark.parametrize("name", ["copy_to_tp", "reduce_from_tp", "gather_from_sp",
                                  "scatter_to_sp"])
def test_conjugate_pairs_do_what_their_names_say_each_way(name):
    world, (B, T, C) = 2, (2, 6, 5)
    torch.manual_seed(3)
    gathers = name == "gather_from_sp"                      # (B, T/t, C) in, (B, T, C) out
    shape_in, shape_out = ((B, T // world, C), (B, T, C)) if gathers else \
        ((B, T, C), (B, T // world, C)) if name == "scatter_to_sp" else ((B, T, C), (B, T, C))
    xs = [torch.randn(shape_in, dtype=torch.float64) for _ in range(world)]
    grads = [torch.randn(shape_out, dtype=torch.float64) for _ in range(world)]
    S = 8 * B * T * C                                       # one whole (B, T, C) in bytes
    whole, gathered = sum(xs), torch.cat(xs, dim=1)
    for rank, (y, x_grad, forward, backward) in enumerate(launch.run(_pair, world, name, xs,
                                                                    grads)):
        expected = {"copy_to_tp": lambda: (xs[rank], sum(grads), 0, S),
                    "reduce_from_tp": lambda: (whole, grads[rank], S, 0),
                    "gather_from_sp": lambda: (gathered, tp.sequence_shard(sum(grads), rank,
                                                                           world), S / 2, S / 2),
                    "scatter_to_sp": lambda: (tp.sequence_shard(whole, rank, world),
                                              torch.cat(grads, dim=1), S / 2, S / 2)}[name]()
        torch.testing.assert_close(y, expected[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x_grad, expected[1], rtol=1e-12, atol=1e-12)
        assert (forward, backward) == expected[2:]      # a ring of 2: (t-1)/t·S each half


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
            torch.testing.assert_close(g, _block_shard(name, grads, rank, world), **close)


@pytest.mark.parametrize("world, sequence_parallel", [(1, False), (2, False), (2, True),
                                                       (4, False), (4, True)])
def test_bytes_sent_and_kept_per_rank_equal_the_formulas(world, sequence_parallel):
    batch, seq, width, heads = 2, 12, 24, 4
    block, x, grad_out = _case(batch, seq, width, heads, torch.float32, seed=1)
    results = launch.run(_split_block, world, block, x, grad_out, sequence_parallel)
    sent = tp.tp_bytes_per_layer(batch, seq, width, world, sequence_parallel=sequence_parallel)
    kept = tp.tp_activation_bytes(batch, seq, width, heads, world,
                                  sequence_parallel=sequence_parallel)
    for *_, kept_r, forward_r, backward_r in results:
        assert (forward_r, backward_r) == (sent["forward"], sent["backward"])
        assert kept_r == kept


def test_formulas_at_one_rank_are_the_whole_blocks_and_shrink_as_the_paper_says():
    b, s, h, a = 2, 16, 48, 4
    assert tp.tp_activation_bytes(b, s, h, a, 1) == ck.block_activation_bytes(b, s, h, a)
    assert tp.tp_activation_bytes(b, s, h, a, 1, sequence_parallel=True) == \
        ck.block_activation_bytes(b, s, h, a)
    assert tp.tp_bytes_per_layer(b, s, h, 1) == {"forward": 0, "backward": 0}
    for t in (2, 4):
        plain = tp.tp_activation_bytes(b, s, h, a, t)
        sp = tp.tp_activation_bytes(b, s, h, a, t, sequence_parallel=True)
        # the part sequence parallelism shards: LayerNorm and column inputs 4·sbh, statistics 4·sb
        assert plain - sp == 4 * (4 * s * b * h + 4 * s * b) * (t - 1) // t
        # an all-reduce is a reduce-scatter and an all-gather: the forward bytes do not change
        S = 4 * b * s * h
        assert tp.tp_bytes_per_layer(b, s, h, t)["forward"] == 2 * 2 * (t - 1) / t * S
        assert tp.tp_bytes_per_layer(b, s, h, t, sequence_parallel=True)["forward"] == \
            2 * 2 * (t - 1) / t * S


@pytest.mark.parametrize("t", [1, 2, 4])
def test_formulas_are_korthikantis_without_dropout_in_16_bits(t):
    b, s, h, a = 2, 64, 48, 4
    theirs = {False: s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t,       # arXiv:2205.05198
              True: s * b * h * 34 / t + 5 * a * s * s * b / t}              # §4.2.1 and §4.2.2
    for sp in (False, True):
        ours = tp.tp_activation_bytes(b, s, h, a, t, sequence_parallel=sp, dtype=torch.bfloat16)
        dropout_masks = 2 * s * b * h / (t if sp else 1) + 3 * a * s * s * b / t
        statistics = 4 * s * b * 2 / (t if sp else 1)
        assert ours == theirs[sp] - dropout_masks + statistics + s * s   # + the bool causal mask


def test_bad_splits_say_what_to_change():
    with pytest.raises(ValueError, match="heads .6. is not divisible .* t=4"):
        tp.TensorParallelBlock(models.Block(24, 6), 0, 4)
    with pytest.raises(ValueError, match="out_features .6. is not divisible .* t=4"):
        tp.ColumnParallelLinear(nn.Linear(8, 6), 0, 4)
    with pytest.raises(ValueError, match="out_features/3 .2. is not divisible .* t=4"):
        tp.ColumnParallelLinear(nn.Linear(8, 6), 0, 4, parts=3)
    with pytest.raises(ValueError, match="in_features .6. is not divisible"):
        tp.RowParallelLinear(nn.Linear(6, 8), 0, 4)
    with pytest.raises(ValueError, match="sequence length .10. is not divisible"):
        tp.sequence_shard(torch.zeros(2, 10, 8), 0, 4)
    with pytest.raises(ValueError, match="rank must be in"):
        tp.TensorParallelBlock(models.Block(24, 4), 4, 4)
    with pytest.raises(ValueError, match="divisible"):
        tp.tp_activation_bytes(2, 10, 24, 4, 4, sequence_parallel=True)
