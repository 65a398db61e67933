"""PyTorch reference of `lrpe_rotate`: the test oracle (run on float64 inputs) and the "torch"
benchmark provider. Device-agnostic; low-precision inputs are computed in float32 and the result
is rounded once to x's dtype, as the kernels do."""

from __future__ import annotations

import torch

from kernelkit.act.reference import act_reference


def positions(batch: int, n: int, offset, device) -> torch.Tensor:
    """Integer positions (offset_b + t), shape (B, N) for a per-batch offset tensor, else (1, N)."""
    t = torch.arange(n, device=device, dtype=torch.int64)
    if isinstance(offset, torch.Tensor):
        return offset.to(device=device, dtype=torch.int64)[:, None] + t
    return (t + int(offset))[None, :]


def full_theta(theta: torch.Tensor, half: int) -> torch.Tensor:
    """theta (rows, E) as one frequency per pair (rows, D/2): E == 1 is shared by every pair,
    1 < E < D/2 leaves pairs j >= E at frequency 0 (not rotated)."""
    rows, e = theta.shape
    if e == 1:
        return theta.expand(rows, half)
    if e < half:
        return torch.cat([theta, theta.new_zeros(rows, half - e)], dim=1)
    return theta


def angles(theta: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(offset_b + t) * theta[h, j] as (B|1, N, rows, D/2) in `dtype`.

    The value is float32(theta) * float32(position) rounded in float32, whatever `dtype`: this is
    the definition every kernel reproduces, so a float64 evaluation differs from the kernels only
    by their cos/sin and arithmetic errors. In float64 the gradient still flows through the exact
    product (theta * pos is exact in float64 for positions below 2**29).
    """
    rounded = theta.float()[None, None] * pos.float()[:, :, None, None]
    if dtype == torch.float32:
        return rounded
    exact = theta.to(dtype)[None, None] * pos.to(dtype)[:, :, None, None]
    return exact + (rounded.to(dtype) - exact).detach()


def lrpe_rotate_reference(
    x: torch.Tensor,
    theta: torch.Tensor,
    offset: int | torch.Tensor = 0,
    act: str = "none",
    dim: int | None = None,
) -> torch.Tensor:
    """y = rotate(act(x, dim), (offset + position) * theta), half-split pairing (j, j + D/2)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xa = act_reference(x.to(compute), act, dim)
    if x.dim() == 3:
        xa = xa.unsqueeze(2)
    batch, n, _, d = xa.shape
    half = d // 2
    pos = positions(batch, n, offset, x.device)
    ang = angles(full_theta(theta, half), pos, compute)
    cos, sin = torch.cos(ang), torch.sin(ang)
    x1, x2 = xa[..., :half], xa[..., half:]
    y = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    if x.dim() == 3:
        y = y.squeeze(2)
    return y.to(x.dtype)
