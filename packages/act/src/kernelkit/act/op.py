"""Validation, torch.library registration, autograd and the public function of `act`; the
launch plans are in launchers.py.

The fallback convention of every kernelkit op: the public function (`act`) validates, then
`if not use_triton(x):` returns the PyTorch reference (traced inline by torch.compile; the one
reference whose shapes depend on data, a softmax over packed sequences, goes through ops of
`define_opaque_op`, which torch.compile calls as they are), and otherwise calls the registered
ops (`act_fwd`, `softmax_fwd` and their backwards), which only launch the Triton kernels."""

from __future__ import annotations

import torch

from kernelkit.shared.packed import check_cu_seqlens
from kernelkit.shared.runtime import define_op, define_opaque_op, interpreting, use_triton

from . import kernels as K
from .launchers import MAX_PACKED_SEQUENCES, run_elementwise, run_softmax_bwd, run_softmax_fwd
from .reference import act_reference, softmax_grad_reference, softmax_reference

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
    # (an exact int first: the common case, one check instead of two isinstance calls)
    if dim.__class__ is not int and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise ValueError(f"dim: expected an int, got {type(dim).__name__}")
    nd = x.dim()
    if nd == 0:
        raise ValueError("x: softmax needs at least one dimension")
    if not -nd <= dim < nd:
        raise ValueError(f"dim: {dim} is out of range for x with {nd} dimensions")
    dim %= nd
    # (x.size(dim) parses its argument: ask only when x is empty, else no dim has size 0)
    if x.numel() == 0 and x.size(dim) == 0:
        raise ValueError(f"dim: softmax over dimension {dim} of size 0 is undefined")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, x.size(dim), x.device, what=f"entries along dim {dim}")
        if cu_seqlens.shape[0] - 1 > MAX_PACKED_SEQUENCES:
            raise ValueError(
                f"cu_seqlens: at most {MAX_PACKED_SEQUENCES} packed sequences, got {cu_seqlens.shape[0] - 1}"
            )
    return dim


# ---------------------------------------------------------------------------------------------
# Registered ops: the Triton kernels only (the public function `act` takes the PyTorch
# reference where `use_triton` says no)
# ---------------------------------------------------------------------------------------------


@define_op("kernelkit_act::act_fwd")
def act_fwd(x: torch.Tensor, act: str) -> torch.Tensor:
    return run_elementwise(K.act_fwd_kernel, torch.empty_like(x), x, act=act)


@define_op("kernelkit_act::act_bwd")
def act_bwd(x: torch.Tensor, dy: torch.Tensor, act: str) -> torch.Tensor:
    return run_elementwise(K.act_bwd_kernel, torch.empty_like(x), x, dy, act=act)


@define_op("kernelkit_act::softmax_fwd")
def softmax_fwd(x: torch.Tensor, dim: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    return run_softmax_fwd(x, dim, cu_seqlens)


@define_op("kernelkit_act::softmax_bwd")
def softmax_bwd(
    y: torch.Tensor, dy: torch.Tensor, dim: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    return run_softmax_bwd(y, dy, dim, cu_seqlens)


# ---------------------------------------------------------------------------------------------
# The PyTorch reference of a softmax over packed sequences (tensors `use_triton` turns down)
# ---------------------------------------------------------------------------------------------
# It slices x at cu_seqlens' values: shapes that depend on data, which torch.compile cannot
# trace. These ops (`define_opaque_op`) are called as they are by torch.compile; every other
# reference path is traced inline.


def _like_first(t, *args):
    return torch.empty_like(t)


@define_opaque_op("kernelkit_act::softmax_packed_reference", fake=_like_first)
def softmax_packed_reference(x: torch.Tensor, dim: int, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return softmax_reference(x, dim, cu_seqlens)


@define_opaque_op("kernelkit_act::softmax_packed_grad_reference", fake=_like_first)
def softmax_packed_grad_reference(
    y: torch.Tensor, dy: torch.Tensor, dim: int, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    return softmax_grad_reference(y, dy, dim, cu_seqlens)


def _reference(x: torch.Tensor, act: str, dim: int | None, cu_seqlens) -> torch.Tensor:
    """`act` on tensors the Triton kernels do not take (CPU tensors without the interpreter):
    the PyTorch reference, differentiable through torch's autograd (packed: the opaque ops)."""
    if cu_seqlens is not None:
        return softmax_packed_reference(x, dim, cu_seqlens)
    return act_reference(x, act, dim)


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


def _packed_reference_backward(ctx, dy):
    y, cu_seqlens = ctx.saved_tensors
    return softmax_packed_grad_reference(y, dy, ctx.dim, cu_seqlens), None, None


act_fwd.register_autograd(_act_backward, setup_context=_act_setup)
softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)
softmax_packed_reference.register_autograd(_packed_reference_backward, setup_context=_softmax_setup)


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
    if not use_triton(x):
        return _reference(x, act, dim, cu_seqlens)
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
    "softmax_packed_grad_reference",
    "softmax_packed_reference",
]
