"""Launch plans of flash-attn: tile tables by head dim and dtype, the split-KV plan, and where
the TMA and Gluon paths apply."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from kernelkit.shared.runtime import (
    cdiv,
    interpreting,
    next_power_of_2,
    num_sms,
)

try:  # Gluon (triton.experimental.gluon) is newer than the oldest Triton this package accepts
    from . import kernels_gluon as KG
except ImportError:  # pragma: no cover
    KG = None


@dataclass(frozen=True)
class Tile:
    """Tile of one kernel: BLOCK_M query rows x BLOCK_N keys, warps and pipeline stages; tma:
    read the loop's tiles through TMA descriptors where the inputs allow it (`use_tma`), else
    with pointer loads; gluon: the Gluon kernel of kernels_gluon.py where `_gluon_flag` allows
    it (forward: BLOCK_M = 128, a `stages`-deep K/V ring, else `FWD_TILES`' portable tile;
    dk/dv: BLOCK_N = 128, a `stages`-deep q/do ring, else `portable_dkdv`)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False
    gluon: bool = False


# Tiles by BLOCK_D for half-precision inputs on Hopper. Candidates were screened by compiling
# for sm_90a (registers, spills, shared memory), then timed with benchmarks/tune.py on an H200
# at N = 8k and on an H100 at N = 4k/16k/32k (NOTES.md). TMA loads where they measured faster:
# the d = 128 backward and the d = 64 causal backward (whose new tiles only fit without pointer
# registers); the forward measured the same either way and keeps pointer loads. d = 16 and 32:
# H100 flash-table sweep (tune.py --flash-table, B = H = 1 causal, N = 1k/4k/16k, 2026-11-23):
# forward 64 x 128 1.84x / 1.86x over 128 x 64, d32 dq 64 x 128 1.13x; their dk/dv candidates
# were mixed across N (kept). d = 256 was not timed.
FWD_TILES = {
    16: Tile(64, 128, 4, 3),
    32: Tile(64, 128, 4, 3),
    64: Tile(128, 64, 8, 3),
    128: Tile(128, 128, 8, 3),
    256: Tile(128, 32, 8, 2),
}
# The Gluon forward (kernels_gluon.py: a TMA producer warp feeding a 2-deep K/V ring, two
# 64-row consumer warpgroups with asynchronous warpgroup MMAs) where it measured faster on an
# H100 (lab/flash-attn/ab/hopper_ab.py): d = 128 non-causal, 502 -> 644 TFLOP/s at N = 16k
# (cuDNN 605), 461 -> 566 at 4k. d = 64 measured equal or slower, causal was not verified:
# portable tiles.
GLUON_FWD_TILES = {128: Tile(128, 128, 4, 2, tma=True, gluon=True)}
# Causal (bottom-right diagonal), H100 A/B of 2026-11-23 (lab/flash-attn/ab/hopper_ab.py
# --cases 64:1,128:1), TFLOP/s current / Gluon 128x128 s2 / cuDNN: d128 N16k 432 / 598 / 563,
# N4k 365 / 474 / 561; d64 N16k 385 / 429 / 445 but N4k 361 / 323 / 422: d64 stays on the
# portable kernel.
GLUON_CAUSAL_FWD_TILES = {128: Tile(128, 128, 4, 2, tma=True, gluon=True)}
# d = 64 forwards of at least this many query rows take the same Gluon tiles, causal and not,
# the q tile in registers (launchers.GLUON_FWD_Q_REGS_MAX_D). H100, TFLOP/s portable / Gluon:
# causal (session 20, q in shared memory) 16k 384 / 426, 383 / 427 at the leaderboard's B 16
# H 1, 8k 388 / 381, 4k 361 / 323; (session 21, q in registers, two runs) 16k 390-400 / 427-430,
# leaderboard 376-385 / 421-425, 8k 373-377 / 383-384, 4k 360-366 / 324-329. Non-causal
# (session 21) 16k 423-441 / 443-452, 8k 422-425 / 420-430, 4k 411-422 / 387-404 (with q in
# shared memory, session 20: 16k 434-446 / 442-449, 8k 434 / 409). Logs:
# lab/flash-attn/logs/NVIDIA-H100-80GB-HBM3-hopper_ab-session21-*.log.
# Persistent (session 22, launchers.GLUON_FWD_PERSISTENT), portable / Gluon: causal 8k 385 /
# 419, 4k 359 / 394, 2k (B8 H32) 331 / 346; non-causal 8k 419 / 446, 4k 429 / 430.
GLUON_CAUSAL_FWD_MIN_N = {64: 2048}
GLUON_FWD_MIN_N = {64: 8192}
# The Gluon dk/dv kernel (kernels_gluon.attn_bwd_gluon_kernel: 2 x 64 keys per program, BLOCK_M
# query rows per step, a `stages`-deep q/do ring; dq stays with the portable dq kernel) where it
# measured faster on an H100 (session 20, lab/flash-attn/ab/hopper_ab.py; backward TFLOP/s at
# N = 16k / 8k / 4k, portable / Gluon): d128 non-causal 400 / 443, 396 / 439, 376 / 386 (3
# stages; 2 stages: 428, 393, 414); causal 375 / 419, 330 / 396, 305 / 354 (2 stages). d64
# measured 0.86-1.0x the portable kernels (BLOCK_M 128 spills): portable.
GLUON_DKDV_TILES = {128: Tile(64, 128, 4, 3, tma=True, gluon=True)}
GLUON_CAUSAL_DKDV_TILES = {128: Tile(64, 128, 4, 2, tma=True, gluon=True)}
# As a plan's dq tile beside a Gluon dk/dv tile: dq summed in the Gluon kernel (5 block products
# per tile pair instead of 7; a reducer warp adds the parts with TMA reduce-adds), in a fixed
# order unless the backward may add them in any order (`flash_attn(deterministic=False)`).
GLUON_FUSED_DQ = Tile(0, 0, 0, 0, gluon=True)
# Half-precision backwards of at least this many query rows, by BLOCK_D (non-causal, causal;
# None: never), sum dq in the Gluon dk/dv kernel (`fused_dq_plan`, its K and V in registers:
# launchers.GLUON_BWD_KV_REGS_MAX_D; d <= launchers.GLUON_FUSED_DQ_MAX_D): in a fixed order by
# default (FUSED_DQ_MIN_N), in any order with deterministic=False (ANY_ORDER_DQ_MIN_N). H100,
# session 23 (the dq products in a warpgroup of their own, tiles in groups of heads, causal
# fixed-order sums from the last key block down: launchers._bwd_tile_order), backward TFLOP/s
# of the dq-kernel backward / fused in a fixed order / in any order
# (lab/flash-attn/logs/NVIDIA-H100-80GB-HBM3-*-session23.log):
#   d64 causal 16k B16 H1   326-345 / 390 / 423-459
#   d64 causal 16k B1 H32   336-346 / 403 / 428-443
#   d64 causal 32k B1 H16   348 / 421 / 463
#   d64 causal 8k B2 H32    321-336 / 360 / 383-428     B4 H16 323 / 354 / 406
#   d64 causal 4k B4 H32    287-311 / 312 / 360-374
#   d64 non-causal 16k      352-371 / 397-415 / 413-436  4k 348-351 / 344 / 415-416
# With two reducer warps in a fixed order (kernels_gluon.ORDERED_DQ_REDUCERS; H200, session 24,
# lab/flash-attn/logs/NVIDIA-H200-bwd-dq-rule-session24.log), dq-kernel backward / fixed order:
# non-causal 8k B2 H32 376-388 / 430-439 (fused from 8k on), 4k B4 H32 373-385 / 373-379;
# causal 4k B4 H32 311-317 / 303-331, 2k B8 H32 259-274 / 228-255 (the dq kernel stays).
FUSED_DQ_MIN_N = {64: (8192, 8192)}
ANY_ORDER_DQ_MIN_N = {64: (4096, 4096)}
FUSED_DQ_DKDV = Tile(64, 128, 4, 2, tma=True, gluon=True)
# dk/dv: BLOCK_N keys held by the program, BLOCK_M query rows per step.
DKDV_TILES = {
    16: Tile(64, 128, 8, 2),
    32: Tile(64, 128, 8, 2),
    64: Tile(32, 64, 4, 3),
    128: Tile(32, 128, 8, 3, tma=True),
    256: Tile(16, 32, 8, 2),
}
# dq: BLOCK_M query rows held by the program, BLOCK_N keys per step.
DQ_TILES = {
    16: Tile(128, 64, 8, 3),
    32: Tile(64, 128, 4, 3),
    64: Tile(128, 64, 8, 3),
    128: Tile(128, 64, 8, 3, tma=True),
    256: Tile(64, 16, 4, 2),
}
# Causal overrides (the diagonal's masked steps and the uneven work per program favour other
# shapes): (fwd, dk/dv, dq) entries, None = the table above.
CAUSAL_TILES: dict[int, tuple[Tile | None, Tile | None, Tile | None]] = {
    64: (None, Tile(64, 64, 4, 3, tma=True), Tile(128, 64, 8, 4, tma=True)),
    128: (None, Tile(64, 128, 8, 3, tma=True), Tile(128, 64, 8, 4, tma=True)),
}
# float32 inputs (three tf32 products per dot) need about three times the operand registers:
# small tiles, (fwd, dk/dv, dq) by BLOCK_D. Winners of the H100 flash-table sweep (geometric
# mean over N = 1k/4k/16k against the previous tile; NOTES.md): forward d16/d32 64 x 64 1.4x,
# d64 32 x 64 2.1x, d128 32 x 64 1.5x; d128 dk/dv 64 x 32 TMA 1.7x (it spills a little, and
# still beats every spill-free tile); dq d32 1.12x, d64 1.07x, d128 1.17x.
FP32_TILES = {
    16: (Tile(64, 64, 4, 2), Tile(32, 32, 4, 1), Tile(32, 32, 4, 1)),
    32: (Tile(64, 64, 4, 2), Tile(32, 64, 4, 2), Tile(64, 64, 4, 2)),
    64: (Tile(32, 64, 4, 2), Tile(32, 32, 4, 1), Tile(32, 64, 4, 2)),
    128: (Tile(32, 64, 8, 1), Tile(64, 32, 8, 1, tma=True), Tile(16, 32, 4, 2, tma=True)),
    256: (Tile(16, 16, 4, 1), Tile(16, 16, 4, 1), Tile(16, 16, 4, 1)),
}
PREPROCESS_BLOCK_M = 64
# Half-precision forwards whose grid cannot fill the GPU (few heads, short rows): by BLOCK_D, a
# 64-row tile (twice the programs) and the waves (programs of the table's tile per SM) below
# which it replaces the table's tile, non-causal / causal. H100 (`tune.py --small-grid`, NOTES.md
# "Small-grid forward"), d64 64 x 128 w4 s3 against 128 x 64 w8 s3: non-causal 1.19-1.61x up to
# 1 wave, 0.96-0.97x at 3.9; causal (uneven programs: smaller ones balance the tail) 1.27-1.52x
# up to 1 wave, 1.16-1.33x at 3.9, 0.97-1.01x at 15.5. d128: the 64-row tiles lost to the
# Gluon kernel wherever the forward was not host-bound (0.5-0.92x): none. Causal Gluon tiles
# that fill one wave are kept (`small_grid_fwd`).
SMALL_GRID_FWD = {64: (Tile(64, 128, 4, 3), 2.0, 8.0)}
# A window's left edge adds a third (masked) loop to the forward, and packed batches always run
# the ragged-length masks; with pointer loads the d = 128 128 x 128 forward tile then needs
# 1.7-1.9 KB of stack (1.1 KB without), with TMA loads none: such forwards at d >= 128 read K/V
# through TMA. A register-screen choice, to be timed (a larger value switches it off).
MASKED_FWD_TMA_MIN_D = 128
# Under the interpreter: small, unequal tiles so that tests at small N still walk several
# blocks, the causal diagonal and the sequence ends in every kernel; TMA loads (the pointer
# path runs where inputs are misaligned and in test_other_tile_shapes).
INTERPRETER_FWD = Tile(32, 16, 4, 1, tma=True)
INTERPRETER_DKDV = Tile(16, 32, 4, 1, tma=True)
INTERPRETER_DQ = Tile(32, 16, 4, 1, tma=True)

# Split-KV forward (decoding), by BLOCK_D: (BLOCK_N, warps, stages, tma) of the tile whose
# BLOCK_M rows hold the packed (query head of the group, query) rows of one kv head, 16..64 of
# them; more rows take the dense forward's tile. Memory-bound: the bytes in flight set the time,
# so TMA loads, two stages of K/V ahead, and little shared memory (d = 128, 16 x 64: 70 KB,
# 80 registers, three programs per SM; NOTES.md). To be measured: benchmarks/tune_decode.py.
SPLIT_TILES = {16: (128, 4, 3, True), 32: (128, 4, 3, True), 64: (128, 4, 3, True),
               128: (128, 4, 2, True), 256: (32, 8, 3, True)}  # fmt: skip
SPLIT_FP32_TILES = {16: (32, 4, 2, True), 32: (32, 4, 2, True), 64: (32, 4, 2, True),
                    128: (32, 4, 2, True), 256: (16, 8, 2, True)}  # fmt: skip
# The number of splits (`split_plan`): as many as keep the launch within SPLIT_WAVES programs per
# SM (one wave of resident programs, no tail), at most SPLIT_MAX, and every split at least
# max(SPLIT_MIN_KEYS, SPLIT_KEYS_PER_ROW * padded rows) keys:
# its float32 partial (8 bytes per row and head-dim element, written and read back) then costs
# at most 1/8 of the K/V bytes it reads (4 per key and element in half precision).
SPLIT_WAVES, SPLIT_MIN_KEYS, SPLIT_KEYS_PER_ROW, SPLIT_MAX = 1, 256, 16, 128
# Nq up to this always takes the split kernel (even unsplit): the dense one would read each K/V
# byte once per query head and fill 128-row tiles with a few rows.
DECODE_MAX_NQ = 16
# Under the interpreter (4 stand-in SMs): small tiles and splits, so that tests with a few dozen
# keys already take several splits.
INTERPRETER_SPLIT = (16, 4, 1, True)
INTERPRETER_SPLIT_RULE = (2, 32, 1, 128)
# Packed rows per program of the merge (at most the split tile's BLOCK_M, which it divides).
COMBINE_BLOCK_R = 16


@dataclass(frozen=True)
class Plan:
    fwd: Tile
    dkdv: Tile
    dq: Tile


def block_d_for(d: int) -> int:
    return max(16, next_power_of_2(d))


def plan_for(
    d: int,
    causal: bool,
    dtype: torch.dtype,
    masked_fwd: bool = False,
    grid: tuple[int, int, int] | None = None,
) -> Plan:
    """The tiles used for head dim d (padded to a power of two), causal (or any right-bounded
    window) or not, dtype; masked_fwd: a forward with more masked code (a window's left edge,
    or per-sequence lengths); grid (sequences x heads, query rows per sequence, SMs): the
    forward's tile may then change for a small grid (`small_grid_fwd`)."""
    if interpreting():
        return Plan(INTERPRETER_FWD, INTERPRETER_DKDV, INTERPRETER_DQ)
    bd = block_d_for(d)
    if dtype == torch.float32:
        return Plan(*FP32_TILES[bd])
    fwd, _, dq = CAUSAL_TILES.get(bd, (None, None, None)) if causal else (None, None, None)
    dkdv = portable_dkdv(bd, causal)
    if not masked_fwd:
        fwd = (GLUON_CAUSAL_FWD_TILES if causal else GLUON_FWD_TILES).get(bd) or fwd
        min_n = (GLUON_CAUSAL_FWD_MIN_N if causal else GLUON_FWD_MIN_N).get(bd, 1 << 62)
        if grid is not None and grid[1] >= min_n:
            fwd = (GLUON_CAUSAL_FWD_TILES if causal else GLUON_FWD_TILES)[128]
        dkdv = (GLUON_CAUSAL_DKDV_TILES if causal else GLUON_DKDV_TILES).get(bd) or dkdv
    fwd = fwd or FWD_TILES[bd]
    if grid is not None:
        fwd = small_grid_fwd(fwd, bd, causal, *grid)
    if masked_fwd and bd >= MASKED_FWD_TMA_MIN_D:
        fwd = replace(fwd, tma=True)
    return Plan(fwd, dkdv, dq or DQ_TILES[bd])


def portable_dkdv(bd: int, causal: bool, dtype: torch.dtype = torch.bfloat16) -> Tile:
    """The portable dk/dv tile of a backward (also where a Gluon tile cannot run:
    `launchers._gluon_dkdv`)."""
    if dtype == torch.float32:
        return FP32_TILES[bd][1]
    return (CAUSAL_TILES.get(bd, (None,) * 3)[1] if causal else None) or DKDV_TILES[bd]


def fused_dq_plan(plan: Plan, bd: int, causal: bool, nq: int, deterministic: bool) -> Plan:
    """The backward's plan for nq query rows: the Gluon dk/dv kernel summing dq
    (`GLUON_FUSED_DQ`) from FUSED_DQ_MIN_N query rows on, or from ANY_ORDER_DQ_MIN_N where dq's
    parts may be added in any order; else `plan` (the Gluon kernel's own conditions still apply
    at launch)."""
    min_n = (FUSED_DQ_MIN_N if deterministic else ANY_ORDER_DQ_MIN_N).get(bd, (None, None))[causal]
    if interpreting() or min_n is None or nq < min_n:
        return plan
    return Plan(plan.fwd, FUSED_DQ_DKDV, GLUON_FUSED_DQ)


def small_grid_fwd(tile: Tile, bd: int, causal: bool, bh: int, nq: int, sms: int) -> Tile:
    """The half-precision forward tile for bh (sequence, head) pairs of nq query rows on `sms`
    SMs: SMALL_GRID_FWD's 64-row tile where `tile` would launch fewer programs than its waves
    x sms, else `tile`."""
    small, waves, causal_waves = SMALL_GRID_FWD.get(bd, (None, 0.0, 0.0))
    if small is None or tile.block_m <= small.block_m:
        return tile
    programs = bh * cdiv(nq, tile.block_m)
    if tile.gluon and causal and programs >= sms:
        # The persistent Gluon forward balances causal tiles itself (pairs of a long and a
        # short one): H100, d64, TFLOP/s small tile / Gluon at B1 H8 8k 318 / 402, 16k 402 /
        # 434, B2 H8 4k 280 / 357, B1 H16 8k 352 / 418 (session 22).
        return tile
    return small if programs < (causal_waves if causal else waves) * sms else tile


@dataclass(frozen=True)
class SplitPlan:
    """Split-KV forward: `tile` (BLOCK_M packed query rows, BLOCK_N keys per step) over
    `splits` runs of `split_len` keys (a multiple of BLOCK_N; the last run may be shorter),
    the first from key `start` (a block boundary: keys before it are outside every window)."""

    tile: Tile
    splits: int
    split_len: int
    start: int = 0


def split_tile(rows: int, d: int, dtype: torch.dtype) -> Tile:
    """The split kernel's tile for `rows` packed query rows per kv head (GROUP * Nq)."""
    bm = max(16, next_power_of_2(rows))
    if interpreting():
        return Tile(min(bm, 32), *INTERPRETER_SPLIT)
    dense = plan_for(d, False, dtype).fwd
    if dense.gluon:  # the split kernel is a portable one
        dense = FWD_TILES[block_d_for(d)]
    if bm >= dense.block_m:  # many rows: the dense forward's tile
        return dense
    table = SPLIT_FP32_TILES if dtype == torch.float32 else SPLIT_TILES
    return Tile(bm, *table[block_d_for(d)])


def split_plan(q, k, num_splits: int | None = None, tile: Tile | None = None, left: int = -1):
    """The split-KV plan for q (B, Nq, H, D), k (B, Nk, Hkv, D), or None for the dense forward.

    Automatic (num_splits None): when T = B * Hkv * ceil(GROUP * Nq / BLOCK_M) query tiles (the
    GROUP query heads of a kv head packed into one tile) cannot fill the GPU, the keys are split
    into S = min(SPLIT_WAVES * SMs // T, Nk // max(SPLIT_MIN_KEYS, SPLIT_KEYS_PER_ROW * padded
    rows), SPLIT_MAX) runs. The split path is taken when S >= 2, and always (S >= 1) for
    Nq <= DECODE_MAX_NQ. num_splits forces at most that many splits (runs of whole key blocks of
    equal length, so 5 blocks in 4 splits are 3 runs of 2, 2, 1); tile forces the tile. A
    sliding window's left edge (`left` >= 0, as `window_for` returns it) leaves the keys before
    the first query's window out: only the rest is split."""
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    rows = (h // hkv) * nq
    tile = tile or split_tile(rows, int(d), q.dtype)
    start = max(0, nk - nq - left) // tile.block_n * tile.block_n if left >= 0 else 0
    nk -= start
    key_blocks = cdiv(nk, tile.block_n)
    if num_splits is None:
        waves, min_keys, keys_per_row, most = (
            INTERPRETER_SPLIT_RULE
            if interpreting()
            else (SPLIT_WAVES, SPLIT_MIN_KEYS, SPLIT_KEYS_PER_ROW, SPLIT_MAX)
        )
        row_tiles = cdiv(rows, tile.block_m)
        tiles = b * hkv * row_tiles
        per_split = max(min_keys, keys_per_row * row_tiles * tile.block_m)
        num_splits = min(waves * num_sms(q.device) // tiles, nk // per_split, most)
        if num_splits < 2 and nq > DECODE_MAX_NQ:
            return None
    blocks = cdiv(key_blocks, max(1, min(num_splits, key_blocks)))
    return SplitPlan(tile, cdiv(key_blocks, blocks), blocks * tile.block_n, start)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: three tf32 products per dot (about float32 accuracy, at a third of the
    tf32 rate); half precision ignores the setting."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def use_tma(*tensors: torch.Tensor) -> bool:
    """Whether the kernels' loops read these (B, N, H, D) tensors through TMA descriptors: on
    Hopper or newer (and under the interpreter, which runs the same code) when every row starts
    16-byte aligned, as the copy engine requires, and rows do not overlap (an expanded gradient
    with stride 0 takes the pointer path). Storages from torch's allocators are aligned, so the
    storage offset and the strides decide (also for fake tensors while tracing)."""
    device = tensors[0].device
    if not (_hopper(device.index or 0) if device.type == "cuda" else interpreting()):
        return False
    for t in tensors:
        size, d = t.element_size(), t.shape[-1]
        if (t.storage_offset() * size) % 16:
            return False
        for st, n in zip(t.stride()[:-1], t.shape[:-1]):
            if n > 1 and (st < d or (st * size) % 16):
                return False
    return True


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def _tma_scratch(device: torch.device):
    """Allocator (triton.set_allocator) of the global memory in which the kernels build their
    descriptors on `device`; torch.compile's launcher installs its own."""

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    return alloc


def _tma_flag(tile: Tile, *tensors: torch.Tensor) -> bool:
    """The TMA constexpr of a launch whose loop reads `tensors`; installs the scratch allocator
    when it is on (a context variable: set in every thread that launches, autograd's backward
    thread included)."""
    flag = tile.tma and use_tma(*tensors)
    if flag and tensors[0].device.type == "cuda":
        triton.set_allocator(_tma_scratch(tensors[0].device))
    return flag


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _gluon_flag(tile: Tile, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the forward takes the Gluon kernel of kernels_gluon.py: the tile asks for it,
    half-precision inputs with BLOCK_D 64 or 128 on an sm_90 GPU (Gluon has no interpreter),
    every tensor TMA-aligned."""
    return (
        tile.gluon
        and KG is not None
        and q.dtype != torch.float32
        and block_d_for(q.shape[-1]) in (64, 128)
        and _gluon_device(q.device)
        and _tma_flag(tile, q, k, v)
    )


def _gluon_device(device: torch.device) -> bool:
    """An sm_90 GPU, not under the interpreter (which cannot run Gluon kernels)."""
    return device.type == "cuda" and not interpreting() and _sm90(device.index or 0)
