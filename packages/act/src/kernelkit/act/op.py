"""Validation, torch.library registration, autograd and the public function of `act`; the
launch plans are in launchers.py."""

from __future__ import annotations

import torch

from kernelkit.shared.packed import check_cu_seqlens
from kernelkit.shared.runtime import define_op, interpreting, traced, use_triton

from . import kernels as K
from .launchers import MAX_PACKED_SEQUENCES, run_elementwise, run_softmax_bwd, run_softmax_fwd
from .reference import (
    act_grad_reference,
    act_reference,
    softmax_grad_reference,
    softmax_reference,
)

ACTS = ("none", "relu", "sigmoid", "silu", "softmax")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def validate(x, act: str, dim: int | None, cu_seqlens=None) -> int | None:
    """Check the arguments of `act`; returns `dim` normalised to be non-negative."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x: dtype must be float32, float16 or bfloat16, got {x.dtype}")
    if act not in ACTS:
        raise ValueError(f"act: must be one of {ACTS}, got {act!r}")
    if act != "softmax":
        if dim is not None:
            raise ValueError(f"dim: only softmax takes a dim, got dim={dim} with act={act!r}")
        if cu_seqlens is not None:
            raise ValueError(f"cu_seqlens: only softmax takes packed sequences, got act={act!r}")
        return None
    if dim is None:
        raise ValueError("dim: softmax needs the dimension to normalise over (e.g. dim=-1)")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dim: expected an int, got {type(dim).__name__}")
    nd = x.dim()
    if nd == 0:
        raise ValueError("x: softmax needs at least one dimension")
    if not -nd <= dim < nd:
        raise ValueError(f"dim: {dim} is out of range for x with {nd} dimensions")
    dim %= nd
    if x.size(dim) == 0:
        raise ValueError(f"dim: softmax over dimension {dim} of size 0 is undefined")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, x.size(dim), x.device, what=f"entries along dim {dim}")
        if cu_seqlens.shape[0] - 1 > MAX_PACKED_SEQUENCES:
            raise ValueError(
                f"cu_seqlens: at most {MAX_PACKED_SEQUENCES} packed sequences, got {cu_seqlens.shape[0] - 1}"
            )
    return dim


# ---------------------------------------------------------------------------------------------
# Registered ops
# ---------------------------------------------------------------------------------------------


@define_op("kernelkit_act::act_fwd")
def act_fwd(x: torch.Tensor, act: str) -> torch.Tensor:
    if not use_triton(x):
        y = act_reference(x, act)
        return y.clone() if y is x else y
    return run_elementwise(K.act_fwd_kernel, torch.empty_like(x), x, act=act)


@define_op("kernelkit_act::act_bwd")
def act_bwd(x: torch.Tensor, dy: torch.Tensor, act: str) -> torch.Tensor:
    if not use_triton(x):
        return act_grad_reference(x, dy, act)  # closed form: torch.compile traces this body
    return run_elementwise(K.act_bwd_kernel, torch.empty_like(x), x, dy, act=act)


# The CPU reference of a softmax over packed sequences slices x at cu_seqlens' values: shapes
# that depend on data, which torch.compile cannot trace. A traced call on that path goes to the
# op's opaque twin (`define_op`'s `fake`), which runs this same function on real tensors. Every
# other path stays visible to torch.compile (the Triton kernels, the plain reference).


def _softmax_fwd_fake(x, dim, cu_seqlens=None):
    return torch.empty_like(x)


def _softmax_bwd_fake(y, dy, dim, cu_seqlens=None):
    return torch.empty_like(y)


def _opaque(x: torch.Tensor, cu_seqlens) -> bool:
    """Whether a call goes to the opaque twin: traced, on the CPU reference, packed."""
    return cu_seqlens is not None and traced(x) and not use_triton(x)


@define_op("kernelkit_act::softmax_fwd", fake=_softmax_fwd_fake)
def softmax_fwd(x: torch.Tensor, dim: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    if not use_triton(x):
        if _opaque(x, cu_seqlens):
            return softmax_fwd.opaque(x, dim, cu_seqlens)
        return softmax_reference(x, dim, cu_seqlens)
    return run_softmax_fwd(x, dim, cu_seqlens)


@define_op("kernelkit_act::softmax_bwd", fake=_softmax_bwd_fake)
def softmax_bwd(
    y: torch.Tensor, dy: torch.Tensor, dim: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    if not use_triton(y):
        if _opaque(y, cu_seqlens):
            return softmax_bwd.opaque(y, dy, dim, cu_seqlens)
        return softmax_grad_reference(y, dy, dim, cu_seqlens)
    return run_softmax_bwd(y, dy, dim, cu_seqlens)


def _act_setup(ctx, inputs, output):
    x, act = inputs
    ctx.act = act
    ctx.save_for_backward(x)


def _act_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return act_bwd(x, dy, ctx.act), None


def _softmax_setup(ctx, inputs, output):
    _, dim, cu_seqlens = inputs
    ctx.dim = dim
    ctx.save_for_backward(output, cu_seqlens)


def _softmax_backward(ctx, dy):
    y, cu_seqlens = ctx.saved_tensors
    return softmax_bwd(y, dy, ctx.dim, cu_seqlens), None, None


act_fwd.register_autograd(_act_backward, setup_context=_act_setup)
softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)


def act(
    x: torch.Tensor,
    act: str = "none",
    dim: int | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply `act` ("none", "relu", "sigmoid", "silu", "softmax") to x; softmax needs `dim`.

    Any shape, any strides, float32/float16/bfloat16; math in float32, output in x's dtype.
    `act="none"` returns x itself (an alias, no copy and no kernel).

    `cu_seqlens` (softmax only): sequences packed back to back along `dim`, as int32 prefix sums
    (num_seqs + 1,) on x's device (first entry 0, non-decreasing, last entry x.size(dim)); the
    softmax then runs over each sequence on its own. Its values are checked for CPU tensors
    only (reading device values would synchronise): on a GPU they are the caller's contract.
    """
    dim = validate(x, act, dim, cu_seqlens)
    if act == "none":
        return x
    if act == "softmax":
        return softmax_fwd(x, dim, cu_seqlens)
    return act_fwd(x, act)


__all__ = [
    "ACTS",
    "act",
    "act_bwd",
    "act_fwd",
    "interpreting",
    "softmax_bwd",
    "softmax_fwd",
]
