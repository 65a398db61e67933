"""The portable forward (FlashAttention-2): one program per (query block, batch * head), any
mask (causal, window edges), packed batches, softcap; and its launch (`launch`, `can_implement`).
Layout and conventions: `triton/common.py`."""

import triton
import triton.language as tl

from kernelkit.shared.runtime import cdiv

from ..config import FwdConfig, Problem, Scores, Varlen, fixed_shift_unfit
from ..strides import strides
from .common import (
    LN2,
    _head_source,
    _load_kv,
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
def _fwd_steps(
    acc,
    l_i,
    m_i,
    q,
    k_src,
    v_src,
    stride_kn,
    stride_vn,
    pages,
    page_size,
    stride_kp,
    stride_vp,
    rows,
    lo,
    hi,
    Nk,
    lo_shift,
    hi_shift,
    qk_scale,
    cap_scale,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    PAGED: tl.constexpr,
    FIXED_SHIFT: tl.constexpr = False,
):
    """Online-softmax accumulation of key blocks [lo, hi) into acc (BLOCK_M x BLOCK_DV: v's
    head dim, HEAD_DIM_V). MASK: apply the window (causal) and end-of-sequence masks (the
    scores of hidden keys are -inf). PAGED: K/V in a paged cache (`_load_kv`; pages: the
    sequence's block-table row, stride_kp / stride_vp the page strides). FIXED_SHIFT (capped
    scores): m_i holds `Scores.row_shift` and stays; no maxima, no rescaling."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_kv(k_src, pages, page_size, stride_kp, start_n, stride_kn, offs_n, Nk, offs_d,
                     CHECK_N, HEAD_DIM, TMA, PAGED)  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if SOFTCAP:
            qk = _tanh(qk * cap_scale, SOFTCAP == 2)
        if MASK:
            keep = _visible(rows[:, None], cols[None, :], Nk, lo_shift, hi_shift, LOCAL, CAUSAL,
                            CHECK_N)  # fmt: skip
            qk = tl.where(keep, qk * qk_scale, -float("inf"))
        if FIXED_SHIFT:
            if MASK:
                p = tl.math.exp2(qk - m_i[:, None])
            else:
                p = tl.math.exp2(qk * qk_scale - m_i[:, None])
            m_ij = m_i
            l_i = l_i + tl.sum(p, 1)
        else:
            if MASK:
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
        v = _load_kv(v_src, pages, page_size, stride_vp, start_n, stride_vn, offs_n, Nk, offs_dv,
                     CHECK_N, HEAD_DIM_V, TMA, PAGED)  # fmt: skip
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Nq", "Nk", "win_left", "win_right"])
def attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
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
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    H,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    cap_scale,
    row_shift,
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
    SEQUSED: tl.constexpr,
    FIXED_SHIFT: tl.constexpr,
):
    """o (HEAD_DIM_V wide: v's head dim) and LSE of one block of query rows of one head.
    CAUSAL: keys past i + shift + win_right are hidden (win_right = 0: causal); LOCAL: keys
    before i + shift - win_left. SEQUSED (VARLEN): sequence b sees only its first SEQUSED_K[b]
    keys (the shift counts those). FIXED_SHIFT (SOFTCAP): every score shifted by row_shift
    (`Scores.row_shift`), not by its row's running maximum."""
    # Scalars may arrive as float64 (torch.compile passes Python floats so): keep math float32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap_scale = tl.cast(cap_scale, tl.float32)
    pid_m, bh = _program_ids(tl.cdiv(Nq, BLOCK_M), CAUSAL)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    if VARLEN:
        q0, Nq = _sequence(CU_Q, b)
        k0, Nk = _sequence(CU_K, b)
        if SEQUSED:  # the keys past the used ones are never read
            Nk = tl.load(SEQUSED_K + b)
        if pid_m * BLOCK_M >= Nq:
            return
        Q += q0 * stride_qn
        O += q0 * stride_on
        LSE += q0
        K += k0 * stride_kn
        V += k0 * stride_vn
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qn
    q_ptrs = q_ptrs + offs_m[:, None] * stride_qn + offs_d[None, :]
    q = _load_rows(q_ptrs, rows, Nq, offs_d, not EVEN_M, HEAD_DIM)
    k_src = _head_source(K + b * stride_kb + hk * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, TMA)  # fmt: skip
    v_src = _head_source(V + b * stride_vb + hk * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM_V,
                         BLOCK_DV, TMA)  # fmt: skip

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FIXED_SHIFT:
        m_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + tl.cast(row_shift, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    lo_shift = Nk - Nq - win_left
    hi_shift = Nk - Nq + win_right
    # Key blocks cut by the window's left edge, those every row of this block sees in full, then
    # the diagonal (right edge) and the ragged end; the rest are never loaded.
    lo, mid_lo, mid_hi, hi = _ranges(start_m, start_m + BLOCK_M - 1, 0, Nk, lo_shift, hi_shift,
                                     BLOCK_N, LOCAL, CAUSAL, True)  # fmt: skip
    if LOCAL:
        acc, l_i, m_i = _fwd_steps(
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, None, 1, 0, 0, rows, lo,
            mid_lo, Nk, lo_shift, hi_shift, qk_scale, cap_scale, True, CAUSAL, not EVEN_N,
            HEAD_DIM, BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, LOCAL, 0,
            FIXED_SHIFT,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_steps(
        acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, None, 1, 0, 0, rows, mid_lo,
        mid_hi, Nk, lo_shift, hi_shift, qk_scale, cap_scale, False, CAUSAL, False, HEAD_DIM,
        BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, LOCAL, 0, FIXED_SHIFT,
    )  # fmt: skip
    if CAUSAL or LOCAL or not EVEN_N:
        acc, l_i, m_i = _fwd_steps(
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, None, 1, 0, 0, rows, mid_hi,
            hi, Nk, lo_shift, hi_shift, qk_scale, cap_scale, True, CAUSAL, not EVEN_N,
            HEAD_DIM, BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, LOCAL, 0,
            FIXED_SHIFT,
        )  # fmt: skip

    # A row that sees no key (causal with Nq > Nk, windows) has l = 0: zeros and LSE = -inf.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on
    o_ptrs = o_ptrs + offs_m[:, None] * stride_on + offs_dv[None, :]
    _store_rows(o_ptrs, o.to(O.dtype.element_ty), rows, Nq, offs_dv, not EVEN_M, HEAD_DIM_V)
    lse = (m_i + tl.math.log2(l_i)) * LN2
    lse_ptrs = LSE + b * stride_lb + h * stride_lh + rows
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=rows < Nq)


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------


def can_implement(p: Problem, cfg: FwdConfig) -> str | None:
    """None if this kernel can run `cfg` for problem `p`, else why not."""
    t = cfg.tile
    if any(x & (x - 1) for x in (t.block_m, t.block_n)) or min(t.block_m, t.block_n) < 16:
        return f"tile {t}: BLOCK_M and BLOCK_N must be powers of two >= 16"
    if cfg.tma and not p.tma_kv:
        return "TMA loads need 16-byte aligned K/V rows on a GPU with TMA"
    if p.softcap and cfg.fast_tanh and p.target.interpreter:
        return "tanh.approx does not run under the interpreter"
    if cfg.fixed_shift:
        return fixed_shift_unfit(p)
    return None


def launch(ops, p: Problem, cfg: FwdConfig, s: Scores, q, k, v, o, lse, varlen: Varlen | None):
    """Launch the portable forward into o and lse for q, k, v (4-D, or packed with `varlen`;
    v and o may have a head dim of their own)."""
    t, packed = cfg.tile, varlen is not None
    lse_strides = (0, lse.stride(0)) if packed else (lse.stride(0), lse.stride(1))
    ops.launch(
        attn_fwd_kernel, (cdiv(p.nq, t.block_m) * p.batch * p.heads,),
        Q=q, K=k, V=v, O=o, LSE=lse,
        CU_Q=varlen.cu_q if packed else None, CU_K=varlen.cu_k if packed else None,
        SEQUSED_K=varlen.seqused_k if packed else None,
        **strides("q", q, packed), **strides("k", k, packed), **strides("v", v, packed),
        **strides("o", o, packed), stride_lb=lse_strides[0], stride_lh=lse_strides[1],
        H=p.heads, GROUP=p.heads // p.kv_heads, Nq=p.nq, Nk=p.nk,
        qk_scale=s.qk_scale, cap_scale=s.cap_scale, row_shift=s.row_shift,
        win_left=max(p.left, 0), win_right=p.right,
        HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, HEAD_DIM_V=p.head_dim_v, BLOCK_DV=p.block_dv,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, CAUSAL=p.causal,
        EVEN_M=not packed and bool(p.nq % t.block_m == 0),
        EVEN_N=not packed and bool(p.nk % t.block_n == 0), DOT_PREC=dot_precision(p.dtype),
        TMA=cfg.tma, SOFTCAP=s.softcap, LOCAL=p.local, VARLEN=packed,
        SEQUSED=packed and varlen.seqused_k is not None, FIXED_SHIFT=cfg.fixed_shift,
        num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
