"""Validation, launch plans, torch.library registration and autograd for `lrpe_rotate`."""

from __future__ import annotations

import torch

from kernelkit.act import softmax_chunk_stats
from kernelkit.act.op import ACTS, FLOAT_DTYPES
from kernelkit.shared.runtime import cdiv, define_op, launch, next_power_of_2, num_sms, use_triton

from . import kernels as K
from .reference import lrpe_rotate_reference

# Internal kinds: the element-wise acts keep their names, "softmax" is over D, SEQ over N.
SEQ = "softmax_seq"

# Launch parameters (read at call time: benchmarks/tune.py sweeps them). A half-tile
# [BLOCK_N, BLOCK_E] holds about TILE elements: BLOCK_N = 32 tokens at D = 128, two bf16 halves
# = 8 KB per batch row. Registers bound the programs per SM; cos/sin of the tile stay live across
# the batch loop, so tiles are kept moderate.
TILE = 2048
NUM_WARPS = 8  # H200 sweep: 8 warps x TILE 2048 = 92% of copy bandwidth fwd (4 warps: 86%)
PROGRAMS_PER_SM = 4  # batch rows are split into groups until about this many programs per SM
# Softmax over N: a program walks a chunk of the sequence of one (b, h).
SEQ_TILE = 2048
SEQ_WARPS = 4
SEQ_PROGRAMS_PER_SM = 8  # the sequence is split into chunks until about this many programs/SM
MIN_BLOCK_N = 8
MAX_BLOCK_N = 128


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _validate_x_theta(x, theta) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x: dtype must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() not in (3, 4):
        raise ValueError(f"x: expected shape (B, N, H, D) or (B, N, D), got {tuple(x.shape)}")
    d = x.shape[-1]
    if d == 0 or d % 2 != 0:
        raise ValueError(f"x: the head dim D must be even and positive, got D={d}")
    heads = x.shape[2] if x.dim() == 4 else 1
    if not isinstance(theta, torch.Tensor):
        raise ValueError(f"theta: expected a torch.Tensor, got {type(theta).__name__}")
    if not theta.dtype.is_floating_point:
        raise ValueError(f"theta: dtype must be floating point, got {theta.dtype}")
    if theta.dim() != 2:
        raise ValueError(f"theta: expected shape (H, E) or (1, E), got {tuple(theta.shape)}")
    rows, e = theta.shape
    if rows != 1 and rows != heads:
        where = f"H={heads}" if x.dim() == 4 else "1 (x has no head axis)"
        raise ValueError(f"theta: has {rows} rows, expected 1 or {where}")
    if not 1 <= e <= d // 2:
        raise ValueError(f"theta: E={e} frequencies per head, expected 1 <= E <= D/2 = {d // 2}")
    if theta.device != x.device:
        raise ValueError(f"theta: is on {theta.device} but x is on {x.device}")


def _validate_offset(x, offset) -> None:
    if isinstance(offset, torch.Tensor):
        if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
            raise ValueError(
                f"offset: a tensor offset must have an integer dtype, got {offset.dtype}"
            )
        if offset.dim() != 1 or offset.shape[0] != x.shape[0]:
            raise ValueError(
                f"offset: a tensor offset must have shape (B,) = ({x.shape[0]},), "
                f"got {tuple(offset.shape)}"
            )
        if offset.device != x.device:
            raise ValueError(f"offset: is on {offset.device} but x is on {x.device}")
    elif isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(
            f"offset: expected a Python int or an integer tensor of shape (B,), "
            f"got {type(offset).__name__}"
        )


def _validate_act(x, act, dim) -> str:
    if act not in ACTS:
        raise ValueError(f"act: must be one of {ACTS}, got {act!r}")
    if act != "softmax":
        if dim is not None:
            raise ValueError(f"dim: only softmax takes a dim, got dim={dim} with act={act!r}")
        return act
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dim: softmax needs dim=-1 (over D) or dim=1 (over N), got {dim!r}")
    ndim = x.dim()
    if -ndim <= dim < ndim and dim % ndim == ndim - 1:
        return "softmax"
    if -ndim <= dim < ndim and dim % ndim == 1:
        return SEQ
    raise ValueError(f"dim: softmax runs over D (dim=-1) or the sequence (dim=1), got dim={dim}")


def validate(x, theta, offset, act: str, dim: int | None) -> str:
    """Check the arguments of `lrpe_rotate`; returns the internal act kind."""
    _validate_x_theta(x, theta)
    _validate_offset(x, offset)
    return _validate_act(x, act, dim)


def _act_and_dim(kind: str) -> tuple[str, int | None]:
    if kind == "softmax":
        return "softmax", -1
    if kind == SEQ:
        return "softmax", 1
    return kind, None


# ---------------------------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------------------------


def _tile_plan(kind: str, half: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_E, num_warps): a power-of-two half-tile of about TILE elements."""
    tile, warps = (SEQ_TILE, SEQ_WARPS) if kind == SEQ else (TILE, NUM_WARPS)
    block_e = next_power_of_2(half)
    return max(MIN_BLOCK_N, min(MAX_BLOCK_N, tile // block_e)), block_e, warps


def _batch_groups(batch, n_tiles, heads, device, per_batch) -> tuple[int, int]:
    """(rows per program, groups). With an int offset a program loops over several batch rows
    reusing its cos/sin; rows are split into groups only until the GPU is full."""
    if per_batch:
        return 1, batch
    target = PROGRAMS_PER_SM * num_sms(device)
    groups = min(batch, max(1, cdiv(target, n_tiles * heads)))
    per_group = cdiv(batch, groups)
    return per_group, cdiv(batch, per_group)


def _seq_chunks(batch, n, heads, block_n, device) -> tuple[int, int]:
    """(tokens per chunk, chunks) for the softmax-over-N kernels: a multiple of BLOCK_N."""
    n_blocks = cdiv(n, block_n)
    target = SEQ_PROGRAMS_PER_SM * num_sms(device)
    chunks = min(n_blocks, max(1, cdiv(target, batch * heads)))
    chunk = cdiv(n_blocks, chunks) * block_n
    return chunk, cdiv(n, chunk)


def _theta_args(theta: torch.Tensor, half: int) -> tuple[int, int, int]:
    """(head stride, pair stride, rotated pairs): stride 0 broadcasts one row / one frequency."""
    rows, e = theta.shape
    th_sh = 0 if rows == 1 else theta.stride(0)
    th_se = 0 if e == 1 else theta.stride(1)
    return th_sh, th_se, (half if e == 1 else e)


def _fold_dtheta(partial: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Sum the per-program float32 partials (P, H, D/2) into theta's shape and dtype."""
    d = partial.sum(0)
    rows, e = theta.shape
    if rows == 1:
        d = d.sum(0, keepdim=True)
    d = d.sum(1, keepdim=True) if e == 1 else d[:, :e]
    return d.to(theta.dtype)


# ---------------------------------------------------------------------------------------------
# Registered ops (x is 4-D here: the public function gives (B, N, D) a head axis of 1)
# ---------------------------------------------------------------------------------------------


@define_op("kernelkit_lrpe_rotate::seq_softmax_stats")
def seq_softmax_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk float32 (max, sum) of softmax over N, shape (B*H, C, D) (C = 0 when the
    PyTorch reference runs instead of the kernels)."""
    batch, _n, heads, d = x.shape
    if not use_triton(x) or x.numel() == 0:
        m = x.new_empty((batch * heads, 0, d), dtype=torch.float32)
        return m, torch.empty_like(m)
    # (B, H, N, D) with the softmax over dim 2: B and H are the outer dims whatever x's layout.
    m, s, _, _ = softmax_chunk_stats(x.permute(0, 2, 1, 3), 2)
    return m, s


@define_op("kernelkit_lrpe_rotate::rotate_fwd")
def rotate_fwd(
    x: torch.Tensor,
    theta: torch.Tensor,
    offsets: torch.Tensor | None,
    offset: int,
    kind: str,
    m: torch.Tensor | None,
    s: torch.Tensor | None,
) -> torch.Tensor:
    if not use_triton(x):
        act, dim = _act_and_dim(kind)
        return lrpe_rotate_reference(x, theta, offset if offsets is None else offsets, act, dim)
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    batch, n, heads, d = x.shape
    half = d // 2
    block_n, block_e, warps = _tile_plan(kind, half)
    per_batch = offsets is not None
    offs = offsets if per_batch else theta  # never read without PER_BATCH
    if kind == SEQ:
        chunk, chunks = _seq_chunks(batch, n, heads, block_n, x.device)
        launch(K.seq_softmax_fwd_kernel)[(chunks * batch, heads)](
            x,
            y,
            theta,
            offs,
            m,
            s,
            n,
            offset,
            chunk,
            chunks,
            m.shape[1],
            *x.stride(),
            *y.stride(),
            *_theta_args(theta, half),
            PER_BATCH=per_batch,
            HALF=half,
            BLOCK_N=block_n,
            BLOCK_E=block_e,
            num_warps=warps,
        )
        return y
    n_tiles = cdiv(n, block_n)
    per_group, groups = _batch_groups(batch, n_tiles, heads, x.device, per_batch)
    launch(K.rotate_fwd_kernel)[(n_tiles * groups, heads)](
        x,
        y,
        theta,
        offs,
        batch,
        n,
        offset,
        per_group,
        *x.stride(),
        *y.stride(),
        *_theta_args(theta, half),
        KIND=kind,
        PER_BATCH=per_batch,
        HALF=half,
        BLOCK_N=block_n,
        BLOCK_E=block_e,
        num_warps=warps,
    )
    return y


def _reference_backward(x, dy, theta, offsets, offset, kind, need_dtheta):
    """Gradients by autograd through the PyTorch reference (CPU without the interpreter)."""
    act, dim = _act_and_dim(kind)
    with torch.enable_grad():
        # act "none" without dtheta saves no x: the map is linear, any x gives the same dx.
        xr = (torch.zeros_like(dy) if x is None else x.detach()).requires_grad_()
        thr = theta.detach().requires_grad_(need_dtheta)
        y = lrpe_rotate_reference(xr, thr, offset if offsets is None else offsets, act, dim)
        grads = torch.autograd.grad(y, [xr, thr] if need_dtheta else [xr], dy)
    return grads[0], (grads[1] if need_dtheta else theta.new_empty(0))


@define_op("kernelkit_lrpe_rotate::rotate_bwd")
def rotate_bwd(
    x: torch.Tensor | None,
    dy: torch.Tensor,
    theta: torch.Tensor,
    offsets: torch.Tensor | None,
    offset: int,
    kind: str,
    m: torch.Tensor | None,
    s: torch.Tensor | None,
    need_dtheta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dtheta); dtheta is an empty tensor unless need_dtheta."""
    if not use_triton(dy):
        return _reference_backward(x, dy, theta, offsets, offset, kind, need_dtheta)
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    batch, n, heads, d = dy.shape
    half = d // 2
    if dx.numel() == 0:
        dtheta = torch.zeros_like(theta) if need_dtheta else theta.new_empty(0)
        return dx, dtheta
    block_n, block_e, warps = _tile_plan(kind, half)
    per_batch = offsets is not None
    offs = offsets if per_batch else theta
    xt = dy if x is None else x  # never read when act is none and dtheta is not needed
    common = {
        "PER_BATCH": per_batch,
        "HALF": half,
        "BLOCK_N": block_n,
        "BLOCK_E": block_e,
        "num_warps": warps,
    }
    if kind == SEQ:
        chunk, chunks = _seq_chunks(batch, n, heads, block_n, dy.device)
        grid = (chunks * batch, heads)
        p = dy.new_empty((batch * heads, chunks, d), dtype=torch.float32)
        partial = dy.new_empty(
            (chunks * batch if need_dtheta else 1, heads, half), dtype=torch.float32
        )
        th = _theta_args(theta, half)
        launch(K.seq_softmax_bwd_sums_kernel)[grid](
            xt,
            dy,
            theta,
            offs,
            m,
            s,
            p,
            n,
            offset,
            chunk,
            chunks,
            m.shape[1],
            *xt.stride(),
            *dy.stride(),
            *th,
            **common,
        )
        launch(K.seq_softmax_bwd_apply_kernel)[grid](
            xt,
            dy,
            dx,
            theta,
            offs,
            m,
            s,
            p,
            partial,
            n,
            offset,
            chunk,
            chunks,
            m.shape[1],
            *xt.stride(),
            *dy.stride(),
            *dx.stride(),
            *th,
            NEED_DTHETA=need_dtheta,
            **common,
        )
    else:
        n_tiles = cdiv(n, block_n)
        per_group, groups = _batch_groups(batch, n_tiles, heads, dy.device, per_batch)
        partial = dy.new_empty(
            (n_tiles * groups if need_dtheta else 1, heads, half), dtype=torch.float32
        )
        launch(K.rotate_bwd_kernel)[(n_tiles * groups, heads)](
            xt,
            dy,
            dx,
            theta,
            offs,
            partial,
            batch,
            n,
            offset,
            per_group,
            *xt.stride(),
            *dy.stride(),
            *dx.stride(),
            *_theta_args(theta, half),
            KIND=kind,
            NEED_DTHETA=need_dtheta,
            **common,
        )
    return dx, (_fold_dtheta(partial, theta) if need_dtheta else theta.new_empty(0))


def _fwd_setup(ctx, inputs, output):
    x, theta, offsets, offset, kind, m, s = inputs
    need_dtheta = theta.requires_grad
    ctx.kind, ctx.offset, ctx.need_dtheta = kind, offset, need_dtheta
    # The backward needs act(x) only for an act or for dtheta: act "none" keeps nothing big.
    keep_x = kind != "none" or need_dtheta
    ctx.save_for_backward(x if keep_x else None, theta, offsets, m, s)


def _fwd_backward(ctx, dy):
    x, theta, offsets, m, s = ctx.saved_tensors
    need_dtheta = ctx.need_dtheta and ctx.needs_input_grad[1]
    dx, dtheta = rotate_bwd(x, dy, theta, offsets, ctx.offset, ctx.kind, m, s, need_dtheta)
    return dx, (dtheta if need_dtheta else None), None, None, None, None, None


rotate_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def lrpe_rotate(
    x: torch.Tensor,
    theta: torch.Tensor,
    offset: int | torch.Tensor = 0,
    act: str = "none",
    dim: int | None = None,
) -> torch.Tensor:
    """LRPE rotation (RoPE-style, half-split pairing) of act(x) by (offset + position) * theta.

    x: (B, N, H, D) or (B, N, D), any strides, float32/float16/bfloat16, D even.
    theta: (H, E) or (1, E) with E = D/2 (one frequency per pair), E = 1 (one per head) or
    1 < E < D/2 (pairs j >= E pass through). offset: Python int or integer tensor (B,).
    act: "none", "relu", "sigmoid", "silu" or "softmax" with dim=-1 (over D) or dim=1 (over N).
    Differentiable in x and, when it requires grad, theta.
    """
    kind = validate(x, theta, offset, act, dim)
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    offsets = offset if isinstance(offset, torch.Tensor) else None
    start = 0 if offsets is not None else offset
    m = s = None
    if kind == SEQ:
        m, s = seq_softmax_stats(x4.detach())
    y = rotate_fwd(x4, theta, offsets, start, kind, m, s)
    return y if x.dim() == 4 else y.squeeze(2)


__all__ = ["ACTS", "lrpe_rotate", "rotate_bwd", "rotate_fwd", "seq_softmax_stats", "validate"]
