"""The host paths of lrpe-rotate's ops: `forward` and `backward` allocate the outputs and
launch the kernels of kernels.py and seq_softmax.py (and, for softmax over the sequence,
kernelkit-act's chunk stats and kernelkit-lrpe-core's merge of them).

Each is recorded once per layout and replayed (`kernelkit.shared.replay`): the key is the
layout of the tensors (x or dy, theta, the positions tensors, cu_seqlens, the forward's stats),
the width of the int offset and the options (kind, which gradients, plan, POSITIONS_TILING);
a replay allocates the buffers and calls the prepared launches with the call's own tensors and
offset. Launches per call: one, plus for softmax over the sequence the chunk stats and, with
more than one chunk, their merge (forward); two for softmax over the sequence (backward: sums,
apply).
"""

from __future__ import annotations

import torch

from kernelkit.lrpe_core.op import SEQ, launch_positions, sequence_softmax_stats
from kernelkit.shared import replay

from . import kernels as K
from .kernels import PLAN, Plan, _rotate_layout, _strides, _tokens, _tokens_layout
from .seq_softmax import (
    _seq_layout,
    seq_softmax_bwd_apply_kernel,
    seq_softmax_bwd_sums_kernel,
    seq_softmax_fwd_kernel,
)

__all__ = ["backward", "forward"]

# Indices of the per-call int offset in `forward`'s and `backward`'s replay inputs.
_FWD_START, _BWD_START = 2, 3


def forward(x, theta, start, starts, table, cu_seqlens, kind, plan: Plan = PLAN):
    """(y,), y = rotate(act(x)) for an element-wise act or softmax over D, or (y, stats) for
    softmax over the sequence (`stats` (2, rows, 1, D), the backward reuses them); positions
    (start, starts, table) from kernelkit.lrpe_core.op.validate_positions, or restarting in
    each sequence packed along N with `cu_seqlens`. Replayed per layout; the int `start` is
    the only per-call value."""
    inputs = (x, theta, start, starts, table, cu_seqlens)
    tiling = K.POSITIONS_TILING
    options = (kind, None if plan is PLAN else plan, tiling)  # (a Plan hashes in Python)
    return replay.replayed(_forward, inputs, options, *inputs, kind, plan, tiling)


def forward_recorded(x, theta, start: int, kind: str):
    """The sequence `forward(x, theta, start, None, None, None, kind)` replays for this call
    (positions `start + t`, the default plan): run it as `seq((x, theta, start, None, None,
    None))`, whose first output is y; None where there is none (not called yet, or not
    replayable)."""
    options = (kind, None, K.POSITIONS_TILING)
    return replay.recorded(_forward, (x, theta, start, None, None, None), options)


def _forward(ops, x, theta, start, starts, table, cu_seqlens, kind, plan, tiling):
    """`forward` through `ops`: rotate_fwd_kernel (or, per POSITIONS_TILING,
    rotate_fwd_tokens_kernel), or act's chunk stats, their merge and seq_softmax_fwd_kernel."""
    y = ops.empty_like(x)
    if kind == SEQ:
        stats = sequence_softmax_stats(
            x, cu_seqlens, ops=ops, one_pass_elements=plan.stats_one_pass
        )
        grid, kwargs = _seq_layout(x, theta, stats, cu_seqlens, plan)
        pos_kwargs, vary = launch_positions(start, starts, table, _FWD_START)
        ops.launch(
            seq_softmax_fwd_kernel, grid, x=x, y=y, theta=theta, stats=stats,
            **_strides("x", x), **_strides("y", y), **kwargs, **pos_kwargs, vary=vary,
        )  # fmt: skip
        return y, stats
    tokens, kernel, grid, kwargs = _rotate_launch(
        (K.rotate_fwd_kernel, K.rotate_fwd_tokens_kernel), x, theta, starts, table, cu_seqlens,
        kind, plan, tiling,
    )  # fmt: skip
    # The per-token kernels specialise on the int offset, which they never read (packed
    # sequences only, where it is 0): fixed, not a per-call value.
    pos_kwargs, vary = launch_positions(start, starts, table, None if tokens else _FWD_START)
    ops.launch(
        kernel, grid, x=x, y=y, theta=theta, cu_seqlens=cu_seqlens, **_strides("x", x),
        **_strides("y", y), **kwargs, **pos_kwargs, vary=vary,
    )  # fmt: skip
    return (y,)


def _rotate_launch(kernels, x, theta, starts, table, cu_seqlens, kind, plan, tiling):
    """(per-token?, kernel, grid, layout keywords) of an element-wise / softmax-over-D
    direction: kernels = (its rotate kernel, its per-token kernel), the latter where
    `_tokens` says so."""
    tokens = _tokens(starts, table, cu_seqlens, tiling)
    if tokens:
        return tokens, kernels[1], *_tokens_layout(x, theta, cu_seqlens, kind, plan, tiling)
    return tokens, kernels[0], *_rotate_layout(x, theta, starts, table, cu_seqlens, kind, plan)


def backward(dy, x, theta, start, starts, table, cu_seqlens, stats, kind, need_dtheta,
             plan: Plan = PLAN):  # fmt: skip
    """(dx, float32 d(theta) partials (programs, H, D/2), or an empty (0, 0) tensor of theta's
    dtype without `need_dtheta`); x may be None for act none without d(theta); positions as
    `forward`, `stats` the forward's. Replayed per layout as `forward`."""
    inputs = (dy, x, theta, start, starts, table, cu_seqlens, stats)
    tiling = K.POSITIONS_TILING
    options = (kind, need_dtheta, None if plan is PLAN else plan, tiling)
    return replay.replayed(_backward, inputs, options, *inputs, kind, need_dtheta, plan, tiling)


def _backward(ops, dy, x, theta, start, starts, table, cu_seqlens, stats, kind, need_dtheta,
              plan, tiling):  # fmt: skip
    """`backward` through `ops`: rotate_bwd_kernel (or rotate_bwd_tokens_kernel), or the
    softmax-over-N sums and apply kernels."""
    dx = ops.empty_like(dy)
    heads, half = dy.shape[2], dy.shape[3] // 2
    if kind == SEQ:
        grid, kwargs = _seq_layout(dy, theta, stats, cu_seqlens, plan)
        sums = ops.empty((stats.shape[1], kwargs["num_chunks"], 2 * half), torch.float32, dy.device)
        partials = None
        if need_dtheta:
            partials = ops.empty((grid[0], heads, half), torch.float32, dy.device)
        pos_kwargs, vary = launch_positions(start, starts, table, _BWD_START)
        common = dict(theta=theta, stats=stats, sums=sums, **_strides("x", x),
                      **_strides("g", dy), **kwargs, **pos_kwargs)  # fmt: skip
        ops.launch(seq_softmax_bwd_sums_kernel, grid, x=x, dy=dy, **common, vary=vary)
        ops.launch(
            seq_softmax_bwd_apply_kernel, grid, x=x, dy=dy, dx=dx, dtheta_partials=partials,
            **_strides("d", dx), **common, vary=vary,
        )  # fmt: skip
    else:
        tokens, kernel, grid, kwargs = _rotate_launch(
            (K.rotate_bwd_kernel, K.rotate_bwd_tokens_kernel), dy, theta, starts, table,
            cu_seqlens, kind, plan, tiling,
        )  # fmt: skip
        partials = None
        if need_dtheta:
            partials = ops.empty((grid[0], grid[1], half), torch.float32, dy.device)
        pos_kwargs, vary = launch_positions(start, starts, table, None if tokens else _BWD_START)
        ops.launch(
            kernel, grid, x=x, dy=dy, dx=dx, theta=theta, cu_seqlens=cu_seqlens,
            dtheta_partials=partials, **_strides("x", x if x is not None else dy),
            **_strides("g", dy), **_strides("d", dx), **kwargs, **pos_kwargs, vary=vary,
        )  # fmt: skip
    if partials is None:
        partials = ops.empty((0, 0), theta.dtype, theta.device)
    return dx, partials
