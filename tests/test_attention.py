"""companion.attention: FlashAttention-2 (PyTorch and Triton) equals written-out attention and
SDPA, saves what it promises, and says clearly what it does not take."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from companion import estimate, models
from companion.attention import (FlashAttentionTorch, causal_mask, flash_forward, flash_saved_bytes,
                                 merge, naive_attention, naive_saved_bytes, tile_states)
from companion.attention.tiles import (SHIPPED, SRAM_PER_SM, choose_tiles, fitting_tiles,
                                       forward_hbm_bytes, tile_sram_bytes)
from companion.checkpointing import activation_bytes

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from attention_cases import CASES, TOLERANCE, inputs, max_errors, reference, run  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_shape, k_shape, causal", CASES)
def test_flash_torch_equals_written_out_attention(q_shape, k_shape, causal, dtype):
    (q, k, v), do = inputs(q_shape, k_shape, dtype, seed=len(q_shape))
    got = run(FlashAttentionTorch, q, k, v, do, causal, block_q=16, block_k=8)
    assert max(max_errors(got, reference(q, k, v, do, causal))) <= TOLERANCE[dtype]


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
       nq=st.integers(1, 40), nk=st.integers(1, 40), d=st.integers(1, 12),
       bq=st.integers(1, 17), bk=st.integers(1, 17), causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_flash_torch_on_random_shapes_and_tiles(b, heads, nq, nk, d, bq, bk, causal, seed):
    (q, k, v), do = inputs((b, heads[0], nq, d), (b, heads[1], nk, d), torch.float64, seed)
    got = run(FlashAttentionTorch, q, k, v, do, causal, block_q=bq, block_k=bk)
    assert max(max_errors(got, reference(q, k, v, do, causal))) <= 1e-10


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("nq, nk, causal", [(48, 48, True), (48, 48, False), (30, 70, False)])
def test_flash_torch_equals_sdpa(nq, nk, causal, dtype, tol):
    """SDPA returns no log-sum-exp: outputs and gradients only. Same lengths when causal, since
    SDPA aligns the mask top-left (see the next test)."""
    (q, k, v), do = inputs((2, 4, nq, 32), (2, 4, nk, 32), dtype, seed=nq + nk)
    ours = run(FlashAttentionTorch, q, k, v, do, causal, block_q=32, block_k=16)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    theirs = (o.detach(), ours[1], *torch.autograd.grad(o, (q, k, v), do))
    want = reference(q, k, v, do, causal)
    assert max(max_errors(ours, want)) <= tol and max(max_errors(theirs, want)) <= tol


def test_causal_alignment_bottom_right_for_ours_top_left_for_sdpa():
    (q, k, v), _ = inputs((1, 2, 5, 8), (1, 2, 9, 8), torch.float64, seed=3)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(sdpa, naive_attention(q, k, v, True, align="top_left"))
    ours = FlashAttentionTorch.apply(q, k, v, True)
    torch.testing.assert_close(ours, naive_attention(q, k, v, True, align="bottom_right"))
    assert not torch.allclose(ours, sdpa)
    assert causal_mask(2, 4).tolist() == [[False, False, False, True], [False] * 4]
    assert causal_mask(2, 4, align="top_left").tolist() == [[False, True, True, True],
                                                            [False, False, True, True]]


def test_queries_that_see_no_key_give_zeros_not_nan():
    (q, k, v), do = inputs((2, 9, 8), (2, 4, 8), torch.float32, seed=1)
    o, lse = flash_forward(q, k, v, True, block_q=4, block_k=4)
    assert torch.all(o[:, :5] == 0) and torch.all(lse[:, :5] == float("-inf"))
    grads = torch.autograd.grad(FlashAttentionTorch.apply(q, k, v, True), (q, k, v), do)
    assert all(torch.isfinite(g).all() for g in grads) and torch.all(grads[0][:, :5] == 0)
    assert not torch.isnan(naive_attention(q, k, v, True)).any()


def test_saves_exactly_q_k_v_the_output_and_one_log_sum_exp():
    (q, k, v), _ = inputs((3, 21, 16), (3, 30, 16), torch.float32, seed=0)
    o = FlashAttentionTorch.apply(q, k, v, True, None, 8, 8)
    saved = o.grad_fn.saved_tensors
    assert len(saved) == 5 and all(a is b for a, b in zip(saved[:3], (q, k, v)))
    assert saved[3].data_ptr() == o.data_ptr() and saved[3].shape == o.shape
    assert [t.shape for t in saved].count((3, 21)) == 1 and saved[4].dtype == torch.float32


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_shape, k_shape, dtype", [
    ((2, 3, 10, 8), (2, 3, 12, 8), torch.float32), ((2, 4, 14, 8), (2, 2, 12, 8), torch.bfloat16),
    ((3, 7, 16), (3, 7, 16), torch.float32)])
def test_saved_bytes_formulas_match_measurement(q_shape, k_shape, dtype, causal):
    (q, k, v), _ = inputs(q_shape, k_shape, dtype, seed=0)
    assert activation_bytes(lambda x: naive_attention(x, k, v, causal), q) == naive_saved_bytes(
        q_shape, k_shape, dtype, is_causal=causal)
    assert activation_bytes(lambda x: FlashAttentionTorch.apply(x, k, v, causal), q) == \
        flash_saved_bytes(q_shape, k_shape, dtype)


def test_online_merge_is_exact_and_handles_empty_parts():
    g = torch.Generator().manual_seed(0)
    s, v = torch.randn(3, 20, generator=g, dtype=torch.float64), torch.randn(20, 5, generator=g,
                                                                              dtype=torch.float64)

    def part(cols):
        m = s[:, cols].amax(-1)
        p = torch.exp(s[:, cols] - m[:, None])
        return m, p.sum(-1), p @ v[cols] / p.sum(-1, keepdim=True)
    m, l, o = merge(*part(slice(0, 7)), *part(slice(7, 20)))
    torch.testing.assert_close(o, s.softmax(-1) @ v)
    torch.testing.assert_close(m + l.log(), s.logsumexp(-1))
    empty = (torch.full((3,), float("-inf"), dtype=torch.float64), torch.zeros(3,
             dtype=torch.float64), torch.zeros(3, 5, dtype=torch.float64))
    torch.testing.assert_close(merge(*empty, m, l, o)[2], o)
    assert torch.equal(merge(*empty, *empty)[2], empty[2])
    states = tile_states(s[0], v, 6)
    assert [st["keys"] for st in states] == [6, 12, 18, 20]
    assert states[-1]["lse"] == pytest.approx(float(s[0].logsumexp(0)))


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v: (q, k, v[..., :4], False), "one shape"),
    (lambda q, k, v: (q[..., :4], k, v, False), "head dimensions differ"),
    (lambda q, k, v: (q, k[:1], v[:1], False), "leading dimensions differ"),
    (lambda q, k, v: (q, k[:, :2], v[:, :2], False), "must divide"),
    (lambda q, k, v: (q, k, v, 1), "True or False"),
    (lambda q, k, v: (q.long(), k.long(), v.long(), False), "floating-point"),
    (lambda q, k, v: (q, k.double(), v.double(), False), "one dtype"),
    (lambda q, k, v: (q[0, 0], k[0, 0], v[0, 0], False), "at least 3"),
])
def test_clear_errors(bad, message):
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    with pytest.raises((TypeError, ValueError), match=message):
        FlashAttentionTorch.apply(*bad(q, k, v))
    with pytest.raises(ValueError, match="block_q"):
        FlashAttentionTorch.apply(q, k, v, False, None, 0)
    with pytest.raises(ValueError, match="scale"):
        FlashAttentionTorch.apply(q, k, v, False, float("nan"))


def test_tile_bytes_by_hand_and_the_choice_for_an_h100():
    # Q 128·64·2, K and V 2·64·64·2, S 128·64·4, accumulator 128·64·4, m and l 2·128·4
    assert tile_sram_bytes(128, 64, 64, 2) == 16384 + 16384 + 32768 + 32768 + 1024
    assert forward_hbm_bytes(1000, 1000, 64, 2, 128) == (2000 + 2000 * 8) * 128 + 4000
    h100 = SRAM_PER_SM["H100"]["bytes"]
    assert choose_tiles(h100, 64, 2) == (256, 64)         # 98,304 + 1280·bk <= 233,472
    assert tile_sram_bytes(256, 64, 64, 2) <= h100 < tile_sram_bytes(256, 128, 64, 2)
    assert choose_tiles(4096, 256, 4) is None and fitting_tiles(4096, 256, 4) == []
    assert all(entry["source"] for entry in SRAM_PER_SM.values())


def test_the_levers_move_the_model_to_the_shipped_tiles_where_the_count_allows():
    """The SRAM count alone picks 256 x 16 on an H100 at d = 128; a lower bound on block_k gives
    FA3's causal 128 x 128 there and FA2's 128 x 64 on an A100; two programs per SM halve the
    budget: (128 + 2·64)·256 + 4·128·64 + 4·128·128 + 8·128 = 164,864 > 233,472 // 2."""
    h100, a100 = SRAM_PER_SM["H100"]["bytes"], SRAM_PER_SM["A100"]["bytes"]
    assert choose_tiles(h100, 128, 2) == (256, 16)
    assert choose_tiles(h100, 128, 2, min_block_k=64) == (128, 128)
    assert choose_tiles(a100, 128, 2, min_block_k=64) == (128, 64)
    assert tile_sram_bytes(128, 64, 128, 2) == 164_864 > h100 // 2
    assert choose_tiles(h100, 128, 2, programs_per_sm=2, min_block_k=64) == (64, 64)
    assert choose_tiles(h100, 128, 2, min_block_k=512) is None
    shipped = {(kernel, gpu, causal): tiles for kernel, gpu, causal, tiles, _, _ in SHIPPED}
    assert shipped[("FA3", "H100", True)] == (128, 128) and shipped[("FA2", "A100", None)] == (128, 64)
    # FA2's own count of its shared memory (Q, K, V tiles only): "128 x 32 (48 KB smem)"
    assert 2 * 128 * (128 + 2 * 32) == 48 * 1024


@pytest.mark.parametrize("kind", ["sdpa", "flash"])
def test_gpt_with_a_fused_kernel_trains_like_the_written_out_one(kind):
    x, y = models.make_tokens(3, 40, vocab=30)
    losses, grads = [], []
    for attention in ("written", kind):
        model = models.GPT(30, 40, 32, 2, 4, attention=attention)
        loss = model.loss(x, y)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="attention must be one of"):
        models.GPT(30, 40, 32, 2, 4, attention="flash2")


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                              ("autocast", torch.float32)])
def test_estimator_counts_the_fused_kernels_to_the_byte(precision, dtype):
    from companion.memory import track
    B, T, C, L, H, V = 2, 72, 48, 2, 3, 40
    x, y = models.make_tokens(B, T, vocab=V)
    for kind in ("sdpa", "flash"):
        model = models.GPT(V, T, C, L, H, attention=kind, dtype=dtype)
        with track("cpu") as t, torch.autocast("cpu", torch.bfloat16,
                                               enabled=precision == "autocast"):
            loss = model.loss(x, y)
        assert t.current - loss.untyped_storage().nbytes() == estimate.gpt_activations(
            B, T, C, L, H, V, precision=precision, attention="fused")


def _triton_child(device: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else dict(os.environ)
    return subprocess.run([sys.executable, str(pathlib.Path(__file__).parent / "attention_cases.py"),
                           "triton", device], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (a Linux-only extra)")
def test_triton_kernels_under_the_interpreter_equal_written_out_attention():
    """The Triton kernels on CPU tensors, interpreted, in a child process: the environment
    variable is set for that process only."""
    done = _triton_child("cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok  ") == 2 * len(CASES)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_triton_kernels_native_on_the_gpu():
    done = _triton_child("cuda")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_on_cpu_tensors_without_the_interpreter_says_what_to_do():
    code = ("import torch; from companion.attention import FlashAttentionTriton as F\n"
            "q = torch.randn(1, 16, 16)\ntry:\n    F.apply(q, q, q, False)\n"
            "except RuntimeError as e:\n    print(e)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert "TRITON_INTERPRET=1" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("q_shape, k_shape, causal", [c for c in CASES if c[0][:-2] == c[1][:-2]])
def test_launch_forward_runs_a_kernel_interpreted_in_this_process(q_shape, k_shape, causal):
    """The exercise's launcher: a @triton.jit kernel (compiled kind, TRITON_INTERPRET unset) runs
    on CPU tensors under the interpreter, equals fp64 attention, and Triton's library is left as
    it was found."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from attention_kernels import reference as kernel
    from companion.attention.triton_launch import launch_forward
    assert "TRITON_INTERPRET" not in os.environ and isinstance(kernel, JITFunction)
    q, k, v = (t.detach() for t in inputs(q_shape, k_shape, torch.float32, seed=1)[0])
    o, lse = launch_forward(kernel, q, k, v, causal, 16, 32)
    want_o, want_lse = naive_attention(q.double(), k.double(), v.double(), causal,
                                       return_lse=True)
    assert max(max_errors((o, lse), (want_o, want_lse))) <= 2e-5
    assert isinstance(tl.zeros, JITFunction) and "TRITON_INTERPRET" not in os.environ
    with pytest.raises(ValueError, match="power of two"):
        launch_forward(kernel, q, k, v, causal, 24, 32)
