"""Triton kernels of flash-attn shaped for Hopper's automatic warp specialisation: the algorithm
of kernels.py (same layout, log2 scores, bottom-right causal mask, LSE, GQA), each kernel's
loop marked `tl.range(..., warp_specialize=True)`.

On sm_90 Triton 3.6 runs its Hopper warp-specialisation pass (nvgpu-warp-specialization) on
such a loop: with num_warps = 4 it makes one producer warpgroup that issues the TMA loads into a
`num_stages`-deep shared-memory ring (setmaxnreg 40) and two consumer warpgroups (setmaxnreg
232) that split the dots' M dimension in halves: 12 warps, FlashAttention-3's layout without
its ping-pong scheduling. What the pass needs, found by compiling for sm_90a (NOTES.md):

- every tile read through a TMA descriptor, the tiles loaded before the loop included (a
  pointer-loaded q aborts the compiler in WSLowerToken), and no loop-invariant pointer load
  (dq's LSE and delta rows, which LICM would hoist: read through descriptors too);
- one loop in the kernel (a second one, even unmarked, aborts it in the dominance check; a
  nested loop aborts it in WSDataPartition) and no run-time branch in its body (that silently
  turns the specialisation off).

Hence the shape of these kernels: a masked problem (causal, or a ragged last key block in the
forward) applies its mask on every step instead of only on the diagonal blocks, and dk/dv walks
the (query head of the GQA group, query block) pairs in one flattened loop through 3-D (H, N, D)
descriptors. The host (`op._ws_flag`) launches them only on sm_90, for half precision, where
every tensor the kernel reads is TMA-aligned (`op.use_tma`), and dq only where Nq % 4 == 0
(16-byte LSE rows); under the interpreter the flag is ignored and they run as plain loops. They
take the portable kernels' arguments (DOT_PREC, TMA included), so the host swaps the kernel only.
"""

import triton
import triton.language as tl

from .kernels import LN2, _head_source, _load_vec, _lse_log2, _program_ids, _store_rows


@triton.jit
def _heads_source(base, n_heads, n_rows, stride_h, stride_n, BLOCK_ROWS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """A TMA descriptor over all heads of one batch, (n_heads, n_rows, HEAD_DIM), read in
    (1, BLOCK_ROWS, BLOCK_D) boxes: a loop can change head without building a descriptor."""
    return tl.make_tensor_descriptor(
        base, [n_heads, n_rows, HEAD_DIM], [stride_h, stride_n, 1], [1, BLOCK_ROWS, BLOCK_D]
    )


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["Nq", "Nk"])
def attn_fwd_ws_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_on,
    stride_oh,
    H,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
):
    """One BLOCK_M query block of one head, as kernels.attn_fwd_kernel, in one loop."""
    tl.static_assert(TMA, "the host takes this kernel only where every tensor is TMA-aligned")
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_m, bh = _program_ids(tl.cdiv(Nq, BLOCK_M), CAUSAL)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_src = _head_source(Q + b * stride_qb + h * stride_qh, Nq, stride_qn, BLOCK_M, HEAD_DIM,
                         BLOCK_D, True)  # fmt: skip
    k_src = _head_source(K + b * stride_kb + hk * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, True)  # fmt: skip
    v_src = _head_source(V + b * stride_vb + hk * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, True)  # fmt: skip
    q = q_src.load([start_m, 0])

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    shift = Nk - Nq
    MASK: tl.constexpr = CAUSAL or not EVEN_N
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M + shift, Nk)
        last = tl.minimum(rows + shift, Nk - 1)  # the last key each row sees
    else:
        hi = Nk
        last = tl.full([BLOCK_M], Nk - 1, dtype=tl.int32)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        k = k_src.load([start_n, 0])
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if MASK:
            qk = tl.where(
                (start_n + offs_n)[None, :] <= last[:, None], qk * qk_scale, -float("inf")
            )
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; shift it by 0 to avoid inf - inf.
            m_use = tl.where(m_ij == -float("inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_src.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_ij

    # A row that sees no key (causal, Nq > Nk) has l = 0: output zeros and LSE = -inf.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on
    o_ptrs = o_ptrs + offs_m[:, None] * stride_on + offs_d[None, :]
    _store_rows(o_ptrs, o.to(O.dtype.element_ty), rows, Nq, offs_d, not EVEN_M, HEAD_DIM)
    lse = (m_i + tl.math.log2(l_i)) * LN2
    lse_ptrs = LSE + bh.to(tl.int64) * Nq + rows
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=rows < Nq)


# ---------------------------------------------------------------------------------------------
# Backward (the preprocess kernel is kernels.attn_bwd_preprocess_kernel)
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["Nq", "Nk"])
def attn_bwd_dkdv_ws_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    H,
    Hkv,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
):
    """dk, dv of one BLOCK_N key block of one kv head, as kernels.attn_bwd_dkdv_kernel: one loop
    over the (query head g of the group, query block) pairs, g slowest, so the group's
    contributions still add up in a fixed order (deterministic). k and v stay in shared memory
    (TMA-loaded wgmma operands), not in registers."""
    tl.static_assert(TMA, "the host takes this kernel only where every tensor is TMA-aligned")
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid_n, bhk = _program_ids(tl.cdiv(Nk, BLOCK_N), False)
    b = (bhk // Hkv).to(tl.int64)
    hk = bhk % Hkv
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_src = _head_source(K + b * stride_kb + hk.to(tl.int64) * stride_kh, Nk, stride_kn, BLOCK_N,
                         HEAD_DIM, BLOCK_D, True)  # fmt: skip
    v_src = _head_source(V + b * stride_vb + hk.to(tl.int64) * stride_vh, Nk, stride_vn, BLOCK_N,
                         HEAD_DIM, BLOCK_D, True)  # fmt: skip
    q_src = _heads_source(Q + b * stride_qb, H, Nq, stride_qh, stride_qn, BLOCK_M, HEAD_DIM,
                          BLOCK_D)  # fmt: skip
    do_src = _heads_source(DO + b * stride_dob, H, Nq, stride_doh, stride_don, BLOCK_M, HEAD_DIM,
                           BLOCK_D)  # fmt: skip
    k = k_src.load([start_n, 0])
    v = v_src.load([start_n, 0])
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    shift = Nk - Nq
    m_lo = 0
    if CAUSAL:  # the first query block that sees part of this key block
        m_lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
    n_blocks = tl.cdiv(tl.maximum(Nq - m_lo, 0), BLOCK_M)
    for t in tl.range(0, GROUP * n_blocks, warp_specialize=True):
        g = t // n_blocks
        start_m = m_lo + (t - g * n_blocks) * BLOCK_M
        h = hk * GROUP + g
        rows = start_m + offs_m
        vec = (b * H + h) * Nq + rows
        # Query rows past Nq read q = do = 0 (TMA) and LSE = +inf, so their p is 0.
        q = tl.reshape(q_src.load([h, start_m, 0]), [BLOCK_M, BLOCK_D])
        lse2 = _lse_log2(_load_vec(LSE + vec, rows, Nq, float("inf"), not EVEN_M))
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if CAUSAL:
            p_t = tl.where(cols[:, None] <= rows[None, :] + shift, p_t, 0.0)
        do = tl.reshape(do_src.load([h, start_m, 0]), [BLOCK_M, BLOCK_D])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        delta = _load_vec(DELTA + vec, rows, Nq, 0.0, not EVEN_M)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)

    dk *= sm_scale
    dk_ptrs = DK + b * stride_dkb + hk.to(tl.int64) * stride_dkh + start_n.to(tl.int64) * stride_dkn
    _store_rows(
        dk_ptrs + offs_n[:, None] * stride_dkn + offs_d[None, :],
        dk.to(DK.dtype.element_ty), cols, Nk, offs_d, not EVEN_N, HEAD_DIM,
    )  # fmt: skip
    dv_ptrs = DV + b * stride_dvb + hk.to(tl.int64) * stride_dvh + start_n.to(tl.int64) * stride_dvn
    _store_rows(
        dv_ptrs + offs_n[:, None] * stride_dvn + offs_d[None, :],
        dv.to(DV.dtype.element_ty), cols, Nk, offs_d, not EVEN_N, HEAD_DIM,
    )  # fmt: skip


@triton.jit(do_not_specialize=["Nq", "Nk"])
def attn_bwd_dq_ws_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_dqb,
    stride_dqn,
    stride_dqh,
    H,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
):
    """dq of one query block, as kernels.attn_bwd_dq_kernel, in one loop. Keys past Nk read
    k = v = 0 and add nothing; only the causal mask is needed."""
    tl.static_assert(TMA, "the host takes this kernel only where every tensor is TMA-aligned")
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid_m, bh = _program_ids(tl.cdiv(Nq, BLOCK_M), CAUSAL)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_src = _head_source(Q + b * stride_qb + h * stride_qh, Nq, stride_qn, BLOCK_M, HEAD_DIM,
                         BLOCK_D, True)  # fmt: skip
    do_src = _head_source(DO + b * stride_dob + h * stride_doh, Nq, stride_don, BLOCK_M, HEAD_DIM,
                          BLOCK_D, True)  # fmt: skip
    k_src = _head_source(K + b * stride_kb + hk * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, True)  # fmt: skip
    v_src = _head_source(V + b * stride_vb + hk * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, True)  # fmt: skip
    q = q_src.load([start_m, 0])
    do = do_src.load([start_m, 0])
    # The LSE and delta rows through descriptors over the (B * H, Nq) rows up to this head's
    # (a pointer load outside the loop aborts the warp-specialisation pass; the host takes this
    # kernel only where Nq % 4 == 0, the 16-byte row stride TMA needs). Rows past Nq read zeros;
    # their dq is not stored.
    lse_src = tl.make_tensor_descriptor(LSE, [bh + 1, Nq], [Nq, 1], [1, BLOCK_M])
    delta_src = tl.make_tensor_descriptor(DELTA, [bh + 1, Nq], [Nq, 1], [1, BLOCK_M])
    lse2 = _lse_log2(tl.reshape(lse_src.load([bh, start_m]), [BLOCK_M]))
    delta = tl.reshape(delta_src.load([bh, start_m]), [BLOCK_M])
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    shift = Nk - Nq
    if CAUSAL:  # noqa: SIM108 (a constexpr branch, not a run-time select)
        hi = tl.minimum(start_m + BLOCK_M + shift, Nk)
    else:
        hi = Nk
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        k = k_src.load([start_n, 0])
        v = v_src.load([start_n, 0])
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if CAUSAL:
            p = tl.where((start_n + offs_n)[None, :] <= rows[:, None] + shift, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)

    dq *= sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + start_m.to(tl.int64) * stride_dqn
    _store_rows(
        dq_ptrs + offs_m[:, None] * stride_dqn + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), rows, Nq, offs_d, not EVEN_M, HEAD_DIM,
    )  # fmt: skip
