"""Triton code of the act package.

The first half is the device-level building blocks other kernelkit packages fuse into their own
kernels (import them from `kernelkit.act.kernels`); the second half is this package's kernels.

Conventions: blocks are float32 inside the kernel; `ACT` is a `tl.constexpr` string out of
ELEMENTWISE_ACTS; masked lanes of a softmax input hold -inf.
"""

import triton
import triton.language as tl

ELEMENTWISE_ACTS = ("none", "relu", "sigmoid", "silu")

# Arguments that change with the sequence length (or batch) and are not the extent of a
# contiguous axis: never specialised, so a new N reuses the compiled kernel. The extent of the
# contiguous axis (n, I, a row's L) stays specialised: its divisibility by 16 is what lets
# masked loads be 16 bytes wide.
_SPLIT_SIZES = ["L", "O1", "chunk", "num_chunks"]
_ROW_SIZES = ["rows", "O1"]

# --------------------------------------------------------------------------------------------
# Building blocks (device functions)
# --------------------------------------------------------------------------------------------


@triton.jit
def apply_act(x, ACT: tl.constexpr):
    """Element-wise activation of a float32 block."""
    if ACT == "relu":
        y = tl.where(x < 0.0, 0.0, x)  # NaN propagates, as torch.relu
    elif ACT == "sigmoid":
        y = tl.sigmoid(x)
    elif ACT == "silu":
        y = x * tl.sigmoid(x)
    else:
        y = x
    return y


@triton.jit
def apply_act_grad(x, dy, ACT: tl.constexpr):
    """dy * act'(x) for a float32 block (relu' is 0 at x = 0, as PyTorch)."""
    if ACT == "relu":
        dx = tl.where(x > 0.0, dy, 0.0)
    elif ACT == "sigmoid":
        s = tl.sigmoid(x)
        dx = dy * s * (1.0 - s)
    elif ACT == "silu":
        s = tl.sigmoid(x)
        dx = dy * s * (1.0 + x * (1.0 - s))
    else:
        dx = dy
    return dx


@triton.jit
def _finite_or_zero(m):
    # A running max of -inf (all inputs -inf so far) is used as 0 when shifting, so that
    # exp(-inf - m) gives 0 instead of exp(-inf + inf) = NaN.
    return tl.where(m == -float("inf"), 0.0, m)


@triton.jit
def softmax_stats(x, AXIS: tl.constexpr):
    """(max, sum of exp(x - max)) of a block along AXIS."""
    m = tl.max(x, axis=AXIS)
    s = tl.sum(tl.exp(x - tl.expand_dims(_finite_or_zero(m), AXIS)), axis=AXIS)
    return m, s


@triton.jit
def softmax_merge(m1, s1, m2, s2):
    """Combine two partial (max, sum) pairs of disjoint parts of one softmax axis."""
    m = tl.maximum(m1, m2)
    ms = _finite_or_zero(m)
    s = s1 * tl.exp(m1 - ms) + s2 * tl.exp(m2 - ms)
    return m, s


@triton.jit
def softmax_normalize(x, m, s, AXIS: tl.constexpr):
    """exp(x - m) / s with the stats broadcast along AXIS (NaN for an all -inf row, as torch)."""
    return tl.exp(x - tl.expand_dims(_finite_or_zero(m), AXIS)) * tl.expand_dims(1.0 / s, AXIS)


@triton.jit
def softmax_grad(y, dy, AXIS: tl.constexpr):
    """y * (dy - sum(y * dy)) along AXIS, for a block that holds the whole axis."""
    return y * (dy - tl.expand_dims(tl.sum(y * dy, axis=AXIS), AXIS))


@triton.jit
def combine_chunk_stats(m_ptr, s_ptr, num_chunks, stride_chunk, offs, mask):
    """Global (max, sum) of the columns `offs` from per-chunk stats written by
    `softmax_chunk_stats_kernel` (pointers already at this outer index's (chunk 0, column 0))."""
    m_tot = tl.load(m_ptr + offs, mask=mask, other=0.0)
    s_tot = tl.load(s_ptr + offs, mask=mask, other=1.0)
    for c in range(1, num_chunks):
        m = tl.load(m_ptr + c * stride_chunk + offs, mask=mask, other=0.0)
        s = tl.load(s_ptr + c * stride_chunk + offs, mask=mask, other=1.0)
        m_tot, s_tot = softmax_merge(m_tot, s_tot, m, s)
    return m_tot, s_tot


@triton.jit
def combine_chunk_sums(p_ptr, num_chunks, stride_chunk, offs, mask):
    """Sum over chunks of per-chunk partial sums (e.g. sum(y * dy) for a softmax backward)."""
    tot = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for c in range(1, num_chunks):
        tot += tl.load(p_ptr + c * stride_chunk + offs, mask=mask, other=0.0)
    return tot


@triton.jit
def packed_chunk(cu_seqlens, seq, c, num_chunks, BLOCK: tl.constexpr):
    """(first, end) rows of chunk c when sequence `seq` of a packed axis (int32 prefix sums
    `cu_seqlens`) is split into `num_chunks` chunks of whole BLOCKs (the last ones may be
    empty: first >= end). For split-axis grids over packed sequences: the chunk size follows
    each sequence's length, read on the device, so planning needs no host synchronisation."""
    lo = tl.load(cu_seqlens + seq)
    hi = tl.load(cu_seqlens + seq + 1)
    size = tl.cdiv(tl.cdiv(hi - lo, num_chunks), BLOCK) * BLOCK
    first = lo + c * size
    return first, tl.minimum(first + size, hi)


@triton.jit
def strided_offsets(lin, d1, d2, d3, s0, s1, s2, s3):
    """Memory offsets of linear indices `lin` in a 4-D (.., d1, d2, d3) view with strides s0..s3."""
    i3 = lin % d3
    r = lin // d3
    i2 = r % d2
    r = r // d2
    i1 = r % d1
    i0 = r // d1
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3


# --------------------------------------------------------------------------------------------
# Element-wise kernels. FLAT: every tensor is dense with identical strides, so its storage is
# walked linearly; otherwise the (collapsed, at most 4-D) strides of each tensor are used.
# --------------------------------------------------------------------------------------------


@triton.jit
def act_fwd_kernel(
    x_ptr,
    y_ptr,
    n,
    d1,
    d2,
    d3,
    xs0,
    xs1,
    xs2,
    xs3,
    ys0,
    ys1,
    ys2,
    ys3,
    ACT: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    lin = start + tl.arange(0, BLOCK)
    mask = lin < n
    if FLAT:
        x_off = lin
        y_off = lin
    else:
        x_off = strided_offsets(lin, d1, d2, d3, xs0, xs1, xs2, xs3)
        y_off = strided_offsets(lin, d1, d2, d3, ys0, ys1, ys2, ys3)
    x = tl.load(x_ptr + x_off, mask=mask).to(tl.float32)
    tl.store(y_ptr + y_off, apply_act(x, ACT).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def act_bwd_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    n,
    d1,
    d2,
    d3,
    xs0,
    xs1,
    xs2,
    xs3,
    gs0,
    gs1,
    gs2,
    gs3,
    ds0,
    ds1,
    ds2,
    ds3,
    ACT: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    lin = start + tl.arange(0, BLOCK)
    mask = lin < n
    if FLAT:
        x_off = lin
        g_off = lin
        d_off = lin
    else:
        x_off = strided_offsets(lin, d1, d2, d3, xs0, xs1, xs2, xs3)
        g_off = strided_offsets(lin, d1, d2, d3, gs0, gs1, gs2, gs3)
        d_off = strided_offsets(lin, d1, d2, d3, ds0, ds1, ds2, ds3)
    x = tl.load(x_ptr + x_off, mask=mask).to(tl.float32)
    dy = tl.load(dy_ptr + g_off, mask=mask).to(tl.float32)
    dx = apply_act_grad(x, dy, ACT)
    tl.store(dx_ptr + d_off, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Softmax. A tensor is viewed as (O0, O1, L, I): the softmax axis L, the outer dims collapsed
# to at most two, the inner dims to one. Rows (I == 1, L short) are done in one pass by
# `softmax_*_rows_kernel`, columns (I > 1, L short) by `softmax_*_cols_kernel`. Otherwise L is
# split into chunks (with packed sequences, each sequence is): a stats kernel writes per-chunk
# float32 (max, sum) (or sum(y * dy)) of shape (O0 * O1, C, I), and an apply kernel combines
# them and writes its chunk: every program has work whatever L is.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_ROW_SIZES)
def softmax_fwd_rows_kernel(
    x_ptr,
    y_ptr,
    rows,
    L,
    O1,
    xs_o0,
    xs_o1,
    xs_l,
    ys_o0,
    ys_o1,
    ys_l,
    BLOCK_R: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_L)
    r_ok = r < rows
    c_ok = cols < L
    o0 = r // O1
    o1 = r % O1
    mask = r_ok[:, None] & c_ok[None, :]
    x_off = (o0 * xs_o0 + o1 * xs_o1)[:, None] + cols[None, :] * xs_l
    x = tl.load(x_ptr + x_off, mask=mask, other=-float("inf")).to(tl.float32)
    m, s = softmax_stats(x, 1)
    y = softmax_normalize(x, m, s, 1)
    y_off = (o0 * ys_o0 + o1 * ys_o1)[:, None] + cols[None, :] * ys_l
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_ROW_SIZES)
def softmax_bwd_rows_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    rows,
    L,
    O1,
    ys_o0,
    ys_o1,
    ys_l,
    gs_o0,
    gs_o1,
    gs_l,
    ds_o0,
    ds_o1,
    ds_l,
    BLOCK_R: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_L)
    o0 = r // O1
    o1 = r % O1
    mask = (r < rows)[:, None] & (cols < L)[None, :]
    y = tl.load(
        y_ptr + (o0 * ys_o0 + o1 * ys_o1)[:, None] + cols[None, :] * ys_l, mask=mask, other=0.0
    ).to(tl.float32)
    dy = tl.load(
        dy_ptr + (o0 * gs_o0 + o1 * gs_o1)[:, None] + cols[None, :] * gs_l, mask=mask, other=0.0
    ).to(tl.float32)
    dx = softmax_grad(y, dy, 1)
    tl.store(
        dx_ptr + (o0 * ds_o0 + o1 * ds_o1)[:, None] + cols[None, :] * ds_l,
        dx.to(dx_ptr.dtype.element_ty),
        mask=mask,
    )


# Columns (I > 1, L short): one program holds whole columns, [BLOCK_L >= L, BLOCK_I], and does
# the softmax (or its backward) in one pass: two transfers and one launch instead of three and
# two, for the short sequence axes of small shapes (a decode step, a 256-token prompt).


@triton.jit
def _column_tile(L, I, O1, s_o0, s_o1, s_l, s_i, BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr):
    """(offsets, mask) of this program's [BLOCK_L, BLOCK_I] tile in the (O0, O1, L, I) view:
    program p holds column block p % cdiv(I, BLOCK_I) of outer index p // cdiv(I, BLOCK_I)."""
    n_iblk = tl.cdiv(I, BLOCK_I)
    pid = tl.program_id(0)
    o = pid // n_iblk
    cols = ((pid % n_iblk) * BLOCK_I + tl.arange(0, BLOCK_I)).to(tl.int64)
    rows = tl.arange(0, BLOCK_L).to(tl.int64)
    base = (o // O1).to(tl.int64) * s_o0 + (o % O1).to(tl.int64) * s_o1
    offs = base + rows[:, None] * s_l + cols[None, :] * s_i
    return offs, (rows < L)[:, None] & (cols < I)[None, :]


@triton.jit(do_not_specialize=["L", "O1"])
def softmax_fwd_cols_kernel(
    x_ptr,
    y_ptr,
    L,
    I,
    O1,
    xs_o0,
    xs_o1,
    xs_l,
    xs_i,
    ys_o0,
    ys_o1,
    ys_l,
    ys_i,
    BLOCK_L: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    x_off, mask = _column_tile(L, I, O1, xs_o0, xs_o1, xs_l, xs_i, BLOCK_L, BLOCK_I)
    x = tl.load(x_ptr + x_off, mask=mask, other=-float("inf")).to(tl.float32)
    m, s = softmax_stats(x, 0)
    y_off, _ = _column_tile(L, I, O1, ys_o0, ys_o1, ys_l, ys_i, BLOCK_L, BLOCK_I)
    tl.store(y_ptr + y_off, softmax_normalize(x, m, s, 0).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["L", "O1"])
def softmax_bwd_cols_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    L,
    I,
    O1,
    ys_o0,
    ys_o1,
    ys_l,
    ys_i,
    gs_o0,
    gs_o1,
    gs_l,
    gs_i,
    ds_o0,
    ds_o1,
    ds_l,
    ds_i,
    BLOCK_L: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    y_off, mask = _column_tile(L, I, O1, ys_o0, ys_o1, ys_l, ys_i, BLOCK_L, BLOCK_I)
    g_off, _ = _column_tile(L, I, O1, gs_o0, gs_o1, gs_l, gs_i, BLOCK_L, BLOCK_I)
    d_off, _ = _column_tile(L, I, O1, ds_o0, ds_o1, ds_l, ds_i, BLOCK_L, BLOCK_I)
    y = tl.load(y_ptr + y_off, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + d_off, softmax_grad(y, dy, 0).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_coords(
    L, I, O1, chunk, num_chunks, cu_seqlens, BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr
):
    """(o0, o1, stats row, chunk index, first row, end row, column offsets, column mask) of this
    program in the split-L grid: axis 0 enumerates (outer index, column block), axis 1 the
    chunk of L, or with `cu_seqlens` (packed sequences along L) the (sequence, chunk) pairs:
    each sequence is split into `num_chunks` chunks of whole blocks, and its stats row is
    sequence * O + outer index."""
    n_iblk = tl.cdiv(I, BLOCK_I)
    pid = tl.program_id(0)
    o = pid // n_iblk
    cols = (pid % n_iblk) * BLOCK_I + tl.arange(0, BLOCK_I)
    if cu_seqlens is None:
        c = tl.program_id(1)
        row = o
        l0 = c * chunk
        l1 = tl.minimum(l0 + chunk, L)
    else:
        seq = tl.program_id(1) // num_chunks
        c = tl.program_id(1) % num_chunks
        row = seq * (tl.num_programs(0) // n_iblk) + o
        l0, l1 = packed_chunk(cu_seqlens, seq, c, num_chunks, BLOCK_L)
    return o // O1, o % O1, row, c, l0, l1, cols, cols < I


@triton.jit(do_not_specialize=_SPLIT_SIZES)
def softmax_chunk_stats_kernel(
    x_ptr,
    stats_ptr,
    L,
    I,
    O1,
    chunk,
    num_chunks,
    xs_o0,
    xs_o1,
    xs_l,
    xs_i,
    cu_seqlens,
    BLOCK_L: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    o0, o1, row, c, l0, l1, cols, c_ok = _chunk_coords(
        L, I, O1, chunk, num_chunks, cu_seqlens, BLOCK_L, BLOCK_I
    )
    base = x_ptr + o0.to(tl.int64) * xs_o0 + o1.to(tl.int64) * xs_o1
    m = tl.full([BLOCK_I], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK_I], tl.float32)
    for l_start in range(l0, l1, BLOCK_L):
        rows = l_start + tl.arange(0, BLOCK_L)
        mask = (rows < l1)[:, None] & c_ok[None, :]
        x = tl.load(
            base + rows.to(tl.int64)[:, None] * xs_l + cols[None, :] * xs_i,
            mask=mask,
            other=-float("inf"),
        ).to(tl.float32)
        bm, bs = softmax_stats(x, 0)
        m, s = softmax_merge(m, s, bm, bs)
    # stats (2, S * O, C, I) (S = 1 without cu_seqlens): maxima, then sums. One pointer, not
    # two views of one buffer: a traced launch treats each pointer argument it writes as a
    # separate output. Empty chunks write (-inf, 0), which merges as nothing.
    out = (row.to(tl.int64) * num_chunks + c) * I + cols
    stat_rows = (tl.num_programs(0) // tl.cdiv(I, BLOCK_I)) * (tl.num_programs(1) // num_chunks)
    part = stat_rows.to(tl.int64) * num_chunks * I
    tl.store(stats_ptr + out, m, mask=c_ok)
    tl.store(stats_ptr + part + out, s, mask=c_ok)


@triton.jit(do_not_specialize=_SPLIT_SIZES)
def softmax_fwd_apply_kernel(
    x_ptr,
    y_ptr,
    m_ptr,
    s_ptr,
    L,
    I,
    O1,
    chunk,
    num_chunks,
    xs_o0,
    xs_o1,
    xs_l,
    xs_i,
    ys_o0,
    ys_o1,
    ys_l,
    ys_i,
    cu_seqlens,
    BLOCK_L: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    o0, o1, row, _, l0, l1, cols, c_ok = _chunk_coords(
        L, I, O1, chunk, num_chunks, cu_seqlens, BLOCK_L, BLOCK_I
    )
    stats = row.to(tl.int64) * num_chunks * I
    m, s = combine_chunk_stats(m_ptr + stats, s_ptr + stats, num_chunks, I, cols, c_ok)
    x_base = x_ptr + o0.to(tl.int64) * xs_o0 + o1.to(tl.int64) * xs_o1
    y_base = y_ptr + o0.to(tl.int64) * ys_o0 + o1.to(tl.int64) * ys_o1
    for l_start in range(l0, l1, BLOCK_L):
        rows = (l_start + tl.arange(0, BLOCK_L)).to(tl.int64)
        mask = (rows < l1)[:, None] & c_ok[None, :]
        x = tl.load(x_base + rows[:, None] * xs_l + cols[None, :] * xs_i, mask=mask, other=0.0).to(
            tl.float32
        )
        y = softmax_normalize(x, m, s, 0)
        tl.store(
            y_base + rows[:, None] * ys_l + cols[None, :] * ys_i,
            y.to(y_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit(do_not_specialize=_SPLIT_SIZES)
def softmax_bwd_chunk_sums_kernel(
    y_ptr,
    dy_ptr,
    p_ptr,
    L,
    I,
    O1,
    chunk,
    num_chunks,
    ys_o0,
    ys_o1,
    ys_l,
    ys_i,
    gs_o0,
    gs_o1,
    gs_l,
    gs_i,
    cu_seqlens,
    BLOCK_L: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    o0, o1, row, c, l0, l1, cols, c_ok = _chunk_coords(
        L, I, O1, chunk, num_chunks, cu_seqlens, BLOCK_L, BLOCK_I
    )
    y_base = y_ptr + o0.to(tl.int64) * ys_o0 + o1.to(tl.int64) * ys_o1
    g_base = dy_ptr + o0.to(tl.int64) * gs_o0 + o1.to(tl.int64) * gs_o1
    acc = tl.zeros([BLOCK_I], tl.float32)
    for l_start in range(l0, l1, BLOCK_L):
        rows = (l_start + tl.arange(0, BLOCK_L)).to(tl.int64)
        mask = (rows < l1)[:, None] & c_ok[None, :]
        y = tl.load(y_base + rows[:, None] * ys_l + cols[None, :] * ys_i, mask=mask, other=0.0)
        dy = tl.load(g_base + rows[:, None] * gs_l + cols[None, :] * gs_i, mask=mask, other=0.0)
        acc += tl.sum(y.to(tl.float32) * dy.to(tl.float32), axis=0)
    out = (row.to(tl.int64) * num_chunks + c) * I + cols
    tl.store(p_ptr + out, acc, mask=c_ok)


@triton.jit(do_not_specialize=_SPLIT_SIZES)
def softmax_bwd_apply_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    p_ptr,
    L,
    I,
    O1,
    chunk,
    num_chunks,
    ys_o0,
    ys_o1,
    ys_l,
    ys_i,
    gs_o0,
    gs_o1,
    gs_l,
    gs_i,
    ds_o0,
    ds_o1,
    ds_l,
    ds_i,
    cu_seqlens,
    BLOCK_L: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    o0, o1, row, _, l0, l1, cols, c_ok = _chunk_coords(
        L, I, O1, chunk, num_chunks, cu_seqlens, BLOCK_L, BLOCK_I
    )
    tot = combine_chunk_sums(p_ptr + row.to(tl.int64) * num_chunks * I, num_chunks, I, cols, c_ok)
    y_base = y_ptr + o0.to(tl.int64) * ys_o0 + o1.to(tl.int64) * ys_o1
    g_base = dy_ptr + o0.to(tl.int64) * gs_o0 + o1.to(tl.int64) * gs_o1
    d_base = dx_ptr + o0.to(tl.int64) * ds_o0 + o1.to(tl.int64) * ds_o1
    for l_start in range(l0, l1, BLOCK_L):
        rows = (l_start + tl.arange(0, BLOCK_L)).to(tl.int64)
        mask = (rows < l1)[:, None] & c_ok[None, :]
        y = tl.load(y_base + rows[:, None] * ys_l + cols[None, :] * ys_i, mask=mask, other=0.0).to(
            tl.float32
        )
        dy = tl.load(g_base + rows[:, None] * gs_l + cols[None, :] * gs_i, mask=mask, other=0.0).to(
            tl.float32
        )
        dx = y * (dy - tot[None, :])
        tl.store(
            d_base + rows[:, None] * ds_l + cols[None, :] * ds_i,
            dx.to(dx_ptr.dtype.element_ty),
            mask=mask,
        )
