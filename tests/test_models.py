"""companion.models: deterministic given a seed, the right shapes, causal, and trainable."""
import pytest
import torch

from companion.models import GPT, MLP, make_classification, make_regression, make_tokens


def test_same_seed_same_model_and_data():
    a, b = GPT(40, 16, 32, 2, 4, seed=3), GPT(40, 16, 32, 2, 4, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = GPT(40, 16, 32, 2, 4, seed=4)
    assert not torch.equal(a.head.weight, c.head.weight)
    assert all(torch.equal(u, v) for u, v in zip(make_tokens(5, 16, vocab=40, seed=1),
                                                 make_tokens(5, 16, vocab=40, seed=1)))
    assert torch.equal(make_classification(9, 3, 2, seed=2)[0], make_classification(9, 3, 2, seed=2)[0])
    assert torch.equal(MLP(3, 8, 2, 2, seed=1).net[0].weight, MLP(3, 8, 2, 2, seed=1).net[0].weight)


def test_shapes_and_dtypes():
    x, y = make_tokens(4, 12, vocab=30)
    assert x.shape == y.shape == (4, 12) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])                  # y is x shifted by one
    assert GPT(30, 12, 16, 1, 2)(x).shape == (4, 12, 30)
    X, labels = make_classification(10, 6, 3)
    assert X.shape == (10, 6) and labels.shape == (10,) and int(labels.max()) < 3
    assert MLP(6, 8, 3, 3, dtype=torch.bfloat16)(X.bfloat16()).dtype == torch.bfloat16


def test_gpt_is_causal():
    model = GPT(20, 10, 16, 2, 2)
    x, _ = make_tokens(1, 10, vocab=20)
    changed = x.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 20
    a, b = model(x), model(changed)
    assert torch.allclose(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])


def test_bad_shapes_are_explained():
    with pytest.raises(ValueError, match="multiple of heads"):
        GPT(20, 10, 18, 1, 4)
    with pytest.raises(ValueError, match="longer than seq_len"):
        GPT(20, 4, 16, 1, 2)(torch.zeros(1, 5, dtype=torch.int64))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_a_few_steps_lower_the_loss(kind):
    if kind == "mlp":
        model, data = MLP(8, 32, 2, 4), make_classification(64, 8, 4)
    else:
        model, data = GPT(16, 16, 32, 1, 2), make_tokens(16, 16, vocab=16)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = model.loss(*data).item()
    for _ in range(30):
        opt.zero_grad()
        model.loss(*data).backward()
        opt.step()
    assert model.loss(*data).item() < 0.8 * first


def test_make_regression_is_kept():
    X, y, w, b = make_regression(20, 3, seed=0)
    assert X.shape == (20, 3) and y.shape == (20,)


def test_fused_attention_computes_the_same_and_saves_no_square_term():
    from companion import checkpointing
    x, _ = make_tokens(2, 48, vocab=40, seed=0)
    plain = GPT(40, 48, 32, 2, 4, seed=0)
    fused = GPT(40, 48, 32, 2, 4, seed=0, fused_attention=True)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    saved = {name: [s.shape for s in checkpointing.saved_for_backward(m.blocks[0], m.tok(x))]
             for name, m in (("plain", plain), ("fused", fused))}
    assert (2, 4, 48, 48) in saved["plain"] and (2, 4, 48, 48) not in saved["fused"]
