"""Softmax over the sequence (act="softmax", dim=1) fused with the LRPE rotation: the kernels
and their launch layout (the element-wise and softmax-over-D kernels are in `kernels.py`, whose
device helpers and plan these share; the host path that launches them is in launch.py).

Grid (chunks x B, H): a program owns a chunk of tokens of one (b, h) and combines the per-chunk
stats of its columns once. Forward: act's chunk-stats kernel read x once (lrpe-core merges its
chunks), this kernel reads x and writes y (3 transfers). Backward: the sums kernel reads x and
dy for sum_t(softmax * dxbar) per chunk, the apply kernel reads x, dy and writes dx (5
transfers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernelkit.act.kernels import (
    combine_chunk_stats,
    combine_chunk_sums,
    packed_chunk,
    softmax_normalize,
)
from kernelkit.lrpe_core.kernels import (
    cos_sin,
    slot_frequencies,
    store_dtheta_partial,
    token_positions,
)
from kernelkit.lrpe_core.op import SEQ, theta_args

from .kernels import (
    SEQ_RUNTIME,
    _seq_chunks,
    _tile,
    load_halves,
    rotation,
    store_halves,
    tile_offsets,
)


@triton.jit
def seq_stats(stats, o, num_chunks, num_stat_chunks, j, HALF: tl.constexpr):
    """Global softmax-over-N (max, sum) of columns j and j + D/2 of outer index o (= b * H + h)
    from the per-chunk stats (2, B * H, C, D) of kernelkit-lrpe-core's `sequence_softmax_stats`:
    one pointer, maxima first (a traced launch must not see two views of one buffer). The grid
    is (num_chunks * B, H)."""
    rows = (tl.num_programs(0) // num_chunks) * tl.num_programs(1)  # B * H
    part = rows.to(tl.int64) * num_stat_chunks * (2 * HALF)
    m = stats + o.to(tl.int64) * num_stat_chunks * (2 * HALF)
    ok = j < HALF
    m1, s1 = combine_chunk_stats(m, m + part, num_stat_chunks, 2 * HALF, j, ok)
    m2, s2 = combine_chunk_stats(m, m + part, num_stat_chunks, 2 * HALF, j + HALF, ok)
    return m1, s1, m2, s2


@triton.jit
def seq_coords(pid, num_chunks, chunk, N, cu_seqlens, BLOCK_N: tl.constexpr):
    """(batch row, stats row, first token, end token) of program `pid` on grid axis 0: chunk
    pid % num_chunks of batch row pid // num_chunks or, with `cu_seqlens` (B = 1, sequences
    packed along N), of sequence pid // num_chunks, whose stats are its own row."""
    if cu_seqlens is None:
        b = pid // num_chunks
        t0 = (pid % num_chunks) * chunk
        return b, b, t0, tl.minimum(t0 + chunk, N)
    else:
        seq = pid // num_chunks
        t0, t1 = packed_chunk(cu_seqlens, seq, pid % num_chunks, num_chunks, BLOCK_N)
        return tl.zeros_like(seq), seq, t0, t1  # batch row 0


@triton.jit(do_not_specialize=SEQ_RUNTIME)
def seq_softmax_fwd_kernel(
    x,
    y,
    theta,
    offset,
    positions,
    stats,
    N,
    chunk,
    num_chunks,
    num_stat_chunks,
    stride_xb,
    stride_xn,
    stride_xh,
    stride_xd,
    stride_yb,
    stride_yn,
    stride_yh,
    stride_yd,
    stride_th,
    stride_te,
    n_freq,
    stride_pb,
    stride_pn,
    cu_seqlens,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b, row, t_lo, t_hi = seq_coords(pid, num_chunks, chunk, N, cu_seqlens, BLOCK_N)
    if cu_seqlens is not None:  # positions restart at the first token of each sequence
        offset = -tl.load(cu_seqlens + row)
    j = tl.arange(0, BLOCK_E)
    m1, s1, m2, s2 = seq_stats(
        stats, row * tl.num_programs(1) + h, num_chunks, num_stat_chunks, j, HALF
    )
    freqs = slot_frequencies(theta + h * stride_th, stride_te, j, n_freq)
    x_base = x + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
    y_base = y + b.to(tl.int64) * stride_yb + h.to(tl.int64) * stride_yh
    for t_start in range(t_lo, t_hi, BLOCK_N):
        t = t_start + tl.arange(0, BLOCK_N)
        mask = (t < t_hi)[:, None] & (j < HALF)[None, :]
        x1, x2 = load_halves(
            x_base, tile_offsets(t, j, stride_xn, stride_xd), HALF * stride_xd, mask, 0.0
        )
        cos, sin = rotation(freqs, offset, positions, b, t, N, stride_pb, stride_pn)
        x1 = softmax_normalize(x1, m1, s1, 0)
        x2 = softmax_normalize(x2, m2, s2, 0)
        y_off = tile_offsets(t, j, stride_yn, stride_yd)
        store_halves(
            y_base, y_off, HALF * stride_yd, x1 * cos - x2 * sin, x1 * sin + x2 * cos, mask
        )


def _seq_layout(x, theta, stats, cu_seqlens, plan):
    """(grid, layout kwargs) of the softmax-over-N kernels: (chunks x B, H), or with
    `cu_seqlens` (chunks x sequences, H), each sequence split on the device."""
    batch, n, heads, d = x.shape
    half = d // 2
    block_n, block_e, warps = _tile(plan, SEQ, half)
    rows = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    chunk, chunks = _seq_chunks(plan, rows, n, heads, block_n, x.device, cu_seqlens is not None)
    kwargs = dict(
        N=n,
        chunk=chunk,
        num_chunks=chunks,
        num_stat_chunks=stats.shape[2],
        **theta_args(theta, half),
        cu_seqlens=cu_seqlens,
        HALF=half,
        BLOCK_N=block_n,
        BLOCK_E=block_e,
        num_warps=warps,
    )
    return (chunks * rows, heads), kwargs


@triton.jit
def seq_tile(x_base, dy_base, t, j, mask, row_stats, freqs, pos_args, strides, HALF: tl.constexpr):
    """softmax(x) halves, dxbar halves (inverse rotation of dy) and float32 positions of one
    tile. Invalid lanes: x = 0 gives a finite softmax value, dy = 0 gives dxbar = 0."""
    m1, s1, m2, s2 = row_stats
    offset, positions, b, n, stride_pb, stride_pn = pos_args
    stride_xn, stride_xd, stride_gn, stride_gd = strides
    x1, x2 = load_halves(
        x_base, tile_offsets(t, j, stride_xn, stride_xd), HALF * stride_xd, mask, 0.0
    )
    dy1, dy2 = load_halves(
        dy_base, tile_offsets(t, j, stride_gn, stride_gd), HALF * stride_gd, mask, 0.0
    )
    pos = token_positions(offset, positions, b, t, n, stride_pb, stride_pn).to(tl.float32)
    cos, sin = cos_sin(pos[:, None] * freqs[None, :])
    xb1 = softmax_normalize(x1, m1, s1, 0)
    xb2 = softmax_normalize(x2, m2, s2, 0)
    return xb1, xb2, cos * dy1 + sin * dy2, cos * dy2 - sin * dy1, pos


@triton.jit(do_not_specialize=SEQ_RUNTIME)
def seq_softmax_bwd_sums_kernel(
    x,
    dy,
    theta,
    offset,
    positions,
    stats,
    sums,
    N,
    chunk,
    num_chunks,
    num_stat_chunks,
    stride_xb,
    stride_xn,
    stride_xh,
    stride_xd,
    stride_gb,
    stride_gn,
    stride_gh,
    stride_gd,
    stride_th,
    stride_te,
    n_freq,
    stride_pb,
    stride_pn,
    cu_seqlens,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """sums[row * H + h, chunk, d] = sum over the chunk's tokens of softmax(x) * dxbar (float32)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b, row, t_lo, t_hi = seq_coords(pid, num_chunks, chunk, N, cu_seqlens, BLOCK_N)
    if cu_seqlens is not None:  # positions restart at the first token of each sequence
        offset = -tl.load(cu_seqlens + row)
    j = tl.arange(0, BLOCK_E)
    o = row * tl.num_programs(1) + h
    row_stats = seq_stats(stats, o, num_chunks, num_stat_chunks, j, HALF)
    freqs = slot_frequencies(theta + h * stride_th, stride_te, j, n_freq)
    x_base = x + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
    dy_base = dy + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
    p1 = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    p2 = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    for t_start in range(t_lo, t_hi, BLOCK_N):
        t = t_start + tl.arange(0, BLOCK_N)
        mask = (t < t_hi)[:, None] & (j < HALF)[None, :]
        xb1, xb2, g1, g2, _pos = seq_tile(
            x_base,
            dy_base,
            t,
            j,
            mask,
            row_stats,
            freqs,
            (offset, positions, b, N, stride_pb, stride_pn),
            (stride_xn, stride_xd, stride_gn, stride_gd),
            HALF,
        )
        p1 += xb1 * g1
        p2 += xb2 * g2
    out = (o.to(tl.int64) * num_chunks + pid % num_chunks) * (2 * HALF) + j
    tl.store(sums + out, tl.sum(p1, 0), mask=j < HALF)
    tl.store(sums + out + HALF, tl.sum(p2, 0), mask=j < HALF)


@triton.jit(do_not_specialize=SEQ_RUNTIME)
def seq_softmax_bwd_apply_kernel(
    x,
    dy,
    dx,
    theta,
    offset,
    positions,
    stats,
    sums,
    dtheta_partials,
    N,
    chunk,
    num_chunks,
    num_stat_chunks,
    stride_xb,
    stride_xn,
    stride_xh,
    stride_xd,
    stride_gb,
    stride_gn,
    stride_gh,
    stride_gd,
    stride_db,
    stride_dn,
    stride_dh,
    stride_dd,
    stride_th,
    stride_te,
    n_freq,
    stride_pb,
    stride_pn,
    cu_seqlens,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """dx = softmax(x) * (dxbar - sum_t softmax(x) * dxbar); d(theta) partials as
    rotate_bwd_kernel."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b, row, t_lo, t_hi = seq_coords(pid, num_chunks, chunk, N, cu_seqlens, BLOCK_N)
    if cu_seqlens is not None:  # positions restart at the first token of each sequence
        offset = -tl.load(cu_seqlens + row)
    j = tl.arange(0, BLOCK_E)
    o = row * tl.num_programs(1) + h
    row_stats = seq_stats(stats, o, num_chunks, num_stat_chunks, j, HALF)
    sums_base = sums + o.to(tl.int64) * num_chunks * (2 * HALF)
    dot1 = combine_chunk_sums(sums_base, num_chunks, 2 * HALF, j, j < HALF)[None, :]
    dot2 = combine_chunk_sums(sums_base, num_chunks, 2 * HALF, j + HALF, j < HALF)[None, :]
    freqs = slot_frequencies(theta + h * stride_th, stride_te, j, n_freq)
    x_base = x + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
    dy_base = dy + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
    dx_base = dx + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    for t_start in range(t_lo, t_hi, BLOCK_N):
        t = t_start + tl.arange(0, BLOCK_N)
        mask = (t < t_hi)[:, None] & (j < HALF)[None, :]
        xb1, xb2, g1, g2, pos = seq_tile(
            x_base,
            dy_base,
            t,
            j,
            mask,
            row_stats,
            freqs,
            (offset, positions, b, N, stride_pb, stride_pn),
            (stride_xn, stride_xd, stride_gn, stride_gd),
            HALF,
        )
        d_off = tile_offsets(t, j, stride_dn, stride_dd)
        store_halves(dx_base, d_off, HALF * stride_dd, xb1 * (g1 - dot1), xb2 * (g2 - dot2), mask)
        if dtheta_partials is not None:
            acc += pos[:, None] * (xb1 * g2 - xb2 * g1)
    if dtheta_partials is not None:
        store_dtheta_partial(dtheta_partials, pid, tl.num_programs(1), h, j, HALF, tl.sum(acc, 0))
