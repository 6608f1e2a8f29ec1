"""Chapter 10's checks pass on the reference and fail on the wrong answers a learner writes."""
import math

import pytest
import torch

from companion.attention import flash_forward, merge
from companion.attention.tiles import choose_tiles, fitting_tiles
from companion.checks.ch10 import (check_choose_tiles, check_forward_tiles, check_merge,
                                   check_tile_backward, tile_backward)
from companion.checks.core import CheckFailed


def _merge_no_guard(m1, l1, o1, m2, l2, o2):
    """Known wrong: right on non-empty parts, NaN when a part is over no keys."""
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    l = a1 * l1 + a2 * l2
    return m, l, ((a1 * l1)[..., None] * o1 + (a2 * l2)[..., None] * o2) / l[..., None]


def _merge_unscaled(m1, l1, o1, m2, l2, o2):
    l = l1 + l2
    return torch.maximum(m1, m2), l, (l1[..., None] * o1 + l2[..., None] * o2) / l.clamp_min(
        1e-30)[..., None]


def _merge_exp_weights(m1, l1, o1, m2, l2, o2):
    m = torch.maximum(m1, m2)
    safe = m.masked_fill(m == float("-inf"), 0)
    a1, a2 = torch.exp(m1 - safe), torch.exp(m2 - safe)
    w = (a1 + a2).masked_fill(a1 + a2 == 0, 1)
    return m, a1 * l1 + a2 * l2, (a1[..., None] * o1 + a2[..., None] * o2) / w[..., None]


def _merge_without_max(m1, l1, o1, m2, l2, o2):
    """Known wrong: sums of plain exp() (no maximum subtracted) overflow at large scores."""
    e1, e2 = torch.exp(m1) * l1, torch.exp(m2) * l2
    total = e1 + e2
    return torch.log(total), total, (e1[..., None] * o1 + e2[..., None] * o2) / total[..., None]


def test_merge_reference_passes():
    check_merge(merge)


@pytest.mark.parametrize("wrong, hint", [
    (_merge_no_guard, "never subtract a maximum that is −inf"),
    (_merge_unscaled, "rescale l1 by exp"),
    (_merge_exp_weights, "weigh each part's output by its rescaled sum"),
    (_merge_without_max, None),
])
def test_merge_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_merge(wrong)


def _forward(q, k, v, causal, bq, bk):
    return flash_forward(q, k, v, causal, block_q=bq, block_k=bk)


def _whole_matrix(q, k, v, causal, bq, bk):
    """Known wrong: right numbers, but all the scores at once."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(
            1 + k.shape[-2] - q.shape[-2]), float("-inf"))
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), float("inf"))[..., None])
    return p @ v, lse


def _loop(q, k, v, causal, bq, bk, *, top_left=False, rescale=True, lse_with_m=True):
    """A tile loop with switchable mistakes."""
    B, nq, d = q.shape
    nk, scale = k.shape[1], 1 / math.sqrt(d)
    offset = 0 if top_left else nk - nq
    o, lse = torch.zeros_like(q), torch.empty(B, nq)
    for i in range(0, nq, bq):
        qi = q[:, i:i + bq]
        m = torch.full(qi.shape[:2], float("-inf"))
        l, acc = torch.zeros(qi.shape[:2]), torch.zeros_like(qi)
        rows = torch.arange(i, i + qi.shape[1])
        for j in range(0, nk, bk):
            s = qi @ k[:, j:j + bk].transpose(1, 2) * scale
            cols = torch.arange(j, j + s.shape[-1])
            if causal:
                s = s.masked_fill(cols[None] > rows[:, None] + offset, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            safe = m_new.masked_fill(m_new == float("-inf"), 0)
            p = torch.exp(s - safe[..., None])
            a = torch.exp(m - safe) if rescale else torch.ones_like(m)
            l = a * l + p.sum(-1)
            acc = a[..., None] * acc + p @ v[:, j:j + bk]
            m = m_new
        o[:, i:i + bq] = acc / l.masked_fill(l == 0, 1)[..., None]
        lse[:, i:i + bq] = m + torch.log(l) if lse_with_m else torch.log(l)
    return o, lse


def test_forward_tiles_reference_and_a_correct_loop_pass():
    check_forward_tiles(_forward)
    check_forward_tiles(_loop)


@pytest.mark.parametrize("wrong, hint", [
    (_whole_matrix, "never q @ k.transpose"),
    (lambda *a: _loop(*a, top_left=True), "align the causal mask bottom-right"),
    (lambda *a: _loop(*a, rescale=False), "rescale l and the output"),
    (lambda *a: _loop(*a, lse_with_m=False), r"m \+ log\(l\)"),
    (lambda q, k, v, c, bq, bk: _forward(q * math.sqrt(q.shape[-1]), k, v, c, bq, bk),
     "scale = 1/√d"),
])
def test_forward_tiles_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_forward_tiles(wrong)


def _tile(q, k, v, o, do, lse, scale, *, kind):
    p = torch.exp(q @ k.transpose(-2, -1) * scale - lse[..., None])
    dp = do @ v.transpose(-2, -1)
    ds = {"no D": p * dp, "local D": p * (dp - (p * dp).sum(-1, keepdim=True)),
          "no P": dp - (do * o).sum(-1, keepdim=True)}.get(kind, p * (dp - (do * o).sum(-1, keepdim=True)))
    s = scale if kind != "no scale" else 1.0
    return ds @ k * s, ds.transpose(-2, -1) @ q * s, p.transpose(-2, -1) @ do


def _tile_softmax(q, k, v, o, do, lse, scale):
    """Known wrong: the tile's own softmax instead of exp(S − lse)."""
    p = (q @ k.transpose(-2, -1) * scale).softmax(-1)
    dp = do @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do


def test_tile_backward_reference_passes_and_sums_to_autograd():
    check_tile_backward(tile_backward)
    check_tile_backward(lambda *a: _tile(*a, kind="right"))
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, n, 8, generator=g, dtype=torch.float64) for n in (5, 12, 12, 5))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(8)
    lse = s.logsumexp(-1)
    o = s.softmax(-1) @ v
    want = torch.autograd.grad(o, (q, k, v), do)
    parts = [tile_backward(q.detach(), k[:, j:j + 4].detach(), v[:, j:j + 4].detach(),
                           o.detach(), do, lse.detach(), 1 / math.sqrt(8)) for j in (0, 4, 8)]
    torch.testing.assert_close(sum(p[0] for p in parts), want[0])
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), want[1])
    torch.testing.assert_close(torch.cat([p[2] for p in parts], 1), want[2])


@pytest.mark.parametrize("wrong, hint", [
    (lambda *a: _tile(*a, kind="no D"), r"dS = P ∘ \(dP − D\)"),
    (lambda *a: _tile(*a, kind="local D"), "this tile holds only some of them"),
    (lambda *a: _tile(*a, kind="no P"), "without the factor P"),
    (lambda *a: _tile(*a, kind="no scale"), "both carry the scale"),
    (_tile_softmax, "a softmax over this tile alone"),
])
def test_tile_backward_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_tile_backward(wrong)


SIZES = (16, 32, 64, 128, 256)


def _tiles(sram, d, e, *, score_bytes=4, acc=True, v_tile=True, order="q"):
    fits = [(bq, bk) for bq in SIZES for bk in SIZES
            if (bq + (2 if v_tile else 1) * bk) * d * e + score_bytes * bq * bk
            + (4 * bq * d if acc else 0) + 8 * bq <= sram]
    if not fits:
        return None
    return max(fits) if order == "q" else max(fits, key=lambda p: (p[1], p[0]))


def test_choose_tiles_reference_passes():
    check_choose_tiles(choose_tiles)
    check_choose_tiles(_tiles)
    assert choose_tiles(6_000, 128, 4) is None and fitting_tiles(6_000, 128, 4) == []


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, d, e: _tiles(s, d, e, score_bytes=e), "the scores are fp32"),
    (lambda s, d, e: _tiles(s, d, e, acc=False), "accumulator stays on chip"),
    (lambda s, d, e: _tiles(s, d, e, v_tile=False), "a tile of V"),
    (lambda s, d, e: _tiles(s, d, e, order="k"), "maximize block_q first"),
    (lambda s, d, e: (16, 16), None),
    (lambda s, d, e: (128, 64), None),
])
def test_choose_tiles_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_choose_tiles(wrong)
