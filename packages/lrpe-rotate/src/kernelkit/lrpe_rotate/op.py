"""Validation, torch.library registration and autograd of `lrpe_rotate`. The kernels are in
kernels.py and seq_softmax.py, the host paths that launch them (replayed per layout) in
launch.py; the registered ops only launch."""

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
) -> torch.Tensor:
    """y for 4-D x and an element-wise act or softmax over D (softmax over the sequence:
    `fwd_seq`). theta is float32 (H|1, E). `cu_seqlens`: sequences packed along N (B = 1),
    positions restart in each (`positions` is None then)."""
    if x.numel() == 0:
        return torch.empty_like(x)
    (y,) = launch.forward(x, theta, start, starts, positions, cu_seqlens, kind)
    return y


@define_op("kernelkit_lrpe_rotate::fwd_seq")
def fwd_seq(
    x: torch.Tensor,
    theta: torch.Tensor,
    start: int,
    starts: torch.Tensor | None,
    positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats) for softmax over the sequence: stats the backward reuses (with
    `cu_seqlens`, softmax over N runs over each packed sequence). A separate op: the other
    kinds return y alone (a second output costs an allocation and its autograd bookkeeping per
    call)."""
    if x.numel() == 0:
        return torch.empty_like(x), x.new_empty((0,), dtype=torch.float32)
    return launch.forward(x, theta, start, starts, positions, cu_seqlens, SEQ)


@define_op("kernelkit_lrpe_rotate::bwd")
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
    need_dtheta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dtheta float32, empty unless need_dtheta); x is None for act none without dtheta;
    `stats` fwd_seq's (softmax over the sequence), else None."""
    if dy.numel() == 0:
        return torch.empty_like(dy), torch.zeros_like(theta) if need_dtheta else theta.new_empty(
            (0, 0)
        )
    dx, partials = launch.backward(
        dy, x, theta, start, starts, positions, cu_seqlens, stats, kind, need_dtheta
    )
    # (without need_dtheta, `partials` is already the empty (0, 0) d(theta))
    return dx, (reduce_dtheta(partials, theta.shape) if need_dtheta else partials)


def _grads(ctx, dy):
    """(dx, dtheta) of `bwd`, dtheta None where not needed."""
    x, theta, starts, positions, cu_seqlens, stats = ctx.saved_tensors
    need_dtheta = ctx.needs_input_grad[1]
    dx, dtheta = bwd(
        dy, x, theta, ctx.start, starts, positions, cu_seqlens, stats, ctx.kind, need_dtheta
    )
    return dx, (dtheta if need_dtheta else None)


# the autograd node of a shortcut call that autograd records (`shortcut_key`'s last entry)
_replayed_forward = register_lrpe_autograd(fwd, fwd_seq, _grads)


# lrpe_rotate's common calls that passed its checks, by `shortcut_key`: (the recorded sequence,
# its kernel kind)
_CALLS = replay.Shortcuts()


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
        return lrpe_rotate_reference(xr, theta, where, act_r, dim_r, cu_seqlens).to(x.dtype)
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    theta32 = as_float32(theta)
    if kind == SEQ:
        y, _ = fwd_seq(x4, theta32, start, starts, table, cu_seqlens)
    else:
        y = fwd(x4, theta32, start, starts, table, cu_seqlens, kind)
    if key is not None and x4 is x and theta32 is theta:  # the call the sequence replays
        seq = launch.forward_recorded(x, theta, start, kind)
        if seq is not None:
            _CALLS.remember(key, (seq, kind))
    return y if x.dim() == 4 else y.squeeze(2)


__all__ = ["bwd", "fwd", "fwd_seq", "lrpe_rotate", "validate"]
