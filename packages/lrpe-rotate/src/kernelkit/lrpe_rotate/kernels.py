"""Triton kernels of lrpe-rotate.

x is addressed as (B, N, H, D) through runtime strides (read in place, whatever the layout). A
program holds the two halves of D of a block of tokens of one head as two [BLOCK_N, BLOCK_E]
float32 tiles (pair j is (j, j + D/2)). Activations come from kernelkit-act's building blocks.

KIND (constexpr): "none" / "relu" / "sigmoid" / "silu" (element-wise, before the rotation) or
"softmax" (over D). Softmax over the sequence has its own kernels (stats over all of N first).
PER_BATCH (constexpr): positions come from a per-batch offset tensor instead of the int `offset`.
Sizes, offsets and per-program batch counts are runtime arguments and never specialised, so a
new N, B or offset reuses the compiled kernel.
"""

import triton
import triton.language as tl

from kernelkit.act.kernels import (
    apply_act,
    apply_act_grad,
    combine_chunk_stats,
    combine_chunk_sums,
    softmax_merge,
    softmax_normalize,
    softmax_stats,
)

# cos/sin: quadrant reduction in float64, then Taylor polynomials on [-pi/4, pi/4] in float32.
HALF_PI = tl.constexpr(1.5707963267948966)
TWO_OVER_PI = tl.constexpr(0.6366197723675814)
SIN_3 = tl.constexpr(-1 / 6)
SIN_5 = tl.constexpr(1 / 120)
SIN_7 = tl.constexpr(-1 / 5040)
SIN_9 = tl.constexpr(1 / 362880)
COS_2 = tl.constexpr(-1 / 2)
COS_4 = tl.constexpr(1 / 24)
COS_6 = tl.constexpr(-1 / 720)
COS_8 = tl.constexpr(1 / 40320)
COS_10 = tl.constexpr(-1 / 3628800)

# Never specialised (Triton would otherwise make values of 1 constants and key on divisibility
# by 16): everything that changes with N, B or the offset.
RUNTIME_SIZES = ["B", "N", "offset", "per_group"]
SEQ_RUNTIME_SIZES = ["N", "offset", "chunk", "num_chunks", "num_stat_chunks"]

# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def load_theta(theta_ptr, h, th_sh, th_se, n_rot, j):
    """Frequencies of head h as a float32 [1, BLOCK_E] row; pairs j >= n_rot get 0 (angle 0:
    passed through unchanged). th_se == 0 broadcasts a single frequency over all pairs."""
    th = tl.load(theta_ptr + h * th_sh + j * th_se, mask=j < n_rot, other=0.0)
    return th.to(tl.float32)[None, :]


@triton.jit
def cos_sin(theta, pos):
    """cos and sin of the float32 angle theta * pos ([1, E] x [N, 1]), within ~1.5 ulp.

    The angle is rounded in float32 exactly as the reference computes it; at large positions it
    is ~1e5 rad. Subtracting the nearest multiple of pi/2 in float64 is exact enough there (and
    shared by cos and sin); the float32 polynomials on [-pi/4, pi/4] then cost ~12 FMAs, a
    fraction of two libdevice calls, and give the same results under the interpreter.
    """
    a = (theta * pos).to(tl.float64)
    k = tl.floor(a * tl.full([1, 1], TWO_OVER_PI, tl.float64) + 0.5)
    r = (a - k * tl.full([1, 1], HALF_PI, tl.float64)).to(tl.float32)
    quadrant = (k - 4.0 * tl.floor(k * 0.25)).to(tl.int32)  # k mod 4, in 0..3
    r2 = r * r
    s = r + r * r2 * (SIN_3 + r2 * (SIN_5 + r2 * (SIN_7 + r2 * SIN_9)))
    c = 1.0 + r2 * (COS_2 + r2 * (COS_4 + r2 * (COS_6 + r2 * (COS_8 + r2 * COS_10))))
    odd = (quadrant & 1) != 0
    sin = tl.where(odd, c, s)
    cos = tl.where(odd, s, c)
    sin = tl.where((quadrant & 2) != 0, -sin, sin)
    cos = tl.where(((quadrant + 1) & 2) != 0, -cos, cos)
    return cos, sin


@triton.jit
def token_positions(t, b, offsets_ptr, offset, PER_BATCH: tl.constexpr):
    """float32 positions (offset_b + t) as a [BLOCK_N, 1] column (integers, converted once)."""
    start = tl.load(offsets_ptr + b).to(tl.int64) if PER_BATCH else offset
    return (t.to(tl.int64) + start).to(tl.float32)[:, None]


@triton.jit
def load_halves(ptr, off, half_step, mask, other):
    x1 = tl.load(ptr + off, mask=mask, other=other).to(tl.float32)
    x2 = tl.load(ptr + off + half_step, mask=mask, other=other).to(tl.float32)
    return x1, x2


@triton.jit
def store_halves(ptr, off, half_step, y1, y2, mask):
    tl.store(ptr + off, y1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + off + half_step, y2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_halves(x1, x2):
    """Softmax over D of rows split in two halves (masked lanes hold -inf)."""
    m1, s1 = softmax_stats(x1, 1)
    m2, s2 = softmax_stats(x2, 1)
    m, s = softmax_merge(m1, s1, m2, s2)
    return softmax_normalize(x1, m, s, 1), softmax_normalize(x2, m, s, 1)


@triton.jit
def activated_halves(ptr, off, half_step, mask, KIND: tl.constexpr):
    """act(x) for both halves of a tile; invalid lanes are 0."""
    if KIND == "softmax":
        x1, x2 = load_halves(ptr, off, half_step, mask, -float("inf"))
        x1, x2 = softmax_halves(x1, x2)
        x1 = tl.where(mask, x1, 0.0)  # rows past N are all -inf: NaN there
        x2 = tl.where(mask, x2, 0.0)
    else:
        x1, x2 = load_halves(ptr, off, half_step, mask, 0.0)
        x1 = tl.where(mask, apply_act(x1, KIND), 0.0)
        x2 = tl.where(mask, apply_act(x2, KIND), 0.0)
    return x1, x2


@triton.jit
def tile_coords(pid_t, N, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, HALF: tl.constexpr):
    t = pid_t * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_E)
    mask = (t < N)[:, None] & (j < HALF)[None, :]
    return t, j, mask


@triton.jit
def tile_offsets(t, j, s_n, s_d):
    return t.to(tl.int64)[:, None] * s_n + j[None, :] * s_d


@triton.jit
def seq_stats(m_ptr, s_ptr, o, num_stat_chunks, j, HALF: tl.constexpr):
    """Global softmax-over-N (max, sum) of columns j and j + D/2 of outer index o (= b * H + h)
    from the per-chunk stats of `kernelkit.act.op.softmax_chunk_stats`, shape (B*H, C, D)."""
    base = o.to(tl.int64) * num_stat_chunks * (2 * HALF)
    ok = j < HALF
    m1, s1 = combine_chunk_stats(m_ptr + base, s_ptr + base, num_stat_chunks, 2 * HALF, j, ok)
    m2, s2 = combine_chunk_stats(
        m_ptr + base, s_ptr + base, num_stat_chunks, 2 * HALF, j + HALF, ok
    )
    return m1, s1, m2, s2


# --------------------------------------------------------------------------------------------
# Element-wise act and softmax over D. Grid (token blocks x batch groups, H); a program rotates
# one token block of one head for `per_group` batch rows. With an int offset the angles do not
# depend on the batch row: cos/sin are computed once and reused for every row.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=RUNTIME_SIZES)
def rotate_fwd_kernel(
    x_ptr,
    y_ptr,
    theta_ptr,
    offsets_ptr,
    B,
    N,
    offset,
    per_group,
    xs_b,
    xs_n,
    xs_h,
    xs_d,
    ys_b,
    ys_n,
    ys_h,
    ys_d,
    th_sh,
    th_se,
    n_rot,
    KIND: tl.constexpr,
    PER_BATCH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    b0 = (pid // n_tiles).to(tl.int64) * per_group  # int64 rows: b * stride_b may pass 2**31
    h = tl.program_id(1)
    t, j, mask = tile_coords(pid % n_tiles, N, BLOCK_N, BLOCK_E, HALF)
    theta = load_theta(theta_ptr, h, th_sh, th_se, n_rot, j)
    if not PER_BATCH:
        pos = token_positions(t, 0, offsets_ptr, offset, False)
        cos, sin = cos_sin(theta, pos)
    x_off = h.to(tl.int64) * xs_h + tile_offsets(t, j, xs_n, xs_d)
    y_off = h.to(tl.int64) * ys_h + tile_offsets(t, j, ys_n, ys_d)
    for b in range(b0, tl.minimum(b0 + per_group, B)):
        if PER_BATCH:
            pos = token_positions(t, b, offsets_ptr, offset, True)
            cos, sin = cos_sin(theta, pos)
        x1, x2 = activated_halves(x_ptr + b * xs_b, x_off, HALF * xs_d, mask, KIND)
        store_halves(
            y_ptr + b * ys_b, y_off, HALF * ys_d, x1 * cos - x2 * sin, x1 * sin + x2 * cos, mask
        )


@triton.jit(do_not_specialize=RUNTIME_SIZES)
def rotate_bwd_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    theta_ptr,
    offsets_ptr,
    dtheta_ptr,
    B,
    N,
    offset,
    per_group,
    xs_b,
    xs_n,
    xs_h,
    xs_d,
    gs_b,
    gs_n,
    gs_h,
    gs_d,
    ds_b,
    ds_n,
    ds_h,
    ds_d,
    th_sh,
    th_se,
    n_rot,
    KIND: tl.constexpr,
    PER_BATCH: tl.constexpr,
    NEED_DTHETA: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """dx = act'(x) applied to the inverse rotation of dy; with NEED_DTHETA, this program's share
    of dtheta[h, j] = sum pos * (xbar1 * dxbar2 - xbar2 * dxbar1), written to a float32 partial
    buffer (programs, H, D/2) that the host sums (deterministic, no atomics)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    b0 = (pid // n_tiles).to(tl.int64) * per_group  # int64 rows: b * stride_b may pass 2**31
    h = tl.program_id(1)
    t, j, mask = tile_coords(pid % n_tiles, N, BLOCK_N, BLOCK_E, HALF)
    theta = load_theta(theta_ptr, h, th_sh, th_se, n_rot, j)
    if not PER_BATCH:
        pos = token_positions(t, 0, offsets_ptr, offset, False)
        cos, sin = cos_sin(theta, pos)
    x_off = h.to(tl.int64) * xs_h + tile_offsets(t, j, xs_n, xs_d)
    g_off = h.to(tl.int64) * gs_h + tile_offsets(t, j, gs_n, gs_d)
    d_off = h.to(tl.int64) * ds_h + tile_offsets(t, j, ds_n, ds_d)
    acc = tl.zeros([BLOCK_E], tl.float32)
    for b in range(b0, tl.minimum(b0 + per_group, B)):
        if PER_BATCH:
            pos = token_positions(t, b, offsets_ptr, offset, True)
            cos, sin = cos_sin(theta, pos)
        dy1, dy2 = load_halves(dy_ptr + b * gs_b, g_off, HALF * gs_d, mask, 0.0)
        g1 = cos * dy1 + sin * dy2  # gradient w.r.t. act(x): the inverse rotation of dy
        g2 = cos * dy2 - sin * dy1
        if KIND == "softmax":
            xb1, xb2 = activated_halves(x_ptr + b * xs_b, x_off, HALF * xs_d, mask, KIND)
            dot = tl.sum(xb1 * g1, axis=1) + tl.sum(xb2 * g2, axis=1)
            dx1 = xb1 * (g1 - dot[:, None])
            dx2 = xb2 * (g2 - dot[:, None])
        elif KIND == "none":
            dx1 = g1
            dx2 = g2
            if NEED_DTHETA:
                xb1, xb2 = load_halves(x_ptr + b * xs_b, x_off, HALF * xs_d, mask, 0.0)
        else:
            x1, x2 = load_halves(x_ptr + b * xs_b, x_off, HALF * xs_d, mask, 0.0)
            dx1 = apply_act_grad(x1, g1, KIND)
            dx2 = apply_act_grad(x2, g2, KIND)
            if NEED_DTHETA:
                xb1 = apply_act(x1, KIND)
                xb2 = apply_act(x2, KIND)
        store_halves(dx_ptr + b * ds_b, d_off, HALF * ds_d, dx1, dx2, mask)
        if NEED_DTHETA:  # lanes past N or D/2 have dy = 0, hence g = 0
            acc += tl.sum(pos * (xb1 * g2 - xb2 * g1), axis=0)
    if NEED_DTHETA:
        out = (pid.to(tl.int64) * tl.num_programs(1) + h) * HALF + j
        tl.store(dtheta_ptr + out, acc, mask=j < HALF)


# --------------------------------------------------------------------------------------------
# Softmax over the sequence. Grid (chunks x B, H): a program owns a chunk of tokens of one
# (b, h) and combines the per-chunk stats of its columns once. Forward: act's chunk-stats kernel
# read x once, this kernel reads x and writes y (3 transfers). Backward: the sums kernel reads x
# and dy for sum_t(softmax * dxbar) per chunk, the apply kernel reads x, dy and writes dx
# (5 transfers).
# --------------------------------------------------------------------------------------------


@triton.jit
def seq_coords(pid, num_chunks, chunk, N):
    b = pid // num_chunks
    t0 = (pid % num_chunks) * chunk
    return b, t0, tl.minimum(t0 + chunk, N)


@triton.jit(do_not_specialize=SEQ_RUNTIME_SIZES)
def seq_softmax_fwd_kernel(
    x_ptr,
    y_ptr,
    theta_ptr,
    offsets_ptr,
    m_ptr,
    s_ptr,
    N,
    offset,
    chunk,
    num_chunks,
    num_stat_chunks,
    xs_b,
    xs_n,
    xs_h,
    xs_d,
    ys_b,
    ys_n,
    ys_h,
    ys_d,
    th_sh,
    th_se,
    n_rot,
    PER_BATCH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b, t_lo, t_hi = seq_coords(pid, num_chunks, chunk, N)
    j = tl.arange(0, BLOCK_E)
    m1, s1, m2, s2 = seq_stats(m_ptr, s_ptr, b * tl.num_programs(1) + h, num_stat_chunks, j, HALF)
    theta = load_theta(theta_ptr, h, th_sh, th_se, n_rot, j)
    x_base = x_ptr + b.to(tl.int64) * xs_b + h.to(tl.int64) * xs_h
    y_base = y_ptr + b.to(tl.int64) * ys_b + h.to(tl.int64) * ys_h
    for t_start in range(t_lo, t_hi, BLOCK_N):
        t = t_start + tl.arange(0, BLOCK_N)
        mask = (t < t_hi)[:, None] & (j < HALF)[None, :]
        cos, sin = cos_sin(theta, token_positions(t, b, offsets_ptr, offset, PER_BATCH))
        x_off = tile_offsets(t, j, xs_n, xs_d)
        x1, x2 = load_halves(x_base, x_off, HALF * xs_d, mask, 0.0)
        x1 = softmax_normalize(x1, m1, s1, 0)
        x2 = softmax_normalize(x2, m2, s2, 0)
        y_off = tile_offsets(t, j, ys_n, ys_d)
        store_halves(y_base, y_off, HALF * ys_d, x1 * cos - x2 * sin, x1 * sin + x2 * cos, mask)


@triton.jit
def seq_tile(
    x_base,
    dy_base,
    t,
    j,
    mask,
    m1,
    s1,
    m2,
    s2,
    theta,
    b,
    offsets_ptr,
    offset,
    xs_n,
    xs_d,
    gs_n,
    gs_d,
    PER_BATCH: tl.constexpr,
    HALF: tl.constexpr,
):
    """softmax(x) halves, dxbar halves (inverse rotation of dy) and positions of one tile.
    Invalid lanes: x = 0 gives a finite softmax value, dy = 0 gives dxbar = 0."""
    pos = token_positions(t, b, offsets_ptr, offset, PER_BATCH)
    cos, sin = cos_sin(theta, pos)
    x1, x2 = load_halves(x_base, tile_offsets(t, j, xs_n, xs_d), HALF * xs_d, mask, 0.0)
    dy1, dy2 = load_halves(dy_base, tile_offsets(t, j, gs_n, gs_d), HALF * gs_d, mask, 0.0)
    xb1 = softmax_normalize(x1, m1, s1, 0)
    xb2 = softmax_normalize(x2, m2, s2, 0)
    return xb1, xb2, cos * dy1 + sin * dy2, cos * dy2 - sin * dy1, pos


@triton.jit(do_not_specialize=SEQ_RUNTIME_SIZES)
def seq_softmax_bwd_sums_kernel(
    x_ptr,
    dy_ptr,
    theta_ptr,
    offsets_ptr,
    m_ptr,
    s_ptr,
    p_ptr,
    N,
    offset,
    chunk,
    num_chunks,
    num_stat_chunks,
    xs_b,
    xs_n,
    xs_h,
    xs_d,
    gs_b,
    gs_n,
    gs_h,
    gs_d,
    th_sh,
    th_se,
    n_rot,
    PER_BATCH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """p[b*H + h, chunk, d] = sum over the chunk's tokens of softmax(x) * dxbar (float32)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b, t_lo, t_hi = seq_coords(pid, num_chunks, chunk, N)
    j = tl.arange(0, BLOCK_E)
    o = b * tl.num_programs(1) + h
    m1, s1, m2, s2 = seq_stats(m_ptr, s_ptr, o, num_stat_chunks, j, HALF)
    theta = load_theta(theta_ptr, h, th_sh, th_se, n_rot, j)
    x_base = x_ptr + b.to(tl.int64) * xs_b + h.to(tl.int64) * xs_h
    dy_base = dy_ptr + b.to(tl.int64) * gs_b + h.to(tl.int64) * gs_h
    p1 = tl.zeros([BLOCK_E], tl.float32)
    p2 = tl.zeros([BLOCK_E], tl.float32)
    for t_start in range(t_lo, t_hi, BLOCK_N):
        t = t_start + tl.arange(0, BLOCK_N)
        mask = (t < t_hi)[:, None] & (j < HALF)[None, :]
        xb1, xb2, g1, g2, _pos = seq_tile(
            x_base,
            dy_base,
            t,
            j,
            mask,
            m1,
            s1,
            m2,
            s2,
            theta,
            b,
            offsets_ptr,
            offset,
            xs_n,
            xs_d,
            gs_n,
            gs_d,
            PER_BATCH,
            HALF,
        )
        p1 += tl.sum(xb1 * g1, axis=0)
        p2 += tl.sum(xb2 * g2, axis=0)
    out = (o.to(tl.int64) * num_chunks + pid % num_chunks) * (2 * HALF) + j
    tl.store(p_ptr + out, p1, mask=j < HALF)
    tl.store(p_ptr + out + HALF, p2, mask=j < HALF)


@triton.jit(do_not_specialize=SEQ_RUNTIME_SIZES)
def seq_softmax_bwd_apply_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    theta_ptr,
    offsets_ptr,
    m_ptr,
    s_ptr,
    p_ptr,
    dtheta_ptr,
    N,
    offset,
    chunk,
    num_chunks,
    num_stat_chunks,
    xs_b,
    xs_n,
    xs_h,
    xs_d,
    gs_b,
    gs_n,
    gs_h,
    gs_d,
    ds_b,
    ds_n,
    ds_h,
    ds_d,
    th_sh,
    th_se,
    n_rot,
    PER_BATCH: tl.constexpr,
    NEED_DTHETA: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """dx = softmax(x) * (dxbar - sum_t softmax(x) * dxbar); dtheta partials as rotate_bwd."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b, t_lo, t_hi = seq_coords(pid, num_chunks, chunk, N)
    j = tl.arange(0, BLOCK_E)
    o = b * tl.num_programs(1) + h
    m1, s1, m2, s2 = seq_stats(m_ptr, s_ptr, o, num_stat_chunks, j, HALF)
    p_base = p_ptr + o.to(tl.int64) * num_chunks * (2 * HALF)
    dot1 = combine_chunk_sums(p_base, num_chunks, 2 * HALF, j, j < HALF)[None, :]
    dot2 = combine_chunk_sums(p_base, num_chunks, 2 * HALF, j + HALF, j < HALF)[None, :]
    theta = load_theta(theta_ptr, h, th_sh, th_se, n_rot, j)
    x_base = x_ptr + b.to(tl.int64) * xs_b + h.to(tl.int64) * xs_h
    dy_base = dy_ptr + b.to(tl.int64) * gs_b + h.to(tl.int64) * gs_h
    dx_base = dx_ptr + b.to(tl.int64) * ds_b + h.to(tl.int64) * ds_h
    acc = tl.zeros([BLOCK_E], tl.float32)
    for t_start in range(t_lo, t_hi, BLOCK_N):
        t = t_start + tl.arange(0, BLOCK_N)
        mask = (t < t_hi)[:, None] & (j < HALF)[None, :]
        xb1, xb2, g1, g2, pos = seq_tile(
            x_base,
            dy_base,
            t,
            j,
            mask,
            m1,
            s1,
            m2,
            s2,
            theta,
            b,
            offsets_ptr,
            offset,
            xs_n,
            xs_d,
            gs_n,
            gs_d,
            PER_BATCH,
            HALF,
        )
        d_off = tile_offsets(t, j, ds_n, ds_d)
        store_halves(dx_base, d_off, HALF * ds_d, xb1 * (g1 - dot1), xb2 * (g2 - dot2), mask)
        if NEED_DTHETA:
            acc += tl.sum(pos * (xb1 * g2 - xb2 * g1), axis=0)
    if NEED_DTHETA:
        out = (pid.to(tl.int64) * tl.num_programs(1) + h) * HALF + j
        tl.store(dtheta_ptr + out, acc, mask=j < HALF)
