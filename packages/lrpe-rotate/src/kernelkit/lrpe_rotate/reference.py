"""PyTorch reference of `lrpe_rotate`: the test oracle (run on float64 inputs), the "torch"
benchmark provider and the CPU fallback. Device-agnostic; low-precision inputs are computed in
float32 and the result is rounded once to x's dtype, as the kernels do."""

from __future__ import annotations

import torch

from kernelkit.act.reference import act_reference
from kernelkit.lrpe_core.reference import angles, sequence_positions, slot_frequencies


def lrpe_rotate_reference(
    x: torch.Tensor,
    theta: torch.Tensor,
    offset: int | torch.Tensor = 0,
    act: str = "none",
    dim: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = rotate(act(x, dim), position * theta), half-split pairing (j, j + D/2). `offset`: an
    int start, a (B,) tensor of per-row starts or a (B|1, N) table of positions. With
    `cu_seqlens` (B = 1, sequences packed along N) softmax over N runs per sequence (pass
    the packed positions as `offset`)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    over_n = act == "softmax" and dim % x.dim() == 1
    xa = act_reference(x.to(compute), act, dim, cu_seqlens if over_n else None)
    if x.dim() == 3:
        xa = xa.unsqueeze(2)
    n, d = xa.shape[1], xa.shape[3]
    half = d // 2
    pos = sequence_positions(offset, n, x.device)[:, :, None, None]
    ang = angles(slot_frequencies(theta, half), pos, compute)
    cos, sin = torch.cos(ang), torch.sin(ang)
    x1, x2 = xa[..., :half], xa[..., half:]
    y = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    if x.dim() == 3:
        y = y.squeeze(2)
    return y.to(x.dtype)
