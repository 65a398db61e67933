"""Triton kernels of lrpe-rotate and the plan helpers (tiles, batch groups, layouts) of their
launches; the host paths that launch them are in launch.py.

x is addressed as (B, N, H, D) through runtime strides (read in place, whatever the layout). A
program holds the two halves of D of a block of tokens of one head as two [BLOCK_N, BLOCK_E]
float32 tiles (pair j is (j, j + D/2)). Activations come from kernelkit-act's building blocks;
positions, theta forms, cos/sin and d(theta) partials from kernelkit-lrpe-core.

KIND (constexpr): "none" / "relu" / "sigmoid" / "silu" (element-wise, before the rotation) or
"softmax" (over D). Softmax over the sequence has its own kernels (stats over all of N first),
in `seq_softmax.py`.
Positions: `offset` (an int or a pointer to per-row starts), `positions` (a per-token table
or None) and `cu_seqlens` (sequences packed along N, or None), see kernelkit.lrpe_core.kernels.
Sizes, offsets and per-program batch counts are runtime arguments and never specialised: a new
N, B or offset reuses the compiled kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernelkit.act.kernels import (
    apply_act,
    apply_act_grad,
    softmax_merge,
    softmax_normalize,
    softmax_stats,
)
from kernelkit.lrpe_core.kernels import (
    cos_sin,
    is_pointer,
    packed_starts,
    slot_frequencies,
    store_dtheta_partial,
    token_positions,
)
from kernelkit.lrpe_core.op import (
    ONE_PASS_MAX_ELEMENTS,
    SEQ,
    packed_chunks,
    programs_target,
    theta_args,
)
from kernelkit.shared.runtime import cdiv, interpreting, next_power_of_2

# Never specialised (Triton would otherwise make values of 1 constants and key on divisibility
# by 16): everything that changes with N, B or the offset.
RUNTIME = ["B", "N", "offset", "rows_per_program", "num_seqs", "stride_pb", "stride_pn"]
TOKENS_RUNTIME = ["B", "N", "items_per_program", "num_seqs", "stride_pb", "stride_pn"]
SEQ_RUNTIME = ["N", "offset", "chunk", "num_chunks", "num_stat_chunks", "stride_pb", "stride_pn"]


@dataclass(frozen=True)
class Plan:
    """Launch parameters. A half-tile [BLOCK_N, BLOCK_E] holds about `tile` elements (BLOCK_N =
    32 tokens at D = 128: two bf16 halves = 8 KB per batch row); cos/sin of the tile stay live
    across the batch loop, so tiles are kept moderate. Batch rows are split into groups until
    about `programs_per_sm` programs per SM. Softmax over N: a program walks a chunk of the
    sequence of one (b, h); chunks until about `seq_programs_per_sm` programs per SM. Its
    stats are read in one pass (no merge launch) up to `stats_one_pass` elements per program
    (lrpe-core's `sequence_softmax_stats`)."""

    tile: int = 2048
    warps: int = 8  # H200 sweep: 8 warps x tile 2048 = 92% of copy bandwidth fwd (4: 86%)
    programs_per_sm: int = 4
    seq_tile: int = 2048
    seq_warps: int = 4
    seq_programs_per_sm: int = 8
    min_block_n: int = 8
    max_block_n: int = 128
    tokens_items: int = 8  # per-token positions ("ahead" tilings): items per program, at most
    tokens_programs_per_sm: int = 32  # ... and fewer while programs would drop below this
    # Register cap of the per-token kernels: 64 keeps 4 programs of 8 warps per SM on sm_90
    # (they compile to 64 without spills). 0: no cap.
    tokens_maxnreg: int = 64
    stats_one_pass: int = ONE_PASS_MAX_ELEMENTS


PLAN = Plan()

# How kernels with per-token positions (a (B|1, N) table, per-row starts, cu_seqlens) tile the
# work, read at every call (and part of the plan cache key), so that an A/B flips it in one
# process: "ahead" = the *_tokens_kernel pair, a program walks `Plan.tokens_items` tiles
# loading the next tile's positions one tile ahead; "old" = rotate_fwd_kernel /
# rotate_bwd_kernel, a program per tile and batch row, the tile's positions loaded after its
# x. Int offsets always take the old kernels. H100 A/B (NOTES.md, session 19): "ahead" +1.4 to
# +11.5% in 7 of 8 cells (-1.3% in one); also loading the next tile's x lost.
POSITIONS_TILING = "ahead"
TILINGS = ("old", "ahead")


def _tile(plan: Plan, kind: str, half: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_E, num_warps): a power-of-two half-tile of about `tile` elements."""
    tile, warps = (plan.seq_tile, plan.seq_warps) if kind == SEQ else (plan.tile, plan.warps)
    block_e = next_power_of_2(half)
    return max(plan.min_block_n, min(plan.max_block_n, tile // block_e)), block_e, warps


def _batch_groups(plan, batch, n_tiles, heads, device, per_row) -> tuple[int, int]:
    """(rows per program, groups). With positions shared by all rows a program loops over
    several batch rows reusing its cos/sin; rows are split into groups only until the GPU is full."""
    if per_row:
        return 1, batch
    target = programs_target(device, plan.programs_per_sm)
    groups = min(batch, max(1, cdiv(target, n_tiles * heads)))
    per_group = cdiv(batch, groups)
    return per_group, cdiv(batch, per_group)


def _seq_chunks(plan, batch, n, heads, block_n, device, packed=False) -> tuple[int, int]:
    """(tokens per chunk, chunks) for the softmax-over-N kernels: a multiple of BLOCK_N. Packed
    sequences (`batch` of them) get more chunks (lrpe-core's `packed_chunks`): their chunks are
    a fixed fraction of each sequence, so a long one among short ones would make a long tail."""
    n_blocks = cdiv(n, block_n)
    target = programs_target(device, plan.seq_programs_per_sm)
    chunks = max(1, cdiv(target, batch * heads))
    chunks = min(n_blocks, packed_chunks(chunks) if packed else chunks)
    chunk = cdiv(n_blocks, chunks) * block_n
    return chunk, cdiv(n, chunk)


def _strides(name: str, t: torch.Tensor) -> dict:
    return {f"stride_{name}{a}": s for a, s in zip("bnhd", t.stride())}


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


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
def tile_offsets(t, j, s_n, s_d):
    return t.to(tl.int64)[:, None] * s_n + j[None, :] * s_d


@triton.jit
def rotation(freqs, offset, positions, b, t, n, stride_pb, stride_pn):
    """cos and sin [BLOCK_N, BLOCK_E] of the angles of tokens t (< n) of batch row b."""
    pos = token_positions(offset, positions, b, t, n, stride_pb, stride_pn).to(tl.float32)
    return cos_sin(pos[:, None] * freqs[None, :])


@triton.jit
def row_positions(offset, positions, cu_seqlens, num_seqs, b, t0, t, n, stride_pb, stride_pn):
    """float32 positions of the tokens t = t0 + arange(BLOCK_N) of one tile of batch row b: the
    offset or table forms or, with `cu_seqlens` (B = 1), t - the first token of its sequence.

    Callers issue the tile's loads of x (dy) first and then a barrier: ptxas otherwise hoists
    the table loads and their int64 -> float32 conversions above the loads of x (sm_90 SASS),
    which then wait a full memory latency for the positions. A barrier does not wait for loads
    in flight; it only keeps later loads from moving above it."""
    if cu_seqlens is not None:
        t_last = tl.minimum(t0 + t.shape[0], n) - 1
        _, start = packed_starts(cu_seqlens, num_seqs, t, t0, t_last)
        pos = t - start
    else:
        pos = token_positions(offset, positions, b, t, n, stride_pb, stride_pn)
    return pos.to(tl.float32)


# --------------------------------------------------------------------------------------------
# Element-wise act and softmax over D. Grid (token blocks x batch groups, H); a program rotates
# one token block of one head for `rows_per_program` batch rows. With positions shared by all
# rows, cos/sin are computed once and reused for every row.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=RUNTIME)
def rotate_fwd_kernel(
    x,
    y,
    theta,
    offset,
    positions,
    cu_seqlens,
    B,
    N,
    num_seqs,
    rows_per_program,
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
    KIND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    b0 = (pid // n_tiles).to(tl.int64) * rows_per_program  # b * stride_b may pass 2**31
    h = tl.program_id(1)
    t0 = (pid % n_tiles) * BLOCK_N
    t = t0 + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_E)
    mask = (t < N)[:, None] & (j < HALF)[None, :]
    freqs = slot_frequencies(theta + h * stride_th, stride_te, j, n_freq)
    per_row: tl.constexpr = positions is not None or is_pointer(offset) or cu_seqlens is not None
    if not per_row:
        cos, sin = rotation(freqs, offset, positions, 0, t, N, stride_pb, stride_pn)
    x_off = h.to(tl.int64) * stride_xh + tile_offsets(t, j, stride_xn, stride_xd)
    y_off = h.to(tl.int64) * stride_yh + tile_offsets(t, j, stride_yn, stride_yd)
    for b in range(b0, tl.minimum(b0 + rows_per_program, B)):
        x1, x2 = activated_halves(x + b * stride_xb, x_off, HALF * stride_xd, mask, KIND)
        if per_row:  # after the loads of x: cos/sin wait on loads of their own
            tl.debug_barrier()  # keeps ptxas from scheduling them first (see row_positions)
            pos = row_positions(
                offset, positions, cu_seqlens, num_seqs, b, t0, t, N, stride_pb, stride_pn
            )
            cos, sin = cos_sin(pos[:, None] * freqs[None, :])
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        store_halves(y + b * stride_yb, y_off, HALF * stride_yd, y1, y2, mask)


@triton.jit
def item_positions(
    item, n_tiles, offset, positions, cu_seqlens, num_seqs, N, stride_pb, stride_pn, BLOCK_N
):
    """Integer positions (as loaded: converted to float32 where they are used, so that nothing
    waits on the load before then) of work item `item` (tile item % n_tiles of batch row
    item // n_tiles) of the per-token kernels."""
    b = item // n_tiles
    t0 = (item - b * n_tiles) * BLOCK_N
    t = t0 + tl.arange(0, BLOCK_N)
    if cu_seqlens is not None:
        t_last = tl.minimum(t0 + BLOCK_N, N) - 1
        _, start = packed_starts(cu_seqlens, num_seqs, t, t0, t_last)
        pos = t - start
    elif positions is not None:
        t = tl.minimum(t, N - 1)
        pos = tl.load(positions + tl.cast(b, tl.int64) * stride_pb + t.to(tl.int64) * stride_pn)
    else:
        pos = token_positions(offset, positions, b, t, N, stride_pb, stride_pn)
    return pos


@triton.jit
def load_raw_halves(ptr, off, half_step, mask, other):
    """Both halves of a tile as stored (no conversion)."""
    x1 = tl.load(ptr + off, mask=mask, other=other)
    x2 = tl.load(ptr + off + half_step, mask=mask, other=other)
    return x1, x2


@triton.jit
def act_of_raw(x1, x2, mask, KIND: tl.constexpr):
    """act(x) of raw halves loaded with `other` -inf (softmax) or 0; invalid lanes are 0."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if KIND == "softmax":
        x1, x2 = softmax_halves(x1, x2)
        x1 = tl.where(mask, x1, 0.0)
        x2 = tl.where(mask, x2, 0.0)
    else:
        x1 = tl.where(mask, apply_act(x1, KIND), 0.0)
        x2 = tl.where(mask, apply_act(x2, KIND), 0.0)
    return x1, x2


# --------------------------------------------------------------------------------------------
# Per-token positions (a table, per-row starts or packed sequences), POSITIONS_TILING "ahead".
# Grid (programs, H): a program walks `items_per_program` consecutive work items
# (item = b * n_tiles + tile: one BLOCK_N-token tile of one batch row) of one head, and loads
# the positions of item i + 1 while item i is in flight, so that every tile's cos/sin start
# without waiting on memory (as the int offset's do) and the program streams as many bytes as
# an int-offset program looping over its batch rows.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=TOKENS_RUNTIME)
def rotate_fwd_tokens_kernel(
    x,
    y,
    theta,
    offset,
    positions,
    cu_seqlens,
    B,
    N,
    num_seqs,
    items_per_program,
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
    KIND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    first = tl.program_id(0) * items_per_program
    last = tl.minimum(first + items_per_program, B * n_tiles) - 1
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_E)
    freqs = slot_frequencies(theta + h * stride_th, stride_te, j, n_freq)
    x_h = x + h.to(tl.int64) * stride_xh
    y_h = y + h.to(tl.int64) * stride_yh
    pos = item_positions(
        first, n_tiles, offset, positions, cu_seqlens, num_seqs, N, stride_pb, stride_pn, BLOCK_N
    )
    for item in range(first, last + 1):
        b = item // n_tiles
        t = (item - b * n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (t < N)[:, None] & (j < HALF)[None, :]
        nxt = tl.minimum(item + 1, last)  # the last item reloads itself (cache hits)
        # Loads of the next item's positions first (a table: issued before this item's cos/sin,
        # in flight across its loads and stores); a search of cu_seqlens waits on its own
        # loads, so it comes after this item's loads of x.
        if cu_seqlens is None:
            pos_next = item_positions(
                nxt, n_tiles, offset, positions, cu_seqlens, num_seqs, N, stride_pb, stride_pn,
                BLOCK_N,
            )  # fmt: skip
        cos, sin = cos_sin(pos.to(tl.float32)[:, None] * freqs[None, :])
        x_off = b.to(tl.int64) * stride_xb + tile_offsets(t, j, stride_xn, stride_xd)
        x1, x2 = activated_halves(x_h, x_off, HALF * stride_xd, mask, KIND)
        if cu_seqlens is not None:
            pos_next = item_positions(
                nxt, n_tiles, offset, positions, cu_seqlens, num_seqs, N, stride_pb, stride_pn,
                BLOCK_N,
            )  # fmt: skip
        y_off = b.to(tl.int64) * stride_yb + tile_offsets(t, j, stride_yn, stride_yd)
        store_halves(y_h, y_off, HALF * stride_yd, x1 * cos - x2 * sin, x1 * sin + x2 * cos, mask)
        pos = pos_next


def _rotate_layout(x, theta, starts, table, cu_seqlens, kind, plan):
    """(grid, layout kwargs) of rotate_fwd_kernel / rotate_bwd_kernel."""
    batch, n, heads, d = x.shape
    half = d // 2
    block_n, block_e, warps = _tile(plan, kind, half)
    n_tiles = cdiv(n, block_n)
    per_row = starts is not None or table is not None or cu_seqlens is not None
    per_group, groups = _batch_groups(plan, batch, n_tiles, heads, x.device, per_row)
    kwargs = dict(
        B=batch,
        N=n,
        num_seqs=0 if cu_seqlens is None else cu_seqlens.shape[0] - 1,
        rows_per_program=per_group,
        **theta_args(theta, half),
        KIND=kind,
        HALF=half,
        BLOCK_N=block_n,
        BLOCK_E=block_e,
        num_warps=warps,
    )
    return (n_tiles * groups, heads), kwargs


def _tokens_layout(x, theta, cu_seqlens, kind, plan, tiling):
    """(grid, layout kwargs) of rotate_fwd_tokens_kernel / rotate_bwd_tokens_kernel: work items
    (batch row, tile) split into runs of at most `tokens_items` per program."""
    batch, n, heads, d = x.shape
    half = d // 2
    block_n, block_e, warps = _tile(plan, kind, half)
    items = batch * cdiv(n, block_n)
    target = programs_target(x.device, plan.tokens_programs_per_sm)
    per_program = max(1, min(plan.tokens_items, (items * heads) // target))
    kwargs = dict(
        B=batch,
        N=n,
        num_seqs=0 if cu_seqlens is None else cu_seqlens.shape[0] - 1,
        items_per_program=per_program,
        **theta_args(theta, half),
        KIND=kind,
        HALF=half,
        BLOCK_N=block_n,
        BLOCK_E=block_e,
        num_warps=warps,
    )
    if plan.tokens_maxnreg and not interpreting():
        kwargs["maxnreg"] = plan.tokens_maxnreg
    return (cdiv(items, per_program), heads), kwargs


def _tokens(starts, table, cu_seqlens, tiling) -> bool:
    """Whether a launch takes the per-token kernels (see POSITIONS_TILING)."""
    if tiling not in TILINGS:
        raise ValueError(f"POSITIONS_TILING: expected one of {TILINGS}, got {tiling!r}")
    return tiling != "old" and (starts is not None or table is not None or cu_seqlens is not None)


@triton.jit(do_not_specialize=RUNTIME)
def rotate_bwd_kernel(
    x,
    dy,
    dx,
    theta,
    offset,
    positions,
    cu_seqlens,
    dtheta_partials,
    B,
    N,
    num_seqs,
    rows_per_program,
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
    KIND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """dx = act'(x) applied to the inverse rotation of dy. With `dtheta_partials` (not None)
    this program's share of dtheta[h, j] = sum pos * (xbar1 * dxbar2 - xbar2 * dxbar1), summed
    element-wise over its rows and reduced once at the end; `x` is None when the backward needs
    no x (act none without d(theta))."""
    NEED_DTHETA: tl.constexpr = dtheta_partials is not None
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    b0 = (pid // n_tiles).to(tl.int64) * rows_per_program
    h = tl.program_id(1)
    t0 = (pid % n_tiles) * BLOCK_N
    t = t0 + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_E)
    mask = (t < N)[:, None] & (j < HALF)[None, :]
    freqs = slot_frequencies(theta + h * stride_th, stride_te, j, n_freq)
    per_row: tl.constexpr = positions is not None or is_pointer(offset) or cu_seqlens is not None
    if not per_row:
        cos, sin = rotation(freqs, offset, positions, 0, t, N, stride_pb, stride_pn)
        pos = token_positions(offset, positions, 0, t, N, stride_pb, stride_pn).to(tl.float32)
    x_off = h.to(tl.int64) * stride_xh + tile_offsets(t, j, stride_xn, stride_xd)
    g_off = h.to(tl.int64) * stride_gh + tile_offsets(t, j, stride_gn, stride_gd)
    d_off = h.to(tl.int64) * stride_dh + tile_offsets(t, j, stride_dn, stride_dd)
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    for b in range(b0, tl.minimum(b0 + rows_per_program, B)):
        dy1, dy2 = load_halves(dy + b * stride_gb, g_off, HALF * stride_gd, mask, 0.0)
        if KIND == "softmax":
            xb1, xb2 = activated_halves(x + b * stride_xb, x_off, HALF * stride_xd, mask, KIND)
        elif KIND != "none" or NEED_DTHETA:
            x1, x2 = load_halves(x + b * stride_xb, x_off, HALF * stride_xd, mask, 0.0)
        if per_row:  # after the loads of dy and x: cos/sin wait on loads of their own
            tl.debug_barrier()  # keeps ptxas from scheduling them first (see row_positions)
            pos = row_positions(
                offset, positions, cu_seqlens, num_seqs, b, t0, t, N, stride_pb, stride_pn
            )
            cos, sin = cos_sin(pos[:, None] * freqs[None, :])
        g1 = cos * dy1 + sin * dy2  # gradient w.r.t. act(x): the inverse rotation of dy
        g2 = cos * dy2 - sin * dy1
        if KIND == "softmax":
            dot = tl.sum(xb1 * g1, axis=1) + tl.sum(xb2 * g2, axis=1)
            dx1 = xb1 * (g1 - dot[:, None])
            dx2 = xb2 * (g2 - dot[:, None])
        elif KIND == "none":
            dx1 = g1
            dx2 = g2
            if NEED_DTHETA:
                xb1 = x1
                xb2 = x2
        else:
            dx1 = apply_act_grad(x1, g1, KIND)
            dx2 = apply_act_grad(x2, g2, KIND)
            if NEED_DTHETA:
                xb1 = apply_act(x1, KIND)
                xb2 = apply_act(x2, KIND)
        store_halves(dx + b * stride_db, d_off, HALF * stride_dd, dx1, dx2, mask)
        if NEED_DTHETA:  # lanes past N or D/2 have dy = 0, hence g = 0
            acc += pos[:, None] * (xb1 * g2 - xb2 * g1)
    if NEED_DTHETA:
        store_dtheta_partial(dtheta_partials, pid, tl.num_programs(1), h, j, HALF, tl.sum(acc, 0))


@triton.jit
def dx_of(dy1, dy2, x1, x2, cos, sin, mask, KIND: tl.constexpr, NEED_X: tl.constexpr):
    """(dx halves, g halves, act(x) halves: g where not NEED_X) of one tile of float32 dy and raw x (loaded with
    `other` -inf for softmax, 0 otherwise; unused unless NEED_X): rotate_bwd_kernel's math."""
    g1 = cos * dy1 + sin * dy2  # gradient w.r.t. act(x): the inverse rotation of dy
    g2 = cos * dy2 - sin * dy1
    xb1 = g1  # placeholders where act(x) is not needed
    xb2 = g2
    if KIND == "softmax":
        xb1, xb2 = act_of_raw(x1, x2, mask, KIND)
        dot = tl.sum(xb1 * g1, axis=1) + tl.sum(xb2 * g2, axis=1)
        dx1 = xb1 * (g1 - dot[:, None])
        dx2 = xb2 * (g2 - dot[:, None])
    elif KIND == "none":
        dx1 = g1
        dx2 = g2
        if NEED_X:
            xb1 = x1.to(tl.float32)
            xb2 = x2.to(tl.float32)
    else:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        dx1 = apply_act_grad(f1, g1, KIND)
        dx2 = apply_act_grad(f2, g2, KIND)
        if NEED_X:
            xb1 = apply_act(f1, KIND)
            xb2 = apply_act(f2, KIND)
    return dx1, dx2, g1, g2, xb1, xb2


@triton.jit(do_not_specialize=TOKENS_RUNTIME)
def rotate_bwd_tokens_kernel(
    x,
    dy,
    dx,
    theta,
    offset,
    positions,
    cu_seqlens,
    dtheta_partials,
    B,
    N,
    num_seqs,
    items_per_program,
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
    KIND: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """rotate_bwd_kernel's dx and d(theta) partials with rotate_fwd_tokens_kernel's work items
    (positions one item ahead)."""
    NEED_DTHETA: tl.constexpr = dtheta_partials is not None
    NEED_X: tl.constexpr = KIND != "none" or NEED_DTHETA
    n_tiles = tl.cdiv(N, BLOCK_N)
    first = tl.program_id(0) * items_per_program
    last = tl.minimum(first + items_per_program, B * n_tiles) - 1
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_E)
    freqs = slot_frequencies(theta + h * stride_th, stride_te, j, n_freq)
    x_h = x  # None for act none without d(theta)
    if NEED_X:
        x_h = x + h.to(tl.int64) * stride_xh
    g_h = dy + h.to(tl.int64) * stride_gh
    d_h = dx + h.to(tl.int64) * stride_dh
    other: tl.constexpr = -float("inf") if KIND == "softmax" else 0.0
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    pos = item_positions(
        first, n_tiles, offset, positions, cu_seqlens, num_seqs, N, stride_pb, stride_pn, BLOCK_N
    )
    for item in range(first, last + 1):
        b = item // n_tiles
        t = (item - b * n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (t < N)[:, None] & (j < HALF)[None, :]
        nxt = tl.minimum(item + 1, last)
        if cu_seqlens is None:  # as rotate_fwd_tokens_kernel
            pos_next = item_positions(
                nxt, n_tiles, offset, positions, cu_seqlens, num_seqs, N, stride_pb, stride_pn,
                BLOCK_N,
            )  # fmt: skip
        pos_f = pos.to(tl.float32)
        cos, sin = cos_sin(pos_f[:, None] * freqs[None, :])
        g_off = b.to(tl.int64) * stride_gb + tile_offsets(t, j, stride_gn, stride_gd)
        dy1, dy2 = load_halves(g_h, g_off, HALF * stride_gd, mask, 0.0)
        if NEED_X:
            x_off = b.to(tl.int64) * stride_xb + tile_offsets(t, j, stride_xn, stride_xd)
            x1, x2 = load_raw_halves(x_h, x_off, HALF * stride_xd, mask, other)
        else:
            x1 = dy1
            x2 = dy2
        if cu_seqlens is not None:
            pos_next = item_positions(
                nxt, n_tiles, offset, positions, cu_seqlens, num_seqs, N, stride_pb, stride_pn,
                BLOCK_N,
            )  # fmt: skip
        dx1, dx2, g1, g2, xb1, xb2 = dx_of(dy1, dy2, x1, x2, cos, sin, mask, KIND, NEED_X)
        d_off = b.to(tl.int64) * stride_db + tile_offsets(t, j, stride_dn, stride_dd)
        store_halves(d_h, d_off, HALF * stride_dd, dx1, dx2, mask)
        if NEED_DTHETA:  # lanes past N or D/2 have dy = 0, hence g = 0
            acc += pos_f[:, None] * (xb1 * g2 - xb2 * g1)
        pos = pos_next
    if NEED_DTHETA:
        store_dtheta_partial(dtheta_partials, tl.program_id(0), tl.num_programs(1), h, j, HALF,
                             tl.sum(acc, 0))  # fmt: skip
