"""FlashAttention-2 forward kernels in Triton for the tests of chapter 10's Triton exercise: the
reference and the wrong kernels a learner writes, each with the signature `launch_forward`
launches. One kernel body with a switch (`_forward`); each public kernel is one setting of it."""
import triton
import triton.language as tl


@triton.jit
def _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, MISTAKE: tl.constexpr):
    """The reference when MISTAKE is "", else the kernel with that one mistake."""
    tile, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + head * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                mask=(rows[:, None] < n_q) & (dims[None, :] < d), other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    offset = 0 if MISTAKE == "top_left" else n_k - n_q
    stop = n_k
    if IS_CAUSAL and MISTAKE != "no_skipping":
        stop = tl.minimum(n_k, (tile + 1) * BLOCK_Q + offset)
        if MISTAKE == "stop_first_row":                  # the tile's first row's last key + 1
            stop = tl.minimum(n_k, tile * BLOCK_Q + offset + 1)
        if MISTAKE == "stop_one_short":
            stop = tl.minimum(n_k, (tile + 1) * BLOCK_Q + offset - 1)
        if MISTAKE == "stop_whole_tiles":               # rounded down to a whole key tile
            stop = tl.minimum(n_k, tl.maximum((tile + 1) * BLOCK_Q + offset, 0) // BLOCK_K
                              * BLOCK_K)
    for start in range(0, stop, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        inside = (cols[:, None] < n_k) & (dims[None, :] < d)
        k = tl.load(K + head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=inside, other=0.0)
        v = tl.load(V + head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=inside, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        seen = cols[None, :] < (n_k + BLOCK_K if MISTAKE == "no_key_mask" else n_k)
        if IS_CAUSAL:
            if MISTAKE == "strict_diagonal":
                seen = seen & (cols[None, :] < rows[:, None] + offset)
            else:
                seen = seen & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = m_new if MISTAKE == "no_inf_guard" else tl.where(m_new == float("-inf"), 0.0,
                                                                   m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        one = tl.full([BLOCK_Q], 1.0, tl.float32)
        l = (one if MISTAKE == "no_rescale" else alpha) * l + tl.sum(p, 1)
        alpha_acc = one if MISTAKE == "no_rescale" or MISTAKE == "no_acc_rescale" else alpha
        acc = alpha_acc[:, None] * acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    safe = tl.where(l > 0, l, 1.0)
    o_h = stride_qh if MISTAKE == "q_strides_for_o" else stride_oh
    o_n = stride_qn if MISTAKE == "q_strides_for_o" else stride_on
    tl.store(O + head * o_h + rows[:, None] * o_n + dims[None, :], acc / safe[:, None],
             mask=(rows[:, None] < n_q) & (dims[None, :] < d))
    lse = tl.log(safe) if MISTAKE == "lse_without_m" else m + tl.log(safe)
    tl.store(L + head * stride_lh + rows, tl.where(l > 0, lse, float("-inf")), mask=rows < n_q)


@triton.jit
def reference(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
              stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "")


@triton.jit
def no_rescale(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
               stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "no_rescale")


@triton.jit
def no_acc_rescale(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                   stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "no_acc_rescale")


@triton.jit
def top_left(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "top_left")


@triton.jit
def no_key_mask(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "no_key_mask")


@triton.jit
def lse_without_m(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                  stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "lse_without_m")


@triton.jit
def no_skipping(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "no_skipping")


@triton.jit
def q_strides_for_o(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                    stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "q_strides_for_o")


@triton.jit
def no_inf_guard(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                 stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "no_inf_guard")


@triton.jit
def stop_first_row(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                   stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "stop_first_row")


@triton.jit
def stop_one_short(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                   stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "stop_one_short")


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
def _q_tile(Q, stride_qh, stride_qn, n_q, d, tile, head, BLOCK_Q: tl.constexpr,
            BLOCK_D: tl.constexpr, HOW: tl.constexpr):
    """The Q tile, loaded with a block pointer or a tensor descriptor (zeros out of bounds)."""
    if HOW == "block_ptr":
        pointer = tl.make_block_ptr(Q + head * stride_qh, (n_q, d), (stride_qn, 1),
                                    (tile * BLOCK_Q, 0), (BLOCK_Q, BLOCK_D), (1, 0))
        return tl.load(pointer, boundary_check=(0, 1), padding_option="zero")
    else:
        described = tl.make_tensor_descriptor(Q + head * stride_qh, shape=[n_q, d],
                                              strides=[stride_qn, 1],
                                              block_shape=[BLOCK_Q, BLOCK_D])
        return described.load([tile * BLOCK_Q, 0])


@triton.jit
def _with_q_from(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                 stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HOW: tl.constexpr):
    """The reference with its Q tile loaded by `_q_tile`."""
    tile, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    q = _q_tile(Q, stride_qh, stride_qn, n_q, d, tile, head, BLOCK_Q, BLOCK_D, HOW)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    stop = n_k
    if IS_CAUSAL:
        stop = tl.minimum(n_k, (tile + 1) * BLOCK_Q + n_k - n_q)
    for start in range(0, stop, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        inside = (cols[:, None] < n_k) & (dims[None, :] < d)
        k = tl.load(K + head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=inside, other=0.0)
        v = tl.load(V + head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                    mask=inside, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        seen = cols[None, :] < n_k
        if IS_CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None] + n_k - n_q)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        l = alpha * l + tl.sum(p, 1)
        acc = alpha[:, None] * acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    safe = tl.where(l > 0, l, 1.0)
    tl.store(O + head * stride_oh + rows[:, None] * stride_on + dims[None, :], acc / safe[:, None],
             mask=(rows[:, None] < n_q) & (dims[None, :] < d))
    tl.store(L + head * stride_lh + rows, tl.where(l > 0, m + tl.log(safe), float("-inf")),
             mask=rows < n_q)


@triton.jit
def block_pointers(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh,
                   stride_on, stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Correct where Triton has block pointers; Triton 3.9 removed them (NotImplementedError)."""
    _with_q_from(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                 stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "block_ptr")


@triton.jit
def tensor_descriptors(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh,
                       stride_on, stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr,
                       BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Correct: the Q tile through tl.make_tensor_descriptor, what replaced block pointers."""
    _with_q_from(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                 stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D, "descriptor")


@triton.jit
def not_written(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
                stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """What a workbook's stub is: a kernel whose body raises."""
    raise NotImplementedError("Exercise: replace this line with your code (about 30 lines in "
                              "the reference solution).")


@triton.jit
def strict_diagonal(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh,
                    stride_on, stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D,
             "strict_diagonal")


@triton.jit
def stop_whole_tiles(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh,
                     stride_on, stride_lh, n_q, n_k, d, scale, IS_CAUSAL: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    _forward(Q, K, V, O, L, stride_qh, stride_qn, stride_kh, stride_kn, stride_oh, stride_on,
             stride_lh, n_q, n_k, d, scale, IS_CAUSAL, BLOCK_Q, BLOCK_K, BLOCK_D,
             "stop_whole_tiles")
