"""The host functions that launch flash-attn's kernels: `forward` (dense, split-KV or Gluon) and
`backward`, from validated arguments and a plan."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton

from kernelkit.shared import replay
from kernelkit.shared.runtime import (
    cdiv,
    interpreting,
    next_power_of_2,
    num_sms,
)

from . import kernels as K

try:  # Gluon (triton.experimental.gluon) is newer than the oldest Triton this package accepts
    from . import kernels_gluon as KG
except ImportError:  # pragma: no cover
    KG = None
from .plans import (
    COMBINE_BLOCK_R,
    FWD_TILES,
    INTERPRETER_FWD,
    PREPROCESS_BLOCK_M,
    Plan,
    SplitPlan,
    Tile,
    _gluon_flag,
    _tma_flag,
    _tma_scratch,
    block_d_for,
    dot_precision,
    fused_dq_plan,
    plan_for,
    portable_dkdv,
    split_plan,
)

LOG2E = 1.4426950408889634  # scores run in log2 units (exp2)


def _forward_gluon(ops, q, k, v, o, lse, tile: Tile, causal: bool, qk_scale: float,
                   cap_scale: float, softcap_mode: int) -> None:  # fmt: skip
    """The Gluon forward (dense, non-causal or bottom-right causal, softcap through
    tanh.approx (`_score_args`' mode 2) or none; no window or packing)."""
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    num_m = cdiv(nq, tile.block_m)
    pairs = causal and GLUON_FWD_CAUSAL_PAIRS and num_m % 2 == 0
    units = num_m * b * h // (2 if pairs else 1)
    programs = min(units, num_sms(q.device)) if GLUON_FWD_PERSISTENT else units
    ops.launch(
        KG.attn_fwd_gluon_kernel, (programs,),
        q, k, v, o, lse, *_tma_strides3(q), *_tma_strides3(k), *_tma_strides3(v),
        *_strides3(o), b, h, h // hkv, nq, nk, qk_scale, cap_scale, HEAD_DIM=d,
        BLOCK_D=block_d_for(d),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, CAUSAL=causal,
        EVEN_M=bool(nq % tile.block_m == 0), EVEN_N=bool(nk % tile.block_n == 0),
        DOT_PREC=dot_precision(q.dtype), TMA=True, STAGES=tile.stages,
        SOFTCAP=softcap_mode == 2, Q_REGS=block_d_for(d) <= GLUON_FWD_Q_REGS_MAX_D,
        PAIRS=pairs, num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip


# Softcap on half-precision inputs on the GPU uses the tanh.approx.f32 instruction (one MUFU op,
# as FlashAttention does); float32 inputs and the interpreter an exact float32 formula. False:
# the exact formula everywhere (an A/B switch; NOTES.md).
FAST_TANH = True
# The backward's query (dk/dv) and key (dq) loops at a length that is not a block multiple
# (ragged dense N, every packed batch): only the last, partial block takes the length checks,
# the blocks before it run the unchecked code of a block-multiple length. False: every block of
# a ragged loop is checked, as before (an A/B switch; lab/flash-attn/ab/varlen_ab.py).
PEEL_RAGGED_TAIL = True
# The backward's row vectors (the LSE in log2 units and delta) written by its preprocess padded:
# each length rounded up to ROW_PAD rows (+inf / 0 there) and each sequence of a packed batch
# starting on a multiple of 16. The dk/dv and dq kernels then read them without row checks and
# with 8-byte vectors at any length: the ragged and packed d64 dk/dv kernel needed 207-224
# registers without it (2 programs per SM), 156 at block-multiple lengths (3). False: the
# forward's LSE and an unpadded delta, checked rows (an A/B switch; lab/flash-attn/ab/varlen_ab.py).
PAD_ROW_VECTORS = True
ROW_PAD = 128  # at least every backward tile's BLOCK_M (powers of two)
# The Gluon forward up to this BLOCK_D holds its q tile in registers as the S = q K^T wgmma's A
# operand instead of reading it from shared memory (d128 would spill). H100 A/B (NOTES.md,
# session 21), d64 TFLOP/s shared / registers: non-causal 424 / 443 at 16k, 407 / 430 at 8k,
# 373 / 404 at 4k; causal 418 / 430 at 16k. 0: never (an A/B switch).
GLUON_FWD_Q_REGS_MAX_D = 64
# The Gluon forward launches one program per SM, each walking its share of the tiles (the next
# tile's q and K/V load while the current one finishes; the descriptors are built once);
# False: one program per tile (an A/B switch). Causal forwards with an even number of query
# blocks walk them in pairs of a long and a short one (kernels_gluon._fwd_tile, PAIRS), so that
# the programs stay in step on the same heads (with single tiles the persistent causal forward
# lost 30% at 16k: the programs drift apart over the heads, whose K/V then leave L2). H100
# (session 22, interleaved, TFLOP/s one program per tile / persistent / persistent in pairs;
# lab/flash-attn/logs/*-gluon-fwd-persistent-pairs-session22.log): d128 causal 16k 591 / 420 / 602,
# 8k 528 / 537 / 570, 4k 468 / 511 / 534; non-causal 16k 610 / 626, 4k 549 / 600, 1k (B16)
# 392 / 502; d64 causal leaderboard 431 / 298 / 439, 16k 424 / 407 / 432, 8k 387 / 404 / 419,
# 4k 326 / 373 / 394, 2k 253 / 311 / 346; non-causal 16k 434 / 432, 8k 400 / 446, 4k 379 / 430.
GLUON_FWD_PERSISTENT = True
GLUON_FWD_CAUSAL_PAIRS = True
# The same for the K and V of the Gluon dk/dv kernel that sums dq (the S^T and dP^T products'
# A operands): d64 fused backward 1.02-1.06x (H100, session 21). The dk/dv-only variant
# (dq kernel beside it) computed wrong dk / dv with them on the H100 (the fused variants were
# bitwise right; a miscompile not understood), so it keeps them in shared memory.
GLUON_BWD_KV_REGS_MAX_D = 64
# dq summed in the Gluon dk/dv kernel (`plans.GLUON_FUSED_DQ`) up to this BLOCK_D: its dq
# warpgroup holds a BLOCK_M x BLOCK_D float32 part in 72 registers per thread beside two
# consumers at 208 (kernels_gluon.FUSED_CONSUMER_REGS); above it the dq kernel runs beside.
GLUON_FUSED_DQ_MAX_D = 64
# The Gluon dk/dv kernel (dq kernel beside it) for at most this many query rows launches one
# program per SM walking its share of the tiles (kernels_gluon PERSISTENT), as the forward.
# H100, session 22, d128 backward TFLOP/s one program per tile / persistent
# (lab/flash-attn/logs/*-gluon-bwd-persistent-short-session22.log): 1k (B16 H16) 295 / 309, causal
# 214 / 227; 2k 347 / 357, causal 288 / 301; 4k 395 / 397, causal 352 / 357; 8k causal 396 /
# 398; 16k causal 429 / 417. The fused-dq variants always run one program per tile (looping
# made the d64 one spill). 0: never (an A/B switch).
GLUON_BWD_PERSISTENT_MAX_N = 4096


# The Gluon dk/dv kernel's tiles go in groups of a few (batch, kv head)s (`_bwd_tile_heads`);
# False: key-block-major over all heads (an A/B switch). H100, session 23, backward TFLOP/s
# key-block-major / grouped (lab/flash-attn/logs/*-bwd-tile-groups-session23.log): d64 fused dq
# in any order causal 16k (B1 H32) 394 / 428, 8k 352 / 428, 4k 225 / 372, non-causal 16k 381 / 413,
# 4k 246 / 415, the leaderboard (B16 H1) 446 / 434; in a fixed order non-causal 16k 370 / 397,
# 4k 219 / 344; d128 dk/dv-only non-causal 16k 441 / 454, 4k 397 / 410. Persistent causal
# tiles stay key-block-major (d128 4k 367 / 301 grouped: each program's tiles were then all
# long or all short).
GLUON_BWD_HEAD_GROUPS = True
# Causal dq sums in a fixed order go from the last key block down, launched in that order
# (`_bwd_tile_order`); False: from key block 0 up, key-block-major over all heads (0.6.0). Up,
# key block j waits for j - 1 to climb the two query blocks j starts above it, and in groups
# that chain is a whole head long (leaderboard 379 -> 246 grouped); down, j + 1 started two
# blocks below j and is ahead. The price: the longest tiles launch last (a tail of 3-7% by a
# list-scheduling estimate). H100, session 23, up / down (lab/flash-attn/logs/
# *-bwd-descending-dq-session23.log): leaderboard 369 / 390, 16k B1 H32 364 / 403, 32k H16
# 393 / 421, 8k B2 H32 299 / 360, 4k B4 H32 202 / 312.
GLUON_BWD_DESCENDING_DQ = True


def _bwd_tile_heads(bhk: int, key_blocks: int, sms: int, key_block_major: bool) -> int:
    """(batch, kv head)s per tile group of the Gluon dk/dv kernel (`kernels_gluon._bwd_tile`):
    the largest divisor of bhk that keeps about one wave of programs on the group, so that the
    programs running at once share q, do and dq's sums in L2; bhk (one group) where the tiles
    must stay key-block-major."""
    if key_block_major or not GLUON_BWD_HEAD_GROUPS:
        return bhk
    want = max(1, cdiv(sms, key_blocks))
    return max(g for g in range(1, min(want, bhk) + 1) if bhk % g == 0)


def _bwd_tile_order(bhk: int, key_blocks: int, sms: int, causal: bool, persistent: bool,
                    ordered: bool) -> int:  # fmt: skip
    """kernels_gluon._bwd_tile's tile_heads: groups of `_bwd_tile_heads` (batch, kv head)s,
    negative (each group from its last key block down) for causal dq sums in a fixed order;
    one group (key-block-major) for persistent causal tiles, or causal sums in a fixed order
    from key block 0 up."""
    if causal and ordered and GLUON_BWD_DESCENDING_DQ:
        return -_bwd_tile_heads(bhk, key_blocks, sms, False)
    return _bwd_tile_heads(bhk, key_blocks, sms, causal and (persistent or ordered))


def _pad_row_vectors(varlen: Varlen | None, nq: int, bd: int) -> bool:
    """Whether a backward takes the padded row vectors (`PAD_ROW_VECTORS`): packed batches,
    ragged lengths and BLOCK_D <= 64. H100 A/B (NOTES.md, session 19): packed d64 causal
    backward 1.26x -> 1.02x the dense one; dense d64 1-5% faster; dense block-multiple d128
    non-causal 3% slower (causal equal), so d >= 128 keeps the plain vectors there."""
    return PAD_ROW_VECTORS and (varlen is not None or nq % ROW_PAD != 0 or bd <= 64)


def _score_args(scale: float, softcap: float, q: torch.Tensor) -> tuple[float, float, int]:
    """(qk_scale, cap_scale, SOFTCAP) of a launch: scores in log2 units are q.k * qk_scale, or
    with a cap tanh(q.k * cap_scale) * qk_scale (kernels.py); SOFTCAP 0 off, 1 exact tanh,
    2 tanh.approx."""
    if not softcap:
        return scale * LOG2E, 0.0, 0
    fast = FAST_TANH and q.device.type == "cuda" and q.dtype != torch.float32
    return softcap * LOG2E, scale / softcap, 2 if fast else 1


def _window_args(causal: bool, window: tuple[int, int]) -> tuple[bool, bool, int, int]:
    """(CAUSAL, LOCAL, win_left, win_right) of a launch: CAUSAL bounds keys on the right
    (j <= i + shift + win_right; causal is win_right = 0), LOCAL on the left."""
    left, right = window
    upper = causal or right >= 0
    return upper, left >= 0, max(left, 0), 0 if causal else max(right, 0)


def _unit_d(t: torch.Tensor) -> torch.Tensor:
    """The kernels read D with unit stride; any other layout of the last dim is copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides3(t: torch.Tensor):
    return t.stride(0), t.stride(1), t.stride(2)


def _tma_strides3(t: torch.Tensor):
    """`_strides3` for a TMA descriptor over the whole tensor: a dim of size 1 is never stepped
    (its coordinate is 0) and `use_tma` does not check its stride, which may then be anything
    (a slice, an unsqueeze): a 16-byte stand-in, as the copy engine requires."""
    return tuple(st if n > 1 else 16 // t.element_size() for st, n in zip(t.stride()[:3], t.shape))


@dataclass(frozen=True)
class Varlen:
    """A packed batch (`flash_attn_varlen`): q (total_q, H, D), k/v (total_k, Hkv, D), sequence
    b being rows cu_q[b]:cu_q[b + 1] of q and cu_k[b]:cu_k[b + 1] of k/v (int32 prefix sums, on
    q's device); max_q, max_k bound the sequence lengths (they size the grid)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _seq_strides(t: torch.Tensor, varlen: Varlen | None):
    """(batch, row, head) strides of a (B, N, H, D) tensor; for a packed (total, H, D) one the
    batch stride is 0: each sequence's programs start at its own row (kernels.py, VARLEN)."""
    return _strides3(t) if varlen is None else (0, t.stride(0), t.stride(1))


# `forward` and `backward` key their replayed launch sequences (`replay.replayed`) on the
# tensors (and a packed batch's cu_seqlens) and options: the call's (direction, causal, scale,
# softcap, window, a packed batch's max_seqlen or None), then the module switches and the rule
# that plans read (tests patch them): FAST_TANH, PEEL_RAGGED_TAIL, PAD_ROW_VECTORS, the
# GLUON_FWD_* switches (forward) or GLUON_BWD_* ones (backward), interpreting(). Built inline:
# this is the host path of every call.


def forward(
    q,
    k,
    v,
    causal: bool,
    scale: float,
    plan: Plan | None = None,
    split: SplitPlan | None = None,
    softcap: float = 0.0,
    window: tuple[int, int] = (-1, -1),
    varlen: Varlen | None = None,
):
    """(o, lse) for 4-D q (B, Nq, H, D), k/v (B, Nk, Hkv, D); launches only (no autograd).
    softcap > 0 caps the scores (softcap * tanh(s / softcap)); window (left, right) as returned
    by `window_for`. With `varlen`: packed q (total_q, H, D), k/v (total_k, Hkv, D), o like q
    and lse (H, total_q).

    With neither `plan` nor `split` given, `split_plan` chooses between the dense forward and
    the split-KV one, and the launches are recorded per layout and replayed (`replay`); a `plan`
    alone runs the dense forward with its tile, a `split` the split-KV forward (dense batches
    only)."""
    if plan is None and split is None:
        if varlen is None:
            inputs, sizes = (q, k, v), None
        else:
            inputs = (q, k, v, varlen.cu_q, varlen.cu_k)
            sizes = varlen.max_q, varlen.max_k
        options = ("fwd", causal, scale, softcap, window, sizes, FAST_TANH, PEEL_RAGGED_TAIL,
                   PAD_ROW_VECTORS, GLUON_FWD_Q_REGS_MAX_D, GLUON_FWD_CAUSAL_PAIRS,
                   GLUON_FWD_PERSISTENT, interpreting())  # fmt: skip
        return replay.replayed(
            _forward, inputs, options, q, k, v, causal, scale, None, None, softcap, window, varlen
        )
    return _forward(replay.DIRECT, q, k, v, causal, scale, plan, split, softcap, window, varlen)


def _scratch_for_replay(ops, device: torch.device) -> None:
    """TMA launches need Triton's scratch allocator (`_tma_flag` installs it) in the thread that
    launches: a replay installs it again first (autograd runs the backward in its own thread)."""
    if device.type == "cuda":
        ops.on_replay(functools.partial(triton.set_allocator, _tma_scratch(device)))


def _forward(ops, q, k, v, causal, scale, plan, split, softcap, window, varlen):
    """`forward` with its allocations and launches through `ops` (`replay`)."""
    _scratch_for_replay(ops, q.device)
    q, k, v = _unit_d(q), _unit_d(k), _unit_d(v)
    d = int(q.shape[-1])  # compile-time in the kernels: specialise on it under dynamic shapes
    if varlen is None:
        b, nq, h = q.shape[:3]
        nk, hkv = k.shape[1], k.shape[2]
        o = ops.empty((b, nq, h, d), q.dtype, q.device)
        lse = ops.empty((b, h, nq), torch.float32, q.device)
        lse_strides = lse.stride(0), lse.stride(1)
        if b == 0:
            return o, lse
        if plan is None and split is None:
            split = split_plan(q, k, left=window[0])
        if split is not None:
            _forward_split(ops, q, k, v, o, lse, causal, scale, split, softcap, window)
            return o, lse
    else:
        b, nq, nk = varlen.cu_q.shape[0] - 1, varlen.max_q, varlen.max_k
        h, hkv = q.shape[1], k.shape[1]
        o = ops.empty((q.shape[0], h, d), q.dtype, q.device)
        lse = ops.empty((h, q.shape[0]), torch.float32, q.device)
        lse_strides = 0, lse.stride(0)
        if q.shape[0] == 0 or k.shape[0] == 0:  # no rows, or rows that see no key
            ops.unplannable()
            return o.zero_(), lse.fill_(-math.inf)
    upper, local, win_left, win_right = _window_args(causal, window)
    if plan is None:  # the automatic tiles, for the size of this grid
        grid = (b * h, nq, num_sms(q.device))
        plan = plan_for(d, upper, q.dtype, local or varlen is not None, grid)
    t = plan.fwd
    qk_scale, cap_scale, softcap_mode = _score_args(scale, softcap, q)
    if t.gluon:
        # Right edge none or the causal diagonal (win_right 0); no left edge or packing; softcap
        # only through tanh.approx.
        plain = win_right == 0 and not (local or varlen is not None or softcap_mode == 1)
        if plain and _gluon_flag(t, q, k, v):
            _forward_gluon(ops, q, k, v, o, lse, t, upper, qk_scale, cap_scale, softcap_mode)
            return o, lse
        t = FWD_TILES[block_d_for(d)]  # not an sm_90 GPU, or a case the Gluon kernel lacks
    ops.launch(
        K.attn_fwd_kernel,
        (cdiv(nq, t.block_m) * b * h,),
        q,
        k,
        v,
        o,
        lse,
        None if varlen is None else varlen.cu_q,
        None if varlen is None else varlen.cu_k,
        *_seq_strides(q, varlen),
        *_seq_strides(k, varlen),
        *_seq_strides(v, varlen),
        *_seq_strides(o, varlen),
        *lse_strides,
        h,
        h // hkv,
        nq,
        nk,
        qk_scale,
        cap_scale,
        win_left,
        win_right,
        HEAD_DIM=d,
        BLOCK_D=block_d_for(d),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        CAUSAL=upper,
        EVEN_M=varlen is None and bool(nq % t.block_m == 0),
        EVEN_N=varlen is None and bool(nk % t.block_n == 0),
        DOT_PREC=dot_precision(q.dtype),
        TMA=_tma_flag(t, k, v),
        SOFTCAP=softcap_mode,
        LOCAL=local,
        VARLEN=varlen is not None,
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return o, lse


def _forward_split(
    ops,
    q,
    k,
    v,
    o,
    lse,
    causal: bool,
    scale: float,
    split: SplitPlan,
    softcap: float = 0.0,
    window: tuple[int, int] = (-1, -1),
) -> None:
    """Split-KV forward into o and lse: float32 partials per (split, packed query row), then
    their merge (kernels.py, "Split-KV forward")."""
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    t, bd = split.tile, block_d_for(d)
    row_blocks = cdiv(group * nq, t.block_m)
    rows_pad = row_blocks * t.block_m
    o_part = ops.empty((b * hkv, split.splits, rows_pad, bd), torch.float32, q.device)
    lse_part = ops.empty((b * hkv, split.splits, rows_pad), torch.float32, q.device)
    qk_scale, cap_scale, softcap_mode = _score_args(scale, softcap, q)
    upper, local, win_left, win_right = _window_args(causal, window)
    ops.launch(
        K.attn_fwd_split_kernel,
        (row_blocks * split.splits * b * hkv,),
        q,
        k,
        v,
        o_part,
        lse_part,
        *_strides3(q),
        *_strides3(k),
        *_strides3(v),
        hkv,
        group,
        nq,
        nk,
        qk_scale,
        cap_scale,
        split.splits,
        split.split_len,
        rows_pad,
        split.start,
        win_left,
        win_right,
        HEAD_DIM=d,
        BLOCK_D=bd,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        CAUSAL=upper,
        DOT_PREC=dot_precision(q.dtype),
        TMA=_tma_flag(t, k, v),
        SOFTCAP=softcap_mode,
        LOCAL=local,
        num_warps=t.warps,
        num_stages=t.stages,
    )
    block_r = min(t.block_m, COMBINE_BLOCK_R, max(2, next_power_of_2(group * nq)))
    ops.launch(
        K.attn_fwd_combine_kernel,
        (cdiv(group * nq, block_r) * b * hkv,),
        o_part,
        lse_part,
        o,
        lse,
        *_strides3(o),
        h,
        hkv,
        group,
        nq,
        split.splits,
        rows_pad,
        HEAD_DIM=d,
        BLOCK_D=bd,
        BLOCK_R=block_r,
        num_warps=4,
    )


def backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    dlse,
    causal: bool,
    scale: float,
    plan: Plan | None = None,
    softcap: float = 0.0,
    window: tuple[int, int] = (-1, -1),
    varlen: Varlen | None = None,
    deterministic: bool = True,
):
    """(dq, dk, dv) from the saved q, k, v, o, lse; dlse (or None) is the LSE's gradient.
    Layouts as in `forward` (packed with `varlen`); without a `plan` the launches are replayed
    per layout, as in `forward`. Where it measured faster, the replayed plan sums dq in the
    Hopper dk/dv kernel (`plans.fused_dq_plan`), in a fixed order, or in any order with
    deterministic=False (so from fewer rows on); a plan with `plans.GLUON_FUSED_DQ` follows
    `deterministic` too. Every other path is deterministic either way."""
    if plan is None:
        if varlen is None:
            inputs, sizes = (do, q, k, v, o, lse, dlse), None
        else:
            inputs = (do, q, k, v, o, lse, dlse, varlen.cu_q, varlen.cu_k)
            sizes = varlen.max_q, varlen.max_k
        options = ("bwd", causal, scale, softcap, window, sizes, deterministic, FAST_TANH,
                   PEEL_RAGGED_TAIL, PAD_ROW_VECTORS, GLUON_BWD_KV_REGS_MAX_D,
                   GLUON_BWD_PERSISTENT_MAX_N, interpreting())  # fmt: skip
        return replay.replayed(
            _backward, inputs, options,
            do, q, k, v, o, lse, dlse, causal, scale, None, softcap, window, varlen,
            deterministic,
        )  # fmt: skip
    return _backward(replay.DIRECT, do, q, k, v, o, lse, dlse, causal, scale, plan, softcap,
                     window, varlen, deterministic)  # fmt: skip


def _gluon_dkdv(tile: Tile, q, k, v, do, local, win_right, softcap_mode, varlen) -> bool:
    """Whether dk/dv take the Hopper kernel (kernels_gluon.attn_bwd_gluon_kernel): the tile asks
    for it (`Tile.gluon`), a dense batch without a window edge other than the causal diagonal
    and without softcap, the inputs TMA-aligned on sm_90 (`plans._gluon_flag`)."""
    return (
        tile.gluon
        and varlen is None
        and not local
        and win_right == 0
        and not softcap_mode
        and _gluon_flag(tile, q, k, v)
        and _tma_flag(tile, do)
    )


def _backward(ops, do, q, k, v, o, lse, dlse, causal, scale, plan, softcap, window, varlen,
              deterministic=True):  # fmt: skip
    """`backward` with its allocations and launches through `ops` (`replay`)."""
    _scratch_for_replay(ops, q.device)
    do, q, k, v, o = (_unit_d(t) for t in (do, q, k, v, o))
    d = int(q.shape[-1])
    dq = ops.empty(q.shape, q.dtype, q.device)
    dk = ops.empty(k.shape, k.dtype, k.device)
    dv = ops.empty(v.shape, v.dtype, v.device)
    if varlen is None:
        b, nq, h = q.shape[:3]
        nk, hkv = k.shape[1], k.shape[2]
        rows_b, rows = b, nq  # delta's (batch, row) extent, as the LSE's
        if b == 0:
            return dq, dk, dv
    else:
        b, nq, nk = varlen.cu_q.shape[0] - 1, varlen.max_q, varlen.max_k
        h, hkv = q.shape[1], k.shape[1]
        rows_b, rows = 1, q.shape[0]
        if q.shape[0] == 0 or k.shape[0] == 0:
            ops.unplannable()
            return dq.zero_(), dk.zero_(), dv.zero_()
    upper, local, win_left, win_right = _window_args(causal, window)
    bd = block_d_for(d)
    if plan is None:
        plan = plan_for(d, upper, q.dtype, local or varlen is not None)
        if varlen is None and not local:
            plan = fused_dq_plan(plan, bd, upper, nq, deterministic)
    prec = dot_precision(q.dtype)
    qk_scale, cap_scale, softcap_mode = _score_args(scale, softcap, q)
    lse = lse.contiguous()
    # The LSE is (B, H, Nq), or (H, total_q) for a packed batch; both read through (batch,
    # head) strides. The row vectors the backward kernels read (`PAD_ROW_VECTORS`): lse2 and
    # delta, each (B, H, Nq rounded up to ROW_PAD) or (1, H, total_q + (ROW_PAD + 16) * B
    # rounded up to 16) for a packed batch (kernels._rowvec_start); else the LSE itself and a
    # delta like it, (1, H, total_q) packed (whose rows the preprocess walks as one sequence).
    gluon_dkdv = _gluon_dkdv(plan.dkdv, q, k, v, do, local, win_right, softcap_mode, varlen)
    if plan.dkdv.gluon and not gluon_dkdv:  # the portable tiles where the Gluon one cannot run
        portable = portable_dkdv(bd, upper, q.dtype)  # (pointer loads if the plan said so)
        dq_tile = plan_for(d, upper, q.dtype).dq if plan.dq.gluon else plan.dq  # (fused dq)
        plan = Plan(plan.fwd, replace(portable, tma=portable.tma and plan.dkdv.tma), dq_tile)
    elif plan.dq.gluon and bd > GLUON_FUSED_DQ_MAX_D:  # the dq kernel beside the Gluon one
        plan = Plan(plan.fwd, plan.dkdv, plan_for(d, upper, q.dtype).dq)
    pad = gluon_dkdv or _pad_row_vectors(varlen, nq, bd)
    # dq summed in the Gluon dk/dv kernel (`plans.GLUON_FUSED_DQ`): 1 in any order, 2 in a
    # fixed order.
    dq_mode = (2 if deterministic else 1) if gluon_dkdv and plan.dq.gluon else 0
    cu_q, cu_k = (None, None) if varlen is None else (varlen.cu_q, varlen.cu_k)
    pre_m = INTERPRETER_FWD.block_m if interpreting() else PREPROCESS_BLOCK_M
    assert max(plan.dkdv.block_m, plan.dq.block_m, pre_m) <= ROW_PAD
    if not pad:
        width = rows
    elif varlen is None:
        width = cdiv(nq, ROW_PAD) * ROW_PAD
    else:
        width = cdiv(rows + (ROW_PAD + 16) * b, 16) * 16
    delta = ops.empty((rows_b, h, width), torch.float32, q.device)
    lse2 = ops.empty((rows_b, h, width), torch.float32, q.device) if pad else lse
    vec_strides = (delta.stride(0) if varlen is None else 0), delta.stride(1)
    dq_acc = sem = None
    if dq_mode:  # the float32 dq sums and their semaphores, zeroed by the preprocess
        dq_acc = ops.empty((b * h, width, bd), torch.float32, q.device)
        sem = ops.empty((b * h, width // K.SEM_ROWS.value), torch.int32, q.device)
    lse_strides = (lse.stride(0), lse.stride(1)) if varlen is None else (0, lse.stride(0))
    # Padded: a program per (padded block, sequence, head), packed batches included.
    pre_rows = nq if pad else rows
    pre_blocks = cdiv(nq, ROW_PAD) * (ROW_PAD // pre_m) if pad else cdiv(rows, pre_m)
    ops.launch(
        K.attn_bwd_preprocess_kernel,
        (pre_blocks * (b if pad else rows_b) * h,),
        o,
        do,
        lse,
        delta if dlse is None else dlse.contiguous(),
        lse2,
        delta,
        cu_q,
        dq_acc,
        sem,
        *_seq_strides(o, varlen),
        *_seq_strides(do, varlen),
        *lse_strides,
        *vec_strides,
        h,
        pre_rows,
        HAS_DLSE=dlse is not None,
        HEAD_DIM=d,
        BLOCK_D=bd,
        BLOCK_M=pre_m,
        ROWVEC=pad,
        ROW_PAD=ROW_PAD,
        VARLEN=pad and varlen is not None,
        ZERO_DQ=dq_mode > 0,
        num_warps=4,
    )
    lse, lse_strides = lse2, vec_strides  # what dk/dv and dq read
    t = plan.dkdv
    if gluon_dkdv:
        kv_regs = dq_mode > 0 and bd <= GLUON_BWD_KV_REGS_MAX_D
        tiles = cdiv(nk, t.block_n) * b * hkv
        persistent = dq_mode == 0 and nq <= GLUON_BWD_PERSISTENT_MAX_N
        ops.launch(
            KG.attn_bwd_gluon_kernel, (min(tiles, num_sms(q.device)) if persistent else tiles,),
            q, k, v, do, lse2, delta, dk, dv, dq_acc, sem, *_tma_strides3(q), *_tma_strides3(k),
            *_tma_strides3(v), *_tma_strides3(do), *_strides3(dk), *_strides3(dv), width,
            width // K.SEM_ROWS.value, b * h * width,
            _bwd_tile_order(b * hkv, cdiv(nk, t.block_n), num_sms(q.device), upper,
                            persistent, dq_mode == 2), b, h, hkv,
            h // hkv, nq, nk, qk_scale,
            scale, HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=t.block_m, BLOCK_N=t.block_n, CAUSAL=upper,
            STAGES=t.stages, DQ_MODE=dq_mode, KV_REGS=kv_regs, PERSISTENT=persistent,
            num_warps=t.warps,
        )  # fmt: skip
        if dq_mode:
            ops.launch(
                K.attn_bwd_dq_convert_kernel, (cdiv(nq, PREPROCESS_BLOCK_M) * b * h,),
                dq_acc, dq, *_strides3(dq), h, nq, width, HEAD_DIM=d, BLOCK_D=bd,
                BLOCK_M=PREPROCESS_BLOCK_M, num_warps=4,
            )  # fmt: skip
            return dq, dk, dv
    else:
        ops.launch(
            K.attn_bwd_dkdv_kernel,
            (cdiv(nk, t.block_n) * b * hkv,),
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            cu_q,
            cu_k,
            *_seq_strides(q, varlen),
            *_seq_strides(k, varlen),
            *_seq_strides(v, varlen),
            *_seq_strides(do, varlen),
            *_seq_strides(dk, varlen),
            *_seq_strides(dv, varlen),
            *lse_strides,
            h,
            hkv,
            h // hkv,
            nq,
            nk,
            qk_scale,
            scale,
            cap_scale,
            win_left,
            win_right,
            HEAD_DIM=d,
            BLOCK_D=bd,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            CAUSAL=upper,
            EVEN_M=varlen is None and bool(nq % t.block_m == 0),
            EVEN_N=varlen is None and bool(nk % t.block_n == 0),
            DOT_PREC=prec,
            TMA=_tma_flag(t, q, do),
            SOFTCAP=softcap_mode,
            LOCAL=local,
            VARLEN=varlen is not None,
            PEEL_TAIL=PEEL_RAGGED_TAIL,
            ROWVEC=pad,
            ROW_PAD=ROW_PAD,
            num_warps=t.warps,
            num_stages=t.stages,
        )
    t = plan.dq
    ops.launch(
        K.attn_bwd_dq_kernel,
        (cdiv(nq, t.block_m) * b * h,),
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        cu_q,
        cu_k,
        *_seq_strides(q, varlen),
        *_seq_strides(k, varlen),
        *_seq_strides(v, varlen),
        *_seq_strides(do, varlen),
        *_seq_strides(dq, varlen),
        *lse_strides,
        h,
        h // hkv,
        nq,
        nk,
        qk_scale,
        scale,
        cap_scale,
        win_left,
        win_right,
        HEAD_DIM=d,
        BLOCK_D=bd,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        CAUSAL=upper,
        EVEN_M=varlen is None and bool(nq % t.block_m == 0),
        EVEN_N=varlen is None and bool(nk % t.block_n == 0),
        DOT_PREC=prec,
        TMA=_tma_flag(t, k, v),
        SOFTCAP=softcap_mode,
        LOCAL=local,
        VARLEN=varlen is not None,
        PEEL_TAIL=PEEL_RAGGED_TAIL,
        ROWVEC=pad,
        ROW_PAD=ROW_PAD,
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return dq, dk, dv
