"""companion.parallel_runs: chapter 13's comparisons report zero difference and formula bytes for
the right methods, and a real difference for a wrong one."""
import pytest
import torch

from companion import models, parallel_runs as pr
from companion.models import MLP
from companion.pipeline import schedules


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
