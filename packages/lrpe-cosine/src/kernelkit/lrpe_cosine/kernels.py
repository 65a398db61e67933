"""Triton code of lrpe-cosine.

Tiles are 3-D: [BLOCK_N tokens, ROWS batch rows, BLOCK_D >= D features] of one head. With an
int offset the angles do not depend on the batch row, so cos/sin are a [BLOCK_N, 1, BLOCK_D]
tile computed once per program and reused by every row it handles: B times less trigonometry,
and the ROWS rows of one load multiply the bytes in flight without holding more cos/sin. (Rows
sit on axis 1: Triton spreads threads and warps over the feature axis and then axis 0, so the
rows of a token stay in one thread's registers next to that token's cos/sin.)

Layout: x (B, N, H, D), y and dy (B, N, H, 2D) with the cos half first, all with runtime strides.
ACT is a tl.constexpr string: none / relu / sigmoid / silu (element-wise, from kernelkit-act),
softmax (over the D features of each token) or softmax_seq (over the sequence, from float32
per-(b, h, k) (max, sum) stats computed beforehand).

Extension point. The position -> angle mapping is the device functions `positions`,
`frequencies` and `angles`; `activate`, `activate_grad` and the kernels' load/store code do not
know where the angles come from. md-lrpe-cosine maps tokens to grid coordinates instead of
`offset + t` and reuses the rest.
"""

import triton
import triton.language as tl

from kernelkit.act.kernels import (
    apply_act,
    apply_act_grad,
    combine_chunk_stats,
    softmax_grad,
    softmax_normalize,
    softmax_stats,
)

# Sizes, offsets and batch-group sizes change with every call: never specialise on them.
_RUNTIME = ["B", "N", "offset", "rows_per_program", "stats_part"]

# --------------------------------------------------------------------------------------------
# Position -> angle mapping (the extension point)
# --------------------------------------------------------------------------------------------


@triton.jit
def positions(tokens, offset):
    """Integer positions (int64) of the token indices `tokens` of sequences starting at
    `offset` (the int offset, or a block of per-batch-row offsets broadcastable to tokens)."""
    return tokens.to(tl.int64) + offset


@triton.jit
def frequencies(theta_row_ptr, feats, D, E, stride_e):
    """theta[h, k] (float32) for the features `feats` of one head, whose row starts at
    `theta_row_ptr`: E == D one per feature, E == 1 one for all features, 1 < E < D zero
    (angle 0: cos part = x, sin part = 0) for the features k >= E."""
    single = E == 1
    cols = tl.where(single, 0, feats)
    ok = (feats < D) & (single | (feats < E))
    return tl.load(theta_row_ptr + cols * stride_e, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def angles(pos, freqs):
    """float32(freq) * float32(position), exactly the reference's angles; `pos` and `freqs`
    are already shaped to broadcast (e.g. [1, BLOCK_N, 1] x [1, 1, BLOCK_D])."""
    return pos.to(tl.float32) * freqs


@triton.jit
def token_angles(tokens, offset, freqs):
    """[BLOCK_N, 1, BLOCK_D] angles of a block of tokens for an int offset."""
    return angles(positions(tokens, offset)[:, None, None], freqs[None, None, :])


@triton.jit
def row_positions(offsets_ptr, b, row_ok, tokens):
    """[BLOCK_N, ROWS, 1] positions of the tokens of batch rows `b` with per-row offsets."""
    off = tl.load(offsets_ptr + b, mask=row_ok, other=0)
    return positions(tokens[:, None], off[None, :])[:, :, None]


# --------------------------------------------------------------------------------------------
# Activation in front of the feature map (forward and backward), on [tokens, rows, features]
# --------------------------------------------------------------------------------------------


@triton.jit
def activate(x, feat_ok, m, s, ACT: tl.constexpr):
    """x̄ = act(x) of a float32 [tokens, rows, features] tile. softmax: over the valid
    features (`feat_ok` [1, 1, BLOCK_D]); softmax_seq: with the [rows, features] sequence
    (max, sum) `m`, `s`."""
    if ACT == "softmax":
        xm = tl.where(feat_ok, x, -float("inf"))
        mx, sx = softmax_stats(xm, 2)
        y = softmax_normalize(xm, mx, sx, 2)
    elif ACT == "softmax_seq":
        y = softmax_normalize(x, m, s, 0)
    else:
        y = apply_act(x, ACT)
    return y


@triton.jit
def activate_grad(x, xbar, dxbar, tot, ACT: tl.constexpr):
    """dx from dx̄ through the activation; `xbar` = activate(x); `tot` [rows, features] = sum
    over the sequence of x̄ * dx̄ (softmax_seq only)."""
    if ACT == "softmax":
        dx = softmax_grad(xbar, dxbar, 2)
    elif ACT == "softmax_seq":
        dx = xbar * (dxbar - tot[None, :, :])
    else:
        dx = apply_act_grad(x, dxbar, ACT)
    return dx


@triton.jit
def feature_rows(ptr, b, row_ok, h, H, D, feats, feat_ok, other):
    """[rows, features] entries (b, h, feats) of a float32 (B, H, D) buffer (stats or sums)."""
    offs = ((b * H + h).to(tl.int64) * D)[:, None] + feats[None, :]
    return tl.load(ptr + offs, mask=row_ok[:, None] & feat_ok[None, :], other=other)


# --------------------------------------------------------------------------------------------
# Kernels. Grid: (token blocks or chunks, H, batch groups). A program of the forward/backward
# kernels loops over its `rows_per_program` batch rows ROWS at a time.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_RUNTIME)
def lrpe_cosine_fwd_kernel(
    x_ptr,
    theta_ptr,
    offsets_ptr,
    stats_ptr,
    y_ptr,
    B,
    N,
    H,
    D,
    E,
    offset,
    rows_per_program,
    stats_part,
    sxb,
    sxn,
    sxh,
    sxd,
    syb,
    syn,
    syh,
    syd,
    sth,
    ste,
    ACT: tl.constexpr,
    PER_BATCH: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    tile_ok = (tokens < N)[:, None, None] & feat_ok[None, None, :]
    freqs = frequencies(theta_ptr + h * sth, feats, D, E, ste)
    if not PER_BATCH:
        theta_t = token_angles(tokens, offset, freqs)
        cos_t = tl.cos(theta_t)
        sin_t = tl.sin(theta_t)
    x_tile = (tokens.to(tl.int64) * sxn)[:, None, None] + (feats * sxd)[None, None, :]
    y_tile = (tokens.to(tl.int64) * syn)[:, None, None] + (feats * syd)[None, None, :]
    x_head = x_ptr + h.to(tl.int64) * sxh
    y_head = y_ptr + h.to(tl.int64) * syh
    m = tl.zeros([ROWS, BLOCK_D], tl.float32)  # sequence stats: only softmax_seq reads them
    s = tl.full([ROWS, BLOCK_D], 1.0, tl.float32)
    b_lo = tl.program_id(2) * rows_per_program
    b_hi = tl.minimum(b_lo + rows_per_program, B)
    for b0 in range(b_lo, b_hi, ROWS):
        b = b0 + tl.arange(0, ROWS)
        row_ok = b < b_hi
        mask = row_ok[None, :, None] & tile_ok
        if PER_BATCH:
            pos = row_positions(offsets_ptr, b, row_ok, tokens)
            theta_t = angles(pos, freqs[None, None, :])
            cos_t = tl.cos(theta_t)
            sin_t = tl.sin(theta_t)
        if ACT == "softmax_seq":
            m = feature_rows(stats_ptr, b, row_ok, h, H, D, feats, feat_ok, 0.0)
            s = feature_rows(stats_ptr + stats_part, b, row_ok, h, H, D, feats, feat_ok, 1.0)
        x_rows = x_head + (b.to(tl.int64) * sxb)[None, :, None] + x_tile
        x = tl.load(x_rows, mask=mask, other=0.0).to(tl.float32)
        xbar = activate(x, feat_ok[None, None, :], m, s, ACT)
        y_rows = y_head + (b.to(tl.int64) * syb)[None, :, None] + y_tile
        tl.store(y_rows, (xbar * cos_t).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_rows + D * syd, (xbar * sin_t).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_RUNTIME)
def lrpe_cosine_bwd_kernel(
    x_ptr,
    theta_ptr,
    offsets_ptr,
    stats_ptr,
    sums_ptr,
    dy_ptr,
    dx_ptr,
    dtheta_ptr,
    B,
    N,
    H,
    D,
    E,
    offset,
    rows_per_program,
    stats_part,
    sxb,
    sxn,
    sxh,
    sxd,
    sgb,
    sgn,
    sgh,
    sgd,
    sdb,
    sdn,
    sdh,
    sdd,
    sth,
    ste,
    ACT: tl.constexpr,
    PER_BATCH: tl.constexpr,
    NEED_DX: tl.constexpr,
    NEED_DTHETA: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dx̄ = dy_cos cos + dy_sin sin, then the act backward (softmax_seq: the apply pass, with
    the sums of the first pass). With NEED_DTHETA each program also writes its float32 partial
    of dtheta[h, :] = sum pos * x̄ * (dy_sin cos - dy_cos sin) to dtheta_ptr[program, h, :]
    (summed by the host: deterministic)."""
    h = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    tile_ok = (tokens < N)[:, None, None] & feat_ok[None, None, :]
    freqs = frequencies(theta_ptr + h * sth, feats, D, E, ste)
    if not PER_BATCH:
        pos = positions(tokens, offset)[:, None, None]
        theta_t = angles(pos, freqs[None, None, :])
        cos_t = tl.cos(theta_t)
        sin_t = tl.sin(theta_t)
    x_tile = (tokens.to(tl.int64) * sxn)[:, None, None] + (feats * sxd)[None, None, :]
    g_tile = (tokens.to(tl.int64) * sgn)[:, None, None] + (feats * sgd)[None, None, :]
    d_tile = (tokens.to(tl.int64) * sdn)[:, None, None] + (feats * sdd)[None, None, :]
    x_head = x_ptr + h.to(tl.int64) * sxh
    g_head = dy_ptr + h.to(tl.int64) * sgh
    d_head = dx_ptr + h.to(tl.int64) * sdh
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    m = tl.zeros([ROWS, BLOCK_D], tl.float32)  # stats and sums: only softmax_seq reads them
    s = tl.full([ROWS, BLOCK_D], 1.0, tl.float32)
    tot = tl.zeros([ROWS, BLOCK_D], tl.float32)
    b_lo = tl.program_id(2) * rows_per_program
    b_hi = tl.minimum(b_lo + rows_per_program, B)
    for b0 in range(b_lo, b_hi, ROWS):
        b = b0 + tl.arange(0, ROWS)
        row_ok = b < b_hi
        mask = row_ok[None, :, None] & tile_ok
        if PER_BATCH:
            pos = row_positions(offsets_ptr, b, row_ok, tokens)
            theta_t = angles(pos, freqs[None, None, :])
            cos_t = tl.cos(theta_t)
            sin_t = tl.sin(theta_t)
        g_rows = g_head + (b.to(tl.int64) * sgb)[None, :, None] + g_tile
        dy_cos = tl.load(g_rows, mask=mask, other=0.0).to(tl.float32)
        dy_sin = tl.load(g_rows + D * sgd, mask=mask, other=0.0).to(tl.float32)
        dxbar = dy_cos * cos_t + dy_sin * sin_t
        if ACT != "none" or NEED_DTHETA:
            if ACT == "softmax_seq":
                m = feature_rows(stats_ptr, b, row_ok, h, H, D, feats, feat_ok, 0.0)
                s = feature_rows(stats_ptr + stats_part, b, row_ok, h, H, D, feats, feat_ok, 1.0)
                tot = feature_rows(sums_ptr, b, row_ok, h, H, D, feats, feat_ok, 0.0)
            x_rows = x_head + (b.to(tl.int64) * sxb)[None, :, None] + x_tile
            x = tl.load(x_rows, mask=mask, other=0.0).to(tl.float32)
            xbar = activate(x, feat_ok[None, None, :], m, s, ACT)
        else:
            x = dxbar
            xbar = dxbar
        if NEED_DTHETA:
            dang = pos.to(tl.float32) * xbar * (dy_sin * cos_t - dy_cos * sin_t)
            acc += tl.sum(dang, axis=1)
        if NEED_DX:
            dx = activate_grad(x, xbar, dxbar, tot, ACT)
            d_rows = d_head + (b.to(tl.int64) * sdb)[None, :, None] + d_tile
            tl.store(d_rows, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if NEED_DTHETA:
        part = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        out = dtheta_ptr + (part.to(tl.int64) * H + h) * D + feats
        tl.store(out, tl.sum(acc, axis=0), mask=feat_ok)


@triton.jit(do_not_specialize=[*_RUNTIME, "chunk", "num_chunks"])
def lrpe_cosine_bwd_seq_sums_kernel(
    x_ptr,
    theta_ptr,
    offsets_ptr,
    stats_ptr,
    dy_ptr,
    sums_ptr,
    dtheta_ptr,
    B,
    N,
    H,
    D,
    E,
    offset,
    rows_per_program,
    chunk,
    num_chunks,
    stats_part,
    sxb,
    sxn,
    sxh,
    sxd,
    sgb,
    sgn,
    sgh,
    sgd,
    sth,
    ste,
    PER_BATCH: tl.constexpr,
    NEED_DTHETA: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """First pass of the softmax-over-the-sequence backward. A program (chunk of tokens, h,
    ROWS batch rows) writes the float32 partial sums over its tokens of y * dx̄
    (y = softmax(x) over the sequence) to sums_ptr[b, chunk, h, :], and its dtheta partial (it
    has x̄ and dy at hand). `rows_per_program` is ROWS: the grid covers B in groups of ROWS."""
    h = tl.program_id(1)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    b = tl.program_id(2) * rows_per_program + tl.arange(0, ROWS)
    row_ok = b < B
    freqs = frequencies(theta_ptr + h * sth, feats, D, E, ste)
    m = feature_rows(stats_ptr, b, row_ok, h, H, D, feats, feat_ok, 0.0)
    s = feature_rows(stats_ptr + stats_part, b, row_ok, h, H, D, feats, feat_ok, 1.0)
    x_rows = x_ptr + h.to(tl.int64) * sxh + (b.to(tl.int64) * sxb)[None, :, None]
    g_rows = dy_ptr + h.to(tl.int64) * sgh + (b.to(tl.int64) * sgb)[None, :, None]
    # Element-wise accumulators, reduced once at the end: no cross-warp reduction per block.
    sums = tl.zeros([BLOCK_N, ROWS, BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_N, ROWS, BLOCK_D], tl.float32)
    t_start = tl.program_id(0) * chunk
    for t0 in range(t_start, tl.minimum(t_start + chunk, N), BLOCK_N):
        tokens = t0 + tl.arange(0, BLOCK_N)
        mask = (tokens < N)[:, None, None] & row_ok[None, :, None] & feat_ok[None, None, :]
        if PER_BATCH:
            pos = row_positions(offsets_ptr, b, row_ok, tokens)
        else:
            pos = positions(tokens, offset)[:, None, None]
        theta_t = angles(pos, freqs[None, None, :])
        cos_t = tl.cos(theta_t)
        sin_t = tl.sin(theta_t)
        x_tile = (tokens.to(tl.int64) * sxn)[:, None, None] + (feats * sxd)[None, None, :]
        g_tile = (tokens.to(tl.int64) * sgn)[:, None, None] + (feats * sgd)[None, None, :]
        x = tl.load(x_rows + x_tile, mask=mask, other=0.0).to(tl.float32)
        dy_cos = tl.load(g_rows + g_tile, mask=mask, other=0.0).to(tl.float32)
        dy_sin = tl.load(g_rows + g_tile + D * sgd, mask=mask, other=0.0).to(tl.float32)
        xbar = activate(x, feat_ok[None, None, :], m, s, "softmax_seq")
        sums += xbar * (dy_cos * cos_t + dy_sin * sin_t)
        if NEED_DTHETA:
            acc += pos.to(tl.float32) * xbar * (dy_sin * cos_t - dy_cos * sin_t)
    out_rows = b.to(tl.int64) * num_chunks + tl.program_id(0)
    out = sums_ptr + (out_rows[:, None] * H + h) * D + feats[None, :]
    tl.store(out, tl.sum(sums, axis=0), mask=row_ok[:, None] & feat_ok[None, :])
    if NEED_DTHETA:
        part = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        out_t = dtheta_ptr + (part.to(tl.int64) * H + h) * D + feats
        tl.store(out_t, tl.sum(tl.sum(acc, axis=1), axis=0), mask=feat_ok)


@triton.jit(do_not_specialize=["total", "num_chunks"])
def seq_stats_finalize_kernel(m_ptr, s_ptr, out_ptr, total, I, num_chunks, BLOCK: tl.constexpr):
    """Combine per-chunk (max, sum) of kernelkit-act's `softmax_chunk_stats`, shape (O, C, I),
    into the final float32 stats out[0, o * I + i] = max, out[1, o * I + i] = sum."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < total
    base = (idx // I) * num_chunks * I
    m, s = combine_chunk_stats(m_ptr + base, s_ptr + base, num_chunks, I, idx % I, ok)
    tl.store(out_ptr + idx, m, mask=ok)
    tl.store(out_ptr + total + idx, s, mask=ok)
