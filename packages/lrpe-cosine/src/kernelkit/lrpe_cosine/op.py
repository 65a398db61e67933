"""Validation, launch plans, torch.library registration and autograd for `lrpe_cosine`."""

from __future__ import annotations

import torch

from kernelkit.act.kernels import ELEMENTWISE_ACTS
from kernelkit.act.op import ACTS, FLOAT_DTYPES, SoftmaxView, softmax_chunk_stats
from kernelkit.shared.runtime import (
    cdiv,
    define_op,
    interpreting,
    launch,
    next_power_of_2,
    num_sms,
    use_triton,
)

from . import kernels as K
from .reference import lrpe_cosine_reference

# What the kernels are told: the element-wise acts, softmax over D, softmax over the sequence.
KINDS = (*ELEMENTWISE_ACTS, "softmax", "softmax_seq")

# Memory-bound tiles: [BLOCK_N tokens, ROWS batch rows, BLOCK_D >= D features] ~ TILE elements
# per load, 32 per thread at 4 warps. cos/sin are [BLOCK_N, 1, BLOCK_D]: ROWS times fewer
# registers than the x tile, so the registers go to bytes in flight.
ROWS = 4
TILE = 4096
# Per-batch offsets need cos/sin per row (as many registers as the x tile) and the softmax_seq
# sums kernel keeps [ROWS, D] stats and sums per thread: both use half tiles to avoid spills.
SMALL_TILE = 2048
NUM_WARPS = 4
PROGRAMS_PER_SM = 4  # batch rows are grouped only while this many programs remain
# The softmax_seq sums kernel has long programs (a chunk of tokens x ROWS rows): many of them
# keep the last wave short.
SUMS_PROGRAMS_PER_SM = 16
FINALIZE_BLOCK = 1024
_GRID_AXIS_LIMIT = 65535  # grid axes 1 and 2 (heads, batch groups)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def validate(x, theta, offset, act: str, dim):
    """Check the arguments of `lrpe_cosine`; returns the kernel act kind (see KINDS)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x: dtype must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() not in (3, 4):
        raise ValueError(f"x: expected shape (B, N, H, D) or (B, N, D), got {tuple(x.shape)}")
    heads = x.shape[2] if x.dim() == 4 else 1
    d = x.shape[-1]
    if not isinstance(theta, torch.Tensor):
        raise ValueError(f"theta: expected a torch.Tensor, got {type(theta).__name__}")
    if not theta.is_floating_point():
        raise ValueError(f"theta: must be a floating-point tensor, got {theta.dtype}")
    if theta.dim() != 2:
        raise ValueError(f"theta: expected shape (H, E) or (1, E), got {tuple(theta.shape)}")
    rows, e = theta.shape
    if rows != 1 and rows != heads:
        what = "x has no head axis: theta needs 1 row" if x.dim() == 3 else f"1 or H = {heads}"
        raise ValueError(f"theta: has {rows} rows, expected {what}")
    if not 1 <= e <= d:
        raise ValueError(f"theta: E = {e} frequencies per row, expected 1 <= E <= D = {d}")
    if theta.device != x.device:
        raise ValueError(f"theta: is on {theta.device} but x is on {x.device}")
    if isinstance(offset, torch.Tensor):
        if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
            raise ValueError(
                f"offset: a tensor offset must have an integer dtype, got {offset.dtype}"
            )
        if tuple(offset.shape) != (x.shape[0],):
            raise ValueError(
                f"offset: a tensor offset must have shape (B,) = ({x.shape[0]},), "
                f"got {tuple(offset.shape)}"
            )
        if offset.device != x.device:
            raise ValueError(f"offset: is on {offset.device} but x is on {x.device}")
    elif not _is_int(offset):
        raise ValueError(f"offset: expected an int or an integer tensor (B,), got {offset!r}")
    elif isinstance(offset, int) and not -(2**62) <= offset <= 2**62:
        raise ValueError(f"offset: {offset} is out of range (positions are int64)")
    if act not in ACTS:
        raise ValueError(f"act: must be one of {ACTS}, got {act!r}")
    if act != "softmax":
        if dim is not None:
            raise ValueError(f"dim: only softmax takes a dim, got dim={dim} with act={act!r}")
        return act
    if dim is None:
        raise ValueError("dim: softmax needs dim=-1 (over D) or dim=1 (over the sequence)")
    if not _is_int(dim):
        raise ValueError(f"dim: expected an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: {dim} is out of range for x with {x.dim()} dimensions")
    if dim % x.dim() == 1:
        return "softmax_seq"
    if dim % x.dim() == x.dim() - 1:
        return "softmax"
    raise ValueError(f"dim: softmax runs over D (dim=-1) or the sequence (dim=1), got dim={dim}")


# ---------------------------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------------------------


def tile_sizes(d, tile=TILE) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_D): a whole head (BLOCK_D >= D) by as many tokens as fit in `tile` with
    ROWS batch rows. Depends on D only: a new N, B or offset never compiles a new kernel."""
    block_d = next_power_of_2(int(d))
    return max(1, tile // (ROWS * block_d)), block_d


def target_programs(device, per_sm=PROGRAMS_PER_SM) -> int:
    return per_sm * num_sms(device)


def batch_groups(b, programs, device) -> tuple[int, int]:
    """(rows per program, number of batch groups) of the forward/backward kernels: batch rows
    (sharing cos/sin) are grouped, in multiples of ROWS, as long as `programs` x groups still
    gives PROGRAMS_PER_SM programs per multiprocessor."""
    groups = max(1, min(cdiv(b, ROWS), cdiv(target_programs(device), programs)))
    rows = cdiv(cdiv(b, groups), ROWS) * ROWS
    rows = max(rows, cdiv(b, _GRID_AXIS_LIMIT))
    return rows, cdiv(b, rows)


def sequence_chunks(b, n, heads, block_n, device) -> tuple[int, int, int]:
    """(groups, chunk, num_chunks) of the softmax_seq sums kernel: programs of ROWS batch rows
    and a chunk of whole token blocks, chunks added until there are enough programs."""
    groups = cdiv(b, ROWS)
    n_blocks = cdiv(n, block_n)
    target = target_programs(device, SUMS_PROGRAMS_PER_SM)
    chunks = max(1, min(n_blocks, cdiv(target, heads * groups)))
    chunk = cdiv(n_blocks, chunks) * block_n
    return groups, chunk, cdiv(n, chunk)


def _offset_args(offsets, offset, fallback):
    """(pointer, int) kernel arguments: the offsets tensor or a dummy pointer and the int."""
    if offsets is None:
        return fallback, offset, False
    return offsets, 0, True


def _strides(t: torch.Tensor):
    return tuple(t.stride())


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def _sequence_stats(x: torch.Tensor) -> torch.Tensor:
    """Final float32 (max, sum) of the softmax over the sequence for every (b, h, k), shape
    (2, B * H * D): one read of x (kernelkit-act's chunk stats) and a tiny combine kernel."""
    # (B, N, H, D) needs (H, D) to collapse into one inner dim; otherwise the (B, H, N, D) view
    # (two outer dims, inner D) always works. The (O, C, I) stats index o * I + i is
    # b * H * D + h * D + k in both.
    xv, dim = x, 1
    view = SoftmaxView(x.shape, 1, [x.stride()])
    if not view.ok:
        xv, dim = x.transpose(1, 2), 2
        view = SoftmaxView(xv.shape, 2, [xv.stride()])
    m, s, view, (_, _, _, num_chunks) = softmax_chunk_stats(xv, dim, view=view)
    total = view.O0 * view.O1 * view.I
    stats = x.new_empty((2, total), dtype=torch.float32)
    launch(K.seq_stats_finalize_kernel)[(cdiv(total, FINALIZE_BLOCK),)](
        m, s, stats, total, view.I, num_chunks, BLOCK=FINALIZE_BLOCK, num_warps=4
    )
    return stats


def _forward(x, theta, offsets, offset, kind):
    b, n, heads, d = x.shape
    y = x.new_empty((b, n, heads, 2 * d))
    seq = kind == "softmax_seq"
    if y.numel() == 0:
        return y, x.new_empty((2, b * heads * d) if seq else (0,), dtype=torch.float32)
    stats = _sequence_stats(x) if seq else x.new_empty((0,), dtype=torch.float32)
    block_n, block_d = tile_sizes(d, TILE if offsets is None else SMALL_TILE)
    n_blocks = cdiv(n, block_n)
    rows, groups = batch_groups(b, n_blocks * heads, x.device)
    off_ptr, off_int, per_batch = _offset_args(offsets, offset, theta)
    launch(K.lrpe_cosine_fwd_kernel)[(n_blocks, heads, groups)](
        x,
        theta,
        off_ptr,
        stats,
        y,
        b,
        n,
        heads,
        d,
        theta.shape[1],
        off_int,
        rows,
        b * heads * d,
        *_strides(x),
        *_strides(y),
        theta.stride(0) if theta.shape[0] > 1 else 0,
        theta.stride(1),
        ACT=kind,
        PER_BATCH=per_batch,
        ROWS=ROWS,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=NUM_WARPS,
    )
    return y, stats


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def _reduce_dtheta(partials: torch.Tensor, theta_shape) -> torch.Tensor:
    """(programs, H, D) float32 partials -> dtheta of shape (rows, E), summed by torch."""
    rows, e = theta_shape
    g = partials.sum(0)
    g = g.sum(1, keepdim=True) if e == 1 else g[:, :e]
    if rows == 1:
        g = g.sum(0, keepdim=True)
    return g.contiguous()


class _BackwardArgs:
    """Kernel arguments shared by the backward kernels."""

    def __init__(self, dy, x, theta, offsets, offset):
        b, n, heads, d2 = dy.shape
        self.b, self.n, self.heads, self.d = b, n, heads, d2 // 2
        self.off_ptr, off_int, self.per_batch = _offset_args(offsets, offset, theta)
        self.sizes = (b, n, heads, self.d, theta.shape[1], off_int)
        self.x = x if x is not None else dy  # never read: act none without dtheta
        self.x_strides = _strides(x) if x is not None else (0, 0, 0, 0)
        self.theta_strides = (theta.stride(0) if theta.shape[0] > 1 else 0, theta.stride(1))
        self.stats_part = b * heads * self.d


def _sequence_sums(a: _BackwardArgs, dy, theta, stats, need_dtheta):
    """softmax_seq backward, first pass: (sum over the sequence of y * dx̄ as (B, H, D) float32,
    dtheta partials or None)."""
    block_n, block_d = tile_sizes(a.d, SMALL_TILE)
    groups, chunk, num_chunks = sequence_chunks(a.b, a.n, a.heads, block_n, dy.device)
    chunk_sums = dy.new_empty((a.b, num_chunks, a.heads, a.d), dtype=torch.float32)
    partials = None
    if need_dtheta:
        partials = dy.new_empty((num_chunks * groups, a.heads, a.d), dtype=torch.float32)
    launch(K.lrpe_cosine_bwd_seq_sums_kernel)[(num_chunks, a.heads, groups)](
        a.x,
        theta,
        a.off_ptr,
        stats,
        dy,
        chunk_sums,
        partials if need_dtheta else stats,
        *a.sizes,
        ROWS,
        chunk,
        num_chunks,
        a.stats_part,
        *a.x_strides,
        *_strides(dy),
        *a.theta_strides,
        PER_BATCH=a.per_batch,
        NEED_DTHETA=need_dtheta,
        ROWS=ROWS,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=NUM_WARPS,
    )
    return chunk_sums.sum(1), partials


def _backward(dy, x, theta, offsets, offset, stats, kind, need_dx, need_dtheta):
    b, n, heads, d2 = dy.shape
    d = d2 // 2
    if x is None and (need_dtheta or kind != "none"):
        raise RuntimeError("lrpe_cosine backward: x was not saved but is needed")
    if need_dx:
        dx = torch.empty_like(x) if x is not None else dy.new_empty((b, n, heads, d))
    else:
        dx = dy.new_empty((0,))
    if b * n * heads * d == 0:
        if need_dx:
            dx.zero_()
        return dx, (theta.new_zeros(theta.shape) if need_dtheta else theta.new_empty((0,)))
    a = _BackwardArgs(dy, x, theta, offsets, offset)
    sums, partials = stats, None  # stats: a dummy pointer unless softmax_seq
    if kind == "softmax_seq":
        sums, partials = _sequence_sums(a, dy, theta, stats, need_dtheta)
    fuse_dtheta = need_dtheta and kind != "softmax_seq"
    if need_dx or fuse_dtheta:
        block_n, block_d = tile_sizes(d, SMALL_TILE if a.per_batch else TILE)
        n_blocks = cdiv(n, block_n)
        rows, groups = batch_groups(b, n_blocks * heads, dy.device)
        if fuse_dtheta:
            partials = dy.new_empty((n_blocks * groups, heads, d), dtype=torch.float32)
        launch(K.lrpe_cosine_bwd_kernel)[(n_blocks, heads, groups)](
            a.x,
            theta,
            a.off_ptr,
            stats,
            sums,
            dy,
            dx if need_dx else dy,
            partials if fuse_dtheta else stats,
            *a.sizes,
            rows,
            a.stats_part,
            *a.x_strides,
            *_strides(dy),
            *(_strides(dx) if need_dx else (0, 0, 0, 0)),
            *a.theta_strides,
            ACT=kind,
            PER_BATCH=a.per_batch,
            NEED_DX=need_dx,
            NEED_DTHETA=fuse_dtheta,
            ROWS=ROWS,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            num_warps=NUM_WARPS,
        )
    dtheta = _reduce_dtheta(partials, theta.shape) if need_dtheta else theta.new_empty((0,))
    return dx, dtheta


# ---------------------------------------------------------------------------------------------
# Registered ops
# ---------------------------------------------------------------------------------------------


def _public_act(kind: str) -> tuple[str, int | None]:
    if kind == "softmax":
        return "softmax", -1
    if kind == "softmax_seq":
        return "softmax", 1
    return kind, None


def _reference_offset(offsets, offset):
    return offsets if offsets is not None else offset


@define_op("kernelkit_lrpe_cosine::lrpe_cosine_fwd")
def lrpe_cosine_fwd(
    x: torch.Tensor, theta: torch.Tensor, offsets: torch.Tensor | None, offset: int, act: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """y (B, N, H, 2D) and the softmax_seq stats (2, B*H*D) the backward reuses (else empty).
    theta is float32 (H|1, E); offsets is int64 (B,) or None (then the int `offset`)."""
    if not use_triton(x):
        a, dim = _public_act(act)
        y = lrpe_cosine_reference(x, theta, _reference_offset(offsets, offset), a, dim)
        return y, x.new_empty((0,), dtype=torch.float32)
    return _forward(x, theta, offsets, offset, act)


@define_op("kernelkit_lrpe_cosine::lrpe_cosine_bwd")
def lrpe_cosine_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    theta: torch.Tensor,
    offsets: torch.Tensor | None,
    offset: int,
    stats: torch.Tensor,
    act: str,
    need_dx: bool,
    need_dtheta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dtheta); each is an empty tensor when not needed. x may be None for act none
    without dtheta (the backward does not read it)."""
    if not use_triton(dy):
        return _reference_backward(dy, x, theta, offsets, offset, act, need_dx, need_dtheta)
    return _backward(dy, x, theta, offsets, offset, stats, act, need_dx, need_dtheta)


def _reference_backward(dy, x, theta, offsets, offset, act, need_dx, need_dtheta):
    b, n, heads, d2 = dy.shape
    if x is None:  # act none: dx does not depend on x
        x = dy.new_zeros((b, n, heads, d2 // 2))
    a, dim = _public_act(act)
    with torch.enable_grad():
        xr = x.detach().requires_grad_(need_dx)
        tr = theta.detach().requires_grad_(need_dtheta)
        y = lrpe_cosine_reference(xr, tr, _reference_offset(offsets, offset), a, dim)
        wrt = [t for t in (xr, tr) if t.requires_grad]
        grads = list(torch.autograd.grad(y, wrt, dy))
    dx = grads.pop(0) if need_dx else dy.new_empty((0,))
    dtheta = grads.pop(0) if need_dtheta else theta.new_empty((0,))
    return dx, dtheta


def _setup_context(ctx, inputs, output):
    x, theta, offsets, offset, act = inputs
    _, stats = output
    ctx.act = act
    ctx.offset = offset
    # act none: dx needs only dy and the angles, x only matters for dtheta.
    keep_x = act != "none" or ctx.needs_input_grad[1]
    ctx.save_for_backward(x if keep_x else None, theta, offsets, stats)


def _backward_autograd(ctx, dy, _dstats):
    x, theta, offsets, stats = ctx.saved_tensors
    need_dx, need_dtheta = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dtheta = lrpe_cosine_bwd(
        dy, x, theta, offsets, ctx.offset, stats, ctx.act, need_dx, need_dtheta
    )
    return (dx if need_dx else None), (dtheta if need_dtheta else None), None, None, None


lrpe_cosine_fwd.register_autograd(_backward_autograd, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def lrpe_cosine(
    x: torch.Tensor,
    theta: torch.Tensor,
    offset: int | torch.Tensor = 0,
    act: str = "none",
    dim: int | None = None,
) -> torch.Tensor:
    """LRPE cosine feature map: y = [act(x) cos(Theta), act(x) sin(Theta)] along the last dim.

    x: (B, N, H, D) or (B, N, D); theta: (H, E) or (1, E) with 1 <= E <= D (E == D one
    frequency per feature, E == 1 one per head, 1 < E < D angle 0 for features k >= E);
    Theta[b, t, h, k] = (offset_b + t) * theta[h, k] with float32 angles of integer positions.
    offset: int or integer tensor (B,). act: none / relu / sigmoid / silu / softmax with
    dim=-1 (over D) or dim=1 (over the sequence). Output (B, N, H, 2D) or (B, N, 2D), x's dtype;
    gradients flow to x and to theta (when it requires grad).
    """
    kind = validate(x, theta, offset, act, dim)
    three_d = x.dim() == 3
    x4 = x.unsqueeze(2) if three_d else x
    theta32 = theta.to(torch.float32)
    if isinstance(offset, torch.Tensor):
        offsets, offset = offset.to(torch.int64).contiguous(), 0
    else:
        offsets = None
    y, _ = lrpe_cosine_fwd(x4, theta32, offsets, offset, kind)
    return y.squeeze(2) if three_d else y


__all__ = [
    "ACTS",
    "KINDS",
    "batch_groups",
    "interpreting",
    "lrpe_cosine",
    "lrpe_cosine_bwd",
    "lrpe_cosine_fwd",
    "tile_sizes",
    "validate",
]
