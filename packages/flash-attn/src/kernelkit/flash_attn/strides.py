"""Host helpers of every launch: the kernels' stride arguments by name, and Triton's scratch
allocator for the TMA descriptors the kernels build."""

from __future__ import annotations

import functools

import torch
import triton


def unit_d(t: torch.Tensor) -> torch.Tensor:
    """The kernels read D with unit stride; any other layout of the last dim is copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def strides(name: str, t: torch.Tensor, packed: bool = False) -> dict[str, int]:
    """{stride_<name>b, stride_<name>n, stride_<name>h} of a (B, N, H, D) tensor; for a packed
    (total, H, D) one the batch stride is 0: each sequence's programs start at its own row."""
    if packed:
        return {
            f"stride_{name}b": 0,
            f"stride_{name}n": t.stride(0),
            f"stride_{name}h": t.stride(1),
        }
    return {f"stride_{name}b": t.stride(0), f"stride_{name}n": t.stride(1),
            f"stride_{name}h": t.stride(2)}  # fmt: skip


def tma_strides(name: str, t: torch.Tensor) -> dict[str, int]:
    """`strides` for a TMA descriptor over the whole (B, N, H, D) tensor: a dim of size 1 is never
    stepped (its coordinate is 0) and `config.use_tma` does not check its stride, which may then
    be anything (a slice, an unsqueeze): a 16-byte stand-in, as the copy engine requires."""
    st = [s if n > 1 else 16 // t.element_size() for s, n in zip(t.stride()[:3], t.shape)]
    return {f"stride_{name}b": st[0], f"stride_{name}n": st[1], f"stride_{name}h": st[2]}


@functools.cache
def _tma_scratch(device: torch.device):
    """Allocator (triton.set_allocator) of the global memory in which the kernels build their
    descriptors on `device`; torch.compile's launcher installs its own."""

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    return alloc


def tma_allocator(ops, device: torch.device) -> None:
    """Install the scratch allocator TMA launches need in this thread (a context variable: set
    in every thread that launches, autograd's backward thread included), and again before each
    replay of the launches (`ops.on_replay`)."""
    if device.type == "cuda":
        triton.set_allocator(_tma_scratch(device))
        ops.on_replay(functools.partial(triton.set_allocator, _tma_scratch(device)))
