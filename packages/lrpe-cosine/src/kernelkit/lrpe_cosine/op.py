"""Validation, torch.library registration and autograd of `lrpe_cosine`. The kernels are in
kernels.py, the host paths that launch them (replayed per layout) in launch.py; the registered
ops only launch."""

from __future__ import annotations

import torch

from kernelkit.lrpe_core.op import (
    SEQ,
    as_float32,
    cpu_reference_args,
    reduce_dtheta,
    register_lrpe_autograd,
    shortcut_key,
    validate_act,
    validate_positions,
    validate_theta,
    validate_x,
)
from kernelkit.lrpe_core.reference import packed_positions
from kernelkit.shared import replay
from kernelkit.shared.runtime import define_op, use_triton

from . import launch
from .reference import lrpe_cosine_reference


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
) -> torch.Tensor:
    """y (B, N, H, 2D) for an element-wise act or softmax over D (softmax over the sequence:
    `fwd_seq`). theta is float32 (H|1, E). `cu_seqlens`: sequences packed along N (B = 1),
    positions restart in each (`positions` is None then)."""
    if x.numel() == 0:
        return x.new_empty((*x.shape[:-1], 2 * x.shape[-1]))
    (y,) = launch.forward(x, theta, start, starts, positions, cu_seqlens, kind)
    return y


@define_op("kernelkit_lrpe_cosine::fwd_seq")
def fwd_seq(
    x: torch.Tensor,
    theta: torch.Tensor,
    start: int,
    starts: torch.Tensor | None,
    positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats) for softmax over the sequence: stats (2, B*H, 1, D) the backward reuses
    (with `cu_seqlens`, softmax over N runs over each packed sequence: (2, S*H, 1, D)). A
    separate op: the other kinds return y alone (a second output costs an allocation and its
    autograd bookkeeping per call)."""
    if x.numel() == 0:
        stats = x.new_empty((0,), dtype=torch.float32)
        return x.new_empty((*x.shape[:-1], 2 * x.shape[-1])), stats
    return launch.forward(x, theta, start, starts, positions, cu_seqlens, SEQ)


@define_op("kernelkit_lrpe_cosine::bwd")
def bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    theta: torch.Tensor,
    start: int,
    starts: torch.Tensor | None,
    positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    stats: torch.Tensor | None,
    kind: str,
    need_dx: bool,
    need_dtheta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dtheta float32); each is an empty tensor when not needed. x is None for act none
    without dtheta (the backward does not read it); `stats` fwd_seq's (softmax over the
    sequence), else None."""
    b, n, heads, d2 = dy.shape
    if dy.numel() == 0:
        dx = dy.new_zeros((b, n, heads, d2 // 2)) if need_dx else dy.new_empty((0,))
        return dx, (torch.zeros_like(theta) if need_dtheta else theta.new_empty((0, 0)))
    dx, partials = launch.backward(
        dy, x, theta, start, starts, positions, cu_seqlens, stats, kind, need_dx=need_dx,
        need_dtheta=need_dtheta,
    )  # fmt: skip
    # (without need_dtheta, `partials` is already the empty (0, 0) d(theta))
    return dx, (reduce_dtheta(partials, theta.shape) if need_dtheta else partials)


def _grads(ctx, dy):
    """(dx, dtheta) of `bwd`, None where not needed."""
    x, theta, starts, positions, cu_seqlens, stats = ctx.saved_tensors
    need_dx, need_dtheta = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dtheta = bwd(
        dy, x, theta, ctx.start, starts, positions, cu_seqlens, stats, ctx.kind, need_dx,
        need_dtheta,
    )  # fmt: skip
    return (dx if need_dx else None), (dtheta if need_dtheta else None)


# the autograd node of a shortcut call that autograd records (`shortcut_key`'s last entry)
_replayed_forward = register_lrpe_autograd(fwd, fwd_seq, _grads)


# lrpe_cosine's common calls that passed its checks, by `shortcut_key`: (the recorded sequence,
# its kernel kind)
_CALLS = replay.Shortcuts()


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
    # A call like an earlier one that passed the checks replays its sequence at once
    # (`shortcut_key`: the common call; through the op's autograd node where autograd records it)
    key = shortcut_key(x, theta, offset, act, dim, positions, cu_seqlens)
    if key is not None:
        entry = _CALLS._plans.get(key)
        if entry is not None:
            if key[-1]:
                return _replayed_forward(x, theta, offset, entry)
            return entry[0]((x, theta, offset, None, None, None))[0]
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
    theta32 = as_float32(theta)
    if kind == SEQ:
        y, _ = fwd_seq(x4, theta32, start, starts, table, cu_seqlens)
    else:
        y = fwd(x4, theta32, start, starts, table, cu_seqlens, kind)
    if key is not None and x4 is x and theta32 is theta:  # the call the sequence replays
        seq = launch.forward_recorded(x, theta, start, kind)
        if seq is not None:
            _CALLS.remember(key, (seq, kind))
    return y.squeeze(2) if three_d else y


__all__ = ["bwd", "fwd", "fwd_seq", "lrpe_cosine", "validate"]
