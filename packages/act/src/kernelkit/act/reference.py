"""PyTorch reference of `act`: the test oracle (run on float64 inputs) and the "torch" benchmark
provider. PyTorch's half-precision kernels compute these in float32 internally."""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F


def act_reference(
    x: torch.Tensor,
    act: str = "none",
    dim: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    if act == "none":
        return x
    if act == "relu":
        return F.relu(x)
    if act == "sigmoid":
        return torch.sigmoid(x)
    if act == "silu":
        return F.silu(x)
    if act == "softmax":
        return softmax_reference(x, dim, cu_seqlens)
    raise ValueError(f"act: unknown activation {act!r}")


def act_grad_reference(x: torch.Tensor, dy: torch.Tensor, act: str) -> torch.Tensor:
    """dx of act_reference(x, act) for the elementwise activations, in closed form (no autograd:
    torch.compile traces it inside an op, as the CPU fallback's backward), computed in float32
    (float64 inputs: float64) and returned in x's dtype."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, g = x.to(ct), dy.to(ct)
    if act == "none":
        dx = g
    elif act == "relu":
        dx = torch.where(xf > 0, g, torch.zeros_like(g))
    elif act == "sigmoid":
        s = torch.sigmoid(xf)
        dx = g * s * (1 - s)
    elif act == "silu":  # d/dx x s(x) = s (1 + x (1 - s))
        s = torch.sigmoid(xf)
        dx = g * s * (1 + xf * (1 - s))
    else:
        raise ValueError(f"act: no elementwise gradient for {act!r}")
    return dx.to(x.dtype)


def _segments(t: torch.Tensor, dim: int, cu_seqlens: torch.Tensor):
    """The slices of t along `dim` of the sequences packed there (reads cu_seqlens' values)."""
    bounds = cu_seqlens.tolist()
    return [t.narrow(dim, a, b - a) for a, b in pairwise(bounds)]


def softmax_reference(
    x: torch.Tensor, dim: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax over `dim`, or over each sequence packed along `dim` (int32 prefix sums
    `cu_seqlens`), one torch.softmax per sequence."""
    if cu_seqlens is None:
        return torch.softmax(x, dim)
    return torch.cat([torch.softmax(part, dim) for part in _segments(x, dim, cu_seqlens)], dim)


def softmax_grad_reference(
    y: torch.Tensor, dy: torch.Tensor, dim: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """dx of softmax_reference from its output y: y * (dy - sum(y * dy)) per sequence."""
    if cu_seqlens is None:
        return torch._softmax_backward_data(dy, y, dim, y.dtype)
    parts = zip(_segments(y, dim, cu_seqlens), _segments(dy, dim, cu_seqlens))
    return torch.cat([yy * (gg - (yy * gg).sum(dim, keepdim=True)) for yy, gg in parts], dim)
