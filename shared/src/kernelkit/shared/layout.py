"""Stride bookkeeping shared by kernels that read tensors in place instead of copying them."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["collapse_dims", "is_dense"]


def collapse_dims(
    shape: Sequence[int], *strides: Sequence[int]
) -> tuple[list[int], list[list[int]]]:
    """Merge adjacent dimensions that every tensor can address with a single stride.

    All tensors share `shape`; each has its own `strides`. Size-1 dimensions are dropped.
    Returns the collapsed shape and, per tensor, the collapsed strides (outermost first).
    A fully contiguous tensor collapses to one dimension of stride 1.
    """
    dims = [i for i, s in enumerate(shape) if s != 1]
    out_shape: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for i in dims:
        mergeable = bool(out_shape) and all(
            ts[-1] == st[i] * shape[i] for ts, st in zip(out_strides, strides)
        )
        if mergeable:
            out_shape[-1] *= shape[i]
            for ts, st in zip(out_strides, strides):
                ts[-1] = st[i]
        else:
            out_shape.append(shape[i])
            for ts, st in zip(out_strides, strides):
                ts.append(st[i])
    if not out_shape:
        return [1], [[1] for _ in strides]
    return out_shape, out_strides


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when the elements exactly tile a contiguous block of storage (any dim order)."""
    dims = sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True
