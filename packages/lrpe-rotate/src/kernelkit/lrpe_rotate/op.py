"""Validation, torch.library registration and autograd of `lrpe_rotate`. The kernels and the host
functions that plan and launch them are in kernels.py; the registered ops only launch."""

from __future__ import annotations

import torch

from kernelkit.lrpe_core.op import (
    SEQ,
    as_float32,
    cpu_reference_args,
    reduce_dtheta,
    sequence_softmax_stats,
    validate_act,
    validate_positions,
    validate_theta,
    validate_x,
)
from kernelkit.lrpe_core.reference import packed_positions
from kernelkit.shared.runtime import define_op, use_triton

from . import kernels as K
from . import seq_softmax
from .reference import lrpe_rotate_reference


def validate(x, theta, offset, act, dim, positions=None, cu_seqlens=None):
    """Check the arguments of `lrpe_rotate`; returns (kernel kind, (start, starts, table))."""
    validate_x(x)
    d = x.shape[-1]
    if d == 0 or d % 2 != 0:
        raise ValueError(f"x: the head dim D must be even and positive, got D={d}")
    e = validate_theta(x, theta)
    if not 1 <= e <= d // 2:
        raise ValueError(f"theta: E = {e} frequencies per row, expected 1 <= E <= D/2 = {d // 2}")
    pos = validate_positions(x, offset, positions, cu_seqlens)
    return validate_act(x, act, dim, cu_seqlens), pos


@define_op("kernelkit_lrpe_rotate::fwd")
def fwd(
    x: torch.Tensor,
    theta: torch.Tensor,
    start: int,
    starts: torch.Tensor | None,
    positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats) for 4-D x; stats are the softmax-over-N stats the backward reuses (empty for
    other kinds). theta is float32 (H|1, E). `cu_seqlens`: sequences packed along N (B = 1),
    positions restart in each (`positions` is None then) and softmax over N runs
    over each."""
    pos = (start, starts, positions)
    if x.numel() == 0:
        return torch.empty_like(x), x.new_empty((0,), dtype=torch.float32)
    if kind == SEQ:
        stats = sequence_softmax_stats(x, cu_seqlens)
        return seq_softmax.seq_softmax_fwd(x, theta, pos, stats, cu_seqlens), stats
    return K.rotate_fwd(x, theta, pos, kind, cu_seqlens), x.new_empty((0,), dtype=torch.float32)


@define_op("kernelkit_lrpe_rotate::bwd")
def bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    theta: torch.Tensor,
    start: int,
    starts: torch.Tensor | None,
    positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    stats: torch.Tensor,
    kind: str,
    need_dtheta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dtheta float32, empty unless need_dtheta); x is None for act none without dtheta."""
    pos = (start, starts, positions)
    if dy.numel() == 0:
        return torch.empty_like(dy), torch.zeros_like(theta) if need_dtheta else theta.new_empty(
            (0, 0)
        )
    if kind == SEQ:
        dx, partials = seq_softmax.seq_softmax_bwd(
            dy, x, theta, pos, stats, need_dtheta, cu_seqlens
        )
    else:
        dx, partials = K.rotate_bwd(dy, x, theta, pos, kind, need_dtheta, cu_seqlens)
    dtheta = reduce_dtheta(partials, theta.shape) if need_dtheta else theta.new_empty((0, 0))
    return dx, dtheta


def _setup_context(ctx, inputs, output):
    x, theta, start, starts, positions, cu_seqlens, kind = inputs
    ctx.kind, ctx.start = kind, start
    # The backward reads x only for an act or for d(theta): act none keeps nothing big.
    keep_x = kind != "none" or ctx.needs_input_grad[1]
    ctx.save_for_backward(x if keep_x else None, theta, starts, positions, cu_seqlens, output[1])


def _backward(ctx, dy, _dstats):
    x, theta, starts, positions, cu_seqlens, stats = ctx.saved_tensors
    need_dtheta = ctx.needs_input_grad[1]
    dx, dtheta = bwd(
        dy, x, theta, ctx.start, starts, positions, cu_seqlens, stats, ctx.kind, need_dtheta
    )
    return dx, (dtheta if need_dtheta else None), None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


def lrpe_rotate(
    x: torch.Tensor,
    theta: torch.Tensor,
    offset: int | torch.Tensor = 0,
    act: str = "none",
    dim: int | None = None,
    *,
    positions: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """LRPE rotation (RoPE-style, half-split pairing) of act(x) by position * theta.

    x: (B, N, H, D) or (B, N, D), any strides, float32/float16/bfloat16, D even.
    theta: (H, E) or (1, E) with E = D/2 (one frequency per pair), E = 1 (one per head) or
    1 < E < D/2 (pairs j >= E pass through). Positions: `offset + t` for an int offset or a
    per-row integer tensor (B,); or an integer `positions` table (B, N) (or (1, N)); or, for
    sequences packed into one row (B = 1), `cu_seqlens` (int32 prefix sums, num_seqs + 1):
    positions restart at 0 in every sequence, and softmax over N runs over each sequence.
    act: "none", "relu", "sigmoid", "silu" or "softmax" with dim=-1 (over D) or dim=1 (over N).
    Differentiable in x and, when it requires grad, theta.
    """
    kind, pos = validate(x, theta, offset, act, dim, positions, cu_seqlens)
    start, starts, table = pos
    if not use_triton(x):
        where = table if table is not None else (starts if starts is not None else start)
        if cu_seqlens is not None:
            where = packed_positions(cu_seqlens, x.shape[1])
        xr, act_r, dim_r = cpu_reference_args(x, act, dim, cu_seqlens)
        return lrpe_rotate_reference(xr, theta, where, act_r, dim_r, cu_seqlens).to(x.dtype)
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    y, _ = fwd(x4, as_float32(theta), start, starts, table, cu_seqlens, kind)
    return y if x.dim() == 4 else y.squeeze(2)


__all__ = ["bwd", "fwd", "lrpe_rotate", "validate"]
