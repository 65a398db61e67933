"""Triton code of lrpe-cosine.

Every kernel works on a tile of (BLOCK_N tokens) x (all D features) of one head and loops over a
group of batch rows: with an int offset the angles do not depend on the batch, so cos/sin are
computed once per tile and reused for every row of the group (B times less trigonometry).

Layout: x (B, N, H, D), y and dy (B, N, H, 2D) with the cos half first, all with runtime strides.
ACT is a tl.constexpr string: none / relu / sigmoid / silu (element-wise, from kernelkit-act),
softmax (over the D features of a tile) or softmax_seq (over the sequence, using per-(b, h, k)
float32 (max, sum) stats computed beforehand).

Extension point. The position -> angle mapping is the three device functions `positions`,
`frequencies` and `angles`; everything else (`activate`, `activate_grad`, the stores) does not
know where angles come from. md-lrpe-cosine maps tokens to grid coordinates instead of
`offset + t`; it reuses these building blocks and only replaces the mapping.
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
    """Integer positions (int64) of the token indices `tokens` of a sequence that starts at
    `offset` (a scalar: the int offset, or this batch row's entry of the offsets tensor)."""
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
    """[tokens, features] angles float32(freq) * float32(position), exactly the reference's."""
    return pos.to(tl.float32)[:, None] * freqs[None, :]


# --------------------------------------------------------------------------------------------
# Activation in front of the feature map (forward and backward)
# --------------------------------------------------------------------------------------------


@triton.jit
def activate(x, feat_ok, m, s, ACT: tl.constexpr):
    """x̄ = act(x) of a float32 [tokens, features] tile. softmax: over the valid features of
    each token; softmax_seq: with the sequence (max, sum) `m`, `s` of these features."""
    if ACT == "softmax":
        xm = tl.where(feat_ok[None, :], x, -float("inf"))
        mx, sx = softmax_stats(xm, 1)
        y = softmax_normalize(xm, mx, sx, 1)
    elif ACT == "softmax_seq":
        y = softmax_normalize(x, m, s, 0)
    else:
        y = apply_act(x, ACT)
    return y


@triton.jit
def activate_grad(x, xbar, dxbar, tot, ACT: tl.constexpr):
    """dx from dx̄ through the activation; `xbar` = activate(x); `tot` = sum over the sequence
    of x̄ * dx̄ per feature (softmax_seq only)."""
    if ACT == "softmax":
        dx = softmax_grad(xbar, dxbar, 1)
    elif ACT == "softmax_seq":
        dx = xbar * (dxbar - tot[None, :])
    else:
        dx = apply_act_grad(x, dxbar, ACT)
    return dx


@triton.jit
def feature_row(ptr, b, h, H, D, feats, feat_ok, other):
    """Entries (b, h, feats) of a float32 (B, H, D) buffer (sequence stats or sums)."""
    return tl.load(ptr + (b * H + h).to(tl.int64) * D + feats, mask=feat_ok, other=other)


# --------------------------------------------------------------------------------------------
# Kernels. Grid: (token blocks or chunks, H, batch groups of `rows_per_program` rows).
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
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    mask = (tokens < N)[:, None] & feat_ok[None, :]
    freqs = frequencies(theta_ptr + h * sth, feats, D, E, ste)
    if not PER_BATCH:
        theta_t = angles(positions(tokens, offset), freqs)
        cos_t = tl.cos(theta_t)
        sin_t = tl.sin(theta_t)
    x_tile = tokens.to(tl.int64)[:, None] * sxn + feats[None, :] * sxd
    y_tile = tokens.to(tl.int64)[:, None] * syn + feats[None, :] * syd
    m = tl.zeros([BLOCK_D], tl.float32)  # sequence stats: only softmax_seq reads them
    s = tl.full([BLOCK_D], 1.0, tl.float32)
    b0 = tl.program_id(2) * rows_per_program
    for b in range(b0, tl.minimum(b0 + rows_per_program, B)):
        if PER_BATCH:
            theta_t = angles(positions(tokens, tl.load(offsets_ptr + b)), freqs)
            cos_t = tl.cos(theta_t)
            sin_t = tl.sin(theta_t)
        if ACT == "softmax_seq":
            m = feature_row(stats_ptr, b, h, H, D, feats, feat_ok, 0.0)
            s = feature_row(stats_ptr + stats_part, b, h, H, D, feats, feat_ok, 1.0)
        x_row = x_ptr + tl.cast(b, tl.int64) * sxb + h.to(tl.int64) * sxh
        x = tl.load(x_row + x_tile, mask=mask, other=0.0).to(tl.float32)
        xbar = activate(x, feat_ok, m, s, ACT)
        y_row = y_ptr + tl.cast(b, tl.int64) * syb + h.to(tl.int64) * syh + y_tile
        tl.store(y_row, (xbar * cos_t).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_row + D * syd, (xbar * sin_t).to(y_ptr.dtype.element_ty), mask=mask)


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
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dx̄ = dy_cos cos + dy_sin sin, then the act backward. With NEED_DTHETA each program
    also writes its float32 partial of dtheta[h, :] = sum pos * x̄ * (dy_sin cos - dy_cos sin)
    to dtheta_ptr[program, h, :] (summed by the host: deterministic)."""
    h = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    mask = (tokens < N)[:, None] & feat_ok[None, :]
    freqs = frequencies(theta_ptr + h * sth, feats, D, E, ste)
    if not PER_BATCH:
        pos = positions(tokens, offset)
        theta_t = angles(pos, freqs)
        cos_t = tl.cos(theta_t)
        sin_t = tl.sin(theta_t)
    x_tile = tokens.to(tl.int64)[:, None] * sxn + feats[None, :] * sxd
    g_tile = tokens.to(tl.int64)[:, None] * sgn + feats[None, :] * sgd
    d_tile = tokens.to(tl.int64)[:, None] * sdn + feats[None, :] * sdd
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    m = tl.zeros([BLOCK_D], tl.float32)  # sequence stats and sums: only softmax_seq reads them
    s = tl.full([BLOCK_D], 1.0, tl.float32)
    tot = tl.zeros([BLOCK_D], tl.float32)
    b0 = tl.program_id(2) * rows_per_program
    for b in range(b0, tl.minimum(b0 + rows_per_program, B)):
        if PER_BATCH:
            pos = positions(tokens, tl.load(offsets_ptr + b))
            theta_t = angles(pos, freqs)
            cos_t = tl.cos(theta_t)
            sin_t = tl.sin(theta_t)
        g_row = dy_ptr + tl.cast(b, tl.int64) * sgb + h.to(tl.int64) * sgh + g_tile
        dy_cos = tl.load(g_row, mask=mask, other=0.0).to(tl.float32)
        dy_sin = tl.load(g_row + D * sgd, mask=mask, other=0.0).to(tl.float32)
        dxbar = dy_cos * cos_t + dy_sin * sin_t
        if ACT != "none" or NEED_DTHETA:
            if ACT == "softmax_seq":
                m = feature_row(stats_ptr, b, h, H, D, feats, feat_ok, 0.0)
                s = feature_row(stats_ptr + stats_part, b, h, H, D, feats, feat_ok, 1.0)
                tot = feature_row(sums_ptr, b, h, H, D, feats, feat_ok, 0.0)
            x_row = x_ptr + tl.cast(b, tl.int64) * sxb + h.to(tl.int64) * sxh
            x = tl.load(x_row + x_tile, mask=mask, other=0.0).to(tl.float32)
            xbar = activate(x, feat_ok, m, s, ACT)
        else:
            x = dxbar
            xbar = dxbar
        if NEED_DTHETA:
            acc += pos.to(tl.float32)[:, None] * xbar * (dy_sin * cos_t - dy_cos * sin_t)
        if NEED_DX:
            dx = activate_grad(x, xbar, dxbar, tot, ACT)
            d_row = dx_ptr + tl.cast(b, tl.int64) * sdb + h.to(tl.int64) * sdh + d_tile
            tl.store(d_row, dx.to(dx_ptr.dtype.element_ty), mask=mask)
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
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """First pass of the softmax-over-the-sequence backward: per (b, chunk of tokens, h, k)
    float32 partial sums of y * dx̄ (y = softmax(x) over the sequence) into
    sums_ptr[b, chunk, h, k], plus the dtheta partial of this program (it has x̄ and dy).
    The batch rows of the group accumulate into the rows of one [BLOCK_G, BLOCK_D] tile so
    that cos/sin stay shared by the group."""
    h = tl.program_id(1)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    groups = tl.arange(0, BLOCK_G)
    freqs = frequencies(theta_ptr + h * sth, feats, D, E, ste)
    b0 = tl.program_id(2) * rows_per_program
    rows = tl.minimum(rows_per_program, B - b0)
    sums = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    t_start = tl.program_id(0) * chunk
    for t0 in range(t_start, tl.minimum(t_start + chunk, N), BLOCK_N):
        tokens = t0 + tl.arange(0, BLOCK_N)
        mask = (tokens < N)[:, None] & feat_ok[None, :]
        if not PER_BATCH:
            pos = positions(tokens, offset)
            theta_t = angles(pos, freqs)
            cos_t = tl.cos(theta_t)
            sin_t = tl.sin(theta_t)
        x_tile = tokens.to(tl.int64)[:, None] * sxn + feats[None, :] * sxd
        g_tile = tokens.to(tl.int64)[:, None] * sgn + feats[None, :] * sgd
        for j in range(0, rows):
            b = b0 + j
            if PER_BATCH:
                pos = positions(tokens, tl.load(offsets_ptr + b))
                theta_t = angles(pos, freqs)
                cos_t = tl.cos(theta_t)
                sin_t = tl.sin(theta_t)
            m = feature_row(stats_ptr, b, h, H, D, feats, feat_ok, 0.0)
            s = feature_row(stats_ptr + stats_part, b, h, H, D, feats, feat_ok, 1.0)
            x_row = x_ptr + tl.cast(b, tl.int64) * sxb + h.to(tl.int64) * sxh
            x = tl.load(x_row + x_tile, mask=mask, other=0.0).to(tl.float32)
            g_row = dy_ptr + tl.cast(b, tl.int64) * sgb + h.to(tl.int64) * sgh + g_tile
            dy_cos = tl.load(g_row, mask=mask, other=0.0).to(tl.float32)
            dy_sin = tl.load(g_row + D * sgd, mask=mask, other=0.0).to(tl.float32)
            xbar = activate(x, feat_ok, m, s, "softmax_seq")
            part = tl.sum(xbar * (dy_cos * cos_t + dy_sin * sin_t), axis=0)
            sums += tl.where(groups[:, None] == j, part[None, :], 0.0)
            if NEED_DTHETA:
                acc += pos.to(tl.float32)[:, None] * xbar * (dy_sin * cos_t - dy_cos * sin_t)
    out_rows = (b0 + groups).to(tl.int64) * num_chunks + tl.program_id(0)
    out = sums_ptr + (out_rows[:, None] * H + h) * D + feats[None, :]
    tl.store(out, sums, mask=(groups < rows)[:, None] & feat_ok[None, :])
    if NEED_DTHETA:
        part_id = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        tl.store(
            dtheta_ptr + (part_id.to(tl.int64) * H + h) * D + feats,
            tl.sum(acc, axis=0),
            mask=feat_ok,
        )


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
