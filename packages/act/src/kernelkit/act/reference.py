"""PyTorch reference of `act`: the test oracle (run on float64 inputs) and the "torch" benchmark
provider. PyTorch's half-precision kernels compute these in float32 internally."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def act_reference(x: torch.Tensor, act: str = "none", dim: int | None = None) -> torch.Tensor:
    if act == "none":
        return x
    if act == "relu":
        return F.relu(x)
    if act == "sigmoid":
        return torch.sigmoid(x)
    if act == "silu":
        return F.silu(x)
    if act == "softmax":
        return torch.softmax(x, dim=dim)
    raise ValueError(f"act: unknown activation {act!r}")
