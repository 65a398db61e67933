"""Host side shared by the LRPE packages: argument validation, the position and theta arguments
of a launch, the softmax-over-the-sequence statistics and the d(theta) reduction.

Every LRPE op validates with these functions (one set of error texts), hands its kernels
positions as one `offset` argument (an int, or a (B,) tensor of starts) plus an optional
per-token `positions` table (packed sequences: `cu_seqlens`, read by the kernels themselves),
and folds the per-program d(theta) partials the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernelkit.act import (
    ACTS,
    ELEMENTWISE_ACTS,
    FLOAT_DTYPES,
    MAX_PACKED_SEQUENCES,
    softmax_chunk_stats,
)
from kernelkit.act import act as apply_act
from kernelkit.shared import replay, runtime
from kernelkit.shared.packed import check_cu_seqlens
from kernelkit.shared.replay import DIRECT
from kernelkit.shared.runtime import (
    cdiv,
    function_apply,
    interpreting,
    next_power_of_2,
    num_sms,
    plain_call,
)

from .kernels import merge_chunk_stats_kernel, merge_chunk_sums_kernel

__all__ = [
    "KINDS",
    "ONE_PASS_MAX_ELEMENTS",
    "PACKED_CHUNK_CAP",
    "PACKED_WAVES",
    "SEQ",
    "act_and_dim",
    "as_float32",
    "cpu_reference_args",
    "launch_positions",
    "merge_chunk_stats",
    "merge_chunk_sums",
    "packed_chunks",
    "position_args",
    "position_strides",
    "programs_target",
    "reduce_dtheta",
    "register_lrpe_autograd",
    "sequence_softmax_stats",
    "shortcut_key",
    "theta_args",
    "validate_act",
    "validate_positions",
    "validate_theta",
    "validate_x",
]

SEQ = "softmax_seq"
# Softmax over packed sequences: the kernels split every sequence into the same number of chunks
# (a fixed fraction of it), so one long sequence among short ones makes long programs; plans ask
# for this many times their usual number of programs to keep the launch's tail short.
PACKED_WAVES = 4
PACKED_CHUNK_CAP = 32  # ... up to this many chunks: programs merge every chunk of their row
# Softmax over a sequence: read in one pass (one chunk, no merge launch) while a program's
# share, N x min(D rounded up to a power of 2, 128) elements, is at most this many. H200, at
# (1, N, 32, 128) bf16, GPU µs per lrpe_cosine forward, chunks + merge -> one pass: N = 256
# 11.7 -> 12.1, N = 512 15.3 -> 20.1 (each program's loop is latency-bound); at (2, 512, 16, 64)
# 10.1 -> 10.2. Below the bound the merge's launch costs the host more than it saves the GPU.
ONE_PASS_MAX_ELEMENTS = 32768
# An int offset's bound (positions are int64, with room for N)
_MAX_OFFSET = 2**62


def packed_chunks(base: int) -> int:
    """Chunks per packed sequence from the chunk count `base` a dense plan would use:
    PACKED_WAVES times more, but not past PACKED_CHUNK_CAP unless `base` already is."""
    return min(base * PACKED_WAVES, max(base, PACKED_CHUNK_CAP))


# What the kernels are told: the element-wise acts, softmax over D, softmax over the sequence.
KINDS = (*ELEMENTWISE_ACTS, "softmax", SEQ)


def _is_int(v) -> bool:
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def _is_int_tensor(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def validate_x(x) -> None:
    """x: a float32/float16/bfloat16 tensor (B, N, H, D) or (B, N, D)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x: dtype must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() not in (3, 4):
        raise ValueError(f"x: expected shape (B, N, H, D) or (B, N, D), got {tuple(x.shape)}")


def validate_theta(x: torch.Tensor, theta) -> int:
    """theta: a floating-point (H, E) or (1, E) tensor on x's device; returns E (the caller
    checks E against its own form)."""
    heads = x.shape[2] if x.dim() == 4 else 1
    if not isinstance(theta, torch.Tensor):
        raise ValueError(f"theta: expected a torch.Tensor, got {type(theta).__name__}")
    if not theta.is_floating_point():
        raise ValueError(f"theta: must be a floating-point tensor, got {theta.dtype}")
    if theta.dim() != 2:
        raise ValueError(f"theta: expected shape (H, E) or (1, E), got {tuple(theta.shape)}")
    rows, e = theta.shape
    if rows != 1 and rows != heads:
        if x.dim() == 4:
            raise ValueError(f"theta: has {rows} rows, expected 1 or H = {heads}")
        raise ValueError(
            f"theta: has {rows} rows, but x {tuple(x.shape)} is read as (B, N, D), with no head "
            "axis, so theta needs 1 row. Packed sequences in flash_attn_varlen's (total, H, D) "
            "layout go in as (1, total, H, D) (x.unsqueeze(0)) with cu_seqlens"
        )
    if theta.device != x.device:
        raise ValueError(f"theta: is on {theta.device} but x is on {x.device}")
    return e


def validate_positions(x: torch.Tensor, offset, positions=None, cu_seqlens=None):
    """Check how token positions are given; returns (start, starts, table) for `position_args`:
    an int start, a (B,) int64 tensor of per-row starts, or a (B|1, N) integer `positions`
    table. Packed sequences (`cu_seqlens`) return (0, None, None): the kernels derive each
    token's position from its sequence's start on the device, with no per-call table."""
    if offset.__class__ is int and positions is None and cu_seqlens is None:  # the common call
        if not -_MAX_OFFSET <= offset <= _MAX_OFFSET:
            raise ValueError(f"offset: {offset} is out of range (positions are int64)")
        return offset, None, None
    b, n = x.shape[0], x.shape[1]
    given = [
        name for name, v in (("positions", positions), ("cu_seqlens", cu_seqlens)) if v is not None
    ]
    if len(given) == 2:
        raise ValueError("positions: give positions or cu_seqlens, not both")
    if given and not (_is_int(offset) and offset == 0):
        raise ValueError(f"offset: must be 0 when {given[0]} is given, got {offset!r}")
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or not _is_int_tensor(positions):
            raise ValueError("positions: expected an integer tensor (B, N)")
        if positions.dim() != 2 or positions.shape[1] != n or positions.shape[0] not in (1, b):
            raise ValueError(
                f"positions: expected shape (B, N) = ({b}, {n}) or (1, N), "
                f"got {tuple(positions.shape)}"
            )
        if positions.device != x.device:
            raise ValueError(f"positions: is on {positions.device} but x is on {x.device}")
        return 0, None, positions
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, n, x.device, what="tokens N")
        if b != 1:
            raise ValueError(f"x: packed sequences (cu_seqlens) need B = 1, got B = {b}")
        return 0, None, None
    if isinstance(offset, torch.Tensor):
        if not _is_int_tensor(offset):
            raise ValueError(
                f"offset: a tensor offset must have an integer dtype, got {offset.dtype}"
            )
        if tuple(offset.shape) != (b,):
            raise ValueError(
                f"offset: a tensor offset must have shape (B,) = ({b},), got {tuple(offset.shape)}"
            )
        if offset.device != x.device:
            raise ValueError(f"offset: is on {offset.device} but x is on {x.device}")
        return 0, offset.to(torch.int64), None
    if not _is_int(offset):
        raise ValueError(f"offset: expected an int or an integer tensor (B,), got {offset!r}")
    if isinstance(offset, int) and not -_MAX_OFFSET <= offset <= _MAX_OFFSET:
        raise ValueError(f"offset: {offset} is out of range (positions are int64)")
    return offset, None, None


def validate_act(x: torch.Tensor, act, dim, cu_seqlens=None) -> str:
    """act (and dim for softmax); returns the kernel kind (see KINDS). With `cu_seqlens`
    (already checked by validate_positions), softmax over the sequence also checks the number
    of sequences against kernelkit-act's limit for its packed stats."""
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
        if cu_seqlens is not None and cu_seqlens.shape[0] - 1 > MAX_PACKED_SEQUENCES:
            raise ValueError(
                f"cu_seqlens: softmax over the sequence takes at most {MAX_PACKED_SEQUENCES} "
                f"packed sequences, got {cu_seqlens.shape[0] - 1}"
            )
        return SEQ
    if dim % x.dim() == x.dim() - 1:
        return "softmax"
    raise ValueError(f"dim: softmax runs over D (dim=-1) or the sequence (dim=1), got dim={dim}")


_T = torch.Tensor
_grad_enabled = torch.is_grad_enabled


def shortcut_key(x, theta, offset, act, dim, positions=None, cu_seqlens=None) -> tuple | None:
    """The key of an LRPE op's common call in its `replay.Shortcuts` (a call like an earlier
    one that passed the checks replays its recorded sequence at once): plain tensors x and
    theta, an int offset inside validate_positions' bound (its width: its value is the
    replay's per-call value), no positions table, no packed sequences, act a str and dim None
    or an int, no torch.compile tracing or functorch transform. The key holds everything the
    checks and the replay key read: the layouts of x and theta (shapes, strides, dtypes,
    devices, alignment, whether they are one tensor), act, dim, the launch function and
    whether the interpreter runs; and, last, whether autograd records the call (x or theta
    requiring grad, grad mode on: the op then replays through `register_lrpe_autograd`'s
    node). None (the checked path) for every other call."""
    if (
        x.__class__ is _T
        and theta.__class__ is _T
        and offset.__class__ is int
        and -_MAX_OFFSET <= offset <= _MAX_OFFSET
        and positions is None
        and cu_seqlens is None
        and act.__class__ is str
        and (dim is None or dim.__class__ is int)
        and plain_call()
    ):
        return (
            x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15,
            theta.shape, theta.stride(), theta.dtype, theta.device, theta.data_ptr() & 15,
            theta is x, act, dim, replay.int_width(offset), interpreting(), runtime.launch,
            (x.requires_grad or theta.requires_grad) and _grad_enabled(),
        )  # fmt: skip
    return None


def act_and_dim(kind: str) -> tuple[str, int | None]:
    """The public (act, dim) of a kernel kind, for the references."""
    if kind == "softmax":
        return "softmax", -1
    if kind == SEQ:
        return "softmax", 1
    return kind, None


def cpu_reference_args(x: torch.Tensor, act: str, dim, cu_seqlens) -> tuple:
    """(x, act, dim) for a package's PyTorch reference on its CPU fallback (validated
    arguments). A softmax over sequences packed along N slices x at cu_seqlens' values, which
    torch.compile cannot trace inside a graph: it runs here, in float32, through kernelkit-act's
    op (opaque to torch.compile on that path, differentiable), and the reference then applies
    act "none" to it. The references compute in float32 anyway: the caller rounds the result to
    x's dtype once, as before."""
    if cu_seqlens is None or act != "softmax" or dim % x.dim() != 1:
        return x, act, dim
    return apply_act(x.float(), "softmax", 1, cu_seqlens=cu_seqlens), "none", None


# ---------------------------------------------------------------------------------------------
# Launch arguments and plans
# ---------------------------------------------------------------------------------------------


def position_args(start: int, starts: torch.Tensor | None, table: torch.Tensor | None) -> dict:
    """Per-call keyword arguments `offset` and `positions` of an LRPE kernel (the int start or
    the (B,) starts tensor; the per-token table or None)."""
    return {"offset": start if starts is None else starts, "positions": table}


def position_strides(table: torch.Tensor | None) -> dict:
    """Layout keyword arguments `stride_pb`, `stride_pn` of the positions table (one row
    broadcast over the batch: stride 0)."""
    if table is None:
        return {"stride_pb": 0, "stride_pn": 0}
    return {
        "stride_pb": table.stride(0) if table.shape[0] > 1 else 0,
        "stride_pn": table.stride(1),
    }


def launch_positions(start: int, starts, table, index: int | None):
    """(keyword arguments, vary) of the positions of a launch through `ops` (kernelkit.shared
    .replay): `offset`, `positions` and their strides, and, for an int offset, `vary` mapping
    `offset` to the int input `index` of the replayed call (each replay passes its own value).
    `index` None: the kernel reads no int offset (and specialises on it): fixed at `start`,
    which must then be the same at every call (0 with packed sequences)."""
    kwargs = {**position_args(start, starts, table), **position_strides(table)}
    per_call = index is not None and starts is None and table is None
    return kwargs, ({"offset": index} if per_call else None)


def theta_args(theta: torch.Tensor, slots: int) -> dict:
    """Keyword arguments `stride_th`, `stride_te`, `n_freq` of `kernels.slot_frequencies`: one
    row broadcast over heads (stride 0), and one frequency (E == 1) broadcast over all slots."""
    rows, e = theta.shape
    return {
        "stride_th": 0 if rows == 1 else theta.stride(0),
        "stride_te": 0 if e == 1 else theta.stride(1),
        "n_freq": slots if e == 1 else e,
    }


def as_float32(theta: torch.Tensor) -> torch.Tensor:
    """theta as the kernels read it (float32), without a call when it already is."""
    return theta if theta.dtype == torch.float32 else theta.to(torch.float32)


def programs_target(device: torch.device, per_sm: int) -> int:
    """How many programs fill the device `per_sm` deep (a small stand-in under the interpreter)."""
    return per_sm * num_sms(device)


def _merge_launch(rows: int, cols: int) -> tuple[tuple[int, int], dict]:
    """(grid, block keywords) of the chunk-merge kernels for `rows` x `cols` outputs."""
    block = min(next_power_of_2(cols), 1024)
    return (rows, cdiv(cols, block)), {"BLOCK_I": block, "num_warps": min(4, max(1, block // 128))}


def sequence_softmax_stats(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    ops=None,
    one_pass_elements: int = ONE_PASS_MAX_ELEMENTS,
) -> torch.Tensor:
    """Float32 (max, sum) of the softmax over the sequence of x (B, N, H, D), shape
    (2, B * H, 1, D), or with `cu_seqlens` (B = 1, sequences packed along N) one row per
    (sequence, head): (2, S * H, 1, D), row s * H + h. kernelkit-act's chunk-stats kernel reads
    x once for per-chunk stats, which `kernels.merge_chunk_stats_kernel` merges (one launch,
    float64 sums) when there is more than one chunk; x whose N x min(D rounded up to a power of
    2, 128) is at most `one_pass_elements` is read in one chunk (no merge: one launch in all).
    (The LRPE kernels read them through `kernelkit.act.kernels.combine_chunk_stats` with one
    chunk: merging C chunks inside every program instead cost lrpe-cosine, whose programs are 8
    tokens long, more loads than its data in the backward: 3.1 -> 6.7 ms at the seed shape on
    an H100.) `ops`: allocations and launches through kernelkit.shared.replay's interface
    (None: run them, act's plan cached)."""
    # x read as (B, H, N, D): outer dims B and H, inner D, whatever x's layout (a view given
    # as shape and strides: a replay takes only the tensors it was given).
    b, n, h, d = x.shape
    sb, sn, sh, sd = x.stride()
    view = ((b, h, n, d), (sb, sh, sn, sd))
    max_chunks = 1 if n * min(next_power_of_2(d), 128) <= one_pass_elements else None
    stats = softmax_chunk_stats(
        x, 2, cu_seqlens=cu_seqlens, ops=ops, view=view, max_chunks=max_chunks
    )
    return merge_chunk_stats(stats, ops=DIRECT if ops is None else ops)


def merge_chunk_stats(stats: torch.Tensor, *, ops=DIRECT) -> torch.Tensor:
    """float32 per-chunk softmax stats (2, R, C, I) (kernelkit-act's `softmax_chunk_stats`) ->
    the stats of the whole axis (2, R, 1, I), one launch (`kernels.merge_chunk_stats_kernel`,
    float64 sums rounded once) when C > 1; `ops` as in `sequence_softmax_stats`."""
    _, rows, chunks, cols = stats.shape
    if chunks == 1:
        return stats
    out = ops.empty((2, rows, 1, cols), torch.float32, stats.device)
    grid, blocks = _merge_launch(rows, cols)
    ops.launch(merge_chunk_stats_kernel, grid, stats, out, chunks, cols, **blocks)
    return out


def merge_chunk_sums(sums: torch.Tensor, *, ops=DIRECT) -> torch.Tensor:
    """float32 per-chunk partial sums (R, C, I) -> their sums over the chunks (R, 1, I), one
    launch (`kernels.merge_chunk_sums_kernel`, float64 sums) when C > 1; `ops` as in
    `sequence_softmax_stats`."""
    rows, chunks, cols = sums.shape
    if chunks == 1:
        return sums
    out = ops.empty((rows, 1, cols), torch.float32, sums.device)
    grid, blocks = _merge_launch(rows, cols)
    ops.launch(merge_chunk_sums_kernel, grid, sums, out, chunks, cols, **blocks)
    return out


def reduce_dtheta(partials: torch.Tensor, theta_shape, *, wrap: bool = False) -> torch.Tensor:
    """float32 partials (programs, H, slots) -> d(theta) of shape (rows, E), float32.

    Slots map to theta columns as `kernels.slot_frequencies` reads them (slot j < E is column j,
    E == 1 shares column 0, slots >= E have no column) or, with `wrap`, as
    `kernels.wrapped_frequencies` does (slot k is column k mod E)."""
    if not isinstance(wrap, bool):
        raise ValueError(f"wrap: expected a bool, got {wrap!r}")
    rows, e = theta_shape
    g = partials.sum(0)
    slots = g.shape[1]
    if wrap:
        per = -(-slots // e)
        g = torch.nn.functional.pad(g, (0, per * e - slots)).view(g.shape[0], per, e).sum(1)
    elif e == 1:
        g = g.sum(1, keepdim=True)
    else:
        g = g[:, :e]
    if rows == 1:
        g = g.sum(0, keepdim=True)
    return g.contiguous()


def register_lrpe_autograd(fwd, fwd_seq, grads) -> Callable:
    """The autograd of an LRPE package's ops. `fwd(x, theta, start, starts, positions,
    cu_seqlens, kind) -> y` and `fwd_seq(x, theta, start, starts, positions, cu_seqlens) ->
    (y, stats)` (softmax over the sequence: stats the backward reuses); `grads(ctx, dy) ->
    (dx, dtheta)` (None where not needed) reads `ctx.saved_tensors` (x or None, theta, starts,
    positions, cu_seqlens, stats), `ctx.kind` and `ctx.start`. x is kept only for an act or
    d(theta) (act none's dx needs only dy and the angles); the stats output gets no
    gradient, and autograd makes no zeros for it (a launch per call).

    Returns `replayed(x, theta, offset, entry) -> y`, the same node around a shortcut's
    recorded forward (`entry` = (the sequence, its kernel kind); an int offset, no positions
    table or packed sequences): the same saved tensors and backward as the op's own, for calls
    whose `shortcut_key` says autograd records them (plain calls only: no functorch)."""

    def save(ctx, kind, inputs, stats=None):
        x, theta, start, starts, positions, cu_seqlens = inputs[:6]
        ctx.kind, ctx.start = kind, start
        keep_x = kind != "none" or ctx.needs_input_grad[1]
        ctx.save_for_backward(x if keep_x else None, theta, starts, positions, cu_seqlens, stats)

    def setup(ctx, inputs, output):
        save(ctx, inputs[6], inputs)

    def backward(ctx, dy):
        return *grads(ctx, dy), None, None, None, None, None

    def setup_seq(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        save(ctx, SEQ, inputs, output[1])

    def backward_seq(ctx, dy, _dstats):
        if dy is None:  # only the stats (internal: their gradient is not propagated) got one
            return None, None, None, None, None, None
        return *grads(ctx, dy), None, None, None, None

    fwd.register_autograd(backward, setup_context=setup)
    fwd_seq.register_autograd(backward_seq, setup_context=setup_seq)

    def forward_replayed(ctx, x, theta, offset, entry):
        seq, kind = entry
        inputs = (x, theta, offset, None, None, None)
        outputs = seq(inputs)
        save(ctx, kind, inputs, outputs[1] if kind == SEQ else None)
        return outputs[0]

    def backward_replayed(ctx, dy):
        return *grads(ctx, dy), None, None

    node = type(
        "LrpeReplayedForward",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward_replayed), "backward": staticmethod(backward_replayed)},
    )
    return function_apply(node)
