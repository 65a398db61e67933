"""Triton kernels of flash-attn: FlashAttention-2 forward and backward, and a split-KV forward
for decoding (its own section below).

Layout: q and o are (B, Nq, H, D), k and v (B, Nk, Hkv, D), read through runtime strides with a
unit stride along D (the host makes D contiguous); the LSE and delta are (B, H, Nq) float32.
Query head h reads kv head h // GROUP. The backward kernels read the LSE (in log2 units) and
delta from the preprocess's padded copies by default (ROWVEC, `attn_bwd_preprocess_kernel`):
rows past the end hold values that make them add nothing, so those reads need no row checks.

Scores are kept in log2 units, s2 = (q . k) * scale * log2(e), so that exp2 replaces exp.
Causal masking is bottom-right aligned: query i sees key j iff j <= i + SHIFT, SHIFT = Nk - Nq.
Sliding windows generalise it: query i sees key j iff i + SHIFT - left <= j (LOCAL) and
j <= i + SHIFT + right (CAUSAL; right = 0 for causal attention), i.e. lo_shift <= j - i <=
hi_shift. `_ranges` turns these bounds into the blocks a program visits: blocks outside the
window are never loaded, blocks inside it run without a mask, and only the boundary blocks pay.
Softcap (SOFTCAP != 0, Gemma 2): the scores become softcap * tanh(scores / softcap) before the
softmax; the host then passes qk_scale = softcap * log2(e) and cap_scale = scale / softcap, and
the kernels replace q . k by tanh(q . k * cap_scale) right after the product, so the rest of the
softmax is unchanged. The backward recomputes tanh from the raw scores and multiplies dS by
1 - tanh^2. SOFTCAP = 0 compiles none of it.
Every kernel splits its key (or query) loop into blocks no mask can touch, walked without a
mask, and the few blocks on the causal diagonal, the window's edges or past the end of a
sequence, walked with one.

The tiles a loop streams are read through `_head_source` / `_load_block`: a TMA descriptor per
(program, head) when the TMA flag is set (the host checks that rows are 16-byte aligned), else
masked pointer loads. TMA keeps no per-element addresses in registers, which lets the larger
tiles run without spilling.

Packed variable-length batches (VARLEN): the batch axis becomes the sequence index. The host
passes zero batch strides and the longest sequence as Nq / Nk (the grid), and each program reads
its sequence's first row and length from the cu_seqlens prefix sums (`_sequence`), moves its base
pointers to that row and works on that sequence alone; a program whose block starts past its
sequence's end returns at once (those rows are another sequence's, or none). The LSE and delta
are read through (batch, head) strides: (H * Nq, Nq) for a dense batch, (0, total_q) packed; the
padded row vectors (H * Np, Np) with Np = Nq rounded up, or (0, Np) packed with each sequence
from a multiple of 16 (`_rowvec_start`).

Offsets: per-(batch, head) bases and block starts are 64-bit; offsets inside a block are 32-bit.
A program id enumerates (sequence block, batch * head) with the block index fastest, so the
programs that share one head's K/V (or Q/dO) run together and hit L2.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Load a (rows x BLOCK_D) tile; masked only where rows can pass n_rows or D is padded."""
    if CHECK_ROWS:
        if offs_d.shape[0] != HEAD_DIM:
            x = tl.load(
                ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0
            )
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if offs_d.shape[0] != HEAD_DIM:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store_rows(ptrs, x, rows, n_rows, offs_d, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    if CHECK_ROWS:
        if offs_d.shape[0] != HEAD_DIM:
            tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        if offs_d.shape[0] != HEAD_DIM:
            tl.store(ptrs, x, mask=offs_d[None, :] < HEAD_DIM)
        else:
            tl.store(ptrs, x)


@triton.jit
def _load_vec(ptrs, rows, n_rows, other, CHECK_ROWS: tl.constexpr):
    if CHECK_ROWS:  # noqa: SIM108 (a constexpr branch, not a run-time select)
        x = tl.load(ptrs, mask=rows < n_rows, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _head_source(base, n_rows, stride, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """What the loops read one head's (n_rows x HEAD_DIM) rows from: a TMA descriptor of
    (BLOCK_ROWS x BLOCK_D) boxes when TMA (out-of-bounds rows and columns read as zeros), else the
    base pointer itself."""
    src = base
    if TMA:
        src = tl.make_tensor_descriptor(
            base, [n_rows, HEAD_DIM], [stride, 1], [BLOCK_ROWS, BLOCK_D]
        )
    return src


@triton.jit
def _load_block(src, start, stride, offs_rows, n_rows, offs_d, CHECK_ROWS: tl.constexpr,
                HEAD_DIM: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """Rows [start, start + BLOCK_ROWS) of a `_head_source`. The TMA path moves the tile with the
    copy engine: no per-element address registers, which otherwise make the loops spill."""
    if TMA:
        x = src.load([start, 0])
    else:
        ptrs = (
            src + tl.cast(start, tl.int64) * stride + offs_rows[:, None] * stride + offs_d[None, :]
        )
        x = _load_rows(ptrs, start + offs_rows, n_rows, offs_d, CHECK_ROWS, HEAD_DIM)
    return x


@triton.jit
def _lse_log2(lse):
    """Natural-log LSE -> log2 units; an empty row (-inf) becomes +inf so its p = exp2(s - lse) = 0."""
    return tl.where(lse == -float("inf"), float("inf"), lse * LOG2E)


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh in float32. FAST: the tanh.approx.f32 instruction (one MUFU op; relative error
    below 2^-10.9, what FlashAttention's softcap uses), for half-precision inputs on the GPU.
    Else 1 - 2 / (e^2x + 1): float32-accurate to ~1e-7 absolute, +-1 at the ends, and what the
    interpreter runs (no inline assembly there)."""
    if FAST:
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        t = 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)
    return t


@triton.jit
def _sequence(CU, b):
    """(first row (64-bit), number of rows) of sequence b of a packed batch."""
    start = tl.load(CU + b)
    return start.to(tl.int64), tl.load(CU + b + 1) - start


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
def _visible(rows, cols, n_cols, lo_shift, hi_shift, LOWER: tl.constexpr, UPPER: tl.constexpr,
             CHECK_COLS: tl.constexpr):  # fmt: skip
    """Mask of the (row, col) pairs (broadcast) where col is visible to row:
    row + lo_shift <= col (LOWER), col <= row + hi_shift (UPPER), col < n_cols (CHECK_COLS)."""
    if UPPER:
        keep = cols <= rows + hi_shift
        if LOWER:
            keep = keep & (cols >= rows + lo_shift)
        if CHECK_COLS:
            keep = keep & (cols < n_cols)
    elif LOWER:
        keep = cols >= rows + lo_shift
        if CHECK_COLS:
            keep = keep & (cols < n_cols)
    else:
        keep = cols < n_cols
    return keep


@triton.jit
def _ranges(first, last, start, end, lo_shift, hi_shift, BLOCK: tl.constexpr,
            LOWER: tl.constexpr, UPPER: tl.constexpr, ALIGN_END: tl.constexpr):  # fmt: skip
    """The blocks of [start, end) (BLOCK wide, counted from `start`) that rows first..last visit
    when row x sees y iff x + lo_shift <= y (LOWER) and y <= x + hi_shift (UPPER).

    Returns (lo, mid_lo, mid_hi, hi): [lo, mid_lo) and [mid_hi, hi) need the mask, every row
    sees all of [mid_lo, mid_hi), and no row sees anything outside [lo, hi) (so those blocks are
    skipped). Each range is empty or starts on a block boundary. ALIGN_END: [mid_lo, mid_hi)
    stops at a block boundary, so a ragged last block (positions past `end`) is masked too."""
    lo = start
    hi = end
    full_lo = start
    full_hi = end
    if LOWER:
        lo = start + tl.maximum(first + lo_shift - start, 0) // BLOCK * BLOCK
        full_lo = start + tl.cdiv(tl.maximum(last + lo_shift - start, 0), BLOCK) * BLOCK
    if UPPER:
        hi = tl.minimum(end, last + hi_shift + 1)
        # (the last full block ends at the first row's edge, or at the last whole block)
        full_hi = tl.minimum(start + tl.maximum(first + hi_shift + 1 - start, 0) // BLOCK * BLOCK,
                             start + (end - start) // BLOCK * BLOCK)  # fmt: skip
    elif ALIGN_END:
        full_hi = start + (end - start) // BLOCK * BLOCK
    # Without a lower bound the full range starts at `start` and ends at full_hi (<= hi, or
    # both at `start`); the clamps below are only needed with one (and keep the plain causal
    # kernels' bounds as they were).
    mid_lo = start
    mid_hi = full_hi
    if LOWER:
        mid_lo = tl.maximum(tl.minimum(full_lo, hi), lo)
        if UPPER or ALIGN_END:
            mid_hi = tl.maximum(tl.minimum(full_hi, hi), mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _tail_start(lo, hi, n, BLOCK: tl.constexpr):
    """Where the blocks of [lo, hi) (block-aligned from 0) that can reach past n begin: at n's
    last block boundary, clamped to the range. A ragged length leaves one partial block, so
    the loops run [lo, tail) without the length checks and only the rest with them."""
    return tl.maximum(tl.minimum(hi, n // BLOCK * BLOCK), lo)


@triton.jit
def _program_ids(num_blocks, REVERSE: tl.constexpr):
    """(block index, batch * head index) of this program; REVERSE starts with the last blocks
    (the longest causal rows), which balances the tail of the launch."""
    pid = tl.program_id(0)
    blk = pid % num_blocks
    if REVERSE:
        blk = num_blocks - 1 - blk
    return blk, pid // num_blocks


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


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
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
):
    """Online-softmax accumulation of key blocks [lo, hi). MASK: apply the window (causal) and
    end-of-sequence masks (the scores of hidden keys are -inf)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_block(k_src, start_n, stride_kn, offs_n, Nk, offs_d, CHECK_N, HEAD_DIM, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if SOFTCAP:
            qk = _tanh(qk * cap_scale, SOFTCAP == 2)
        if MASK:
            keep = _visible(rows[:, None], cols[None, :], Nk, lo_shift, hi_shift, LOCAL, CAUSAL,
                            CHECK_N)  # fmt: skip
            qk = tl.where(keep, qk * qk_scale, -float("inf"))
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
        v = _load_block(v_src, start_n, stride_vn, offs_n, Nk, offs_d, CHECK_N, HEAD_DIM, TMA)
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
    win_left,
    win_right,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
):
    """o and LSE of one block of query rows of one head. CAUSAL: keys past i + shift + win_right
    are hidden (win_right = 0: causal); LOCAL: keys before i + shift - win_left."""
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

    q_ptrs = Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qn
    q_ptrs = q_ptrs + offs_m[:, None] * stride_qn + offs_d[None, :]
    q = _load_rows(q_ptrs, rows, Nq, offs_d, not EVEN_M, HEAD_DIM)
    k_src = _head_source(K + b * stride_kb + hk * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, TMA)  # fmt: skip
    v_src = _head_source(V + b * stride_vb + hk * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, TMA)  # fmt: skip

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    lo_shift = Nk - Nq - win_left
    hi_shift = Nk - Nq + win_right
    # Key blocks cut by the window's left edge, those every row of this block sees in full, then
    # the diagonal (right edge) and the ragged end; the rest are never loaded.
    lo, mid_lo, mid_hi, hi = _ranges(start_m, start_m + BLOCK_M - 1, 0, Nk, lo_shift, hi_shift,
                                     BLOCK_N, LOCAL, CAUSAL, True)  # fmt: skip
    if LOCAL:
        acc, l_i, m_i = _fwd_steps(
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, rows, lo, mid_lo, Nk,
            lo_shift, hi_shift, qk_scale, cap_scale, True, CAUSAL, not EVEN_N, HEAD_DIM,
            BLOCK_N, BLOCK_D, DOT_PREC, TMA, SOFTCAP, LOCAL,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_steps(
        acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, rows, mid_lo, mid_hi, Nk,
        lo_shift, hi_shift, qk_scale, cap_scale, False, CAUSAL, False, HEAD_DIM, BLOCK_N,
        BLOCK_D, DOT_PREC, TMA, SOFTCAP, LOCAL,
    )  # fmt: skip
    if CAUSAL or LOCAL or not EVEN_N:
        acc, l_i, m_i = _fwd_steps(
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, rows, mid_hi, hi, Nk,
            lo_shift, hi_shift, qk_scale, cap_scale, True, CAUSAL, not EVEN_N, HEAD_DIM,
            BLOCK_N, BLOCK_D, DOT_PREC, TMA, SOFTCAP, LOCAL,
        )  # fmt: skip

    # A row that sees no key (causal with Nq > Nk, windows) has l = 0: zeros and LSE = -inf.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on
    o_ptrs = o_ptrs + offs_m[:, None] * stride_on + offs_d[None, :]
    _store_rows(o_ptrs, o.to(O.dtype.element_ty), rows, Nq, offs_d, not EVEN_M, HEAD_DIM)
    lse = (m_i + tl.math.log2(l_i)) * LN2
    lse_ptrs = LSE + b * stride_lb + h * stride_lh + rows
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=rows < Nq)


# ---------------------------------------------------------------------------------------------
# Split-KV forward (decoding: few query rows, long key sequences)
# ---------------------------------------------------------------------------------------------
#
# When the query side cannot fill the GPU (decoding: Nq = 1..16 against a long KV cache), the
# keys are split across programs. A program owns one split of one kv head and packs the GROUP
# query heads that read that head, times the Nq queries, into the M rows of its tile (packed row
# r = query (r // GROUP) of query head hk * GROUP + r % GROUP), so each K/V byte is read once per
# kv head rather than once per query head. It writes a float32 partial (o normalised by its own
# sum, and its LSE in log2 units) per packed row; `attn_fwd_combine_kernel` merges the splits of
# a row through their LSEs in split order (deterministic). A split in which a row sees no key
# (causal) leaves the neutral partial o = 0, LSE = -inf, which the merge weighs by exp2(-inf) = 0.
#
# Partials: OP (B * Hkv, SPLITS, ROWS_PAD, BLOCK_D) and LP (B * Hkv, SPLITS, ROWS_PAD), float32
# and contiguous, ROWS_PAD = GROUP * Nq rounded up to BLOCK_M: every program writes its whole
# tile unmasked (rows past GROUP * Nq are padding the merge never stores).


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
    ]
)
def attn_fwd_split_kernel(
    Q,
    K,
    V,
    OP,
    LP,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
):
    """Partial attention of BLOCK_M packed query rows of one kv head over the keys of one split,
    k_start + [split * split_len, (split + 1) * split_len) (split_len and k_start: multiples of
    BLOCK_N; k_start > 0 skips keys no window reaches)."""
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
    r = start_r + offs_m
    qi = r // GROUP  # query index of each packed row (>= Nq on padding rows)

    q_off = (qi.to(tl.int64) * stride_qn + (r % GROUP).to(tl.int64) * stride_qh)[:, None]
    q_ptrs = Q + b * stride_qb + hk * GROUP * stride_qh + q_off + offs_d[None, :]
    q = _load_rows(q_ptrs, r, n_rows, offs_d, True, HEAD_DIM)
    k_src = _head_source(K + b * stride_kb + hk * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, TMA)  # fmt: skip
    v_src = _head_source(V + b * stride_vb + hk * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, TMA)  # fmt: skip

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
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
            acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, qi, lo, mid_lo, Nk, lo_shift,
            hi_shift, qk_scale, cap_scale, True, CAUSAL, True, HEAD_DIM, BLOCK_N, BLOCK_D,
            DOT_PREC, TMA, SOFTCAP, LOCAL,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_steps(
        acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, qi, mid_lo, mid_hi, Nk, lo_shift,
        hi_shift, qk_scale, cap_scale, False, CAUSAL, False, HEAD_DIM, BLOCK_N, BLOCK_D,
        DOT_PREC, TMA, SOFTCAP, LOCAL,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_steps(
        acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, qi, mid_hi, hi, Nk, lo_shift,
        hi_shift, qk_scale, cap_scale, True, CAUSAL, True, HEAD_DIM, BLOCK_N, BLOCK_D,
        DOT_PREC, TMA, SOFTCAP, LOCAL,
    )  # fmt: skip

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, -float("inf"), m_i + tl.math.log2(l_i))
    part = (bhk.to(tl.int64) * num_splits + split) * rows_pad + start_r + offs_m
    tl.store(OP + part[:, None] * BLOCK_D + offs_d[None, :], o)
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
    partials neutral) gets o = 0, LSE = -inf."""
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
# Backward
# ---------------------------------------------------------------------------------------------


# Query rows per semaphore of the Hopper backward's ordered dq sums (kernels_gluon.SEM_ROWS).
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
    BLOCK_M: tl.constexpr,
    ROWVEC: tl.constexpr,
    ROW_PAD: tl.constexpr,
    VARLEN: tl.constexpr,
    ZERO_DQ: tl.constexpr,
):
    """delta = rowsum(o * do) - dlse (dlse: the gradient flowing into the returned LSE), rows
    of LSE / DLSE read through (batch, head) strides and of LSE2 / DELTA through theirs.

    ROWVEC: the backward's row vectors, padded: lse2 (the LSE in log2 units) and delta of every
    row up to Nq rounded up to ROW_PAD, +inf and 0 past Nq (so the kernels read them with no
    row check), each sequence of a packed batch (VARLEN) from a multiple of 16 (`_rowvec_start`;
    so they read them with 8-byte vectors; from cu_seqlens' own offsets they could not). The grid
    then covers the padded rows. Else delta only, of the Nq rows.

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
    o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on
    o = _load_rows(
        o_ptrs + offs_m[:, None] * stride_on + offs_d[None, :], rows, Nq, offs_d, True, HEAD_DIM
    )
    do_ptrs = DO + b * stride_dob + h * stride_doh + start_m.to(tl.int64) * stride_don
    do = _load_rows(
        do_ptrs + offs_m[:, None] * stride_don + offs_d[None, :], rows, Nq, offs_d, True, HEAD_DIM
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    vec = b * stride_lb + h * stride_lh + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + vec, mask=rows < Nq, other=0.0)
    out = b * stride_vb + h * stride_vh + rows
    if ROWVEC:  # every padded row (BLOCK_M divides ROW_PAD)
        tl.store(LSE2 + out, _lse_log2(tl.load(LSE + vec, mask=rows < Nq, other=float("inf"))))
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
               BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
               SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr,
               ROWVEC: tl.constexpr):  # fmt: skip
    """dk, dv of one key block plus the query block at start_m, in the transposed (key x query)
    orientation. Query rows past Nq (CHECK_M) load q = do = 0 and LSE = +inf, so their p is 0
    and they add nothing (ROWVEC: the padded row vectors hold +inf and 0 there, unchecked);
    MASK applies the window (causal) mask."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
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
    do = _load_block(do_src, start_m, stride_don, offs_m, Nq, offs_d, CHECK_M, HEAD_DIM, TMA)
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
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                TMA: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr,
                LOCAL: tl.constexpr, ROWVEC: tl.constexpr):  # fmt: skip
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
                BLOCK_M, BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL, ROWVEC,
            )  # fmt: skip
    for start_m in range(start, hi, BLOCK_M):
        dk, dv = _dkdv_step(
            dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qn, stride_don, cols,
            start_m, Nq, lo_shift, hi_shift, qk_scale, cap_scale, MASK, CHECK_M, HEAD_DIM,
            BLOCK_M, BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL, ROWVEC,
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
):
    """dk, dv of one key block of one kv head. With GQA the program loops over the GROUP query
    heads that read this kv head, so their contributions add up in a fixed order (deterministic,
    no atomics). A key block whose sequence has no query rows writes zeros. LSE is the
    forward's LSE, or with ROWVEC the preprocess's padded lse2 (then DELTA is padded alike)."""
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
        v_ptrs + offs_n[:, None] * stride_vn + offs_d[None, :],
        cols,
        Nk,
        offs_d,
        not EVEN_N,
        HEAD_DIM,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

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
    for g in range(GROUP):
        h = (hk * GROUP + g).to(tl.int64)
        q_src = _head_source(Q + b * stride_qb + h * stride_qh, Nq, stride_qn, BLOCK_M, HEAD_DIM,
                             BLOCK_D, TMA)  # fmt: skip
        do_src = _head_source(DO + b * stride_dob + h * stride_doh, Nq, stride_don, BLOCK_M,
                              HEAD_DIM, BLOCK_D, TMA)  # fmt: skip
        vec_base = b * stride_lb + h * stride_lh
        if CAUSAL:
            dk, dv = _dkdv_steps(
                dk, dv, k, v, q_src, do_src, LSE + vec_base, DELTA + vec_base, stride_qn,
                stride_don, cols, m_lo, m_full, Nq, lo_shift, hi_shift, qk_scale, cap_scale,
                True, CHECK_M, False, HEAD_DIM, BLOCK_M, BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL,
                LOCAL, ROWVEC,
            )  # fmt: skip
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_src, do_src, LSE + vec_base, DELTA + vec_base, stride_qn,
            stride_don, cols, m_full, m_full_hi, Nq, lo_shift, hi_shift, qk_scale, cap_scale,
            False, CHECK_M, PEEL_TAIL, HEAD_DIM, BLOCK_M, BLOCK_D, DOT_PREC, TMA, SOFTCAP,
            CAUSAL, LOCAL, ROWVEC,
        )  # fmt: skip
        if LOCAL:
            dk, dv = _dkdv_steps(
                dk, dv, k, v, q_src, do_src, LSE + vec_base, DELTA + vec_base, stride_qn,
                stride_don, cols, m_full_hi, m_hi, Nq, lo_shift, hi_shift, qk_scale, cap_scale,
                True, CHECK_M, False, HEAD_DIM, BLOCK_M, BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL,
                LOCAL, ROWVEC,
            )  # fmt: skip

    dk *= sm_scale
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
        dv_ptrs + offs_n[:, None] * stride_dvn + offs_d[None, :],
        dv.to(DV.dtype.element_ty), cols, Nk, offs_d, not EVEN_N, HEAD_DIM,
    )  # fmt: skip


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, start_n, Nk,
             lo_shift, hi_shift, qk_scale, cap_scale, MASK: tl.constexpr, CHECK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             DOT_PREC: tl.constexpr, TMA: tl.constexpr, SOFTCAP: tl.constexpr,
             CAUSAL: tl.constexpr, LOCAL: tl.constexpr):  # fmt: skip
    """dq of one query block plus the key block at start_n; MASK applies the window (causal)
    mask. Keys past Nk (CHECK_N) load k = v = 0, so their score 0 gives p = exp2(-lse2), which
    overflows where a row's LSE is very negative (few keys, large negative scores), and the
    float16 dS = inf times k = 0 was NaN. The masked steps drop those keys (`_visible`); the
    unmasked ones bound p by 1, which every real key's p is (a column mask there costs the d64
    kernel 25 registers and its second program per SM: 9% of a ragged backward on the H100),
    so a padded key's dS = -delta stays finite and adds delta * 0 = 0."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    cols = start_n + offs_n
    k = _load_block(k_src, start_n, stride_kn, offs_n, Nk, offs_d, CHECK_N, HEAD_DIM, TMA)
    v = _load_block(v_src, start_n, stride_vn, offs_n, Nk, offs_d, CHECK_N, HEAD_DIM, TMA)
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
              BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
              SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr):  # fmt: skip
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
                BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
            )  # fmt: skip
    for start_n in range(start, hi, BLOCK_N):
        dq = _dq_step(
            dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, start_n, Nk,
            lo_shift, hi_shift, qk_scale, cap_scale, MASK, CHECK_N, HEAD_DIM, BLOCK_N, BLOCK_D,
            DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
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
):
    """dq of one query block: a pass over the key blocks of its own (no atomics). LSE and DELTA
    as in the dk/dv kernel."""
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
        do_ptrs + offs_m[:, None] * stride_don + offs_d[None, :],
        rows,
        Nq,
        offs_d,
        not EVEN_M,
        HEAD_DIM,
    )
    vec = b * stride_lb + h * stride_lh + rows
    lse2 = _load_lse2(LSE + vec, rows, Nq, not EVEN_M, ROWVEC)
    delta = _load_vec(DELTA + vec, rows, Nq, 0.0, not (EVEN_M or ROWVEC))
    k_src = _head_source(K + b * stride_kb + hk * stride_kh, Nk, stride_kn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, TMA)  # fmt: skip
    v_src = _head_source(V + b * stride_vb + hk * stride_vh, Nk, stride_vn, BLOCK_N, HEAD_DIM,
                         BLOCK_D, TMA)  # fmt: skip
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
                BLOCK_N, BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
            )  # fmt: skip
        dq = _dq_steps(
            dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, mid_lo, mid_hi, Nk,
            lo_shift, hi_shift, qk_scale, cap_scale, False, not (EVEN_N or CAUSAL), PEEL_TAIL,
            HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
        )  # fmt: skip
        if CAUSAL:
            dq = _dq_steps(
                dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, mid_hi, hi, Nk,
                lo_shift, hi_shift, qk_scale, cap_scale, True, not EVEN_N, False, HEAD_DIM,
                BLOCK_N, BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
            )  # fmt: skip
    else:
        dq = _dq_steps(
            dq, q, do, lse2, delta, k_src, v_src, stride_kn, stride_vn, rows, 0, Nk, Nk,
            lo_shift, hi_shift, qk_scale, cap_scale, False, not EVEN_N, PEEL_TAIL, HEAD_DIM,
            BLOCK_N, BLOCK_D, DOT_PREC, TMA, SOFTCAP, CAUSAL, LOCAL,
        )  # fmt: skip

    dq *= sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + start_m.to(tl.int64) * stride_dqn
    _store_rows(
        dq_ptrs + offs_m[:, None] * stride_dqn + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), rows, Nq, offs_d, not EVEN_M, HEAD_DIM,
    )  # fmt: skip
