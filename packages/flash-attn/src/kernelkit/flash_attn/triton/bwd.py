"""The portable backward: the preprocess (delta, the padded row vectors, zeroed dq sums), the
dk/dv and dq kernels (7 block products per tile pair, deterministic), the conversion of fused
dq sums; and their launches (`can_implement`, `launch_*`). Layout and conventions:
`triton/common.py`; the padded row vectors: `attn_bwd_preprocess_kernel`."""

import triton
import triton.language as tl

from kernelkit.shared.runtime import cdiv

from ..config import DQ_KERNEL, ROW_PAD, BwdConfig, Problem, Scores, Varlen
from ..strides import strides
from .common import (
    LOG2E,
    _head_source,
    _load_block,
    _load_rows,
    _program_ids,
    _ranges,
    _sequence,
    _store_rows,
    _tanh,
    _visible,
    dot_precision,
)


@triton.jit
def _load_vec(ptrs, rows, n_rows, other, CHECK_ROWS: tl.constexpr):
    if CHECK_ROWS:  # noqa: SIM108 (a constexpr branch, not a run-time select)
        x = tl.load(ptrs, mask=rows < n_rows, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _lse_log2(lse):
    """Natural-log LSE -> log2 units; an empty row (-inf) becomes +inf so its p = exp2(s - lse) = 0."""
    return tl.where(lse == -float("inf"), float("inf"), lse * LOG2E)


@triton.jit
def _rowvec_start(CU, b, ROW_PAD: tl.constexpr):
    """First position of sequence b's rows in the backward's padded row vectors (lse2, delta) of
    a packed batch: a multiple of 16 (as a block-multiple dense row is), with room for the
    sequence's rows rounded up to ROW_PAD before the next sequence's start."""
    return (tl.load(CU + b) // 16 * 16).to(tl.int64) + b * (ROW_PAD + 16)


@triton.jit
def _load_lse2(ptrs, rows, n_rows, CHECK_ROWS: tl.constexpr, ROWVEC: tl.constexpr):
    """The LSE of query rows in log2 units: ROWVEC reads the preprocess's padded copy (already
    in log2 units, +inf past the end: no row check), else the forward's LSE."""
    if ROWVEC:
        x = tl.load(ptrs)
    else:
        x = _lse_log2(_load_vec(ptrs, rows, n_rows, float("inf"), CHECK_ROWS))
    return x


@triton.jit
def _tail_start(lo, hi, n, BLOCK: tl.constexpr):
    """Where the blocks of [lo, hi) (block-aligned from 0) that can reach past n begin: at n's
    last block boundary, clamped to the range. A ragged length leaves one partial block, so
    the loops run [lo, tail) without the length checks and only the rest with them."""
    return tl.maximum(tl.minimum(hi, n // BLOCK * BLOCK), lo)


# Query rows per semaphore of the Hopper backward's ordered dq sums (gluon/bwd.py, SEM_ROWS).
SEM_ROWS = tl.constexpr(64)


@triton.jit(do_not_specialize=["Nq"])
def attn_bwd_preprocess_kernel(
    O,
    DO,
    LSE,
    DLSE,
    LSE2,
    DELTA,
    CU_Q,
    DQACC,
    SEM,
    stride_ob,
    stride_on,
    stride_oh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_lb,
    stride_lh,
    stride_vb,
    stride_vh,
    H,
    Nq,
    HAS_DLSE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWVEC: tl.constexpr,
    ROW_PAD: tl.constexpr,
    VARLEN: tl.constexpr,
    ZERO_DQ: tl.constexpr,
    LSE2_SHIFT: tl.constexpr = 0.0,
    DELTA_SCALE: tl.constexpr = 1.0,
):
    """delta = rowsum(o * do) - dlse (dlse: the gradient flowing into the returned LSE; o and do
    HEAD_DIM_V wide, v's head dim), rows of LSE / DLSE read through (batch, head) strides and
    of LSE2 / DELTA through theirs.

    ROWVEC: the backward's row vectors, padded: lse2 (the LSE in log2 units) and delta of every
    row up to Nq rounded up to ROW_PAD, +inf and 0 past Nq (so the kernels read them with no
    row check), each sequence of a packed batch (VARLEN) from a multiple of 16 (`_rowvec_start`;
    so they read them with 8-byte vectors; from cu_seqlens' own offsets they could not). The grid
    then covers the padded rows. Else delta only, of the Nq rows. LSE2_SHIFT, DELTA_SCALE
    (ROWVEC): stored are lse2 - LSE2_SHIFT and delta * DELTA_SCALE (the Gluon backward's
    softcap, gluon/bwd.py `scaled_rows`).

    ZERO_DQ (ROWVEC, dense): also zero the Hopper backward's float32 dq sums (DQACC, (B * H,
    padded rows, BLOCK_D)) and its semaphores (SEM, one per 64 padded rows) of these rows."""
    num_blocks = tl.cdiv(Nq, BLOCK_M)
    if ROWVEC:
        num_blocks = tl.cdiv(Nq, ROW_PAD) * (ROW_PAD // BLOCK_M)
    pid_m, bh = _program_ids(num_blocks, False)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    if VARLEN:  # (ROWVEC only: otherwise the host passes the packed rows as one sequence)
        q0, Nq = _sequence(CU_Q, b)
        if start_m >= tl.cdiv(Nq, ROW_PAD) * ROW_PAD:
            return
        O += q0 * stride_on
        DO += q0 * stride_don
        LSE += q0
        DLSE += q0
        v0 = _rowvec_start(CU_Q, b, ROW_PAD)
        LSE2 += v0
        DELTA += v0
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on
    o = _load_rows(o_ptrs + offs_m[:, None] * stride_on + offs_dv[None, :], rows, Nq, offs_dv,
                   True, HEAD_DIM_V)  # fmt: skip
    do_ptrs = DO + b * stride_dob + h * stride_doh + start_m.to(tl.int64) * stride_don
    do = _load_rows(do_ptrs + offs_m[:, None] * stride_don + offs_dv[None, :], rows, Nq, offs_dv,
                    True, HEAD_DIM_V)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    vec = b * stride_lb + h * stride_lh + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + vec, mask=rows < Nq, other=0.0)
    out = b * stride_vb + h * stride_vh + rows
    if ROWVEC:  # every padded row (BLOCK_M divides ROW_PAD)
        lse2 = _lse_log2(tl.load(LSE + vec, mask=rows < Nq, other=float("inf")))
        if LSE2_SHIFT != 0.0 or DELTA_SCALE != 1.0:
            lse2 -= LSE2_SHIFT
            delta *= DELTA_SCALE
        tl.store(LSE2 + out, lse2)
        tl.store(DELTA + out, delta)
        if ZERO_DQ:
            tl.store(DQACC + out[:, None] * BLOCK_D + offs_d[None, :],
                     tl.zeros([BLOCK_M, BLOCK_D], tl.float32))  # fmt: skip
            if start_m % SEM_ROWS == 0:
                vbase = b * stride_vb + h * stride_vh
                tl.store(SEM + vbase // SEM_ROWS + start_m // SEM_ROWS, 0)
    else:
        tl.store(DELTA + out, delta, mask=rows < Nq)


@triton.jit
def attn_bwd_dq_convert_kernel(
    DQACC,
    DQ,
    stride_qb,
    stride_qn,
    stride_qh,
    H,
    Nq,
    vec_stride,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """dq in the inputs' dtype and (B, N, H, D) layout from the Hopper backward's float32 sums
    (DQACC: (B * H, vec_stride, BLOCK_D), already scaled)."""
    pid_m, bh = _program_ids(tl.cdiv(Nq, BLOCK_M), False)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    src = DQACC + (bh.to(tl.int64) * vec_stride + rows[:, None]) * BLOCK_D + offs_d[None, :]
    dq = tl.load(src)
    dst = (
        DQ
        + b * stride_qb
        + h * stride_qh
        + rows[:, None].to(tl.int64) * stride_qn
        + offs_d[None, :]
    )
    tl.store(
        dst, dq.to(DQ.dtype.element_ty), mask=(rows[:, None] < Nq) & (offs_d[None, :] < HEAD_DIM)
    )


@triton.jit
def _dkdv_step(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qn, stride_don, cols,
               start_m, Nq, lo_shift, hi_shift, qk_scale, cap_scale, MASK: tl.constexpr,
               CHECK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
               DOT_PREC: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
               CAUSAL: tl.constexpr, LOCAL: tl.constexpr, ROWVEC: tl.constexpr):  # fmt: skip
    """dk, dv of one key block plus the query block at start_m, in the transposed (key x query)
    orientation (v, do and dv HEAD_DIM_V wide). Query rows past Nq (CHECK_M) load q = do = 0
    and LSE = +inf, so their p is 0 and they add nothing (ROWVEC: the padded row vectors hold
    +inf and 0 there, unchecked); MASK applies the window (causal) mask."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_m + offs_m
    q = _load_block(q_src, start_m, stride_qn, offs_m, Nq, offs_d, CHECK_M, HEAD_DIM, TMA)
    lse2 = _load_lse2(lse_base + rows, rows, Nq, CHECK_M, ROWVEC)
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    if SOFTCAP:  # qk_t holds tanh(s / softcap) from here on
        qk_t = _tanh(qk_t * cap_scale, SOFTCAP == 2)
    p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
    if MASK:
        keep = _visible(rows[None, :], cols[:, None], 0, lo_shift, hi_shift, LOCAL, CAUSAL,
                        False)  # fmt: skip
        p_t = tl.where(keep, p_t, 0.0)
    do = _load_block(do_src, start_m, stride_don, offs_m, Nq, offs_dv, CHECK_M, HEAD_DIM_V, TMA)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    delta = _load_vec(delta_base + rows, rows, Nq, 0.0, CHECK_M and not ROWVEC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # d(softcap * tanh(s / softcap)) / ds
        ds_t = ds_t * (1.0 - qk_t * qk_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qn, stride_don, cols,
                lo, hi, Nq, lo_shift, hi_shift, qk_scale, cap_scale, MASK: tl.constexpr,
                CHECK_M: tl.constexpr, PEEL: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
                SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr,
                ROWVEC: tl.constexpr):  # fmt: skip
    """Accumulate dk, dv of one key block over the query blocks [lo, hi) (`_dkdv_step`).
    PEEL (with CHECK_M): only the blocks from Nq's last block boundary on take the row checks;
    those before it run the unchecked steps of a block-multiple Nq."""
    start = lo
    if PEEL and CHECK_M:
        start = _tail_start(lo, hi, Nq, BLOCK_M)
        for start_m in range(lo, start, BLOCK_M):
            dk, dv = _dkdv_step(
                dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qn, stride_don, cols,
                start_m, Nq, lo_shift, hi_shift, qk_scale, cap_scale, MASK, False, HEAD_DIM,
                BLOCK_M, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
                ROWVEC,
            )  # fmt: skip
    for start_m in range(start, hi, BLOCK_M):
        dk, dv = _dkdv_step(
            dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qn, stride_don, cols,
            start_m, Nq, lo_shift, hi_shift, qk_scale, cap_scale, MASK, CHECK_M, HEAD_DIM,
            BLOCK_M, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
            ROWVEC,
        )  # fmt: skip
    return dk, dv


@triton.jit(do_not_specialize=["Nq", "Nk", "win_left", "win_right"])
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    CU_Q,
    CU_K,
    SEQUSED_K,
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
    stride_lb,
    stride_lh,
    H,
    Hkv,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    sm_scale,
    cap_scale,
    win_left,
    win_right,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    VARLEN: tl.constexpr,
    PEEL_TAIL: tl.constexpr,
    ROWVEC: tl.constexpr,
    ROW_PAD: tl.constexpr,
    SEQUSED: tl.constexpr,
):
    """dk, dv of one key block of one kv head. With GQA the program loops over the GROUP query
    heads that read this kv head, so their contributions add up in a fixed order (deterministic,
    no atomics). A key block whose sequence has no query rows writes zeros. LSE is the
    forward's LSE, or with ROWVEC the preprocess's padded lse2 (then DELTA is padded alike).
    SEQUSED (VARLEN): sequence b uses only its first SEQUSED_K[b] keys; the rest of its rows
    get zeros (a block past the used keys visits no query block)."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    cap_scale = tl.cast(cap_scale, tl.float32)
    pid_n, bhk = _program_ids(tl.cdiv(Nk, BLOCK_N), False)
    b = (bhk // Hkv).to(tl.int64)
    hk = bhk % Hkv
    if VARLEN:
        q0, Nq = _sequence(CU_Q, b)
        k0, Nk = _sequence(CU_K, b)
        if pid_n * BLOCK_N >= Nk:
            return
        if SEQUSED:  # (the block's rows are the sequence's: written below, zeros past used)
            Nk = tl.load(SEQUSED_K + b)
        Q += q0 * stride_qn
        DO += q0 * stride_don
        v0 = q0  # where the sequence's rows start in LSE and DELTA
        if ROWVEC:
            v0 = _rowvec_start(CU_Q, b, ROW_PAD)
        LSE += v0
        DELTA += v0
        K += k0 * stride_kn
        V += k0 * stride_vn
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptrs = K + b * stride_kb + hk.to(tl.int64) * stride_kh + start_n.to(tl.int64) * stride_kn
    k = _load_rows(
        k_ptrs + offs_n[:, None] * stride_kn + offs_d[None, :],
        cols,
        Nk,
        offs_d,
        not EVEN_N,
        HEAD_DIM,
    )
    v_ptrs = V + b * stride_vb + hk.to(tl.int64) * stride_vh + start_n.to(tl.int64) * stride_vn
    v = _load_rows(
        v_ptrs + offs_n[:, None] * stride_vn + offs_dv[None, :],
        cols,
        Nk,
        offs_dv,
        not EVEN_N,
        HEAD_DIM_V,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Query rows past Nq need a check only where they are read through pointers: TMA reads q
    # and do past the sequence as zeros, and the padded row vectors need none. (The checked
    # LSE / delta loads of the pipelined loops cost the d64 causal tile ~50 registers: 2
    # programs per SM instead of 3; NOTES.md.)
    CHECK_M: tl.constexpr = not EVEN_M and not (ROWVEC and TMA)
    lo_shift = Nk - Nq - win_left
    hi_shift = Nk - Nq + win_right
    # Query blocks that see part of this key block (masked: the diagonal / right edge), then
    # those that see all of it, then those cut by the window's left edge; no others.
    m_lo, m_full, m_full_hi, m_hi = _ranges(start_n, start_n + BLOCK_N - 1, 0, Nq, -hi_shift,
                                            -lo_shift, BLOCK_M, CAUSAL, LOCAL, False)  # fmt: skip
    if SEQUSED:  # a block wholly past the used keys visits no query block
        past = start_n >= Nk
        m_lo = tl.where(past, 0, m_lo)
        m_full = tl.where(past, 0, m_full)
        m_full_hi = tl.where(past, 0, m_full_hi)
        m_hi = tl.where(past, 0, m_hi)
    for g in range(GROUP):
        h = (hk * GROUP + g).to(tl.int64)
        q_src = _head_source(Q + b * stride_qb + h * stride_qh, Nq, stride_qn, BLOCK_M, HEAD_DIM,
                             BLOCK_D, TMA)  # fmt: skip
        do_src = _head_source(DO + b * stride_dob + h * stride_doh, Nq, stride_don, BLOCK_M,
                              HEAD_DIM_V, BLOCK_DV, TMA)  # fmt: skip
        vec_base = b * stride_lb + h * stride_lh
        if CAUSAL:
            dk, dv = _dkdv_steps(
                dk, dv, k, v, q_src, do_src, LSE + vec_base, DELTA + vec_base, stride_qn,
                stride_don, cols, m_lo, m_full, Nq, lo_shift, hi_shift, qk_scale, cap_scale,
                True, CHECK_M, False, HEAD_DIM, BLOCK_M, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC,
                TMA, SOFTCAP, CAUSAL, LOCAL, ROWVEC,
            )  # fmt: skip
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_src, do_src, LSE + vec_base, DELTA + vec_base, stride_qn,
            stride_don, cols, m_full, m_full_hi, Nq, lo_shift, hi_shift, qk_scale, cap_scale,
            False, CHECK_M, PEEL_TAIL, HEAD_DIM, BLOCK_M, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC,
            TMA, SOFTCAP, CAUSAL, LOCAL, ROWVEC,
        )  # fmt: skip
        if LOCAL:
            dk, dv = _dkdv_steps(
                dk, dv, k, v, q_src, do_src, LSE + vec_base, DELTA + vec_base, stride_qn,
                stride_don, cols, m_full_hi, m_hi, Nq, lo_shift, hi_shift, qk_scale, cap_scale,
                True, CHECK_M, False, HEAD_DIM, BLOCK_M, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC,
                TMA, SOFTCAP, CAUSAL, LOCAL, ROWVEC,
            )  # fmt: skip

    dk *= sm_scale
    if SEQUSED:  # keys past the used ones (loaded as zeros, their p unmasked) get zeros
        dk = tl.where((cols < Nk)[:, None], dk, 0.0)
        dv = tl.where((cols < Nk)[:, None], dv, 0.0)
    if VARLEN:  # read again here rather than held in registers through the loops
        k0, Nk = _sequence(CU_K, b)
        DK += k0 * stride_dkn
        DV += k0 * stride_dvn
    dk_ptrs = DK + b * stride_dkb + hk.to(tl.int64) * stride_dkh + start_n.to(tl.int64) * stride_dkn
    _store_rows(
        dk_ptrs + offs_n[:, None] * stride_dkn + offs_d[None, :],
        dk.to(DK.dtype.element_ty), cols, Nk, offs_d, not EVEN_N, HEAD_DIM,
    )  # fmt: skip
    dv_ptrs = DV + b * stride_dvb + hk.to(tl.int64) * stride_dvh + start_n.to(tl.int64) * stride_dvn
    _store_rows(
        dv_ptrs + offs_n[:, None] * stride_dvn + offs_dv[None, :],
        dv.to(DV.dtype.element_ty), cols, Nk, offs_dv, not EVEN_N, HEAD_DIM_V,
    )  # fmt: skip


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, start_n, Nk,
             lo_shift, hi_shift, qk_scale, cap_scale, MASK: tl.constexpr, CHECK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr,
             TMA: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
             LOCAL: tl.constexpr):  # fmt: skip
    """dq of one query block plus the key block at start_n (v and do HEAD_DIM_V wide); MASK
    applies the window (causal) mask. Keys past Nk (CHECK_N) load k = v = 0, so their score 0
    gives p = exp2(-lse2), which overflows where a row's LSE is very negative (few keys, large
    negative scores), and the float16 dS = inf times k = 0 was NaN. The masked steps drop those
    keys (`_visible`); the unmasked ones bound p by 1, which every real key's p is (a column
    mask there costs the d64 kernel 25 registers and its second program per SM: 9% of a ragged
    backward on the H100), so a padded key's dS = -delta stays finite and adds delta * 0 = 0."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = start_n + offs_n
    k = _load_block(k_src, start_n, stride_kn, offs_n, Nk, offs_d, CHECK_N, HEAD_DIM, TMA)
    v = _load_block(v_src, start_n, stride_vn, offs_n, Nk, offs_dv, CHECK_N, HEAD_DIM_V, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if SOFTCAP:  # qk holds tanh(s / softcap) from here on
        qk = _tanh(qk * cap_scale, SOFTCAP == 2)
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASK:
        keep = _visible(rows[:, None], cols[None, :], Nk, lo_shift, hi_shift, LOCAL, CAUSAL,
                        CHECK_N)  # fmt: skip
        p = tl.where(keep, p, 0.0)
    elif CHECK_N:
        p = tl.minimum(p, 1.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:  # d(softcap * tanh(s / softcap)) / ds
        ds = ds * (1.0 - qk * qk)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _dq_steps(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, lo, hi, Nk,
              lo_shift, hi_shift, qk_scale, cap_scale, MASK: tl.constexpr, CHECK_N: tl.constexpr,
              PEEL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
              DOT_PREC: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
              CAUSAL: tl.constexpr, LOCAL: tl.constexpr):  # fmt: skip
    """Accumulate dq of one query block over the key blocks [lo, hi) (`_dq_step`); PEEL as in
    `_dkdv_steps`, for the key checks (the TMA path too: its loads need no check, but the
    tail's p does)."""
    start = lo
    if PEEL and CHECK_N:
        start = _tail_start(lo, hi, Nk, BLOCK_N)
        for start_n in range(lo, start, BLOCK_N):
            dq = _dq_step(
                dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, start_n, Nk,
                lo_shift, hi_shift, qk_scale, cap_scale, MASK, False, HEAD_DIM, BLOCK_N,
                BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
            )  # fmt: skip
    for start_n in range(start, hi, BLOCK_N):
        dq = _dq_step(
            dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, start_n, Nk,
            lo_shift, hi_shift, qk_scale, cap_scale, MASK, CHECK_N, HEAD_DIM, BLOCK_N, BLOCK_D,
            HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
        )  # fmt: skip
    return dq


@triton.jit(do_not_specialize=["Nq", "Nk", "win_left", "win_right"])
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    CU_Q,
    CU_K,
    SEQUSED_K,
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
    stride_lb,
    stride_lh,
    H,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    sm_scale,
    cap_scale,
    win_left,
    win_right,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    VARLEN: tl.constexpr,
    PEEL_TAIL: tl.constexpr,
    ROWVEC: tl.constexpr,
    ROW_PAD: tl.constexpr,
    SEQUSED: tl.constexpr,
):
    """dq of one query block: a pass over the key blocks of its own (no atomics). LSE, DELTA
    and SEQUSED as in the dk/dv kernel; v and do HEAD_DIM_V wide."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    cap_scale = tl.cast(cap_scale, tl.float32)
    pid_m, bh = _program_ids(tl.cdiv(Nq, BLOCK_M), CAUSAL)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    if VARLEN:
        q0, Nq = _sequence(CU_Q, b)
        k0, Nk = _sequence(CU_K, b)
        if SEQUSED:
            Nk = tl.load(SEQUSED_K + b)
        if pid_m * BLOCK_M >= Nq:
            return
        Q += q0 * stride_qn
        DO += q0 * stride_don
        DQ += q0 * stride_dqn
        v0 = q0  # where the sequence's rows start in LSE and DELTA
        if ROWVEC:
            v0 = _rowvec_start(CU_Q, b, ROW_PAD)
        LSE += v0
        DELTA += v0
        K += k0 * stride_kn
        V += k0 * stride_vn
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qn
    q = _load_rows(
        q_ptrs + offs_m[:, None] * stride_qn + offs_d[None, :],
        rows,
        Nq,
        offs_d,
        not EVEN_M,
        HEAD_DIM,
    )
    do_ptrs = DO + b * stride_dob + h * stride_doh + start_m.to(tl.int64) * stride_don
    do = _load_rows(
        do_ptrs + offs_m[:, None] * stride_don + offs_dv[None, :],
        rows,
        Nq,
        offs_dv,
        not EVEN_M,
        HEAD_DIM_V,
    )
    vec = b * stride_lb + h * stride_lh + rows
    lse2 = _load_lse2(LSE + vec, rows, Nq, not EVEN_M, ROWVEC)
    delta = _load_vec(DELTA + vec, rows, Nq, 0.0, not (EVEN_M or ROWVEC))
    k_src = _head_source(K + b * stride_kb + hk * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, TMA)  # fmt: skip
    v_src = _head_source(V + b * stride_vb + hk * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM_V,
                         BLOCK_DV, TMA)  # fmt: skip
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo_shift = Nk - Nq - win_left
    hi_shift = Nk - Nq + win_right
    if CAUSAL or LOCAL:
        # As in the forward, but keys past Nk need no mask here (k = v = 0 adds nothing).
        lo, mid_lo, mid_hi, hi = _ranges(start_m, start_m + BLOCK_M - 1, 0, Nk, lo_shift,
                                         hi_shift, BLOCK_N, LOCAL, CAUSAL, False)  # fmt: skip
        if LOCAL:
            dq = _dq_steps(
                dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, lo, mid_lo, Nk,
                lo_shift, hi_shift, qk_scale, cap_scale, True, not EVEN_N, False, HEAD_DIM,
                BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
            )  # fmt: skip
        dq = _dq_steps(
            dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, mid_lo, mid_hi, Nk,
            lo_shift, hi_shift, qk_scale, cap_scale, False, not (EVEN_N or CAUSAL), PEEL_TAIL,
            HEAD_DIM, BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, CAUSAL,
            LOCAL,
        )  # fmt: skip
        if CAUSAL:
            dq = _dq_steps(
                dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, mid_hi, hi, Nk,
                lo_shift, hi_shift, qk_scale, cap_scale, True, not EVEN_N, False, HEAD_DIM,
                BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
            )  # fmt: skip
    else:
        dq = _dq_steps(
            dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, 0, Nk, Nk,
            lo_shift, hi_shift, qk_scale, cap_scale, False, not EVEN_N, PEEL_TAIL, HEAD_DIM,
            BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
        )  # fmt: skip

    dq *= sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + start_m.to(tl.int64) * stride_dqn
    _store_rows(
        dq_ptrs + offs_m[:, None] * stride_dqn + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), rows, Nq, offs_d, not EVEN_M, HEAD_DIM,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------


def can_implement(p: Problem, cfg: BwdConfig) -> str | None:
    """None if the portable dk/dv and dq kernels can run `cfg` for problem `p`, else why not."""
    if cfg.dq_mode != DQ_KERNEL or cfg.dq is None:
        return "dq is summed by the dq kernel beside the portable dk/dv kernel"
    for t in (cfg.dkdv, cfg.dq):
        if any(x & (x - 1) for x in (t.block_m, t.block_n)) or min(t.block_m, t.block_n) < 16:
            return f"tile {t}: BLOCK_M and BLOCK_N must be powers of two >= 16"
        if t.block_m > ROW_PAD:
            return f"tile {t}: BLOCK_M above the row vectors' padding ({ROW_PAD})"
    if cfg.dkdv_tma and not (p.tma_q and p.tma_do):
        return "TMA loads need 16-byte aligned q and do rows on a GPU with TMA"
    if cfg.dq_tma and not p.tma_kv:
        return "TMA loads need 16-byte aligned K/V rows on a GPU with TMA"
    if p.softcap and cfg.fast_tanh and p.target.interpreter:
        return "tanh.approx does not run under the interpreter"
    return None


def launch_preprocess(ops, p: Problem, cfg: BwdConfig, o, do, lse, dlse, lse2, delta, dq_acc,
                      sem, varlen: Varlen | None, block_m: int,
                      scaled: tuple[float, float] | None = None) -> None:  # fmt: skip
    """delta = rowsum(do * o) (minus dlse), with padded row vectors also the LSE in log2 units
    (lse2), and zeroed dq sums and semaphores (dq_acc, sem) where dq is fused. Padded: a program
    per (padded block, sequence, head), packed batches included; else per block of rows.
    scaled (padded only): (shift, factor), lse2 - shift and delta * factor written instead
    (the Gluon backward's softcap, gluon/bwd.py `scaled_rows`)."""
    packed, pad = varlen is not None, cfg.pad_rows
    assert pad or scaled is None, "scaled row vectors are padded ones"
    rows = lse.shape[-1]  # the LSE's rows: Nq, or total_q packed
    lse_strides = (0, lse.stride(0)) if packed else (lse.stride(0), lse.stride(1))
    blocks = cdiv(p.nq, ROW_PAD) * (ROW_PAD // block_m) if pad else cdiv(rows, block_m)
    ops.launch(
        attn_bwd_preprocess_kernel, (blocks * (p.batch if pad or not packed else 1) * p.heads,),
        O=o, DO=do, LSE=lse, DLSE=delta if dlse is None else dlse, LSE2=lse2, DELTA=delta,
        CU_Q=varlen.cu_q if packed else None, DQACC=dq_acc, SEM=sem,
        **strides("o", o, packed), **strides("do", do, packed),
        stride_lb=lse_strides[0], stride_lh=lse_strides[1],
        stride_vb=0 if packed else delta.stride(0), stride_vh=delta.stride(1),
        H=p.heads, Nq=p.nq if pad else rows, HAS_DLSE=dlse is not None,
        HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, HEAD_DIM_V=p.head_dim_v, BLOCK_DV=p.block_dv,
        BLOCK_M=block_m, ROWVEC=pad, ROW_PAD=ROW_PAD,
        VARLEN=pad and packed, ZERO_DQ=dq_acc is not None,
        LSE2_SHIFT=scaled[0] if scaled else 0.0, DELTA_SCALE=scaled[1] if scaled else 1.0,
        num_warps=4,
    )  # fmt: skip


def _common(p: Problem, cfg: BwdConfig, s: Scores, t, varlen: Varlen | None, delta, tma: bool):
    """The keywords the dk/dv and dq launches share: the row vectors' (batch, head) strides (the
    LSE read as delta is laid out), and those after the heads."""
    packed = varlen is not None
    return dict(
        stride_lb=0 if packed else delta.stride(0), stride_lh=delta.stride(1),
    ), dict(
        Nq=p.nq, Nk=p.nk, qk_scale=s.qk_scale, sm_scale=s.sm_scale, cap_scale=s.cap_scale,
        win_left=max(p.left, 0), win_right=p.right,
        HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, HEAD_DIM_V=p.head_dim_v, BLOCK_DV=p.block_dv,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, CAUSAL=p.causal,
        EVEN_M=not packed and bool(p.nq % t.block_m == 0),
        EVEN_N=not packed and bool(p.nk % t.block_n == 0), DOT_PREC=dot_precision(p.dtype),
        TMA=tma, SOFTCAP=s.softcap, LOCAL=p.local, VARLEN=packed, PEEL_TAIL=cfg.peel_tail,
        ROWVEC=cfg.pad_rows, ROW_PAD=ROW_PAD, SEQUSED=packed and varlen.seqused_k is not None,
        num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip


def launch_dkdv(ops, p: Problem, cfg: BwdConfig, s: Scores, q, k, v, do, lse, delta, dk, dv,
                varlen: Varlen | None) -> None:  # fmt: skip
    """dk, dv: one program per (key block, batch * kv head), looping over the query blocks of
    its group's heads."""
    packed, t = varlen is not None, cfg.dkdv
    vec, rest = _common(p, cfg, s, t, varlen, delta, cfg.dkdv_tma)
    ops.launch(
        attn_bwd_dkdv_kernel, (cdiv(p.nk, t.block_n) * p.batch * p.kv_heads,),
        Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DK=dk, DV=dv,
        CU_Q=varlen.cu_q if packed else None, CU_K=varlen.cu_k if packed else None,
        SEQUSED_K=varlen.seqused_k if packed else None,
        **strides("q", q, packed), **strides("k", k, packed), **strides("v", v, packed),
        **strides("do", do, packed), **strides("dk", dk, packed), **strides("dv", dv, packed),
        **vec, H=p.heads, Hkv=p.kv_heads, GROUP=p.heads // p.kv_heads, **rest,
    )  # fmt: skip


def launch_dq(ops, p: Problem, cfg: BwdConfig, s: Scores, q, k, v, do, lse, delta, dq,
              varlen: Varlen | None) -> None:  # fmt: skip
    """dq: one program per (query block, batch * head), looping over key blocks."""
    packed, t = varlen is not None, cfg.dq
    vec, rest = _common(p, cfg, s, t, varlen, delta, cfg.dq_tma)
    ops.launch(
        attn_bwd_dq_kernel, (cdiv(p.nq, t.block_m) * p.batch * p.heads,),
        Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DQ=dq,
        CU_Q=varlen.cu_q if packed else None, CU_K=varlen.cu_k if packed else None,
        SEQUSED_K=varlen.seqused_k if packed else None,
        **strides("q", q, packed), **strides("k", k, packed), **strides("v", v, packed),
        **strides("do", do, packed), **strides("dq", dq, packed),
        **vec, H=p.heads, GROUP=p.heads // p.kv_heads, **rest,
    )  # fmt: skip


def launch_dq_convert(ops, p: Problem, dq_acc, dq, width: int, block_m: int) -> None:
    """dq from the float32 sums of the fused Gluon backward."""
    ops.launch(
        attn_bwd_dq_convert_kernel, (cdiv(p.nq, block_m) * p.batch * p.heads,),
        DQACC=dq_acc, DQ=dq, **strides("q", dq), H=p.heads, Nq=p.nq, vec_stride=width,
        HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=block_m, num_warps=4,
    )  # fmt: skip
