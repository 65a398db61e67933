"""Validation, launch plans, torch.library registration and autograd for `lrpe_cosine`."""

from __future__ import annotations

import torch
import triton

from kernelkit.act.kernels import ELEMENTWISE_ACTS
from kernelkit.act.op import SoftmaxView, num_sms, softmax_chunk_stats
from kernelkit.shared.runtime import define_op, interpreting, launch, use_triton

from . import kernels as K
from .reference import lrpe_cosine_reference

ACTS = ("none", "relu", "sigmoid", "silu", "softmax")
# What the kernels are told: the element-wise acts, softmax over D, softmax over the sequence.
KINDS = (*ELEMENTWISE_ACTS, "softmax", "softmax_seq")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Memory-bound tiles: (BLOCK_N tokens) x (BLOCK_D >= D features) ~ TILE elements per program,
# 16 float32 values per thread per tile at 4 warps (x, cos, sin, two outputs fit in registers).
TILE = 2048
NUM_WARPS = 4
PROGRAMS_PER_SM = 4  # batch rows are grouped only while this many programs remain
MAX_ROWS = 16  # batch rows per program of the softmax_seq sums kernel (= its BLOCK_G)
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


def _next_pow2(n) -> int:
    return triton.next_power_of_2(int(n))


def tile_sizes(d) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_D): a whole head (BLOCK_D >= D) by as many tokens as fit in TILE. Depends
    on D only, so a new N, B or offset never compiles a new kernel."""
    block_d = _next_pow2(d)
    return max(1, TILE // block_d), block_d


def target_programs(device) -> int:
    return PROGRAMS_PER_SM * num_sms(device)


def batch_groups(b, programs, device) -> tuple[int, int]:
    """(rows per program, number of batch groups): group batch rows (shared cos/sin) as long as
    `programs` x groups still gives PROGRAMS_PER_SM programs per multiprocessor."""
    groups = max(1, min(b, triton.cdiv(target_programs(device), programs)))
    rows = max(triton.cdiv(b, groups), triton.cdiv(b, _GRID_AXIS_LIMIT))
    return rows, triton.cdiv(b, rows)


def sequence_chunks(b, n, heads, block_n, device) -> tuple[int, int, int, int]:
    """(rows, groups, chunk, num_chunks) of the softmax_seq sums kernel: up to MAX_ROWS batch
    rows per program (shared cos/sin), then the sequence split into chunks of whole token
    blocks until there are enough programs."""
    groups = triton.cdiv(b, MAX_ROWS)
    rows = triton.cdiv(b, groups)
    n_blocks = triton.cdiv(n, block_n)
    chunks = max(1, min(n_blocks, triton.cdiv(target_programs(device), heads * groups)))
    chunk = triton.cdiv(n_blocks, chunks) * block_n
    return rows, groups, chunk, triton.cdiv(n, chunk)


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
    if not SoftmaxView(x.shape, 1, [x.stride()]).ok:
        xv, dim = x.transpose(1, 2), 2
    m, s, view, (_, _, _, num_chunks) = softmax_chunk_stats(xv, dim)
    total = view.O0 * view.O1 * view.I
    stats = x.new_empty((2, total), dtype=torch.float32)
    launch(K.seq_stats_finalize_kernel)[(triton.cdiv(total, FINALIZE_BLOCK),)](
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
    block_n, block_d = tile_sizes(d)
    n_blocks = triton.cdiv(n, block_n)
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


def _backward(dy, x, theta, offsets, offset, stats, kind, need_dx, need_dtheta):
    b, n, heads, d2 = dy.shape
    d = d2 // 2
    if x is None and (need_dtheta or kind != "none"):
        raise RuntimeError("lrpe_cosine backward: x was not saved but is needed")
    if need_dx:
        dx = torch.empty_like(x) if x is not None else dy.new_empty((b, n, heads, d))
    else:
        dx = dy.new_empty((0,))
    dtheta = theta.new_zeros(theta.shape) if need_dtheta else theta.new_empty((0,))
    if b * n * heads * d == 0:
        if need_dx:
            dx.zero_()
        return dx, dtheta
    block_n, block_d = tile_sizes(d)
    n_blocks = triton.cdiv(n, block_n)
    off_ptr, off_int, per_batch = _offset_args(offsets, offset, theta)
    x_arg = x if x is not None else dy  # never read: act none without dtheta
    x_strides = _strides(x) if x is not None else (0, 0, 0, 0)
    theta_strides = (theta.stride(0) if theta.shape[0] > 1 else 0, theta.stride(1))
    common = (b, n, heads, d, theta.shape[1], off_int)
    sums = stats  # dummy unless softmax_seq
    partials = None
    if kind == "softmax_seq":
        rows, groups, chunk, num_chunks = sequence_chunks(b, n, heads, block_n, dy.device)
        chunk_sums = dy.new_empty((b, num_chunks, heads, d), dtype=torch.float32)
        if need_dtheta:
            partials = dy.new_empty((num_chunks * groups, heads, d), dtype=torch.float32)
        launch(K.lrpe_cosine_bwd_seq_sums_kernel)[(num_chunks, heads, groups)](
            x,
            theta,
            off_ptr,
            stats,
            dy,
            chunk_sums,
            partials if need_dtheta else stats,
            *common,
            rows,
            chunk,
            num_chunks,
            b * heads * d,
            *x_strides,
            *_strides(dy),
            *theta_strides,
            PER_BATCH=per_batch,
            NEED_DTHETA=need_dtheta,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            BLOCK_G=MAX_ROWS,
            num_warps=NUM_WARPS,
        )
        sums = chunk_sums.sum(1)
    if need_dx or (need_dtheta and kind != "softmax_seq"):
        rows, groups = batch_groups(b, n_blocks * heads, dy.device)
        fuse_dtheta = need_dtheta and kind != "softmax_seq"
        if fuse_dtheta:
            partials = dy.new_empty((n_blocks * groups, heads, d), dtype=torch.float32)
        launch(K.lrpe_cosine_bwd_kernel)[(n_blocks, heads, groups)](
            x_arg,
            theta,
            off_ptr,
            stats,
            sums,
            dy,
            dx if need_dx else dy,
            partials if fuse_dtheta else stats,
            *common,
            rows,
            b * heads * d,
            *x_strides,
            *_strides(dy),
            *(_strides(dx) if need_dx else (0, 0, 0, 0)),
            *theta_strides,
            ACT=kind,
            PER_BATCH=per_batch,
            NEED_DX=need_dx,
            NEED_DTHETA=fuse_dtheta,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            num_warps=NUM_WARPS,
        )
    if need_dtheta:
        dtheta = _reduce_dtheta(partials, theta.shape)
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
