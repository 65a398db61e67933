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
