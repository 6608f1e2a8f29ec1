"""Chapter 11's training runs: each kind builds the optimizer its name says."""
import pytest
import torch

from companion import models
from companion.device import sizes
from companion.record.lowbit import KINDS, STABLE_EMBEDDING, _optimizer, train_curve


def _one_step(kind):
    S = sizes("cpu")
    gpt = models.GPT(S.vocab, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads)
    if kind.startswith("bf16"):
        gpt = gpt.to(torch.bfloat16)
    opt = _optimizer(kind, gpt, 1e-3)
    x, y = models.make_tokens(2, S.seq_len, vocab=S.vocab, seed=0)
    gpt.loss(x, y).backward()
    opt.step()
    return gpt, opt


def test_stable_embedding_keeps_only_the_token_embeddings_states_in_32_bits():
    gpt, opt = _one_step(STABLE_EMBEDDING)
    assert opt.state[gpt.tok.weight]["exp_avg"].dtype == torch.float32
    assert "exp_avg_codes" in opt.state[gpt.blocks[0].fc.weight]
    gpt8, opt8 = _one_step("Adam8bit")
    assert "exp_avg_codes" in opt8.state[gpt8.tok.weight]


def test_the_six_byte_kind_rounds_its_bf16_weights_stochastically():
    gpt, opt = _one_step("bf16 + Adam8bit")
    assert gpt.tok.weight.dtype == torch.bfloat16
    assert all(group["stochastic_round"] for group in opt.param_groups)


def test_an_unknown_kind_names_the_kinds():
    with pytest.raises(ValueError, match="bf16 \\+ Adam8bit"):
        train_curve("bf16 + adam", 0, sizes("cpu"), torch.device("cpu"), steps=1)
    assert STABLE_EMBEDDING not in KINDS


def test_no_kind_is_named_plain_bf16_and_the_loss_is_reported_in_fp32():
    """'bf16' alone means stochastic rounding in the layout table: the kind that rounds its
    weights to nearest says so; a bf16 model's loss is reported in fp32, not on bf16's grid."""
    assert "bf16" not in KINDS and "bf16 (nearest)" in KINDS
    S = sizes("cpu")
    losses, _ = train_curve("bf16 (nearest)", 0, S, torch.device("cpu"), steps=2)
    assert any(float(torch.tensor(v).to(torch.bfloat16)) != v for v in losses)
