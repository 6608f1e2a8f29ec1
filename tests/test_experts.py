"""companion.experts: the expert-parallel mixture of experts on 2 and 4 gloo ranks equals the
single-process one (outputs, gradients of inputs, router and experts), sends the formulas' bytes,
keeps the formulas' weights and activations, routes and balances as the papers define, and refuses
bad input."""
import math

import pytest
import torch

from companion import experts as ex, launch

D, H, N = 6, 10, 12           # width, hidden, tokens per rank
ALPHA = 0.1                   # the aux loss's weight in the loss


def _layer(E, top_k, capacity_factor):
    torch.manual_seed(0)
    return ex.MoE(D, H, E, top_k=top_k, capacity_factor=capacity_factor).double()


def _data(world, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(world * N, D, generator=g, dtype=torch.float64),
            torch.randn(world * N, D, generator=g, dtype=torch.float64))


def _rank_step(rank, world, E, top_k, capacity_factor):
    """A worker: this rank's N tokens through its share of the layer, forward and backward."""
    moe = _layer(E, top_k, capacity_factor)
    ep = ex.ExpertParallelMoE(moe, rank, world)
    x, dy = (t[rank * N:(rank + 1) * N] for t in _data(world))
    x = x.clone().requires_grad_()
    stats = ex.EPStats()
    y = ep(x, stats=stats)
    ((y * dy).sum() + ALPHA * ep.routing.aux_loss).backward()
    own_router = ep.router.weight.grad.clone()
    ex.all_reduce_router_grads(ep)
    grads = {name: p.grad for name, p in ep.named_parameters()}
    weights = sum(p.numel() * p.element_size() for p in ep.experts.parameters())
    return y.detach(), x.grad, grads, own_router, stats, weights


def _reference(world, E, top_k, capacity_factor):
    """The whole layer in one process, W groups of N tokens: loss = Σ over groups of each rank's."""
    moe = _layer(E, top_k, capacity_factor)
    x, dy = _data(world)
    x.requires_grad_()
    y = moe(x, groups=world)
    ((y * dy).sum() + ALPHA * world * moe.routing.aux_loss).backward()
    return moe, y.detach(), x.grad


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (1, 0.75), (2, 0.5)])
def test_equals_the_single_process_layer_and_bytes_equal_formulas(world, top_k, capacity_factor):
    E = 8
    results = launch.run(_rank_step, world, E, top_k, capacity_factor, timeout=60)
    moe, y, x_grad = _reference(world, E, top_k, capacity_factor)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), y, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), x_grad, rtol=1e-12, atol=1e-13)
    reference = dict(moe.named_parameters())
    for rank, (_, _, grads, own_router, stats, weights) in enumerate(results):
        torch.testing.assert_close(grads["router.weight"], reference["router.weight"].grad,
                                   rtol=1e-12, atol=1e-13)
        # one rank's router gradient alone is not the whole batch's: the all-reduce matters
        assert not torch.allclose(own_router, reference["router.weight"].grad)
        for name, grad in grads.items():
            if name.startswith("experts."):
                _, j, rest = name.split(".", 2)
                owned = f"experts.{rank * E // world + int(j)}.{rest}"
                torch.testing.assert_close(grad, reference[owned].grad, rtol=1e-12, atol=1e-13)
        assert weights == ex.expert_weight_bytes(D, H, E, world, torch.float64)
        assert stats.activation_bytes == ex.expert_activation_bytes(
            stats.received_tokens, D, H, torch.float64)
    # routing: the ranks' counts add up to the reference's; drops happen only with a capacity
    routed = torch.stack([r[4].routed for r in results])                    # (W, E)
    kept = torch.stack([r[4].kept for r in results])
    assert torch.equal(routed.sum(0), moe.routing.routed)
    assert sum(r[4].dropped for r in results) == moe.routing.dropped == int((routed - kept).sum())
    assert (moe.routing.dropped > 0) == (capacity_factor is not None)
    assert kept.sum() == world * N * top_k - moe.routing.dropped
    # bytes sent per all-to-all, forward and backward, equal the formula from the counts
    formulas = ex.ep_bytes_per_rank(kept, D, torch.float64)
    for stats, formula in zip((r[4] for r in results), formulas):
        assert formula["counts"] == (world - 1) * (E // world) * 8
        assert stats.exchanges == formula
        assert stats.backward.exchanges == {"combine": formula["dispatch"],
                                            "dispatch": formula["combine"]}
        assert stats.sent_bytes == sum(formula.values())
    received = [r[4].received_tokens for r in results]
    assert sum(received) == int(kept.sum())
    assert received == kept.view(world, world, E // world).sum(dim=(0, 2)).tolist()


def _hand_logits():
    """Four tokens, two experts: probabilities (3/4, 1/4), (1/4, 3/4), (3/4, 1/4), (3/4, 1/4)."""
    third = math.log(3.0)
    return torch.tensor([[third, 0.0], [0.0, third], [third, 0.0], [third, 0.0]],
                        dtype=torch.float64)


def test_aux_loss_is_switch_eq_4_by_hand():
    # f = (3/4, 1/4) first choices, P = (5/8, 3/8): 2·(3/4·5/8 + 1/4·3/8) = 9/8
    r = ex.route(_hand_logits(), 1)
    assert r.aux_loss.item() == pytest.approx(9 / 8, abs=1e-15)
    # per group of 2: (1/2, 1/2)·(1/2, 1/2) -> 1; (1, 0)·(3/4, 1/4) -> 3/2; the mean 5/4
    assert ex.route(_hand_logits(), 1, groups=2).aux_loss.item() == pytest.approx(5 / 4)
    # f counts first choices only: top-2 routing has the same loss
    assert ex.route(_hand_logits(), 2).aux_loss.item() == pytest.approx(9 / 8, abs=1e-15)
    # uniform routing gives exactly 1
    assert ex.route(torch.zeros(6, 3, dtype=torch.float64), 1).aux_loss.item() == pytest.approx(1)


def test_weights_and_capacity_follow_gshard_order():
    r = ex.route(_hand_logits(), 2)
    assert r.expert.tolist() == [[0, 1], [1, 0], [0, 1], [0, 1]]
    torch.testing.assert_close(r.weight[0], torch.tensor([0.75, 0.25], dtype=torch.float64))
    assert r.dropped == 0 and r.routed.tolist() == [4, 4]
    # C = ceil(0.5·2·4/2) = 2: expert 0 takes first choices t0, t2 (t3's is dropped), expert 1
    # t1's first choice, then t0's second; the other three second choices are over capacity
    r = ex.route(_hand_logits(), 2, capacity_factor=0.5)
    assert r.kept.tolist() == [[True, True], [True, False], [True, False], [False, False]]
    assert r.dropped == 4
    r = ex.route(_hand_logits(), 1, capacity_factor=1.0)         # C = 2: t3 over it
    assert r.kept.flatten().tolist() == [True, True, True, False]


def test_load_imbalance_on_a_hand_made_routing():
    counts = torch.tensor([[3, 1, 0, 0], [1, 1, 2, 0]])     # per expert 4, 2, 2, 0; mean 2
    assert ex.load_imbalance(counts, 2) == {"expert": 2.0, "rank": 1.5}   # ranks 6, 2; mean 4
    assert ex.load_imbalance(counts, 4) == {"expert": 2.0, "rank": 2.0}
    assert ex.load_imbalance(torch.tensor([5, 5, 5, 5]), 2) == {"expert": 1.0, "rank": 1.0}
    assert ex.load_imbalance(torch.tensor([8, 0, 0, 0]), 4) == {"expert": 4.0, "rank": 4.0}
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        ex.load_imbalance(counts, 3)


def test_weight_bytes_split_the_whole_layer():
    moe = _layer(8, 1, None)
    whole = sum(p.numel() * p.element_size() for p in moe.experts.parameters())
    for world in (1, 2, 4, 8):
        assert ex.expert_weight_bytes(D, H, 8, world, torch.float64) * world == whole
        assert [ex.expert_owner(e, 8, world) for e in range(8)] == \
            [e * world // 8 for e in range(8)]


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="top_k must be between 1 and the number of experts"):
        ex.MoE(D, H, 4, top_k=5)
    with pytest.raises(ValueError, match="top_k must be between"):
        ex.MoE(D, H, 4, top_k=0)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        ex.MoE(D, H, 4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="top_k must be between 1 and the number of experts"):
        ex.route(_hand_logits(), 3)
    with pytest.raises(ValueError, match="N divisible by groups=3"):
        ex.route(_hand_logits(), 1, groups=3)
    moe = _layer(6, 1, None)
    with pytest.raises(ValueError, match="6 experts do not divide by 4"):
        ex.ExpertParallelMoE(moe, 0, 4)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        ex.ExpertParallelMoE(moe, 2, 2)
    x = torch.randn(4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"flatten \(B, T, d\)"):
        moe(x.view(2, 2, D))
    with pytest.raises(ValueError, match=rf"must be a \(N, {D}\) tensor"):
        moe(torch.randn(4, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="tokens are torch.float32 but the layer's weights are "
                                         "torch.float64"):
        moe(x.float())
    with pytest.raises(ValueError, match="4 tokens do not split into 3 equal groups"):
        moe(x, groups=3)
    with pytest.raises(ValueError, match="tokens must be"):
        moe([[0.0] * D])


def _both_all_to_alls(rank, world):
    """A worker: uneven rows (rank r sends r + j + (j == 0) rows to rank j, some none) through ours
    and torch's all_to_all_single; both results and our bytes sent."""
    send = [(rank + j + (j == 0)) % 3 for j in range(world)]
    recv = [(s + rank + (rank == 0)) % 3 for s in range(world)]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(send), D, generator=g)
    stats = ex.EPStats()
    ours = ex.all_to_all_variable(x, send, recv, stats=stats, name="rows")
    theirs = torch.empty(sum(recv), D)
    torch.distributed.all_to_all_single(theirs, x, recv, send)
    return ours, theirs, stats.exchanges, send


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_variable_equals_torchs_all_to_all_single(world):
    for rank, (ours, theirs, exchanges, send) in enumerate(launch.run(_both_all_to_alls, world,
                                                                      timeout=60)):
        assert torch.equal(ours, theirs)
        assert exchanges == {"rows": (sum(send) - send[rank]) * D * 4}
