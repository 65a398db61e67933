"""Packed sequences: several sequences laid back to back along one axis, described by `cu_seqlens`
(int32 prefix sums (num_seqs + 1,), FlashAttention's convention). Host-side checks and the
per-row segment index, shared by every op that takes `cu_seqlens`. Imports only torch.

The values of `cu_seqlens` (first entry 0, non-decreasing, last entry = the packed length) are
checked only where that is free: a tensor on the CPU outside torch.compile tracing. Reading CUDA
values would synchronise with the device (and break CUDA-graph capture), so there, as in
FlashAttention, they are the caller's contract.
"""

from __future__ import annotations

from itertools import pairwise

import torch

__all__ = ["check_cu_seqlens", "segment_ids"]


def check_cu_seqlens(
    cu_seqlens, total: int, device: torch.device, *, name: str = "cu_seqlens", what: str = "rows"
) -> list[int] | None:
    """Check `cu_seqlens` for a packed axis of length `total` on `device` (errors name `name`
    and call the packed entries `what`). Returns the lengths when the values were read (CPU),
    else None."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name}: dtype must be torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"{name}: expected shape (num_seqs + 1,) with num_seqs >= 1, "
            f"got {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"{name}: on device {cu_seqlens.device}, but the input is on {device}")
    if cu_seqlens.stride(0) != 1:  # the kernels read entry i at cu_seqlens + i
        raise ValueError(f"{name}: must be contiguous, got stride {cu_seqlens.stride(0)}")
    if cu_seqlens.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    c = cu_seqlens.tolist()
    if c[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {c[0]}")
    lengths = [b - a for a, b in pairwise(c)]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(
                f"{name}: must be non-decreasing, entry {i + 1} is {c[i + 1]} < {c[i]}"
            )
    if c[-1] != total:
        raise ValueError(f"{name}: last entry {c[-1]} must equal the number of {what} {total}")
    return lengths


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int32 (total,): the sequence each packed row belongs to. No host synchronisation:
    `total` sizes the result."""
    seqs = torch.arange(cu_seqlens.shape[0] - 1, device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(seqs, cu_seqlens.diff(), output_size=total)
