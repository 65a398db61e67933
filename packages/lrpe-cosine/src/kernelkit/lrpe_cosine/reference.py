"""PyTorch reference of `lrpe_cosine`: the test oracle (run on float64 inputs) and the "torch"
benchmark provider.

Math runs in float32 (float64 when x is float64), the output is rounded once to x's dtype. The
angle is always the float32 product float32(theta) * float32(integer position), the value the
kernels compute; the float64 oracle keeps that value but differentiates it in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernelkit.act.reference import act_reference


def positions(offset: int | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """Integer positions (int64) of the n tokens: shape (1, n) for an int offset, (B, n) for a
    per-batch offset tensor of shape (B,)."""
    t = torch.arange(n, device=device, dtype=torch.int64)
    if isinstance(offset, torch.Tensor):
        return offset.to(device=device, dtype=torch.int64)[:, None] + t
    return (t + offset)[None, :]


def feature_frequencies(theta: torch.Tensor, d: int) -> torch.Tensor:
    """(rows, D) frequency of every feature: E == D as is, E == 1 shared by all features of a
    head, 1 < E < D zero (angle 0) for the features k >= E."""
    e = theta.shape[-1]
    if e == d:
        return theta
    if e == 1:
        return theta.expand(-1, d)
    return F.pad(theta, (0, d - e))


def angles(freqs: torch.Tensor, pos: torch.Tensor, math_dtype: torch.dtype) -> torch.Tensor:
    """Theta[b, t, h, k] = float32(freqs[h, k]) * float32(pos[b, t]), shape (B|1, N, rows, D)."""
    exact = freqs.float()[None, None] * pos.float()[:, :, None, None]
    if math_dtype == torch.float32:
        return exact
    # Same value as the float32 product, but its gradient is computed in `math_dtype`.
    lin = freqs.to(math_dtype)[None, None] * pos.to(math_dtype)[:, :, None, None]
    return lin + (exact.to(math_dtype) - lin).detach()


def lrpe_cosine_reference(
    x: torch.Tensor,
    theta: torch.Tensor,
    offset: int | torch.Tensor = 0,
    act: str = "none",
    dim: int | None = None,
) -> torch.Tensor:
    """y = [act(x) cos(Theta), act(x) sin(Theta)] for x (B, N, H, D) or (B, N, D)."""
    three_d = x.dim() == 3
    x4 = x.unsqueeze(2) if three_d else x
    n, d = x4.shape[1], x4.shape[3]
    math_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if act == "softmax":
        dim = 1 if dim % x.dim() == 1 else -1
    xbar = act_reference(x4.to(math_dtype), act, dim)
    theta_angles = angles(feature_frequencies(theta, d), positions(offset, n, x.device), math_dtype)
    y = torch.cat([xbar * torch.cos(theta_angles), xbar * torch.sin(theta_angles)], dim=-1)
    y = y.to(x.dtype)
    return y.squeeze(2) if three_d else y
