"""FlashAttention-2 forward kernels in Triton for the tests of chapter 10's Triton exercise: the
reference and the wrong kernels a learner writes, each with the signature `launch_forward`
launches. One kernel body with switches (`_forward`); each public kernel is one setting of them."""
import triton
import triton.language as tl


@triton.jit
def _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, RESCALE: tl.constexpr,
             TOP_LEFT: tl.constexpr, KEY_MASK: tl.constexpr, LSE_WITH_M: tl.constexpr,
             SKIP: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + head * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                mask=(rows[:, None] < n_q) & (dims[None, :] < d), other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    offset = 0 if TOP_LEFT else n_k - n_q
    stop = n_k
    if IS_CAUSAL and SKIP:
        stop = tl.minimum(n_k, (tile + 1) * BLOCK_Q + offset)
    for start in range(0, stop, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        inside = (cols[:, None] < n_k) & (dims[None, :] < d)
        k = tl.load(K + head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=inside, other=0.0)
        v = tl.load(V + head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=inside, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        seen = cols[None, :] < (n_k if KEY_MASK else n_k + BLOCK_K)
        if IS_CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift) if RESCALE else tl.full([BLOCK_Q], 1.0, tl.float32)
        l = alpha * l + tl.sum(p, 1)
        acc = alpha[:, None] * acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    safe = tl.where(l > 0, l, 1.0)
    tl.store(O + head * stride_oh + rows[:, None] * stride_on + dims[None, :], acc / safe[:, None],
             mask=(rows[:, None] < n_q) & (dims[None, :] < d))
    lse = m + tl.log(safe) if LSE_WITH_M else tl.log(safe)
    tl.store(L + head * stride_lh + rows, tl.where(l > 0, lse, float("-inf")), mask=rows < n_q)


@triton.jit
def reference(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
              stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, True, False,
             True, True, True)


@triton.jit
def no_rescale(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
               stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, False, False,
             True, True, True)


@triton.jit
def top_left(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, True, True,
             True, True, True)


@triton.jit
def no_key_mask(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, True, False,
             False, True, True)


@triton.jit
def lse_without_m(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                  stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, True, False,
             True, False, True)


@triton.jit
def no_skipping(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, True, False,
             True, True, False)


@triton.jit
def unmasked_loads(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh,
                   stride_on, stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Known wrong: K and V loaded without a mask, scores not masked past n_k (reads padding)."""
    tile, head = tl.program_id(0), tl.program_id(1)
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + head * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                mask=(rows[:, None] < n_q) & (dims[None, :] < d), other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for start in range(0, n_k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        k = tl.load(K + head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=dims[None, :] < d, other=0.0)
        v = tl.load(V + head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=dims[None, :] < d, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = alpha * l + tl.sum(p, 1)
        acc = alpha[:, None] * acc + tl.dot(p, v)
        m = m_new
    tl.store(O + head * stride_oh + rows[:, None] * stride_on + dims[None, :], acc / l[:, None],
             mask=(rows[:, None] < n_q) & (dims[None, :] < d))
    tl.store(L + head * stride_lh + rows, m + tl.log(l), mask=rows < n_q)


@triton.jit
def not_written(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """What a workbook's stub is: a kernel whose body raises."""
    raise NotImplementedError("Exercise: replace this line with your code (about 30 lines in "
                              "the reference solution).")
