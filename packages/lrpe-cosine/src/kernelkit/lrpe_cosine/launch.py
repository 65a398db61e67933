"""The host paths of lrpe-cosine's ops (also md-lrpe-cosine's): `forward` and `backward`
allocate the outputs and launch the kernels of kernels.py (and, for softmax over the sequence,
kernelkit-act's chunk stats and kernelkit-lrpe-core's merges).

Each is recorded once per layout and replayed (`kernelkit.shared.replay`): the key is the
layout of the tensors (x, theta, the positions tensors, cu_seqlens, the forward's stats and
angle table), the width of the int offset and the options (kind, grid, cache, plan, which
gradients); a replay allocates the buffers and calls the prepared launches with the call's own
tensors and offset. Launches per call: one, plus for softmax over the sequence the chunk stats
and, with more than one chunk, their merge (forward); the sums kernel and, with more than one
chunk, the merge of its sums (backward, before the main kernel).
"""

from __future__ import annotations

import torch

from kernelkit.lrpe_core.op import SEQ, launch_positions, merge_chunk_sums, sequence_softmax_stats
from kernelkit.shared import replay
from kernelkit.shared.runtime import cdiv

from .kernels import (
    PLAN,
    Grid,
    Plan,
    _angle_args,
    _strides,
    batch_groups,
    cosine_bwd_kernel,
    cosine_bwd_seq_sums_kernel,
    cosine_fwd_kernel,
    load_rows,
    sequence_chunks,
    tile_sizes,
)

__all__ = ["backward", "forward"]


def _num_seqs(cu_seqlens) -> int:
    """The number of sequences packed along N (0: not packed)."""
    return 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _per_row(starts, table, cu_seqlens, grid) -> bool:
    """Whether positions differ per batch row or token run (per-row cos/sin: the small tile)."""
    return (starts is not None or table is not None or cu_seqlens is not None) and grid is None


# Indices of the per-call int offset in `forward`'s and `backward`'s replay inputs.
_FWD_START, _BWD_START = 2, 3


def _grid(plan: Plan, per_row: bool, b, n, heads, d, device):
    """(BLOCK_N, BLOCK_D, key blocks, rows per program, batch groups) of the cosine kernels'
    (n_blocks, heads, groups) grid: the small tile for per-row positions."""
    block_n, block_d = tile_sizes(d, plan.small_tile if per_row else plan.tile, load_rows(b))
    n_blocks = cdiv(n, block_n)
    rows, groups = batch_groups(plan, b, n_blocks * heads, device)
    return block_n, block_d, n_blocks, rows, groups


def _key(plan: Plan):
    """A plan as the replay key holds it: None for the shipped one (a dataclass hashes its
    fields in Python at every lookup)."""
    return None if plan is PLAN else plan


def forward(
    x,
    theta,
    start,
    starts,
    table,
    cu_seqlens,
    kind,
    *,
    grid: Grid | None = None,
    cache: bool | None = None,
    plan: Plan = PLAN,
):
    """(y,) with y (B, N, H, 2D) = [act(x) cos, act(x) sin]; (y, stats) for softmax_seq, the
    softmax-over-N stats (2, rows, 1, D) (over each packed sequence with `cu_seqlens`); with a
    `cache` (md-lrpe-cosine), (y, stats, angles) for every kind, stats empty unless
    softmax_seq, angles the float32 angle table (N, H, D) with `cache` True, else empty.
    Positions (start, starts, table) of a sequence (ignored with a `grid`), or restarting in
    each sequence packed along N with `cu_seqlens`.

    The whole host path (stats, allocations, launches) is recorded once per layout and
    replayed (kernelkit.shared.replay): the int `start` is the only per-call value."""
    inputs = (x, theta, start, starts, table, cu_seqlens)
    options = (kind, grid, cache, _key(plan))
    args = (x, theta, start, starts, table, cu_seqlens, kind, grid, cache, plan)
    return replay.replayed(_forward, inputs, options, *args)


def forward_recorded(x, theta, start: int, kind: str, *, grid: Grid | None = None, cache=None):
    """The sequence `forward(x, theta, start, None, None, None, kind, grid=grid, cache=cache)`
    replays for this call (positions `start + t`, or the `grid`'s; the default plan): run it as
    `seq((x, theta, start, None, None, None))`, whose first output is y; None where there is
    none (not called yet, or not replayable)."""
    options = (kind, grid, cache, _key(PLAN))
    return replay.recorded(_forward, (x, theta, start, None, None, None), options)


def _forward(ops, x, theta, start, starts, table, cu_seqlens, kind, grid, cache, plan):
    """`forward` with its allocations and launches through `ops`: act's chunk stats and
    lrpe-core's merge (softmax_seq), then cosine_fwd_kernel."""
    b, n, heads, d = x.shape
    device = x.device
    stats = None
    if kind == SEQ:
        stats = sequence_softmax_stats(
            x, cu_seqlens, ops=ops, one_pass_elements=plan.stats_one_pass
        )
    elif cache is not None:
        stats = ops.empty((0,), torch.float32, device)
    angles = (
        None
        if cache is None
        else ops.empty((n, heads, d) if cache else (0,), torch.float32, device)
    )
    y = ops.empty((b, n, heads, 2 * d), x.dtype, device)
    per_row = _per_row(starts, table, cu_seqlens, grid)
    block_n, block_d, n_blocks, rows, groups = _grid(plan, per_row, b, n, heads, d, device)
    pos_kwargs, vary = launch_positions(start, starts, table, _FWD_START)
    ops.launch(
        cosine_fwd_kernel,
        (n_blocks, heads, groups),
        x=x,
        y=y,
        theta=theta,
        stats=stats if kind == SEQ else None,
        cu_seqlens=cu_seqlens,
        angles=angles if cache else None,
        B=b,
        N=n,
        D=d,
        num_seqs=_num_seqs(cu_seqlens),
        rows_per_program=rows,
        num_stat_chunks=stats.shape[2] if kind == SEQ else 0,
        **_strides("x", x),
        **_strides("y", y),
        **_angle_args(theta, d, grid),
        ACT=kind,
        ROWS=load_rows(b),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=plan.warps,
        **pos_kwargs,
        vary=vary,
    )
    if cache is not None:
        return y, stats, angles
    return (y, stats) if kind == SEQ else (y,)


def backward(
    dy,
    x,
    theta,
    start,
    starts,
    table,
    cu_seqlens,
    stats,
    kind,
    *,
    need_dx=True,
    need_dtheta=False,
    grid: Grid | None = None,
    angles=None,
    plan: Plan = PLAN,
):
    """(dx, float32 d(theta) partials (programs, H, D)); an empty (0,) dx without `need_dx`,
    an empty (0, 0) tensor of theta's dtype for the partials without `need_dtheta`. x may be
    None for act none without d(theta); `stats` the forward's (softmax_seq); `angles` the
    forward's table or None. Replayed per layout as `forward`."""
    inputs = (dy, x, theta, start, starts, table, cu_seqlens, stats, angles)
    options = (kind, need_dx, need_dtheta, grid, _key(plan))
    args = (*inputs, kind, need_dx, need_dtheta, grid, plan)
    return replay.replayed(_backward, inputs, options, *args)


def _backward(
    ops, dy, x, theta, start, starts, table, cu_seqlens, stats, angles, kind, need_dx,
    need_dtheta, grid, plan,
):  # fmt: skip
    """`backward` through `ops`: for softmax_seq the sums kernel (and its d(theta) partials)
    and lrpe-core's merge of its chunk sums, then cosine_bwd_kernel unless only d(theta) of a
    softmax_seq is needed."""
    b, n, heads, d2 = dy.shape
    d = d2 // 2
    device = dy.device
    dx = None
    if need_dx:
        dx = ops.empty_like(x) if x is not None else ops.empty((b, n, heads, d), dy.dtype, device)
    per_row = _per_row(starts, table, cu_seqlens, grid)
    pos_kwargs, vary = launch_positions(start, starts, table, _BWD_START)
    common = dict(
        theta=theta,
        stats=stats if kind == SEQ else None,
        angles=angles,
        B=b,
        N=n,
        D=d,
        num_seqs=_num_seqs(cu_seqlens),
        num_stat_chunks=stats.shape[2] if kind == SEQ else 0,
        cu_seqlens=cu_seqlens,
        **_strides("x", x),
        **_strides("g", dy),
        **_angle_args(theta, d, grid),
        ROWS=load_rows(b),
        num_warps=plan.warps,
        **pos_kwargs,
    )
    main = need_dx or (need_dtheta and kind != SEQ)
    sums, partials, num_chunks = None, None, 0
    if kind == SEQ:
        block_n, block_d = tile_sizes(d, plan.small_tile, load_rows(b))
        if cu_seqlens is None:
            groups = cdiv(b, load_rows(b))
            chunk, num_chunks = sequence_chunks(plan, heads * groups, n, block_n, device)
            sums_grid = (num_chunks, heads, groups)
        else:  # B = 1, each packed sequence split into num_chunks on the device
            seqs = cu_seqlens.shape[0] - 1
            chunk, num_chunks = sequence_chunks(plan, heads * seqs, n, block_n, device, True)
            sums_grid = (seqs * num_chunks, heads, 1)
        sums = ops.empty((stats.shape[1], num_chunks, d), torch.float32, device)
        if need_dtheta:
            programs = sums_grid[0] * sums_grid[2]
            partials = ops.empty((programs, heads, d), torch.float32, device)
        ops.launch(
            cosine_bwd_seq_sums_kernel,
            sums_grid,
            x=x,
            dy=dy,
            sums=sums,
            dtheta_partials=partials,
            **common,
            chunk=chunk,
            num_chunks=num_chunks,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            vary=vary,
        )
        if main:  # merged once, not in each short main-kernel program
            sums = merge_chunk_sums(sums, ops=ops)
    if main:
        block_n, block_d, n_blocks, rows, groups = _grid(plan, per_row, b, n, heads, d, device)
        if need_dtheta and kind != SEQ:
            partials = ops.empty((n_blocks * groups, heads, d), torch.float32, device)
        ops.launch(
            cosine_bwd_kernel,
            (n_blocks, heads, groups),
            x=x,
            dy=dy,
            dx=dx,
            sums=sums,
            dtheta_partials=partials if kind != SEQ else None,
            **common,
            rows_per_program=rows,
            num_chunks=min(num_chunks, 1),  # the chunk sums are merged before this kernel
            **_strides("d", dx),
            ACT=kind,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            vary=vary,
        )
    if dx is None:
        dx = ops.empty((0,), dy.dtype, device)
    if partials is None:
        partials = ops.empty((0, 0), theta.dtype, theta.device)
    return dx, partials
