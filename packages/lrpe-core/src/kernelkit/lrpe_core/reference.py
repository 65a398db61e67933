"""Reference side of the LRPE positional code: integer positions, per-slot frequencies and the
float32 angles every LRPE kernel reproduces. Device-agnostic PyTorch.

One naming across the packages:
  * positions: int64 token positions, (B|1, N) for a sequence, (N, D) per feature for a grid;
  * frequencies: theta expanded to one float per slot (a rotated pair or a cosine feature);
  * angles: float32(frequency) * float32(position), the value the kernels compute. Evaluated in
    float64 (the test oracle) the value stays that float32 product and only its gradient is
    float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "angles",
    "grid_positions",
    "packed_positions",
    "sequence_positions",
    "slot_frequencies",
    "wrap_frequencies",
]


def sequence_positions(offset: int | torch.Tensor, n: int, device) -> torch.Tensor:
    """Positions of n tokens starting at `offset`: (1, N) for an int, (B, N) for a per-batch
    tensor (B,) of starts, or the (B|1, N) integer `offset` table itself when it is 2-D."""
    if isinstance(offset, torch.Tensor):
        offset = offset.to(device=device, dtype=torch.int64)
        if offset.dim() == 2:
            return offset
        return offset[:, None] + torch.arange(n, device=device, dtype=torch.int64)
    return torch.arange(n, device=device, dtype=torch.int64)[None, :] + offset


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(1, total) positions of sequences packed back to back (prefix sums `cu_seqlens`):
    every sequence restarts at 0. No host synchronisation: `total` sizes the result."""
    cu = cu_seqlens.to(torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu.diff(), output_size=total)
    return (torch.arange(total, device=cu.device) - starts)[None, :]


def grid_positions(shape: Sequence[int], extra: int, e: int, d: int, device) -> torch.Tensor:
    """(N, D) int64 position of feature k of token t on a row-major grid `shape` (last axis
    fastest) behind `extra` leading tokens: the coordinate of cell t - extra along axis k // e;
    0 for the extra tokens."""
    cells = math.prod(shape)
    coords = torch.stack(
        torch.unravel_index(torch.arange(cells, device=device), tuple(shape)), dim=-1
    )  # (cells, m)
    axis = torch.arange(d, device=device) // e
    per_feature = coords[:, axis]  # (cells, D)
    return F.pad(per_feature, (0, 0, extra, 0))


def slot_frequencies(theta: torch.Tensor, slots: int) -> torch.Tensor:
    """theta (rows, E) as one frequency per slot (rows, slots): E == slots as is, E == 1 shared by
    every slot, 1 < E < slots zero (angle 0: passed through) for the slots j >= E."""
    e = theta.shape[-1]
    if e == slots:
        return theta
    if e == 1:
        return theta.expand(-1, slots)
    return F.pad(theta, (0, slots - e))


def wrap_frequencies(theta: torch.Tensor, d: int) -> torch.Tensor:
    """theta (rows, E) as the frequency of each of d features on a grid: theta[:, k mod E]."""
    return theta[:, torch.arange(d, device=theta.device) % theta.shape[-1]]


def angles(freqs: torch.Tensor, pos: torch.Tensor, math_dtype: torch.dtype) -> torch.Tensor:
    """Angles (B|1, N, rows, slots): float32(freqs) * float32(pos) for frequencies `freqs`
    (rows, slots) and integer positions `pos` broadcastable to that shape -- (B|1, N, 1, 1) per
    token, (1, N, 1, slots) per feature. The value is the float32 product whatever
    `math_dtype`; only the gradient (w.r.t. freqs) is computed in `math_dtype`."""
    exact = freqs.float()[None, None] * pos.float()
    if math_dtype == torch.float32:
        return exact
    lin = freqs.to(math_dtype)[None, None] * pos.to(math_dtype)
    return lin + (exact.to(math_dtype) - lin).detach()
