"""Triton kernels of lrpe-cosine and the plan helpers (tiles, batch groups, chunks, keyword
arguments) of their launches; the host paths that launch them are in launch.py.

Tiles are 3-D: [BLOCK_N tokens, ROWS batch rows, BLOCK_D >= D features] of one head. When the
positions are shared by all batch rows, cos/sin are a [BLOCK_N, 1, BLOCK_D] tile computed once
per program and reused by every row it handles: B times less trigonometry, and the ROWS rows of
one load multiply the bytes in flight without holding more cos/sin. (Rows sit on axis 1: Triton
spreads threads and warps over the feature axis and then axis 0, so the rows of a token stay in
one thread's registers next to that token's cos/sin.)

Layout: x (B, N, H, D), y and dy (B, N, H, 2D) with the cos half first, all with runtime strides.
ACT is a tl.constexpr string: none / relu / sigmoid / silu (element-wise, from kernelkit-act),
softmax (over the D features of each token) or softmax_seq (over the sequence, from the
per-chunk (max, sum) stats of kernelkit-lrpe-core's `sequence_softmax_stats`).

Where the angles come from (kernelkit-lrpe-core): GRID_AXES == 0, a sequence: position
(`offset`, `positions`, or `cu_seqlens` for sequences packed along N) times the slot frequency
of each feature; GRID_AXES = m > 0, tokens on an m-axis grid behind `extra` leading tokens
(md-lrpe-cosine): feature k turns with the coordinate of its axis k // E at frequency
theta[k mod E]. With `angles` (not None) the forward also writes
the float32 angle table (N, H, D) and the backward reads it instead of recomputing the angles
(md-lrpe-cosine's cache=True: the same float32 values, so identical results).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernelkit.act.kernels import (
    apply_act,
    apply_act_grad,
    combine_chunk_stats,
    combine_chunk_sums,
    packed_chunk,
    softmax_grad,
    softmax_normalize,
    softmax_stats,
)
from kernelkit.lrpe_core.kernels import (
    cos_sin,
    grid_positions,
    is_pointer,
    packed_starts,
    slot_frequencies,
    store_dtheta_partial,
    token_positions,
    wrapped_frequencies,
)
from kernelkit.lrpe_core.op import (
    ONE_PASS_MAX_ELEMENTS,
    packed_chunks,
    programs_target,
    theta_args,
)
from kernelkit.shared.runtime import cdiv, next_power_of_2

# Sizes, offsets, grid sizes and batch-group sizes change with every call: never specialise.
RUNTIME = [
    "B",
    "N",
    "offset",
    "rows_per_program",
    "num_stat_chunks",
    "num_chunks",
    "num_seqs",
    "chunk",
    "stride_pb",
    "stride_pn",
    "extra",
    "size_a",
    "size_b",
    "size_c",
]

ROWS = 4  # batch rows per tile (axis 1); one when B = 1 (`load_rows`)


@dataclass(frozen=True)
class Plan:
    """Launch parameters. Memory-bound tiles [BLOCK_N tokens, ROWS rows, BLOCK_D >= D] of about
    `tile` elements, 32 per thread at 4 warps. Per-row positions need cos/sin per row (as many
    registers as the x tile) and the softmax_seq sums kernel keeps [BLOCK_N, ROWS, D] sums per
    thread: both use `small_tile` to avoid spills. Batch rows are grouped only while
    `programs_per_sm` programs remain; the sums kernel's long programs (a chunk of tokens x
    ROWS rows) are split until `sums_programs_per_sm`. Softmax over N reads its stats in one
    pass (no merge launch) up to `stats_one_pass` elements per program (lrpe-core's
    `sequence_softmax_stats`)."""

    tile: int = 4096
    small_tile: int = 2048
    warps: int = 4
    programs_per_sm: int = 4
    sums_programs_per_sm: int = 16
    stats_one_pass: int = ONE_PASS_MAX_ELEMENTS


PLAN = Plan()
_GRID_AXIS_LIMIT = 65535  # grid axes 1 and 2 (heads, batch groups)


@dataclass(frozen=True)
class Grid:
    """Tokens on a row-major grid `shape` (1 to 4 axes, last fastest) behind `extra` leading
    tokens; `e` frequencies per axis (feature k uses axis k // e and theta[:, k mod e])."""

    shape: tuple[int, ...]
    extra: int
    e: int


def load_rows(b) -> int:
    """Batch rows per load (the tile's axis 1): ROWS, or 1 for a single row (B = 1: a packed
    row, a small batch), whose tile then holds ROWS times more tokens instead of masked rows."""
    return 1 if b == 1 else ROWS


def tile_sizes(d, tile, rows=ROWS) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_D): a whole head (BLOCK_D >= D) by as many tokens as fit in `tile` with
    `rows` batch rows. Depends on D and whether B = 1 only: a new N, B > 1 or offset never
    compiles a new kernel."""
    block_d = next_power_of_2(int(d))
    return max(1, tile // (rows * block_d)), block_d


def batch_groups(plan, b, programs, device) -> tuple[int, int]:
    """(rows per program, number of batch groups): batch rows (sharing cos/sin) are grouped, in
    multiples of load_rows(b), as long as `programs` x groups still fills the device."""
    per_load = load_rows(b)
    groups = max(
        1, min(cdiv(b, per_load), cdiv(programs_target(device, plan.programs_per_sm), programs))
    )
    rows = cdiv(cdiv(b, groups), per_load) * per_load
    rows = max(rows, cdiv(b, _GRID_AXIS_LIMIT))
    return rows, cdiv(b, rows)


def sequence_chunks(plan, programs, n, block_n, device, packed=False) -> tuple[int, int]:
    """(chunk, num_chunks) of the softmax_seq sums kernel, whose programs are a chunk of whole
    token blocks of `programs` (heads x batch-row groups, or heads x packed sequences) units:
    chunks added until there are enough programs (more for packed sequences: lrpe-core's
    `packed_chunks`)."""
    n_blocks = cdiv(n, block_n)
    target = programs_target(device, plan.sums_programs_per_sm)
    chunks = max(1, cdiv(target, programs))
    chunks = max(1, min(n_blocks, packed_chunks(chunks) if packed else chunks))
    chunk = cdiv(n_blocks, chunks) * block_n
    return chunk, cdiv(n, chunk)


def _angle_args(theta, d, grid: Grid | None) -> dict:
    """Theta and grid keyword arguments of the kernels."""
    if grid is None:
        return {
            **theta_args(theta, d),
            "extra": None,
            "size_a": None,
            "size_b": None,
            "size_c": None,
            "GRID_AXES": 0,
        }
    inner = [*reversed(grid.shape[1:]), 1, 1, 1]  # last axis first
    return {
        "stride_th": 0 if theta.shape[0] == 1 else theta.stride(0),
        "stride_te": theta.stride(1),
        "n_freq": grid.e,
        "extra": grid.extra,
        "size_a": inner[0],
        "size_b": inner[1],
        "size_c": inner[2],
        "GRID_AXES": len(grid.shape),
    }


def _strides(name: str, t: torch.Tensor | None) -> dict:
    """stride_<name>{b,n,h,d} keyword arguments (zeros for an absent tensor)."""
    st = t.stride() if t is not None else (0, 0, 0, 0)
    return {f"stride_{name}{a}": v for a, v in zip("bnhd", st)}


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def tile_positions(
    offset,
    positions,
    b,
    t,
    N,
    stride_pb,
    stride_pn,
    feats,
    extra,
    E,
    size_a,
    size_b,
    size_c,
    GRID_AXES: tl.constexpr,
):
    """float32 positions broadcastable to [BLOCK_N, ROWS, BLOCK_D]: per token ([BLOCK_N, 1, 1],
    or [BLOCK_N, ROWS, 1] when they depend on the rows `b` [ROWS]) for a sequence, per feature
    ([BLOCK_N, 1, BLOCK_D]) on a grid."""
    if GRID_AXES == 0:
        if b is None:
            pos = token_positions(offset, positions, 0, t, N, stride_pb, stride_pn)[:, None]
        else:
            pos = token_positions(
                offset, positions, b[None, :], t[:, None], N, stride_pb, stride_pn
            )
        pos = pos.to(tl.float32)[:, :, None]
    else:
        pos = grid_positions(t, feats, extra, E, size_a, size_b, size_c, GRID_AXES)
        pos = pos.to(tl.float32)[:, None, :]
    return pos


@triton.jit
def head_frequencies(theta, h, stride_th, stride_te, n_freq, feats, D, GRID_AXES: tl.constexpr):
    """[1, 1, BLOCK_D] float32 frequency of each feature of head h."""
    row = theta + h * stride_th
    if GRID_AXES == 0:
        freqs = slot_frequencies(row, stride_te, feats, n_freq)
    else:
        freqs = wrapped_frequencies(row, stride_te, feats, n_freq, D)
    return freqs[None, None, :]


@triton.jit
def activate(x, feat_ok, m, s, ACT: tl.constexpr, PACKED: tl.constexpr):
    """x̄ = act(x) of a float32 [tokens, rows, features] tile. softmax: over the valid
    features (`feat_ok` [1, 1, BLOCK_D]); softmax_seq: with the sequence (max, sum) `m`, `s`,
    [rows, features], or [tokens, features] when PACKED (each token's own sequence)."""
    if ACT == "softmax":
        xm = tl.where(feat_ok, x, -float("inf"))
        mx, sx = softmax_stats(xm, 2)
        y = softmax_normalize(xm, mx, sx, 2)
    elif ACT == "softmax_seq":
        y = softmax_normalize(x, m, s, 1) if PACKED else softmax_normalize(x, m, s, 0)
    else:
        y = apply_act(x, ACT)
    return y


@triton.jit
def activate_grad(x, xbar, dxbar, tot, ACT: tl.constexpr, PACKED: tl.constexpr):
    """dx from dx̄ through the activation; `xbar` = activate(x); `tot` = sum over the sequence
    of x̄ * dx̄ (softmax_seq only), shaped as activate's stats."""
    if ACT == "softmax":
        dx = softmax_grad(xbar, dxbar, 2)
    elif ACT == "softmax_seq":
        dx = xbar * (dxbar - tot[:, None, :]) if PACKED else xbar * (dxbar - tot[None, :, :])
    else:
        dx = apply_act_grad(x, dxbar, ACT)
    return dx


@triton.jit
def sequence_stats(stats, b, h, B, H, C, D, feats, mask):
    """[rows, features] softmax-over-the-sequence (max, sum), combined from the C chunks of the
    (2, B * H, C, D) stats: one pointer, maxima first (a traced launch must not see two views of
    one buffer). Packed sequences: `b` holds sequences (one per token) and B their number."""
    part = (B * H).to(tl.int64) * C * D
    offs = ((b * H + h).to(tl.int64) * C * D)[:, None] + feats[None, :]
    return combine_chunk_stats(stats, stats + part, C, D, offs, mask)


@triton.jit
def angle_table_offsets(t, h, H, D, feats):
    """[BLOCK_N, 1, BLOCK_D] offsets into the float32 angle table (N, H, D)."""
    return ((t.to(tl.int64) * H + h) * D)[:, None, None] + feats[None, None, :]


# --------------------------------------------------------------------------------------------
# Forward. Grid: (token blocks, H, batch groups); a program loops over its `rows_per_program`
# batch rows ROWS at a time.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=RUNTIME)
def cosine_fwd_kernel(
    x,
    y,
    theta,
    offset,
    positions,
    stats,
    cu_seqlens,
    angles,
    B,
    N,
    D,
    num_seqs,
    rows_per_program,
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
    extra,
    size_a,
    size_b,
    size_c,
    ACT: tl.constexpr,
    GRID_AXES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    h = tl.program_id(1)
    H = tl.num_programs(1)
    t0 = tl.program_id(0) * BLOCK_N
    t = t0 + tl.arange(0, BLOCK_N)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    tile_ok = (t < N)[:, None, None] & feat_ok[None, None, :]
    freqs = head_frequencies(theta, h, stride_th, stride_te, n_freq, feats, D, GRID_AXES)
    per_row: tl.constexpr = positions is not None or is_pointer(offset) or cu_seqlens is not None
    if not per_row:
        ang = freqs * tile_positions(
            offset,
            positions,
            None,
            t,
            N,
            stride_pb,
            stride_pn,
            feats,
            extra,
            n_freq,
            size_a,
            size_b,
            size_c,
            GRID_AXES,
        )
        if angles is not None:  # batch group 0 writes the table
            keep = tile_ok & (tl.program_id(2) == 0)
            tl.store(angles + angle_table_offsets(t, h, H, D, feats), ang, mask=keep)
        cos_t, sin_t = cos_sin(ang)
    x_tile = (t.to(tl.int64) * stride_xn)[:, None, None] + (feats * stride_xd)[None, None, :]
    y_tile = (t.to(tl.int64) * stride_yn)[:, None, None] + (feats * stride_yd)[None, None, :]
    x_head = x + h.to(tl.int64) * stride_xh
    y_head = y + h.to(tl.int64) * stride_yh
    if cu_seqlens is not None:  # B = 1, sequences packed along N: each token's and its start
        seqs, starts = packed_starts(cu_seqlens, num_seqs, t, t0, tl.minimum(t0 + BLOCK_N, N) - 1)
    PACKED: tl.constexpr = cu_seqlens is not None and ACT == "softmax_seq"
    if PACKED:  # stats of each token's sequence
        seq_ok = (t < N)[:, None] & feat_ok[None, :]
        m_t, s_t = sequence_stats(stats, seqs, h, num_seqs, H, 1, D, feats, seq_ok)
    else:  # sequence stats: only softmax_seq reads them
        m_t = tl.zeros([ROWS, BLOCK_D], tl.float32)
        s_t = tl.full([ROWS, BLOCK_D], 1.0, tl.float32)
    b_lo = tl.program_id(2) * rows_per_program
    b_hi = tl.minimum(b_lo + rows_per_program, B)
    for b0 in range(b_lo, b_hi, ROWS):
        b = b0 + tl.arange(0, ROWS)
        row_ok = b < b_hi
        mask = row_ok[None, :, None] & tile_ok
        x_rows = x_head + (b.to(tl.int64) * stride_xb)[None, :, None] + x_tile
        xv = tl.load(x_rows, mask=mask, other=0.0).to(tl.float32)
        if cu_seqlens is not None:
            cos_t, sin_t = cos_sin((t - starts).to(tl.float32)[:, None, None] * freqs)
        elif per_row:  # after the loads of x: cos/sin wait on loads of their own
            tl.debug_barrier()  # else ptxas hoists the position loads and conversions above x's
            pos = tile_positions(
                offset,
                positions,
                tl.minimum(b, B - 1),
                t,
                N,
                stride_pb,
                stride_pn,
                feats,
                extra,
                n_freq,
                size_a,
                size_b,
                size_c,
                GRID_AXES,
            )
            cos_t, sin_t = cos_sin(pos * freqs)
        if ACT == "softmax_seq" and not PACKED:
            stat_ok = row_ok[:, None] & feat_ok[None, :]
            m_t, s_t = sequence_stats(stats, b, h, B, H, num_stat_chunks, D, feats, stat_ok)
        xbar = activate(xv, feat_ok[None, None, :], m_t, s_t, ACT, PACKED)
        y_rows = y_head + (b.to(tl.int64) * stride_yb)[None, :, None] + y_tile
        tl.store(y_rows, (xbar * cos_t).to(y.dtype.element_ty), mask=mask)
        tl.store(y_rows + D * stride_yd, (xbar * sin_t).to(y.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=RUNTIME)
def cosine_bwd_kernel(
    x,
    dy,
    dx,
    theta,
    offset,
    positions,
    stats,
    cu_seqlens,
    sums,
    angles,
    dtheta_partials,
    B,
    N,
    D,
    num_seqs,
    rows_per_program,
    num_stat_chunks,
    num_chunks,
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
    extra,
    size_a,
    size_b,
    size_c,
    ACT: tl.constexpr,
    GRID_AXES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dx̄ = dy_cos cos + dy_sin sin, then the act backward (softmax_seq: with the per-chunk
    sums of the first pass). With `dtheta_partials` each program also writes its float32
    partial of dtheta[h, :] = sum pos * x̄ * (dy_sin cos - dy_cos sin). `dx` None: d(theta)
    only; `x` None: act none without d(theta) (dx needs no x)."""
    NEED_DTHETA: tl.constexpr = dtheta_partials is not None
    h = tl.program_id(1)
    H = tl.num_programs(1)
    t0 = tl.program_id(0) * BLOCK_N
    t = t0 + tl.arange(0, BLOCK_N)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    tile_ok = (t < N)[:, None, None] & feat_ok[None, None, :]
    freqs = head_frequencies(theta, h, stride_th, stride_te, n_freq, feats, D, GRID_AXES)
    per_row: tl.constexpr = positions is not None or is_pointer(offset) or cu_seqlens is not None
    if not per_row:
        pos = tile_positions(
            offset,
            positions,
            None,
            t,
            N,
            stride_pb,
            stride_pn,
            feats,
            extra,
            n_freq,
            size_a,
            size_b,
            size_c,
            GRID_AXES,
        )
        if angles is not None:
            ang = tl.load(angles + angle_table_offsets(t, h, H, D, feats), mask=tile_ok, other=0.0)
        else:
            ang = pos * freqs
        cos_t, sin_t = cos_sin(ang)
    x_tile = (t.to(tl.int64) * stride_xn)[:, None, None] + (feats * stride_xd)[None, None, :]
    g_tile = (t.to(tl.int64) * stride_gn)[:, None, None] + (feats * stride_gd)[None, None, :]
    d_tile = (t.to(tl.int64) * stride_dn)[:, None, None] + (feats * stride_dd)[None, None, :]
    g_head = dy + h.to(tl.int64) * stride_gh
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if cu_seqlens is not None:  # B = 1, sequences packed along N: each token's and its start
        seqs, starts = packed_starts(cu_seqlens, num_seqs, t, t0, tl.minimum(t0 + BLOCK_N, N) - 1)
    PACKED: tl.constexpr = cu_seqlens is not None and ACT == "softmax_seq"
    if PACKED:  # stats and sums of each token's sequence
        seq_ok = (t < N)[:, None] & feat_ok[None, :]
        m_t, s_t = sequence_stats(stats, seqs, h, num_seqs, H, 1, D, feats, seq_ok)
        offs = ((seqs * H + h).to(tl.int64) * D)[:, None] + feats[None, :]
        tot = combine_chunk_sums(sums, 1, D, offs, seq_ok)
    else:  # stats and sums: only softmax_seq reads them
        m_t = tl.zeros([ROWS, BLOCK_D], tl.float32)
        s_t = tl.full([ROWS, BLOCK_D], 1.0, tl.float32)
        tot = tl.zeros([ROWS, BLOCK_D], tl.float32)
    b_lo = tl.program_id(2) * rows_per_program
    b_hi = tl.minimum(b_lo + rows_per_program, B)
    for b0 in range(b_lo, b_hi, ROWS):
        b = b0 + tl.arange(0, ROWS)
        row_ok = b < b_hi
        mask = row_ok[None, :, None] & tile_ok
        g_rows = g_head + (b.to(tl.int64) * stride_gb)[None, :, None] + g_tile
        dy_cos = tl.load(g_rows, mask=mask, other=0.0).to(tl.float32)
        dy_sin = tl.load(g_rows + D * stride_gd, mask=mask, other=0.0).to(tl.float32)
        if ACT != "none" or NEED_DTHETA:
            x_rows = x + h.to(tl.int64) * stride_xh + (b.to(tl.int64) * stride_xb)[None, :, None]
            xv = tl.load(x_rows + x_tile, mask=mask, other=0.0).to(tl.float32)
        if cu_seqlens is not None:
            pos = (t - starts).to(tl.float32)[:, None, None]
            cos_t, sin_t = cos_sin(pos * freqs)
        elif per_row:  # after the loads of dy and x: cos/sin wait on loads of their own
            tl.debug_barrier()  # else ptxas hoists the position loads and conversions above
            pos = tile_positions(
                offset,
                positions,
                tl.minimum(b, B - 1),
                t,
                N,
                stride_pb,
                stride_pn,
                feats,
                extra,
                n_freq,
                size_a,
                size_b,
                size_c,
                GRID_AXES,
            )
            cos_t, sin_t = cos_sin(pos * freqs)
        dxbar = dy_cos * cos_t + dy_sin * sin_t
        if ACT != "none" or NEED_DTHETA:
            if ACT == "softmax_seq" and not PACKED:
                stat_ok = row_ok[:, None] & feat_ok[None, :]
                m_t, s_t = sequence_stats(stats, b, h, B, H, num_stat_chunks, D, feats, stat_ok)
                offs = ((b * H + h).to(tl.int64) * num_chunks * D)[:, None] + feats[None, :]
                tot = combine_chunk_sums(sums, num_chunks, D, offs, stat_ok)
            xbar = activate(xv, feat_ok[None, None, :], m_t, s_t, ACT, PACKED)
        else:
            xv = dxbar
            xbar = dxbar
        if NEED_DTHETA:
            acc += tl.sum(pos * xbar * (dy_sin * cos_t - dy_cos * sin_t), axis=1)
        if dx is not None:
            dxv = activate_grad(xv, xbar, dxbar, tot, ACT, PACKED)
            d_rows = dx + h.to(tl.int64) * stride_dh + (b.to(tl.int64) * stride_db)[None, :, None]
            tl.store(d_rows + d_tile, dxv.to(dx.dtype.element_ty), mask=mask)
    if NEED_DTHETA:
        part = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        store_dtheta_partial(dtheta_partials, part, H, h, feats, D, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=RUNTIME)
def cosine_bwd_seq_sums_kernel(
    x,
    dy,
    theta,
    offset,
    positions,
    stats,
    cu_seqlens,
    sums,
    angles,
    dtheta_partials,
    B,
    N,
    D,
    num_seqs,
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
    extra,
    size_a,
    size_b,
    size_c,
    GRID_AXES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """First pass of the softmax-over-the-sequence backward. A program (chunk of tokens, h,
    ROWS batch rows) writes the float32 sums over its tokens of y * dx̄ (y = softmax of x over
    the sequence) to sums[b * H + h, chunk, :], and its d(theta) partial (it has x̄ and dy).
    With `cu_seqlens` (B = 1, sequences packed along N) axis 0 enumerates (sequence, chunk)
    and a sequence's stats and sums are its own row s * H + h."""
    NEED_DTHETA: tl.constexpr = dtheta_partials is not None
    h = tl.program_id(1)
    H = tl.num_programs(1)
    feats = tl.arange(0, BLOCK_D)
    feat_ok = feats < D
    b = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    row_ok = b < B
    b_pos = tl.minimum(b, B - 1)
    freqs = head_frequencies(theta, h, stride_th, stride_te, n_freq, feats, D, GRID_AXES)
    stat_ok = row_ok[:, None] & feat_ok[None, :]
    if cu_seqlens is None:
        c = tl.program_id(0)
        stat_rows = b  # [ROWS]
        t_start = c * chunk
        t_end = tl.minimum(t_start + chunk, N)
        m_t, s_t = sequence_stats(stats, b, h, B, H, num_stat_chunks, D, feats, stat_ok)
    else:
        seq = tl.program_id(0) // num_chunks
        c = tl.program_id(0) % num_chunks
        stat_rows = seq + b  # lane 0 (the only row: B = 1) is the sequence
        t_start, t_end = packed_chunk(cu_seqlens, seq, c, num_chunks, BLOCK_N)
        offset = -tl.load(cu_seqlens + seq)  # positions restart at the sequence's first token
        m_t, s_t = sequence_stats(stats, stat_rows, h, num_seqs, H, 1, D, feats, stat_ok)
    x_rows = x + h.to(tl.int64) * stride_xh + (b.to(tl.int64) * stride_xb)[None, :, None]
    g_rows = dy + h.to(tl.int64) * stride_gh + (b.to(tl.int64) * stride_gb)[None, :, None]
    per_row: tl.constexpr = positions is not None or is_pointer(offset)
    # Element-wise accumulators, reduced once at the end: no cross-warp reduction per block.
    acc_sums = tl.zeros([BLOCK_N, ROWS, BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_N, ROWS, BLOCK_D], tl.float32)
    for t0 in range(t_start, t_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        mask = (t < t_end)[:, None, None] & row_ok[None, :, None] & feat_ok[None, None, :]
        pos = tile_positions(
            offset,
            positions,
            b_pos if per_row else None,
            t,
            N,
            stride_pb,
            stride_pn,
            feats,
            extra,
            n_freq,
            size_a,
            size_b,
            size_c,
            GRID_AXES,
        )
        if angles is not None:
            tab_ok = (t < N)[:, None, None] & feat_ok[None, None, :]
            ang = tl.load(angles + angle_table_offsets(t, h, H, D, feats), mask=tab_ok, other=0.0)
        else:
            ang = pos * freqs
        cos_t, sin_t = cos_sin(ang)
        # Loads after cos/sin here (unlike the main kernels): with the loads first, the GPU
        # compile of the grid form contracted the products into FMAs differently with and
        # without the angle cache, and cache=True must give d(theta) bit for bit.
        x_tile = (t.to(tl.int64) * stride_xn)[:, None, None] + (feats * stride_xd)[None, None, :]
        g_tile = (t.to(tl.int64) * stride_gn)[:, None, None] + (feats * stride_gd)[None, None, :]
        xv = tl.load(x_rows + x_tile, mask=mask, other=0.0).to(tl.float32)
        dy_cos = tl.load(g_rows + g_tile, mask=mask, other=0.0).to(tl.float32)
        dy_sin = tl.load(g_rows + g_tile + D * stride_gd, mask=mask, other=0.0).to(tl.float32)
        xbar = softmax_normalize(xv, m_t, s_t, 0)
        acc_sums += xbar * (dy_cos * cos_t + dy_sin * sin_t)
        if NEED_DTHETA:
            acc += pos * xbar * (dy_sin * cos_t - dy_cos * sin_t)
    out = ((stat_rows * H + h).to(tl.int64) * num_chunks + c)[:, None] * D + feats[None, :]
    tl.store(sums + out, tl.sum(acc_sums, axis=0), mask=stat_ok)
    if NEED_DTHETA:
        part = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        store_dtheta_partial(
            dtheta_partials, part, H, h, feats, D, tl.sum(tl.sum(acc, axis=1), axis=0)
        )
