"""PyTorch reference of `lrpe_cosine`: the test oracle (run on float64 inputs), the "torch"
benchmark provider and the CPU fallback.

Math runs in float32 (float64 when x is float64), the output is rounded once to x's dtype. The
angle is always the float32 product float32(theta) * float32(integer position), the value the
kernels compute; the float64 oracle keeps that value but differentiates it in float64.
"""

from __future__ import annotations

import torch

from kernelkit.act.reference import act_reference
from kernelkit.lrpe_core.reference import angles, sequence_positions, slot_frequencies


def cosine_feature_map(
    x: torch.Tensor, theta_angles_of, act: str, dim: int | None, cu_seqlens=None
):
    """[act(x) cos(Theta), act(x) sin(Theta)] for x (B, N, H, D) or (B, N, D), with
    `theta_angles_of(math_dtype)` giving Theta broadcastable to (B, N, H, D) (4-D); softmax
    over N runs over each sequence packed along N with `cu_seqlens`."""
    three_d = x.dim() == 3
    x4 = x.unsqueeze(2) if three_d else x
    math_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    packed = None
    if act == "softmax":
        dim = 1 if dim % x.dim() == 1 else -1
        packed = cu_seqlens if dim == 1 else None
    xbar = act_reference(x4.to(math_dtype), act, dim, packed)
    ang = theta_angles_of(math_dtype)
    y = torch.cat([xbar * torch.cos(ang), xbar * torch.sin(ang)], dim=-1).to(x.dtype)
    return y.squeeze(2) if three_d else y


def lrpe_cosine_reference(
    x: torch.Tensor,
    theta: torch.Tensor,
    offset: int | torch.Tensor = 0,
    act: str = "none",
    dim: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = [act(x) cos(Theta), act(x) sin(Theta)] for x (B, N, H, D) or (B, N, D); `offset`: an
    int start, a (B,) tensor of per-row starts or a (B|1, N) table of positions. With
    `cu_seqlens` (B = 1, sequences packed along N) softmax over N runs per sequence (pass
    the packed positions as `offset`)."""
    n, d = x.shape[1], x.shape[-1]
    pos = sequence_positions(offset, n, x.device)[:, :, None, None]
    return cosine_feature_map(
        x, lambda dtype: angles(slot_frequencies(theta, d), pos, dtype), act, dim, cu_seqlens
    )
