"""Device code shared by the LRPE kernels: where a token is, which frequency a slot has, the
accurate cos/sin of their product, and the d(theta) partial each program writes.

A slot is what one frequency turns: a rotated pair (j, j + D/2) in lrpe-rotate, a feature in the
cosine packages. Angles are float32(frequency) * float32(integer position), exactly the
reference's value (kernelkit.lrpe_core.reference.angles).

Positions come in three forms, told apart at compile time by what the launch passes:
  * `offset` an int:                  position = offset + t (one start for every batch row);
  * `offset` a pointer to (B,) ints:  position = offset[b] + t;
  * `positions` a pointer (not None): position = positions[b, t] (per-token table, any strides);
  * sequences packed along N (B = 1): position = t - (first token of t's sequence), from the
    int32 prefix sums `cu_seqlens` on the device (`packed_starts`), no per-token table;
and, for tokens on a grid (md-lrpe-cosine), a per-feature coordinate (`grid_positions`).
Positions depend on the batch row exactly when `positions is not None or is_pointer(offset)`
(a compile-time condition): kernels then compute cos/sin per row, else once per program. Where
cos/sin wait on a load from memory (a table, per-row starts), kernels issue the tile's loads of
x (dy) first, so that the two latencies overlap instead of adding up.
"""

import triton
import triton.language as tl

# cos/sin: quadrant reduction in float64, Taylor polynomials on [-pi/4, pi/4] in float32.
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


@triton.jit
def cos_sin(angle):
    """cos and sin of a float32 angle tile (any shape), within ~1.5 ulp.

    LRPE angles reach ~1e5 rad at long positions. Subtracting the nearest multiple of pi/2 in
    float64 is exact enough there and shared by cos and sin; the float32 polynomials then cost
    ~12 FMAs, a fraction of two libdevice calls, and give the same bits under the interpreter.
    """
    a = angle.to(tl.float64)
    k = tl.floor(a * tl.full([], TWO_OVER_PI, tl.float64) + 0.5)
    r = (a - k * tl.full([], HALF_PI, tl.float64)).to(tl.float32)
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


@triton.constexpr_function
def is_pointer(arg):
    """Whether a kernel argument is a pointer (here: `offset` given as a tensor of per-row starts)
    rather than an int. A compile-time function, so that it also holds where torch's analysis of
    a traced launch passes the int `offset` as a constexpr (`offset.dtype` would not exist)."""
    return isinstance(arg, tl.tensor) and arg.dtype.is_ptr()


@triton.jit
def token_positions(offset, positions, b, t, n, stride_pb, stride_pn):
    """int64 positions of tokens `t` of batch rows `b` (shaped by the caller to broadcast, e.g.
    t [BLOCK_N, 1] with b [1, ROWS], or a scalar b; every b must be a valid row), see the
    module docstring for the forms. Tokens t >= n (masked lanes) get the last token's position,
    so that no lane reads past the tables."""
    t = tl.minimum(t, n - 1)
    if positions is not None:
        # tl.cast, not b.to: b may be a Python int (a loop index under the interpreter)
        row = tl.cast(b, tl.int64) * stride_pb
        p = tl.load(positions + row + t.to(tl.int64) * stride_pn)
        p = p.to(tl.int64)
    elif is_pointer(offset):
        p = t.to(tl.int64) + tl.load(offset + b).to(tl.int64)
    else:
        p = t.to(tl.int64) + offset
    return p


@triton.jit
def packed_starts(cu_seqlens, num_seqs, t, t_first, t_last):
    """(sequence, first token of that sequence), int32, of tokens t (any shape; clamped to
    [t_first, t_last], the scalar bounds of the caller's tile) of `num_seqs` sequences packed
    along one axis (int32 prefix sums `cu_seqlens`): t lies in the last sequence s whose first
    token cu_seqlens[s] <= t. Binary searches over the prefix sums (a few hundred bytes, cache
    resident) instead of a per-token table built per call: one on scalars finds the sequences of
    t_first and t_last, and tokens search only between those two, so a tile inside one sequence
    (the common case) loads nothing per token. Whatever cu_seqlens holds (unchecked on the GPU),
    sequences stay in [0, num_seqs): wrong values, never reads out of bounds."""
    t = tl.minimum(tl.maximum(t, t_first), t_last)
    # Binary lifting: steps P/2, ..., 1 with P the first power of two >= num_seqs.
    step = tl.full([], 1, tl.int32)
    while step < num_seqs:
        step *= 2
    lo = tl.zeros_like(step)
    hi = tl.zeros_like(step)
    while step > 1:
        step = step // 2
        c_lo = tl.minimum(lo + step, num_seqs - 1)
        c_hi = tl.minimum(hi + step, num_seqs - 1)
        lo = tl.where(tl.load(cu_seqlens + c_lo) <= t_first, c_lo, lo)
        hi = tl.where(tl.load(cu_seqlens + c_hi) <= t_last, c_hi, hi)
    seq = tl.zeros_like(t) + lo
    start = tl.zeros_like(t) + tl.load(cu_seqlens + lo)
    while step <= hi - lo:  # step is 1 here
        step *= 2
    while step > 1:
        step = step // 2
        c = tl.minimum(seq + step, hi)
        first = tl.load(cu_seqlens + c)
        take = first <= t
        seq = tl.where(take, c, seq)
        start = tl.where(take, first, start)
    return seq, start


@triton.jit
def grid_positions(t, feats, extra, E, size_a, size_b, size_c, AXES: tl.constexpr):
    """int32 [BLOCK_N, BLOCK_D] grid coordinate of token t (cell t - extra of a row-major grid
    of AXES <= 4 axes, last fastest) along the axis of each feature k, k // E. size_a, size_b,
    size_c are the sizes of the last, second-last and third-last axes. Extra tokens t < extra
    have coordinate 0 on every axis (angle 0)."""
    cell = t - extra
    cell = tl.where(cell < 0, 0, cell)
    axis = (feats // E)[None, :]
    pos = tl.zeros([t.shape[0], feats.shape[0]], tl.int32)
    rest = cell
    if AXES > 1:
        pos = tl.where(axis == AXES - 1, (rest % size_a)[:, None], pos)
        rest = rest // size_a
    if AXES > 2:
        pos = tl.where(axis == AXES - 2, (rest % size_b)[:, None], pos)
        rest = rest // size_b
    if AXES > 3:
        pos = tl.where(axis == AXES - 3, (rest % size_c)[:, None], pos)
        rest = rest // size_c
    return tl.where(axis == 0, rest[:, None], pos)


@triton.jit
def slot_frequencies(theta_ptr, stride_e, slots, n_freq):
    """float32 frequencies of `slots` of one theta row: theta[j] for j < n_freq, 0 beyond
    (angle 0: the slot passes through). The host passes stride_e = 0 and n_freq = all slots for
    a single shared frequency (E == 1); see kernelkit.lrpe_core.op.theta_args."""
    return tl.load(theta_ptr + slots * stride_e, mask=slots < n_freq, other=0.0).to(tl.float32)


@triton.jit
def wrapped_frequencies(theta_ptr, stride_e, feats, E, D):
    """float32 frequencies theta[k mod E] of grid features k < D (0 beyond D)."""
    return tl.load(theta_ptr + (feats % E) * stride_e, mask=feats < D, other=0.0).to(tl.float32)


@triton.jit
def store_dtheta_partial(partials_ptr, part, H, h, slots, n_slots, acc):
    """This program's float32 d(theta) partial of head h into partials[part, h, :n_slots]; the
    host sums the partials in a fixed order (deterministic, no atomics)."""
    out = (part.to(tl.int64) * H + h) * n_slots + slots
    tl.store(partials_ptr + out, acc, mask=slots < n_slots)


# ---------------------------------------------------------------------------------------------
# Softmax over the sequence: merging per-chunk partials once per call
# ---------------------------------------------------------------------------------------------
# Two small launches of `kernelkit.lrpe_core.op` (they replace a handful of torch ops between
# the LRPE launches: one launch each instead of up to nine). Sums run in float64 and are rounded
# to float32 once: the result is the float32 nearest to the exact merge of the float32 inputs
# (up to a double rounding at near-ties), never further from it than a float32 merge.


@triton.jit(do_not_specialize=["C"])
def merge_chunk_stats_kernel(stats, out, C, I, BLOCK_I: tl.constexpr):
    """Per-chunk softmax stats (2, R, C, I) float32 (maxima, then sums of exp(x - max), as
    kernelkit-act's chunk-stats kernel writes them) -> the stats of the whole axis (2, R, 1, I):
    the maximum over chunks (NaN if any is NaN, as torch's amax), and the sum over chunks of
    s_c * exp(m_c - max) (with a max of -inf read as 0: all-(-inf) rows sum to 0) in float64.
    Grid (R, column blocks)."""
    r = tl.program_id(0)
    rows = tl.num_programs(0).to(tl.int64)  # R
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = cols < I
    m_ptr = stats + r.to(tl.int64) * C * I + cols
    s_ptr = m_ptr + rows * C * I
    top = tl.full([BLOCK_I], -float("inf"), tl.float32)
    for c in range(C):
        m = tl.load(m_ptr + c * I, mask=ok, other=-float("inf"))
        top = tl.maximum(top, m, propagate_nan=tl.PropagateNan.ALL)
    shift = tl.where(top == -float("inf"), 0.0, top).to(tl.float64)
    total = tl.zeros([BLOCK_I], tl.float64)
    for c in range(C):
        m = tl.load(m_ptr + c * I, mask=ok, other=-float("inf")).to(tl.float64)
        s = tl.load(s_ptr + c * I, mask=ok, other=0.0).to(tl.float64)
        total += s * tl.exp(m - shift)
    o_ptr = out + r.to(tl.int64) * I + cols
    tl.store(o_ptr, top, mask=ok)
    tl.store(o_ptr + rows * I, total.to(tl.float32), mask=ok)


@triton.jit(do_not_specialize=["C"])
def merge_chunk_sums_kernel(sums, out, C, I, BLOCK_I: tl.constexpr):
    """Per-chunk float32 partial sums (R, C, I) -> their sum over chunks (R, 1, I), in float64.
    Grid (R, column blocks)."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = cols < I
    p_ptr = sums + r.to(tl.int64) * C * I + cols
    total = tl.zeros([BLOCK_I], tl.float64)
    for c in range(C):
        total += tl.load(p_ptr + c * I, mask=ok, other=0.0).to(tl.float64)
    tl.store(out + r.to(tl.int64) * I + cols, total.to(tl.float32), mask=ok)
