"""Validation, torch.library registration and autograd of `lrpe_cosine`. The kernels and the host
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
from .reference import lrpe_cosine_reference

_NO_STATS = (0,)


def validate(x, theta, offset, act, dim, positions=None, cu_seqlens=None):
    """Check the arguments of `lrpe_cosine`; returns (kernel kind, (start, starts, table))."""
    validate_x(x)
    d = x.shape[-1]
    e = validate_theta(x, theta)
    if not 1 <= e <= d:
        raise ValueError(f"theta: E = {e} frequencies per row, expected 1 <= E <= D = {d}")
    pos = validate_positions(x, offset, positions, cu_seqlens)
    return validate_act(x, act, dim, cu_seqlens), pos


@define_op("kernelkit_lrpe_cosine::fwd")
def fwd(
    x: torch.Tensor,
    theta: torch.Tensor,
    start: int,
    starts: torch.Tensor | None,
    positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (B, N, H, 2D), stats): stats are the softmax-over-N stats (2, B*H, 1, D) the backward
    reuses (empty for other kinds). theta is float32 (H|1, E). `cu_seqlens`: sequences packed
    along N (B = 1), positions restart in each (`positions` is None then) and
    softmax over N runs over each (stats (2, S*H, 1, D))."""
    pos = (start, starts, positions)
    stats = x.new_empty(_NO_STATS, dtype=torch.float32)
    if x.numel() == 0:
        return x.new_empty((*x.shape[:-1], 2 * x.shape[-1])), stats
    if kind != SEQ:
        return K.cosine_fwd(x, theta, pos, kind, cu_seqlens=cu_seqlens), stats
    stats = sequence_softmax_stats(x, cu_seqlens)
    return K.cosine_fwd(x, theta, pos, kind, stats, cu_seqlens), stats


@define_op("kernelkit_lrpe_cosine::bwd")
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
    need_dx: bool,
    need_dtheta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dtheta float32); each is an empty tensor when not needed. x is None for act none
    without dtheta (the backward does not read it)."""
    b, n, heads, d2 = dy.shape
    if dy.numel() == 0:
        dx = dy.new_zeros((b, n, heads, d2 // 2)) if need_dx else dy.new_empty((0,))
        return dx, (torch.zeros_like(theta) if need_dtheta else theta.new_empty((0, 0)))
    pos = (start, starts, positions)
    dx, partials = K.cosine_bwd(
        dy,
        x,
        theta,
        pos,
        kind,
        (stats if kind == SEQ else None),
        cu_seqlens,
        need_dx=need_dx,
        need_dtheta=need_dtheta,
    )
    dx = dx if need_dx else dy.new_empty((0,))
    dtheta = reduce_dtheta(partials, theta.shape) if need_dtheta else theta.new_empty((0, 0))
    return dx, dtheta


def _setup_context(ctx, inputs, output):
    x, theta, start, starts, positions, cu_seqlens, kind = inputs
    ctx.kind, ctx.start = kind, start
    # act none: dx needs only dy and the angles, x only matters for dtheta.
    keep_x = kind != "none" or ctx.needs_input_grad[1]
    saved = (x if keep_x else None, theta, starts, positions, cu_seqlens, output[1])
    ctx.save_for_backward(*saved)


def _backward(ctx, dy, _dstats):
    x, theta, starts, positions, cu_seqlens, stats = ctx.saved_tensors
    need_dx, need_dtheta = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dtheta = bwd(
        dy, x, theta, ctx.start, starts, positions, cu_seqlens, stats, ctx.kind, need_dx,
        need_dtheta,
    )  # fmt: skip
    dx = dx if need_dx else None
    return dx, (dtheta if need_dtheta else None), None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


def lrpe_cosine(
    x: torch.Tensor,
    theta: torch.Tensor,
    offset: int | torch.Tensor = 0,
    act: str = "none",
    dim: int | None = None,
    *,
    positions: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """LRPE cosine feature map: y = [act(x) cos(Theta), act(x) sin(Theta)] along the last dim.

    x: (B, N, H, D) or (B, N, D); theta: (H, E) or (1, E) with 1 <= E <= D (E == D one
    frequency per feature, E == 1 one per head, 1 < E < D angle 0 for features k >= E);
    Theta[b, t, h, k] = position * theta[h, k] with float32 angles of integer positions.
    Positions: `offset + t` for an int offset or a per-row integer tensor (B,); or an integer
    `positions` table (B, N) (or (1, N)); or, for sequences packed into one row (B = 1),
    `cu_seqlens` (int32 prefix sums, num_seqs + 1): positions restart at 0 in every sequence,
    and softmax over the sequence runs over each sequence.
    act: none / relu / sigmoid / silu / softmax with dim=-1 (over D) or dim=1 (over the
    sequence). Output (B, N, H, 2D) or (B, N, 2D), x's dtype; gradients flow to x and to theta
    (when it requires grad).
    """
    kind, pos = validate(x, theta, offset, act, dim, positions, cu_seqlens)
    start, starts, table = pos
    if not use_triton(x):
        where = table if table is not None else (starts if starts is not None else start)
        if cu_seqlens is not None:
            where = packed_positions(cu_seqlens, x.shape[1])
        xr, act_r, dim_r = cpu_reference_args(x, act, dim, cu_seqlens)
        return lrpe_cosine_reference(xr, theta, where, act_r, dim_r, cu_seqlens).to(x.dtype)
    three_d = x.dim() == 3
    x4 = x.unsqueeze(2) if three_d else x
    y, _ = fwd(x4, as_float32(theta), start, starts, table, cu_seqlens, kind)
    return y.squeeze(2) if three_d else y


__all__ = ["bwd", "fwd", "lrpe_cosine", "validate"]
