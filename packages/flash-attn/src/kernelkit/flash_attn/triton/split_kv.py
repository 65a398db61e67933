"""The split-KV forward (decoding: few query rows, long key sequences) and its launch.

When the query side cannot fill the GPU (decoding: Nq = 1..16 against a long KV cache), the
keys are split across programs. A program owns one split of one kv head and packs the GROUP
query heads that read that head, times the Nq queries, into the M rows of its tile (packed row
r = query (r // GROUP) of query head hk * GROUP + r % GROUP), so each K/V byte is read once per
kv head rather than once per query head. It writes a float32 partial (o normalised by its own
sum, and its LSE in log2 units) per packed row; `attn_fwd_combine_kernel` merges the splits of
a row through their LSEs in split order (deterministic). A split in which a row sees no key
(causal) leaves the neutral partial o = 0, LSE = -inf, which the merge weighs by exp2(-inf) = 0.

Partials: OP (B * Hkv, SPLITS, ROWS_PAD, BLOCK_DV), BLOCK_DV v's padded head dim, and LP
(B * Hkv, SPLITS, ROWS_PAD), float32 and contiguous, ROWS_PAD = GROUP * Nq rounded up to
BLOCK_M: every program writes its whole tile unmasked (rows past GROUP * Nq are padding the
merge never stores).
"""

import torch
import triton
import triton.language as tl

from kernelkit.shared.runtime import cdiv

from ..config import FwdConfig, KVCache, Problem, Scores
from ..strides import strides
from .common import LN2, _head_source, _load_rows, _ranges, _store_rows, dot_precision
from .fwd import _fwd_steps


@triton.jit(
    do_not_specialize=[
        "Nq",
        "Nk",
        "num_splits",
        "split_len",
        "rows_pad",
        "k_start",
        "win_left",
        "win_right",
        "page_size",
        "cache_rows",
    ]
)
def attn_fwd_split_kernel(
    Q,
    K,
    V,
    OP,
    LP,
    O,
    LSE,
    SEQLENS,
    TABLE,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_on,
    stride_oh,
    H,
    Hkv,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    cap_scale,
    num_splits,
    split_len,
    rows_pad,
    k_start,
    win_left,
    win_right,
    page_size,
    cache_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    VAR_K: tl.constexpr,
    PAGED: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Partial attention of BLOCK_M packed query rows of one kv head over the keys of one split,
    k_start + [split * split_len, (split + 1) * split_len) (split_len and k_start: multiples of
    BLOCK_N; k_start > 0 skips keys no window reaches).

    A KV cache (`flash_attn_with_kvcache`): VAR_K, sequence b has SEQLENS[b] + Nk keys (its
    cache length plus the rows just appended), and its keys are split here into num_splits runs
    of whole blocks (so a short sequence in a long cache still spreads over the splits); else
    every sequence has Nk keys. PAGED (1: a page per row, 2: a page per key block, through TMA):
    K and V are (pages, page_size, Hkv, D) and key j of sequence b is row j % page_size of page
    TABLE[b, j // page_size] (stride_kb, stride_vb: the page strides; cache_rows: pages x
    page_size, the rows of PAGED = 2's descriptor). V and the partial o: HEAD_DIM_V wide.
    DIRECT (one split, num_splits == 1): o and the natural-log LSE go straight to O and LSE,
    as `attn_fwd_combine_kernel` would write them from the one partial (its weight is
    exp2(0) = 1: the same values), and OP, LP are not used."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap_scale = tl.cast(cap_scale, tl.float32)
    # Program order: row block fastest, then split, then (batch, kv head): the row blocks that
    # read one split's keys run together (L2).
    pid = tl.program_id(0)
    n_rows = GROUP * Nq
    row_blocks = tl.cdiv(n_rows, BLOCK_M)
    mb = pid % row_blocks
    split = (pid // row_blocks) % num_splits
    bhk = pid // (row_blocks * num_splits)
    b = (bhk // Hkv).to(tl.int64)
    hk = (bhk % Hkv).to(tl.int64)
    start_r = mb * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    r = start_r + offs_m
    qi = r // GROUP  # query index of each packed row (>= Nq on padding rows)
    if VAR_K:
        Nk = tl.load(SEQLENS + b) + Nk
        if LOCAL:
            k_start = tl.maximum(Nk - Nq - win_left, 0) // BLOCK_N * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(Nk - k_start, BLOCK_N), num_splits) * BLOCK_N

    q_off = (qi.to(tl.int64) * stride_qn + (r % GROUP).to(tl.int64) * stride_qh)[:, None]
    q_ptrs = Q + b * stride_qb + hk * GROUP * stride_qh + q_off + offs_d[None, :]
    q = _load_rows(q_ptrs, r, n_rows, offs_d, True, HEAD_DIM)
    if PAGED:
        pages = TABLE + b * stride_tb
        k_base = K + hk * stride_kh
        v_base = V + hk * stride_vh
        src_rows = cache_rows
    else:
        pages = TABLE
        k_base = K + b * stride_kb + hk * stride_kh
        v_base = V + b * stride_vb + hk * stride_vh
        src_rows = Nk
    k_src = _head_source(k_base, src_rows, stride_kn, BLOCK_N, HEAD_DIM, BLOCK_D, TMA)
    v_src = _head_source(v_base, src_rows, stride_vn, BLOCK_N, HEAD_DIM_V, BLOCK_DV, TMA)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    lo_shift = Nk - Nq - win_left
    hi_shift = Nk - Nq + win_right
    # This split's keys that the real rows (first_q..last_q) see: keys past the last row's
    # diagonal or before the first row's window are skipped (a split outside runs no step and
    # keeps the neutral partial); only blocks on the window's edges need the mask.
    first_q = start_r // GROUP
    last_q = tl.minimum((start_r + BLOCK_M - 1) // GROUP, Nq - 1)
    k_lo = k_start + split * split_len
    lo, mid_lo, mid_hi, hi = _ranges(first_q, last_q, k_lo, tl.minimum(k_lo + split_len, Nk),
                                     lo_shift, hi_shift, BLOCK_N, LOCAL, CAUSAL, True)  # fmt: skip
    if LOCAL:
        acc, l_i, m_i = _fwd_steps(
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, pages, page_size, stride_kb,
            stride_vb, qi, lo, mid_lo, Nk, lo_shift, hi_shift, qk_scale, cap_scale, True,
            CAUSAL, True, HEAD_DIM, BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA,
            SOFTCAP, LOCAL, PAGED,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_steps(
        acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, pages, page_size, stride_kb,
        stride_vb, qi, mid_lo, mid_hi, Nk, lo_shift, hi_shift, qk_scale, cap_scale, False,
        CAUSAL, False, HEAD_DIM, BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP,
        LOCAL, PAGED,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_steps(
        acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, pages, page_size, stride_kb,
        stride_vb, qi, mid_hi, hi, Nk, lo_shift, hi_shift, qk_scale, cap_scale, True, CAUSAL,
        True, HEAD_DIM, BLOCK_N, BLOCK_D, HEAD_DIM_V, BLOCK_DV, DOT_PREC, TMA, SOFTCAP, LOCAL,
        PAGED,
    )  # fmt: skip

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, -float("inf"), m_i + tl.math.log2(l_i))
    if DIRECT:
        h = hk * GROUP + r % GROUP
        o_off = (qi.to(tl.int64) * stride_on + h * stride_oh)[:, None]
        o_ptrs = O + b * stride_ob + o_off + offs_dv[None, :]
        _store_rows(o_ptrs, o.to(O.dtype.element_ty), r, n_rows, offs_dv, True, HEAD_DIM_V)
        tl.store(LSE + (b * H + h) * Nq + qi, lse2 * LN2, mask=r < n_rows)
    else:
        part = (bhk.to(tl.int64) * num_splits + split) * rows_pad + start_r + offs_m
        tl.store(OP + part[:, None] * BLOCK_DV + offs_dv[None, :], o)
        tl.store(LP + part, lse2)


@triton.jit(do_not_specialize=["Nq", "num_splits", "rows_pad"])
def attn_fwd_combine_kernel(
    OP,
    LP,
    O,
    LSE,
    stride_ob,
    stride_on,
    stride_oh,
    H,
    Hkv,
    GROUP,
    Nq,
    num_splits,
    rows_pad,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """o and the natural-log LSE of BLOCK_R packed rows of one kv head: the splits' partials
    weighted by exp2(lse_s - max_s lse_s), summed in split order. A row no split saw (all
    partials neutral) gets o = 0, LSE = -inf. HEAD_DIM, BLOCK_D: o's (v's head dim)."""
    pid = tl.program_id(0)
    n_rows = GROUP * Nq
    row_blocks = tl.cdiv(n_rows, BLOCK_R)
    bhk = pid // row_blocks
    start_r = (pid % row_blocks) * BLOCK_R
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r = start_r + offs_r
    base = bhk.to(tl.int64) * num_splits * rows_pad + r  # BLOCK_R divides the padded row count

    m = tl.full([BLOCK_R], -float("inf"), dtype=tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(LP + base + s * rows_pad))
    m = tl.where(m == -float("inf"), 0.0, m)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        row = base + s * rows_pad
        w = tl.math.exp2(tl.load(LP + row) - m)
        l_i += w
        acc += w[:, None] * tl.load(OP + row[:, None] * BLOCK_D + offs_d[None, :])
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, -float("inf"), (m + tl.math.log2(l_i)) * LN2)

    b = (bhk // Hkv).to(tl.int64)
    hk = bhk % Hkv
    qi = r // GROUP
    h = hk * GROUP + r % GROUP
    o_off = (qi.to(tl.int64) * stride_on + h.to(tl.int64) * stride_oh)[:, None]
    o_ptrs = O + b * stride_ob + o_off + offs_d[None, :]
    _store_rows(o_ptrs, o.to(O.dtype.element_ty), r, n_rows, offs_d, True, HEAD_DIM)
    tl.store(LSE + (b * H + h) * Nq + qi, lse, mask=r < n_rows)


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------


def can_implement(p: Problem, cfg: FwdConfig) -> str | None:
    """None if the split-KV forward can run `cfg` for problem `p`, else why not."""
    if p.packed:
        return "packed batches take the dense forward"
    if cfg.split is None or cfg.split.splits < 1:
        return "no split given"
    if cfg.tma and not p.tma_kv:
        return "TMA loads need 16-byte aligned K/V rows on a GPU with TMA"
    if cfg.tma and p.page_size % cfg.tile.block_n:
        return f"TMA loads of a paged cache need pages of whole key blocks ({cfg.tile.block_n})"
    if p.softcap and cfg.fast_tanh and p.target.interpreter:
        return "tanh.approx does not run under the interpreter"
    if cfg.fixed_shift:
        return "fixed_shift: the split-KV forward keeps each row's running maximum"
    return None


def launch(ops, p: Problem, cfg: FwdConfig, s: Scores, q, k, v, o, lse,
           cache: KVCache | None = None) -> None:  # fmt: skip
    """Split-KV forward into o and lse: float32 partials per (split, packed query row), then
    their merge in split order; one split (`Split.direct`) writes o and lse itself. With
    `cache`, k and v are `flash_attn_with_kvcache`'s cache."""
    t, split = cfg.tile, cfg.split
    group = p.heads // p.kv_heads
    row_blocks = cdiv(group * p.nq, t.block_m)
    rows_pad = row_blocks * t.block_m
    bhk = p.batch * p.kv_heads
    o_part = lse_part = None
    if not split.direct:
        o_part = ops.empty((bhk, split.splits, rows_pad, p.block_dv), torch.float32, q.device)
        lse_part = ops.empty((bhk, split.splits, rows_pad), torch.float32, q.device)
    seqlens = table = None
    nk, stride_tb, page_size, cache_rows, paged = p.nk, 0, 1, 0, 0
    if cache is not None:
        seqlens, table, nk = cache.seqlens, cache.table, cache.keys
        if table is not None:
            stride_tb, page_size = table.stride(0), cache.page_size
            cache_rows, paged = k.shape[0] * page_size, 2 if cfg.tma else 1
    ops.launch(
        attn_fwd_split_kernel, (row_blocks * split.splits * bhk,),
        Q=q, K=k, V=v, OP=o_part, LP=lse_part, O=o, LSE=lse, SEQLENS=seqlens, TABLE=table,
        **strides("q", q), **strides("k", k), **strides("v", v), stride_tb=stride_tb,
        **strides("o", o), H=p.heads, Hkv=p.kv_heads, GROUP=group, Nq=p.nq, Nk=nk,
        qk_scale=s.qk_scale, cap_scale=s.cap_scale,
        num_splits=split.splits, split_len=split.split_len, rows_pad=rows_pad,
        k_start=split.start, win_left=max(p.left, 0), win_right=p.right,
        page_size=page_size, cache_rows=cache_rows,
        HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, HEAD_DIM_V=p.head_dim_v, BLOCK_DV=p.block_dv,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, CAUSAL=p.causal, DOT_PREC=dot_precision(p.dtype),
        TMA=cfg.tma, SOFTCAP=s.softcap, LOCAL=p.local, VAR_K=seqlens is not None, PAGED=paged,
        DIRECT=split.direct, num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
    if split.direct:
        return
    ops.launch(
        attn_fwd_combine_kernel, (cdiv(group * p.nq, split.combine_rows) * bhk,),
        OP=o_part, LP=lse_part, O=o, LSE=lse, **strides("o", o),
        H=p.heads, Hkv=p.kv_heads, GROUP=group, Nq=p.nq, num_splits=split.splits,
        rows_pad=rows_pad, HEAD_DIM=p.head_dim_v, BLOCK_D=p.block_dv,
        BLOCK_R=split.combine_rows, num_warps=4,
    )  # fmt: skip
