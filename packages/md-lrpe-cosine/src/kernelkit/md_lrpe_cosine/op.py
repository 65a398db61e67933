"""Validation, torch.library registration and autograd of `md_lrpe_cosine`. The kernels are
kernelkit-lrpe-cosine's, launched with grid positions (`kernelkit.lrpe_cosine.kernels.Grid`);
the registered ops only launch. Two forward ops: `fwd_plain` (y alone) for the common call (an
element-wise act or softmax over D, no angle cache), `fwd` (y, stats, angles) for softmax over
the tokens or the angle cache: outputs that are always empty cost an allocation each and their
autograd bookkeeping per call."""

from __future__ import annotations

import functools
import math

import torch

from kernelkit.lrpe_core.op import (
    SEQ,
    as_float32,
    reduce_dtheta,
    shortcut_key,
    validate_act,
    validate_theta,
    validate_x,
)
from kernelkit.lrpe_cosine import kernels as K
from kernelkit.lrpe_cosine import launch
from kernelkit.shared import replay
from kernelkit.shared.runtime import define_op, function_apply, traced, use_triton

from .reference import md_lrpe_cosine_reference

MAX_AXES = 4
_SEQUENCE = (0, None, None)  # (start, starts, table): unused with a grid


def _is_int(v) -> bool:
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def validate(x, theta, shape, l, act, dim, cache) -> tuple[str, tuple[int, ...]]:
    """Check the arguments of `md_lrpe_cosine`; returns (kernel kind, shape as a tuple).
    (Written for the common call: plain ints and a tuple are checked by class first.)"""
    validate_x(x)
    if shape.__class__ is tuple:
        grid = shape
    elif isinstance(shape, (tuple, list, torch.Size)):
        grid = tuple(shape)
    else:
        raise ValueError(f"shape: expected a tuple of ints (the grid), got {shape!r}")
    for s in grid:
        if s.__class__ is not int and not _is_int(s):
            raise ValueError(f"shape: expected a tuple of ints (the grid), got {shape!r}")
    m = len(grid)
    if not 1 <= m <= MAX_AXES:
        raise ValueError(f"shape: expected 1 to {MAX_AXES} axes, got {m}: {grid}")
    if min(grid) < 1:
        raise ValueError(f"shape: every side must be positive, got {grid}")
    if (l.__class__ is not int and not _is_int(l)) or l < 0:
        raise ValueError(f"l: expected a non-negative int (extra leading tokens), got {l!r}")
    n, tokens = x.shape[1], math.prod(grid)
    if n != l + tokens:
        raise ValueError(
            f"x: N = {n} tokens, expected l + prod(shape) = {l} + {tokens} = {l + tokens}"
        )
    e = validate_theta(x, theta)
    d = x.shape[-1]
    if e * m < d:
        raise ValueError(
            f"theta: E = {e} frequencies per axis cover E * m = {e * m} < D = {d} "
            f"features of a {m}-axis grid (need E >= ceil(D / m) = {-(-d // m)})"
        )
    if not isinstance(cache, bool):
        raise ValueError(f"cache: expected a bool, got {cache!r}")
    return validate_act(x, act, dim), grid


@functools.lru_cache(maxsize=1024)
def _grid_of(shape: tuple[int, ...], extra: int, e: int) -> K.Grid:
    return K.Grid(shape, extra, e)


def _grid(theta, shape, extra) -> K.Grid:
    """The launch's Grid, one object per (shape, extra, E) in eager calls: the replay key
    compares it by identity first (a new dataclass costs its __init__ and a Python __eq__ per
    lookup). Traced calls (sizes may be symbolic, and are not replayed) make their own."""
    if traced(theta):
        return K.Grid(tuple(shape), extra, theta.shape[1])
    return _grid_of(tuple(shape), extra, theta.shape[1])


@define_op("kernelkit_md_lrpe_cosine::fwd_plain")
def fwd_plain(
    x: torch.Tensor, theta: torch.Tensor, shape: list[int], extra: int, kind: str
) -> torch.Tensor:
    """y (B, N, H, 2D) for an element-wise act or softmax over D without the angle cache (`fwd`
    for softmax over the tokens or the cache)."""
    if x.numel() == 0:
        b, n, heads, d = x.shape
        return x.new_empty((b, n, heads, 2 * d))
    (y,) = launch.forward(x, theta, *_SEQUENCE, None, kind, grid=_grid(theta, shape, extra))
    return y


@define_op("kernelkit_md_lrpe_cosine::fwd")
def fwd(
    x: torch.Tensor, theta: torch.Tensor, shape: list[int], extra: int, kind: str, cache: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (B, N, H, 2D), stats, angles): softmax-over-N chunk stats (else empty) and, with
    `cache`, the float32 angle table (N, H, D) the backward reads (else empty)."""
    b, n, heads, d = x.shape
    if x.numel() == 0:
        stats = x.new_empty((0,), dtype=torch.float32)
        angles = x.new_empty((n, heads, d) if cache else (0,), dtype=torch.float32)
        return x.new_empty((b, n, heads, 2 * d)), stats, angles
    grid = _grid(theta, shape, extra)
    return launch.forward(x, theta, *_SEQUENCE, None, kind, grid=grid, cache=cache)


@define_op("kernelkit_md_lrpe_cosine::bwd")
def bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    theta: torch.Tensor,
    shape: list[int],
    extra: int,
    stats: torch.Tensor | None,
    angles: torch.Tensor | None,
    kind: str,
    need_dx: bool,
    need_dtheta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dtheta float32); each is an empty tensor when not needed. x is None for act none
    without dtheta; `stats` and `angles` are `fwd`'s (empty where not made) or None
    (`fwd_plain`)."""
    if dy.numel() == 0:
        b, n, heads, d2 = dy.shape
        dx = dy.new_zeros((b, n, heads, d2 // 2)) if need_dx else dy.new_empty((0,))
        return dx, (torch.zeros_like(theta) if need_dtheta else theta.new_empty((0, 0)))
    dx, partials = launch.backward(
        dy, x, theta, *_SEQUENCE, None, stats, kind, need_dx=need_dx, need_dtheta=need_dtheta,
        grid=_grid(theta, shape, extra),
        angles=angles if angles is not None and angles.numel() else None,
    )  # fmt: skip
    # (without need_dtheta, `partials` is already the empty (0, 0) d(theta))
    return dx, (reduce_dtheta(partials, theta.shape, wrap=True) if need_dtheta else partials)


def _save(ctx, x, theta, shape, extra, kind, *tensors):
    ctx.kind, ctx.shape, ctx.extra = kind, shape, extra
    keep_x = kind != "none" or ctx.needs_input_grad[1]
    ctx.save_for_backward(x if keep_x else None, theta, *tensors)


def _grads(ctx, dy, x, theta, stats=None, angles=None):
    """The autograd outputs for x and theta."""
    need_dx, need_dtheta = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dtheta = bwd(
        dy, x, theta, ctx.shape, ctx.extra, stats, angles, ctx.kind, need_dx, need_dtheta
    )
    return (dx if need_dx else None), (dtheta if need_dtheta else None)


def _setup_context(ctx, inputs, output):
    x, theta, shape, extra, kind, _cache = inputs
    ctx.set_materialize_grads(False)  # no zeros for the stats' and angles' gradients
    _save(ctx, x, theta, shape, extra, kind, output[1], output[2])


def _backward(ctx, dy, _dstats, _dangles):
    if dy is None:  # only the stats or angles (internal: not propagated) got a gradient
        return None, None, None, None, None, None
    return *_grads(ctx, dy, *ctx.saved_tensors), None, None, None, None


def _setup_plain(ctx, inputs, output):
    _save(ctx, *inputs)


def _backward_plain(ctx, dy):
    return *_grads(ctx, dy, *ctx.saved_tensors), None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
fwd_plain.register_autograd(_backward_plain, setup_context=_setup_plain)


class _ReplayedForward(torch.autograd.Function):
    """The autograd node of a shortcut call that autograd records: the kept sequence of `fwd`
    or `fwd_plain` (`entry` = (sequence, kind, shape as a list, l, whether it is `fwd`'s)), the
    same saved tensors and backward as their own nodes."""

    @staticmethod
    def forward(ctx, x, theta, entry):
        seq, kind, shape, extra, full = entry
        outputs = seq((x, theta, 0, None, None, None))
        _save(ctx, x, theta, shape, extra, kind, *(outputs[1:] if full else ()))
        return outputs[0]

    @staticmethod
    def backward(ctx, dy):
        return *_grads(ctx, dy, *ctx.saved_tensors), None


# (functorch transforms take the checked path: `shortcut_key`)
_replayed_forward = function_apply(_ReplayedForward)
# md_lrpe_cosine's common calls that passed its checks, by `_call_key`: the entry above
_CALLS = replay.Shortcuts()


def _call_key(x, theta, shape, l, act, dim, cache) -> tuple | None:
    """The key of an `md_lrpe_cosine` call in `_CALLS`: lrpe-core's `shortcut_key` of (x, theta,
    act, dim) (layouts, act, dim, the launch function, the interpreter, no tracing or functorch;
    last, whether autograd records the call) behind the grid as a tuple of ints, l an int and
    cache a bool, whose values the key holds: everything `validate` and the replay key read.
    None (the checked path) for other types of shape, l or cache, whose values could compare
    equal to a valid one's (1.0 == 1, True == 1) without passing the checks."""
    if shape.__class__ is not tuple or l.__class__ is not int or cache.__class__ is not bool:
        return None
    for s in shape:
        if s.__class__ is not int:
            return None
    base = shortcut_key(x, theta, 0, act, dim)
    return None if base is None else (shape, l, cache, *base)


def md_lrpe_cosine(
    x: torch.Tensor,
    theta: torch.Tensor,
    shape,
    l: int = 0,
    act: str = "none",
    dim: int | None = None,
    cache: bool = False,
) -> torch.Tensor:
    """LRPE cosine over a 1-D to 4-D token grid with `l` extra leading tokens.

    x: (B, N, H, D) or (B, N, D) with N = l + prod(shape), any strides, float32/float16/bfloat16.
    shape: the grid (n_0, ..., n_{m-1}), row-major, last axis fastest. theta: (H, E) or (1, E)
    with E * m >= D: feature k turns with the coordinate of axis k // E at frequency
    theta[h, k mod E]; the l extra tokens get angle 0 (output [act(x), 0]). act: none / relu /
    sigmoid / silu / softmax with dim=-1 (over D) or dim=1 (over all N tokens, extra ones
    included). cache=True keeps the float32 angle table (N, H, D) from the forward for the
    backward (more memory, identical results). Output (B, N, H, 2D) or (B, N, 2D) in x's dtype;
    gradients flow to x and to theta (when it requires grad).
    """
    # A call like an earlier one that passed the checks replays its sequence at once, through
    # the ops' autograd node where autograd records it (`_call_key`'s last entry)
    key = _call_key(x, theta, shape, l, act, dim, cache)
    if key is not None:
        entry = _CALLS._plans.get(key)
        if entry is not None:
            if key[-1]:
                return _replayed_forward(x, theta, entry)
            return entry[0]((x, theta, 0, None, None, None))[0]
    kind, grid = validate(x, theta, shape, l, act, dim, cache)
    if not use_triton(x):
        return md_lrpe_cosine_reference(x, theta, grid, l, act, dim)
    three_d = x.dim() == 3
    x4 = x.unsqueeze(2) if three_d else x
    theta32 = as_float32(theta)
    full = kind == SEQ or cache
    if full:
        y, _, _ = fwd(x4, theta32, list(grid), l, kind, cache)
    else:
        y = fwd_plain(x4, theta32, list(grid), l, kind)
    if key is not None and x4 is x and theta32 is theta:  # the call the sequence replays
        seq = launch.forward_recorded(
            x, theta, 0, kind, grid=_grid(theta, grid, l), cache=cache if full else None
        )
        if seq is not None:
            _CALLS.remember(key, (seq, kind, list(grid), l, full))
    return y.squeeze(2) if three_d else y


__all__ = ["bwd", "fwd", "fwd_plain", "md_lrpe_cosine", "validate"]
