"""companion.models: deterministic given a seed, the right shapes, causal, and trainable; the
Llama against Hugging Face's own."""
import time

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode

from companion.estimate import llama_params
from companion.models import (GPT, MLP, Llama, llama_intermediate, make_classification,
                              make_regression, make_tokens)


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


@pytest.mark.parametrize("kind", ["mlp", "gpt", "llama"])
def test_a_few_steps_lower_the_loss(kind):
    if kind == "mlp":
        model, data = MLP(8, 32, 2, 4), make_classification(64, 8, 4)
    elif kind == "gpt":
        model, data = GPT(16, 16, 32, 1, 2), make_tokens(16, 16, vocab=16)
    else:
        model = Llama(16, 16, 32, 1, 4, kv_heads=2, intermediate=64)
        data = make_tokens(16, 16, vocab=16)
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


LLAMAS = [dict(vocab=50, seq_len=16, width=32, depth=2, heads=4, kv_heads=2, intermediate=56),
          dict(vocab=31, seq_len=9, width=24, depth=3, heads=3, kv_heads=3, intermediate=40,
               tied=True),
          dict(vocab=19, seq_len=12, width=40, depth=1, heads=10, kv_heads=5, intermediate=72,
               qkv_bias=True)]


@pytest.mark.parametrize("shape", LLAMAS)
def test_llama_counts_its_parameters_by_formula(shape):
    model = Llama(**shape)
    sizes = {k: shape[k] for k in ("vocab", "width", "depth", "heads", "kv_heads",
                                   "intermediate")}
    extra = {k: shape[k] for k in ("tied", "qkv_bias") if k in shape}
    assert sum(p.numel() for p in model.parameters()) == llama_params(**sizes, **extra)
    block = model.blocks[0]
    assert (block.heads, block.kv_heads, block.fused_attention) == (
        shape["heads"], shape["kv_heads"], True)
    assert block.k_proj.out_features == shape["kv_heads"] * shape["width"] // shape["heads"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_shapes_and_a_loss_that_backpropagates(dtype):
    model = Llama(40, 12, 32, 2, 4, kv_heads=2, intermediate=48, dtype=dtype, seed=1)
    x, y = make_tokens(3, 12, vocab=40)
    logits = model(x)
    assert logits.shape == (3, 12, 40) and logits.dtype == dtype
    loss = model.loss(x, y)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    same = Llama(40, 12, 32, 2, 4, kv_heads=2, intermediate=48, dtype=dtype, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), same.parameters()))


def test_a_tied_llama_has_one_embedding_tensor():
    model = Llama(40, 12, 32, 1, 4, intermediate=48, tied=True)
    assert model.head.weight is model.tok.weight
    assert model.head.weight.untyped_storage().data_ptr() == \
        model.tok.weight.untyped_storage().data_ptr()
    model.loss(*make_tokens(2, 12, vocab=40)).backward()
    assert model.tok.weight.grad is model.head.weight.grad       # both uses add into one


def test_llama_is_causal_and_its_rotary_buffers_are_shared():
    model = Llama(20, 10, 16, 2, 2, intermediate=32)
    x, _ = make_tokens(1, 10, vocab=20)
    changed = x.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 20
    a, b = model(x), model(changed)
    assert torch.allclose(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])
    assert all(block.rotary is model.rotary for block in model.blocks)
    assert [name for name, _ in model.named_buffers()] == ["rotary.cos", "rotary.sin"]
    assert model.state_dict().keys().isdisjoint({"rotary.cos", "rotary.sin"})


def test_grouped_query_attention_is_attention_with_shared_key_value_heads():
    """The block's attention against a written-out one: k and v repeated heads // kv_heads times,
    causal softmax of q·kᵀ/√d, rotation as RoFormer's pairs (i, i + d/2)."""
    model = Llama(30, 7, 24, 1, 6, kv_heads=2, intermediate=32, rope_theta=100.0)
    block, x = model.blocks[0], torch.randn(2, 7, 24)
    B, T, h, kv, d = 2, 7, 6, 2, 4
    q = block.q_proj(x).view(B, T, h, d).transpose(1, 2)                    # (B, h, T, d)
    k = block.k_proj(x).view(B, T, kv, d).transpose(1, 2)                   # (B, kv, T, d)
    v = block.v_proj(x).view(B, T, kv, d).transpose(1, 2)
    angle = torch.arange(T)[:, None] * 100.0 ** (-torch.arange(0, d, 2) / d)   # (T, d/2)
    cos, sin = angle.cos(), angle.sin()

    def rotate(t):
        a, b = t[..., :d // 2], t[..., d // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    q, k = rotate(q), rotate(k).repeat_interleave(h // kv, dim=1)           # (B, h, T, d)
    scores = q @ k.transpose(-2, -1) / d ** 0.5                             # (B, h, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v.repeat_interleave(h // kv, dim=1)            # (B, h, T, d)
    expected = block.o_proj(y.transpose(1, 2).reshape(B, T, h * d))
    torch.testing.assert_close(block.attention(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_computes_what_hugging_face_computes(family):
    transformers = pytest.importorskip("transformers")
    V, T, C, L, H, KV, I = 50, 16, 32, 2, 4, 2, 56
    config = dict(vocab_size=V, hidden_size=C, intermediate_size=I, num_hidden_layers=L,
                  num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=T,
                  rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=family == "qwen2")
    if family == "llama":
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    else:
        theirs = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    ours = Llama(V, T, C, L, H, kv_heads=KV, intermediate=I, tied=family == "qwen2",
                 qkv_bias=family == "qwen2", rope_theta=500.0, norm_eps=1e-6)
    renames = [("model.embed_tokens", "tok"), ("model.layers", "blocks"), ("model.norm", "norm"),
               ("lm_head", "head"), ("self_attn.", ""), ("mlp.", ""),
               ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")]
    state = {}
    for name, tensor in theirs.state_dict().items():
        for old, new in renames:
            name = name.replace(old, new)
        state[name] = tensor
    ours.load_state_dict(state, strict=True)
    assert sum(p.numel() for p in ours.parameters()) == theirs.num_parameters()
    x = torch.randint(V, (3, T))
    torch.testing.assert_close(ours(x), theirs(x).logits, rtol=1e-5, atol=1e-5)


def test_llama_3_8b_builds_on_fake_tensors_in_seconds():
    start = time.perf_counter()
    with FakeTensorMode():
        model = Llama(128256, 8192, 4096, 32, 32, kv_heads=8, intermediate=14336,
                      rope_theta=500000.0, dtype=torch.bfloat16)
    assert time.perf_counter() - start < 10
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert llama_intermediate(4096) == 11008                  # Llama 2 7B's SwiGLU width


def test_bad_llama_shapes_are_explained():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        Llama(20, 8, 24, 1, 6, kv_heads=4, intermediate=32)
    with pytest.raises(ValueError, match="multiple of heads"):
        Llama(20, 8, 18, 1, 4, intermediate=32)
    with pytest.raises(ValueError, match="always fused"):
        Llama(20, 8, 16, 1, 2, intermediate=32, fused_attention=False)
    with pytest.raises(ValueError, match="longer than seq_len"):
        Llama(20, 4, 16, 1, 2, intermediate=32)(torch.zeros(1, 5, dtype=torch.int64))
