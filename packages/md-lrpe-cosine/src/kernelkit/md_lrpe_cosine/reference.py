"""PyTorch reference of `md_lrpe_cosine`: the test oracle (run on float64 inputs), the "torch"
benchmark provider and the CPU fallback.

Theta[t = l + s, h, k] = s_{k // E} * theta[h, k mod E] with (s_0, ..., s_{m-1}) the row-major
coordinates of cell s of the grid `shape`; 0 for the l extra tokens. Angles are float32
products of integer coordinates, as in the 1-D packages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernelkit.lrpe_core.reference import angles, grid_positions, wrap_frequencies
from kernelkit.lrpe_cosine.reference import cosine_feature_map


def md_lrpe_cosine_reference(
    x: torch.Tensor,
    theta: torch.Tensor,
    shape: Sequence[int],
    l: int = 0,
    act: str = "none",
    dim: int | None = None,
) -> torch.Tensor:
    """y = [act(x) cos(Theta), act(x) sin(Theta)] for x (B, l + prod(shape), H, D) or (B, N, D)."""
    d, e = x.shape[-1], theta.shape[-1]
    pos = grid_positions(shape, l, e, d, x.device)[None, :, None, :]
    return cosine_feature_map(
        x, lambda dtype: angles(wrap_frequencies(theta, d), pos, dtype), act, dim
    )
