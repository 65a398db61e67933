"""Launch plans of `act`: how each kernel of kernels.py is launched for a tensor's layout (grids,
sizes, strides, prepared launches cached per layout), and the host API `softmax_chunk_stats`."""

from __future__ import annotations

import torch

from kernelkit.shared.layout import collapse_dims, is_dense
from kernelkit.shared.runtime import (
    PLAIN_TENSORS,
    PlanCache,
    cdiv,
    launch,
    next_power_of_2,
    num_sms,
)

from . import kernels as K

# Tile sizes (elements). Memory-bound: big enough for 16-byte accesses and several loads in
# flight per thread, small enough to keep thousands of programs at benchmark sizes.
ELEMENTWISE_BLOCK = 2048
ELEMENTWISE_WARPS = 8
ROWS_MAX_L = 8192  # a softmax row up to this long is held by one program (single pass)
ROWS_TILE = 2048  # elements per (rows x L) tile of the single-pass row kernels
COLS_MAX_L = 1024  # a softmax axis up to this long, beside I > 1 columns: one pass (columns)
COLS_TILE = 16384  # elements per [L, I] tile of the columns kernels (>= 16 columns at L 1024)
COLS_WARPS = 8
SPLIT_TILE = 16384  # elements per (L x I) tile of the split-L kernels: more bytes in flight
# The backward's apply kernel holds three tiles (y, dy, dx): at 16384 one of its specialisations
# (64-bit outer strides, a (1, 65536, 32, 128) tensor) compiled to 32 registers and 832 bytes of
# spills on an H100, 7.8 ms instead of 0.67 ms. 8192 compiles without spills (166-198 registers)
# and is as fast elsewhere (NOTES.md).
SPLIT_BWD_TILE = 8192
SPLIT_WARPS = 4  # warps of the split-L softmax kernels
PROGRAMS_PER_SM = 8  # split-L: chunks are added until about this many programs per SM
MAX_PACKED_SEQUENCES = 65535  # packed sequences x chunks share grid axis 1 (CUDA limit 65535)
PACKED_WAVES = 4  # packed sequences: chunks until about this many times PROGRAMS_PER_SM,
PACKED_CHUNK_CAP = 32  # but no more than this many chunks per sequence for that


def _strided4(shape, strides):
    """Pad a collapsed (<= 4-D) layout to 4 dims: sizes (d1, d2, d3), one 4-stride per tensor."""
    pad = 4 - len(shape)
    sizes = [1] * pad + list(shape)
    return sizes[1:], [[0] * pad + list(s) for s in strides]


# Plans (grid, sizes, strides, prepared launches) depend only on shapes and strides: eager calls
# keep them in `_PLANS`, so a repeated call costs a dict lookup. Traced calls (fake tensors,
# symbolic sizes) build a plan and use it once.
_PLANS = PlanCache()


def _elementwise_plan(kernel, act: str, *tensors: torch.Tensor):
    """A function of (*inputs, out) that launches the element-wise `kernel` on them."""
    out = tensors[-1]
    # Contiguous (the common case, checked in C) or dense with one shared stride order.
    flat = all(t.is_contiguous() for t in tensors)
    if not flat:
        stride = out.stride()
        flat = all(t.stride() == stride for t in tensors) and is_dense(out.shape, stride)
    if flat:
        sizes, strides = [1, 1, 1], [[0, 0, 0, 1]] * len(tensors)
    else:
        shape, strides = collapse_dims(out.shape, *(t.stride() for t in tensors))
        if len(shape) > 4:  # layouts no 4-D view describes: read a compact copy instead
            return lambda *ts: run_elementwise(
                kernel, ts[-1], *(t.contiguous() for t in ts[:-1]), act=act
            )
        sizes, strides = _strided4(shape, strides)
    return launch(kernel).prepare(
        (cdiv(out.numel(), ELEMENTWISE_BLOCK),),
        *tensors,
        out.numel(),
        *sizes,
        *(s for st in strides for s in st),
        ACT=act,
        FLAT=flat,
        BLOCK=ELEMENTWISE_BLOCK,
        num_warps=ELEMENTWISE_WARPS,
    )


def run_elementwise(kernel, out: torch.Tensor, *tensors: torch.Tensor, act: str) -> torch.Tensor:
    n = out.numel()
    if n == 0:
        return out
    ts = (*tensors, out)
    for t in ts:
        if t.__class__ not in PLAIN_TENSORS or not t.is_contiguous():
            break
    else:  # plain and contiguous: the plan depends on the size only
        # (id: a JITFunction hashes its source's cache key, ~0.3 us)
        key = (id(kernel), act, n)
        plan = _PLANS._plans.get(key)  # PlanCache.get without its call, on a hit
        if plan is None:
            plan = _PLANS.get(key, _elementwise_plan, kernel, act, *ts)
        plan(*ts)
        return out
    if all(t.__class__ in PLAIN_TENSORS for t in ts):
        key = (id(kernel), act, out.shape, *(t.stride() for t in ts))
        _PLANS.get(key, _elementwise_plan, kernel, act, *ts)(*ts)
    else:  # traced: fake tensors, maybe symbolic sizes
        _elementwise_plan(kernel, act, *ts)(*ts)
    return out


class SoftmaxView:
    """Tensors of one shape viewed as (O0, O1, L, I) around the softmax dim, with per-tensor
    strides (o0, o1, l, i). Outer dims must collapse to two and inner dims to one."""

    def __init__(self, shape, dim: int, strides_list):
        outer, o_strides = collapse_dims(shape[:dim], *(s[:dim] for s in strides_list))
        inner, i_strides = collapse_dims(shape[dim + 1 :], *(s[dim + 1 :] for s in strides_list))
        self.ok = len(outer) <= 2 and len(inner) == 1
        if not self.ok:
            return
        pad = 2 - len(outer)
        self.O0, self.O1 = [1] * pad + outer
        self.L = shape[dim]
        self.I = inner[0]
        self.strides = [
            [*([0] * pad + os_), st[dim], is_[0]]
            for os_, is_, st in zip(o_strides, i_strides, strides_list)
        ]


def _split_plan(
    view: SoftmaxView, device: torch.device, seqs: int | None = None, tile=None, max_chunks=None
):
    """(BLOCK_L, BLOCK_I, chunk, num_chunks) for the split-L softmax kernels. With `seqs` packed
    sequences along L, each is split into num_chunks chunks (their size is set per sequence
    on the device, from its length; `chunk` is unused). `max_chunks`: at most that many."""
    block_i = min(next_power_of_2(view.I), 128)
    block_l = max(1, (tile or SPLIT_TILE) // block_i)
    programs = view.O0 * view.O1 * cdiv(view.I, block_i) * (seqs or 1)
    target = PROGRAMS_PER_SM * num_sms(device)
    cap = max_chunks or cdiv(view.L, block_l)
    if seqs is None:
        chunks = max(1, min(cdiv(target, programs), cdiv(view.L, block_l), cap))
        chunk = cdiv(cdiv(view.L, chunks), block_l) * block_l
        return block_l, block_i, chunk, cdiv(view.L, chunk)
    # Packed: a sequence's chunks are 1/num_chunks of it, so a long one among short ones makes
    # long programs; PACKED_WAVES times more chunks keep the tail of the launch short. Every
    # apply program merges all chunks of its row, so the extra chunks stop at PACKED_CHUNK_CAP.
    base = cdiv(target, programs)
    chunks = min(base * PACKED_WAVES, max(base, PACKED_CHUNK_CAP))
    chunks = max(1, min(chunks, cdiv(view.L, block_l), cap, MAX_PACKED_SEQUENCES // seqs))
    return block_l, block_i, block_l, chunks


def _rows_plan(view: SoftmaxView):
    block_l = next_power_of_2(view.L)
    block_r = max(1, ROWS_TILE // block_l)
    return block_r, block_l, (4 if block_r * block_l <= 2048 else 8)


def _use_rows(view: SoftmaxView) -> bool:
    return view.I == 1 and view.L <= ROWS_MAX_L


def _cols_launch(kernel, view: SoftmaxView, tile: int, *tensors):
    """The columns kernel's launch prepared for `view` (whole columns of about `tile`
    elements per program), a function of `tensors`."""
    block_l = next_power_of_2(view.L)
    block_i = max(1, min(next_power_of_2(view.I), tile // block_l))
    grid = (view.O0 * view.O1 * cdiv(view.I, block_i),)
    sizes = (view.L, view.I, view.O1)
    strides = [s for st in view.strides for s in st]
    return launch(kernel).prepare(
        grid, *tensors, *sizes, *strides, BLOCK_L=block_l, BLOCK_I=block_i, num_warps=COLS_WARPS
    )


class _SplitLaunches:
    """The split-L plan of one layout: float32 scratch of `shape` (from `new`, a float32 tensor
    on the device: `new.new_empty(shape)` is the cheapest allocation call) and the grid, sizes
    and block shapes shared by the split kernels. With `cu_seqlens` (packed sequences along L,
    the same for every outer index) the launches take it as their last tensor and the
    stats have a row per (sequence, outer index)."""

    def __init__(
        self, t, view: SoftmaxView, plan=None, cu_seqlens=None, tile=None, max_chunks=None
    ):
        seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
        self.plan = plan or _split_plan(view, t.device, seqs, tile, max_chunks)
        block_l, block_i, chunk, num_chunks = self.plan
        self.cu_seqlens = cu_seqlens
        self.shape = (2, (seqs or 1) * view.O0 * view.O1, num_chunks, view.I)
        self.new = torch.empty(0, dtype=torch.float32, device=t.device)
        self.grid = (view.O0 * view.O1 * cdiv(view.I, block_i), (seqs or 1) * num_chunks)
        self.sizes = (view.L, view.I, view.O1, chunk, num_chunks)
        self.blocks = {"BLOCK_L": block_l, "BLOCK_I": block_i, "num_warps": SPLIT_WARPS}

    def prepare(self, kernel, *tensors, strides):
        return launch(kernel).prepare(
            self.grid, *tensors, *self.sizes, *strides, cu_seqlens=self.cu_seqlens, **self.blocks
        )


def _packed(cu_seqlens) -> tuple:
    """The trailing per-call tensor of a split launch: (cu_seqlens,) or ()."""
    return () if cu_seqlens is None else (cu_seqlens,)


class _StatsPlan(_SplitLaunches):
    """softmax_chunk_stats of one layout: a function of (x, cu_seqlens) returning the
    (2, S * O, C, I) stats."""

    def __init__(
        self, x: torch.Tensor, view: SoftmaxView, plan=None, cu_seqlens=None, max_chunks=None
    ):
        super().__init__(x, view, plan, cu_seqlens, max_chunks=max_chunks)
        stats = self.new.new_empty(self.shape)
        self.launch = self.prepare(K.softmax_chunk_stats_kernel, x, stats, strides=view.strides[0])

    def __call__(self, x: torch.Tensor, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(stats, stats[1]): the maxima start where stats does."""
        stats = self.new.new_empty(self.shape)
        self.launch(x, stats, *_packed(cu_seqlens))
        return stats, stats[1]


def softmax_chunk_stats(
    x: torch.Tensor,
    dim: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
    ops=None,
    view: tuple | None = None,
    max_chunks: int | None = None,
) -> torch.Tensor:
    """Per-chunk float32 (max, sum) of a softmax over `dim` of x: shape (2, O, C, I), where O
    is the product of the dims before `dim`, I of those after it, and C the number of chunks
    the softmax axis is split into (stats[0] the maxima, stats[1] the sums of exp(x - max)).
    With `cu_seqlens` (int32 prefix sums of S sequences packed along `dim`, see `act`) the
    shape is (2, S * O, C, I): row s * O + o holds the C chunks of sequence s (an empty
    sequence: max -inf, sum 0).

    Building block for ops that fuse a softmax over a long axis (the lrpe packages): they read
    x once here, then combine the C chunks of the columns they need with
    `kernels.combine_chunk_stats` while they write their output. The dims before `dim` must
    collapse to at most two and those after it to one (always true for a (B, H, N, D) view).
    Arguments are not validated (callers in other packages validate their own).

    `view` = (shape, strides): read x's storage (from x's first element) as that view instead,
    without making it. `ops` (kernelkit.shared.replay's interface): allocate the stats and
    launch through it, for a caller whose launch sequence is recorded and replayed (a replay
    takes only the tensors it was given, hence `view` rather than a view of x).

    `max_chunks`: split the axis into at most that many chunks (None: as many as fill the
    device). One chunk returns stats a caller can use without a merge (a launch fewer for
    short axes, where the host path costs more than the GPU work).
    """
    if ops is not None:
        shape, strides = view if view is not None else (x.shape, x.stride())
        lay = _stats_plan(x, dim, cu_seqlens, shape, strides, prepare=False, max_chunks=max_chunks)
        stats = ops.empty(lay.shape, torch.float32, x.device)
        ops.launch(
            K.softmax_chunk_stats_kernel,
            lay.grid,
            x,
            stats,
            *lay.sizes,
            *lay.strides,
            cu_seqlens=cu_seqlens,
            **lay.blocks,
        )
        return stats
    if view is not None:
        x = x.as_strided(*view)
    if x.__class__ in PLAIN_TENSORS:
        seqs = None if cu_seqlens is None else cu_seqlens.shape[0]
        key = ("stats", dim, seqs, max_chunks, x.get_device(), x.shape, x.stride())
        plan = _PLANS.get(key, _stats_plan, x, dim, cu_seqlens, None, None, True, max_chunks)
        return plan(x, cu_seqlens)[0]
    return _stats_plan(x, dim, cu_seqlens, max_chunks=max_chunks)(x, cu_seqlens)[0]


def _stats_plan(
    x: torch.Tensor, dim: int, cu_seqlens, shape=None, strides=None, prepare=True, max_chunks=None
):
    """The `_StatsPlan` of x (or of x read as `shape` / `strides`); `prepare=False`: only its
    layout (`_SplitLaunches`, plus the view's strides as `strides`); `max_chunks` as in
    `softmax_chunk_stats`."""
    view = SoftmaxView(
        x.shape if shape is None else shape, dim, [x.stride() if strides is None else strides]
    )
    if not view.ok:
        raise ValueError("x: layout not supported by the split softmax (collapse failed)")
    if prepare:
        return _StatsPlan(x, view, cu_seqlens=cu_seqlens, max_chunks=max_chunks)
    lay = _SplitLaunches(x, view, cu_seqlens=cu_seqlens, max_chunks=max_chunks)
    lay.strides = view.strides[0]
    return lay


class _SplitSoftmaxFwd(_SplitLaunches):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, view: SoftmaxView, cu_seqlens=None):
        super().__init__(x, view, cu_seqlens=cu_seqlens)
        self.stats = _StatsPlan(x, view, self.plan, cu_seqlens)
        m = self.new.new_empty(self.shape)
        self.apply = self.prepare(
            K.softmax_fwd_apply_kernel, x, y, m, m[1], strides=(*view.strides[0], *view.strides[1])
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor, cu_seqlens=None) -> None:
        self.apply(x, y, *self.stats(x, cu_seqlens), *_packed(cu_seqlens))


class _SplitSoftmaxBwd(_SplitLaunches):
    def __init__(self, y, dy, dx, view: SoftmaxView, cu_seqlens=None):
        super().__init__(y, view, cu_seqlens=cu_seqlens, tile=SPLIT_BWD_TILE)
        self.shape = self.shape[1:]  # one float32 sum(y * dy) per (row, chunk, column)
        p = self.new.new_empty(self.shape)
        ys, gs, ds = view.strides
        self.sums = self.prepare(K.softmax_bwd_chunk_sums_kernel, y, dy, p, strides=(*ys, *gs))
        self.apply = self.prepare(K.softmax_bwd_apply_kernel, y, dy, dx, p, strides=(*ys, *gs, *ds))

    def __call__(self, y, dy, dx, cu_seqlens=None) -> None:
        p = self.new.new_empty(self.shape)
        packed = _packed(cu_seqlens)
        self.sums(y, dy, p, *packed)
        self.apply(y, dy, dx, p, *packed)


def _softmax_fwd_plan(x: torch.Tensor, y: torch.Tensor, dim: int, cu_seqlens=None):
    """A function that writes softmax(x, dim) into y: called as (x, y), or (x, y, cu_seqlens)
    with packed sequences (a plan is made for one or the other). The one-launch plans are the
    prepared launch itself (no wrapper: its call is the whole host path)."""
    view = SoftmaxView(x.shape, dim, [x.stride(), y.stride()])
    if not view.ok:
        return lambda x, y, cu=None: y.copy_(run_softmax_fwd(x.contiguous(), dim, cu))
    if cu_seqlens is None and view.I > 1 and view.L <= COLS_MAX_L:
        return _cols_launch(K.softmax_fwd_cols_kernel, view, COLS_TILE, x, y)
    if cu_seqlens is not None or not _use_rows(view):
        return _SplitSoftmaxFwd(x, y, view, cu_seqlens)
    block_r, block_l, warps = _rows_plan(view)
    rows = view.O0 * view.O1
    xs, ys = view.strides
    return launch(K.softmax_fwd_rows_kernel).prepare(
        (cdiv(rows, block_r),),
        x,
        y,
        rows,
        view.L,
        view.O1,
        *xs[:3],
        *ys[:3],
        BLOCK_R=block_r,
        BLOCK_L=block_l,
        num_warps=warps,
    )


def _softmax_bwd_plan(y, dy, dx, dim: int, cu_seqlens=None):
    """A function that writes the softmax backward into dx: called as (y, dy, dx), or
    (y, dy, dx, cu_seqlens) with packed sequences (as `_softmax_fwd_plan`)."""
    view = SoftmaxView(y.shape, dim, [y.stride(), dy.stride(), dx.stride()])
    if not view.ok:
        return lambda y, dy, dx, cu=None: dx.copy_(
            run_softmax_bwd(y.contiguous(), dy.contiguous(), dim, cu)
        )
    if cu_seqlens is None and view.I > 1 and view.L <= COLS_MAX_L:
        return _cols_launch(K.softmax_bwd_cols_kernel, view, COLS_TILE, y, dy, dx)
    if cu_seqlens is not None or not _use_rows(view):
        return _SplitSoftmaxBwd(y, dy, dx, view, cu_seqlens)
    block_r, block_l, warps = _rows_plan(view)
    rows = view.O0 * view.O1
    ys, gs, ds = view.strides
    return launch(K.softmax_bwd_rows_kernel).prepare(
        (cdiv(rows, block_r),),
        y,
        dy,
        dx,
        rows,
        view.L,
        view.O1,
        *ys[:3],
        *gs[:3],
        *ds[:3],
        BLOCK_R=block_r,
        BLOCK_L=block_l,
        num_warps=warps,
    )


def run_softmax_fwd(x: torch.Tensor, dim: int, cu_seqlens=None) -> torch.Tensor:
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    if cu_seqlens is None and x.__class__ in PLAIN_TENSORS and x.is_contiguous():
        # The common call: x and y contiguous, so the plan depends on dim, device and shape
        # (PlanCache.get without its call on a hit, as run_elementwise's).
        key = ("fwd dense", dim, x.get_device(), x.shape)
        plan = _PLANS._plans.get(key)
        if plan is None:
            plan = _PLANS.get(key, _softmax_fwd_plan, x, y, dim)
        plan(x, y)
        return y
    if x.__class__ in PLAIN_TENSORS and (
        cu_seqlens is None or cu_seqlens.__class__ is torch.Tensor
    ):
        seqs = None if cu_seqlens is None else cu_seqlens.shape[0]
        key = ("fwd", dim, seqs, x.get_device(), x.shape, x.stride(), y.stride())
        plan = _PLANS.get(key, _softmax_fwd_plan, x, y, dim, cu_seqlens)
    else:
        plan = _softmax_fwd_plan(x, y, dim, cu_seqlens)
    plan(x, y, *_packed(cu_seqlens))
    return y


def run_softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dim: int, cu_seqlens=None) -> torch.Tensor:
    dx = torch.empty_like(y)
    if y.numel() == 0:
        return dx
    if (
        cu_seqlens is None
        and y.__class__ in PLAIN_TENSORS
        and dy.__class__ in PLAIN_TENSORS
        and y.is_contiguous()
        and dy.is_contiguous()
    ):  # y, dy and dx contiguous: as run_softmax_fwd's common call
        key = ("bwd dense", dim, y.get_device(), y.shape)
        plan = _PLANS._plans.get(key)
        if plan is None:
            plan = _PLANS.get(key, _softmax_bwd_plan, y, dy, dx, dim)
        plan(y, dy, dx)
        return dx
    if PlanCache.cacheable(y, dy, cu_seqlens):  # plain tensors: plans are cached per layout
        seqs = None if cu_seqlens is None else cu_seqlens.shape[0]
        key = ("bwd", dim, seqs, y.get_device(), y.shape, y.stride(), dy.stride(), dx.stride())
        plan = _PLANS.get(key, _softmax_bwd_plan, y, dy, dx, dim, cu_seqlens)
    else:
        plan = _softmax_bwd_plan(y, dy, dx, dim, cu_seqlens)
    plan(y, dy, dx, *_packed(cu_seqlens))
    return dx


__all__ = ["run_elementwise", "run_softmax_bwd", "run_softmax_fwd", "softmax_chunk_stats"]
