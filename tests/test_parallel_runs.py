"""companion.parallel_runs: chapter 13's comparisons report zero difference and formula bytes for
the right methods, and a real difference for a wrong one."""
import pytest
import torch

from companion import models, parallel_runs as pr
from companion.models import MLP
from companion.pipeline import schedules
from companion.record import alone


def test_block_split_over_two_ranks_matches_and_sends_the_formula():
    torch.manual_seed(0)
    block = models.Block(32, 4, dtype=torch.float64)
    x, g = torch.randn(2, 8, 32, dtype=torch.float64), torch.randn(2, 8, 32, dtype=torch.float64)
    for sp in (False, True):
        run = pr.compare_block(block, x, g, 2, sequence_parallel=sp)
        assert run.error < 1e-12
        assert all(sent == run.sent_formula for sent in run.sent)
        assert run.kept == [run.kept_formula] * 2 and run.kept_formula < run.whole_kept


def test_a_block_with_other_weights_is_a_difference():
    """The comparison is against the block it was given: split a different block, see an error."""
    torch.manual_seed(0)
    block = models.Block(32, 4, dtype=torch.float64)
    x, g = torch.randn(2, 8, 32, dtype=torch.float64), torch.randn(2, 8, 32, dtype=torch.float64)
    shifted = models.Block(32, 4, dtype=torch.float64)
    shifted.load_state_dict(block.state_dict())
    with torch.no_grad():
        shifted.fc.weight[0, 0] += 1.0
    results = pr.launch.run(pr.split_block_run, 2, shifted, x, g, False)
    want = block(x)
    assert (results[0][0] - want.detach()).abs().max() > 1e-3


@pytest.mark.parametrize("method, layout", [("ring", "zigzag"), ("ulysses", "contiguous")])
def test_attention_split_matches_full_attention(method, layout):
    q, k, v, do = (torch.randn(1, 4, 16, 8, dtype=torch.float64) for _ in range(4))
    run = pr.compare_attention(q, k, v, do, 2, method=method, layout=layout)
    assert run.error < 1e-12
    assert all(sent == run.sent_formula for sent in run.sent)
    with pytest.raises(ValueError, match="ring' or 'ulysses"):
        pr.compare_attention(q, k, v, do, 2, method="tree")


def test_pipeline_peaks_are_predicted_and_1f1b_holds_fewer():
    model = MLP(16, 32, 4, 5, seed=0, dtype=torch.float64).net
    g = torch.Generator().manual_seed(1)
    xs = list(torch.randn(4, 8, 16, dtype=torch.float64, generator=g).unbind())
    ys = list(torch.randint(5, (4, 8), generator=g).unbind())
    runs = {name: pr.compare_pipeline(model, xs, ys, make(2, 4), name=name)
            for name, make in (("gpipe", schedules.gpipe), ("1f1b", schedules.one_f_one_b))}
    for run in runs.values():
        assert run.error < 1e-12
        assert run.peak_activation_bytes == run.predicted_peak
        assert run.bubble_formula == pytest.approx(1 / 5) and 0 <= run.bubble < 1
    assert runs["1f1b"].peak_activation_bytes[0] * 2 == runs["gpipe"].peak_activation_bytes[0]


def test_experts_over_two_ranks_match_and_send_the_formula():
    from companion import experts
    torch.manual_seed(0)
    moe = experts.MoE(8, 16, 4, top_k=2, capacity_factor=0.75).double()
    x, dy = torch.randn(32, 8, dtype=torch.float64), torch.randn(32, 8, dtype=torch.float64)
    run = pr.compare_experts(moe, x, dy, 2)
    assert run.error < 1e-12 and run.dropped > 0
    assert run.sent == run.sent_formula and run.activations == run.activations_formula
    assert run.weights == [run.weights_formula] * 2 and 2 * run.weights_formula == run.whole_weights
    assert sum(run.received) == 2 * 32 - run.dropped


def test_one_rank_alone_holds_the_formulas_share_of_a_block():
    """What one GPU records: rank 0's share of a t-way split, its collectives on a group of one,
    keeps `tp_activation_bytes(t)` and holds the shard's weights; t = 1 is the whole block's
    count, and the share shrinks with t (a split that kept the whole would fail here)."""
    torch.manual_seed(0)
    block = models.Block(32, 4)
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    rows = pr.launch.run(alone.block_shard_alone, 1, block, x, g, (1, 2, 4))[0]
    for t in (1, 2, 4):
        assert rows[t]["kept"] == pr.tp.tp_activation_bytes(2, 8, 32, 4, t)
        assert rows[t]["weights"] == 4 * (12 * 32 * 32 // t + 7 * 32 // t + 6 * 32)
    assert rows[1]["peak"] > rows[2]["peak"] > rows[4]["peak"] > 0


def test_one_ring_rank_alone_keeps_its_output_and_log_sum_exp():
    q, k, v, do = (torch.randn(1, 2, 32, 8) for _ in range(4))
    rows = pr.launch.run(alone.ring_shard_alone, 1, (q, k, v, do), (2, 4))[0]
    for ranks in (2, 4):
        assert rows[ranks]["kept"] == pr.cp.ring_kept_bytes((1, 2, 32 // ranks, 8), torch.float32)
    assert rows[0]["kept"] == pr.cp.ring_kept_bytes((1, 2, 32, 8), torch.float32)  # full SDPA
    assert rows[2]["kept"] == 2 * rows[4]["kept"]


def test_attention_steps_are_timed_in_rounds_on_every_rank():
    q, k, v, do = (torch.randn(1, 2, 16, 8) for _ in range(4))
    per_rank = pr.launch.run(alone.attention_step_seconds, 2, "ring", (q, k, v, do), True, "zigzag",
                             2)
    for times in per_rank:
        assert sorted(times) == ["full", "ring"]
        assert all(len(s) == 2 and min(s) > 0 for s in times.values())


def test_the_split_runs_return_cpu_tensors():
    """The workers run where `launch.rank_device()` says (a GPU under NCCL) and hand back CPU
    tensors, which the references compare with."""
    torch.manual_seed(0)
    block = models.Block(32, 4)
    x, g = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    y, xg, grads, *_ = pr.launch.run(pr.split_block_run, 2, block, x, g, True)[1]
    assert {t.device.type for t in (y, xg, *grads.values())} == {"cpu"}
    q, k, v, do = (torch.randn(1, 2, 16, 8) for _ in range(4))
    out = pr.launch.run(pr.attention_shard_run, 2, "ring", (q, k, v, do), True, "zigzag")[0]
    assert {t.device.type for t in out[:4]} == {"cpu"}


@pytest.mark.gpu
def test_the_workers_run_on_the_gpus_under_nccl():
    """On CUDA: one rank alone on GPU 0 keeps the formula's bytes (every large tensor a multiple
    of the allocator's 512-byte blocks; the mask and the LayerNorms' statistics round up, less
    than 512 bytes each of some twenty tensors), and with 2 GPUs the split block and ring
    attention match their CPU references."""
    torch.manual_seed(0)
    block = models.Block(64, 4)
    x, g = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    rows = pr.launch.run(alone.block_shard_alone, 1, block, x, g, (1, 2), backend="nccl")[0]
    for t in (1, 2):
        want = pr.tp.tp_activation_bytes(2, 16, 64, 4, t)
        assert want <= rows[t]["kept"] <= want + 512 * 20
    if torch.cuda.device_count() < 2:
        pytest.skip("the split runs need 2 GPUs")
    run = pr.compare_block(block, x, g, 2, backend="nccl")
    assert run.error < 1e-4 and all(sent == run.sent_formula for sent in run.sent)
    q, k, v, do = (torch.randn(1, 4, 64, 16) for _ in range(4))
    att = pr.compare_attention(q, k, v, do, 2, layout="zigzag", backend="nccl")
    assert att.error < 1e-4 and all(sent == att.sent_formula for sent in att.sent)
