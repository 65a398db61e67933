"""The chooser: a `Problem` in, a frozen `FwdConfig` / `BwdConfig` out, decided once per call
(per layout: the launches are replayed) and never rewritten. Each backend module says whether
it can run a config (`can_implement`: None, or the reason it cannot); where the preferred
kernel cannot, the chooser takes the next one and says why in the config's `why`.

Forward: the split-KV kernel for decoding shapes (`split_config`), else the Gluon kernel where its
table and rule ask for it and it can run, else the portable kernel with the table's tile
(small grids: a 64-row tile). Backward: the Gluon dk/dv kernel (d128) or, from the fused-dq
thresholds, the Gluon kernel summing dq too (d64), where it can run; else the portable dk/dv
and dq kernels. A value head dim other than the query's (Dv != D) runs the portable kernels
(the Gluon ones cannot), with the tables' tiles of the larger of the two (`Problem.block_d_max`).
"""

from __future__ import annotations

from dataclasses import replace

from kernelkit.shared.runtime import cdiv, next_power_of_2

from . import tables as T
from .config import (
    BWD_GLUON,
    BWD_TRITON,
    DQ_ANY_ORDER,
    DQ_KERNEL,
    DQ_ORDERED,
    FWD_GLUON,
    FWD_SPLIT,
    FWD_TRITON,
    ROW_PAD,
    BwdConfig,
    FwdConfig,
    Problem,
    Split,
    Tile,
    fixed_shift_unfit,
)
from .gluon import bwd as gluon_bwd
from .gluon import fwd as gluon_fwd
from .triton import bwd as triton_bwd
from .triton import fwd as triton_fwd
from .triton import split_kv as triton_split_kv

__all__ = [
    "check_bwd",
    "check_fwd",
    "choose_bwd",
    "choose_fwd",
    "dense_fwd_config",
    "gluon_bwd_config",
    "gluon_fwd_config",
    "portable_bwd_config",
    "portable_fwd_config",
    "split_config",
    "table_tiles",
    "tile_heads",
]


def _fast_tanh(p: Problem) -> bool:
    """Softcap through tanh.approx.f32 (one MUFU op, as FlashAttention does) for half precision
    on a GPU; float32 and the interpreter take an exact float32 formula."""
    return bool(p.softcap) and p.half and not p.target.interpreter


def _fixed_shift(p: Problem) -> bool:
    """Capped scores shifted by one fixed value instead of each row's running maximum wherever
    that fits (`config.fixed_shift_unfit`): fewer instructions per score, the same weights."""
    return fixed_shift_unfit(p) is None


def table_tiles(p: Problem) -> tuple[Tile, Tile, Tile]:
    """The portable kernels' (fwd, dk/dv, dq) tiles of the tables for problem `p`, by the larger
    of its head dims (shared memory and registers grow with both)."""
    bd = p.block_d_max
    if p.target.interpreter:
        return T.INTERPRETER_FWD, T.INTERPRETER_DKDV, T.INTERPRETER_DQ
    if not p.half:
        return T.FP32_TILES[bd]
    fwd, dkdv, dq = T.CAUSAL_TILES.get(bd, (None,) * 3) if p.causal else (None,) * 3
    return fwd or T.FWD_TILES[bd], dkdv or T.DKDV_TILES[bd], dq or T.DQ_TILES[bd]


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def choose_fwd(p: Problem) -> FwdConfig:
    """The forward's config for problem `p`: split-KV for decoding shapes, else
    `dense_fwd_config`."""
    if p.empty:
        return portable_fwd_config(p, table_tiles(p)[0], "nothing to compute")
    if not p.packed:
        split = split_config(p)
        if split is not None:
            return split
    return dense_fwd_config(p)


def dense_fwd_config(p: Problem) -> FwdConfig:
    """The dense forward's config: the Gluon kernel where the tables ask for it and it can run,
    else the portable kernel with the table's tile (a 64-row tile for small grids; TMA loads for
    masked forwards at large head dims)."""
    portable = table_tiles(p)[0]
    why = "the table's tile"
    gluon = _gluon_fwd_wanted(p)
    if gluon is not None:
        cfg = gluon_fwd_config(p, why=gluon)
        reason = gluon_fwd.can_implement(p, cfg)
        if reason is None:
            return cfg
        why = f"the Gluon forward cannot run: {reason}"
    elif p.half and not p.target.interpreter:
        small = _small_grid(p, portable)
        if small is not None:
            portable, why = small, "a 64-row tile: the table's would not fill the GPU"
    if p.masked and p.block_d_max >= T.MASKED_FWD_TMA_MIN_D and p.half and not p.target.interpreter:
        portable = replace(portable, tma=True)
    return portable_fwd_config(p, portable, why)


def portable_fwd_config(p: Problem, tile: Tile, why: str = "a given tile") -> FwdConfig:
    """The portable forward with `tile`, TMA loads where the tile asks for them and K/V allow."""
    return FwdConfig(FWD_TRITON, tile, tile.tma and p.tma_kv, _fast_tanh(p),
                     fixed_shift=_fixed_shift(p), why=why)  # fmt: skip


def gluon_fwd_config(p: Problem, tile: Tile = T.GLUON_FWD_TILE, why: str = "") -> FwdConfig:
    """The Gluon forward's config for `p` with `tile` (2 x 64 rows, a `stages`-deep K/V ring):
    persistent (one program per SM), causal tiles in pairs of a long and a short query block
    where the query blocks pair up, the q tile in registers up to GLUON_FWD_Q_REGS_MAX_D; a
    sliding window's tiles dealt by an atomic counter (dynamic). Window tiles differ in length
    less regularly than causal ones, so a fixed stride leaves the busiest program far above
    the mean at a few tiles a program (H200, d128, 16k, 15.5 tiles a program: window 4k
    0.975 -> 0.879 ms, 8k 1.765 -> 1.473 ms; at 64k within 1.6% either way)."""
    pairs = bool(p.causal and not p.local and cdiv(p.nq, tile.block_m) % 2 == 0)
    return FwdConfig(FWD_GLUON, tile, True, _fast_tanh(p), persistent=True, pairs=pairs,
                     q_regs=p.block_d <= T.GLUON_FWD_Q_REGS_MAX_D, dynamic=p.local,
                     fixed_shift=_fixed_shift(p), why=why)  # fmt: skip


def _gluon_fwd_wanted(p: Problem) -> str | None:
    """Why the tables ask for the Gluon forward here, or None: half precision, no packing, d128,
    or d64 from GLUON_FWD_MIN_N query rows."""
    if not p.half or p.packed or p.target.interpreter or p.block_d not in T.GLUON_FWD_MIN_N:
        return None
    min_n = T.GLUON_FWD_MIN_N[p.block_d][p.causal]
    if p.nq < min_n:
        return None
    if _small_grid(p, T.GLUON_FWD_TILE) is not None:
        return None
    return f"Gluon forward: d{p.block_d}" + (f" from {min_n} query rows" if min_n else "")


def _small_grid(p: Problem, tile: Tile) -> Tile | None:
    """SMALL_GRID_FWD's 64-row tile where `tile` would launch fewer programs than its waves x
    SMs, else None. A causal Gluon tile that fills one wave is kept: the persistent Gluon forward
    balances causal tiles itself."""
    small, waves, causal_waves = T.SMALL_GRID_FWD.get(p.block_d_max, (None, 0.0, 0.0))
    if small is None or tile.block_m <= small.block_m:
        return None
    programs = p.batch * p.heads * cdiv(p.nq, tile.block_m)
    if tile == T.GLUON_FWD_TILE and p.causal and programs >= p.target.sms:
        return None
    return small if programs < (causal_waves if p.causal else waves) * p.target.sms else None


def split_config(p: Problem, num_splits: int | None = None, tile: Tile | None = None):
    """The split-KV config for a dense problem, or None for the dense forward.

    Automatic (num_splits None): when T = B * Hkv * ceil(GROUP * Nq / BLOCK_M) query tiles (the
    GROUP query heads of a kv head packed into one tile) cannot fill the GPU, the keys are split
    into S = min(SPLIT_WAVES * SMs // T, Nk // max(SPLIT_MIN_KEYS, SPLIT_KEYS_PER_ROW * padded
    rows), SPLIT_MAX) runs. The split path is taken when S >= 2, and always (S >= 1) for
    Nq <= DECODE_MAX_NQ. num_splits forces at most that many splits (runs of whole key blocks of
    equal length, so 5 blocks in 4 splits are 3 runs of 2, 2, 1); tile forces the tile. A
    window's left edge leaves the keys before the first query's window out: only the rest is
    split. A KV cache (`p.cache`) always takes the split-KV kernel; with per-sequence lengths
    (`p.var_k`) the splits count from its capacity and each sequence's keys are spread over
    them on the device. TMA loads K/V where rows are aligned, pages hold whole key blocks and
    the automatic launch is at most SPLIT_TMA_MAX_WAVES waves; pages of a multiple of
    PAGED_TILE's keys that are not whole blocks of the table's tile take PAGED_TILE (TMA), and
    other pages (a page per row) PAGED_ROWS_SPLIT_WAVES times the splits."""
    group = p.heads // p.kv_heads
    rows = group * p.nq
    auto = num_splits is None
    tile = tile or _split_tile(p, rows)
    nk = p.nk
    start = max(0, nk - p.nq - p.left) // tile.block_n * tile.block_n if p.local else 0
    nk -= start
    key_blocks = cdiv(nk, tile.block_n)
    if num_splits is None:
        waves, min_keys, keys_per_row, most = (
            T.INTERPRETER_SPLIT_RULE
            if p.target.interpreter
            else (T.SPLIT_WAVES, T.SPLIT_MIN_KEYS, T.SPLIT_KEYS_PER_ROW, T.SPLIT_MAX)
        )
        row_tiles = cdiv(rows, tile.block_m)
        tiles = p.batch * p.kv_heads * row_tiles
        per_split = max(min_keys, keys_per_row * row_tiles * tile.block_m)
        if p.page_size % tile.block_n:  # a page per row: more splits, more loads in flight
            waves *= T.PAGED_ROWS_SPLIT_WAVES
        num_splits = min(waves * p.target.sms // tiles, nk // per_split, most)
        if num_splits < 2 and p.nq > T.DECODE_MAX_NQ and not p.cache:
            return None
    blocks = cdiv(key_blocks, max(1, min(num_splits, key_blocks)))
    combine = min(tile.block_m, T.COMBINE_BLOCK_R, max(2, next_power_of_2(rows)))
    split = Split(cdiv(key_blocks, blocks), blocks * tile.block_n, start, combine)
    why = f"split-KV: {rows} packed query rows per kv head, {split.splits} splits of the keys"
    programs = p.batch * p.kv_heads * cdiv(rows, tile.block_m) * split.splits
    tma = tile.tma and p.tma_kv and p.page_size % tile.block_n == 0
    if auto and programs > T.SPLIT_TMA_MAX_WAVES * p.target.sms and not p.target.interpreter:
        tma = False  # many waves: pointer loads measured faster
    if p.page_size:
        why += f"; pages of {p.page_size} rows, " + ("a page per key block (TMA)" if tma else
                                                     "a page per row")  # fmt: skip
    return FwdConfig(FWD_SPLIT, tile, tma, _fast_tanh(p), split, why=why)


def _split_tile(p: Problem, rows: int) -> Tile:
    """The split kernel's tile for `rows` packed query rows per kv head (GROUP * Nq): the dense
    forward's portable tile for many rows, else SPLIT_TILES' with 16..64 rows."""
    bm = max(16, next_power_of_2(rows))
    if p.target.interpreter:
        return Tile(min(bm, 32), *T.INTERPRETER_SPLIT)
    bd = p.block_d_max
    dense = (T.FWD_TILES if p.half else {d: t[0] for d, t in T.FP32_TILES.items()})[bd]
    if bm >= dense.block_m:  # many rows: the dense forward's tile
        return dense
    table = T.SPLIT_TILES if p.half else T.SPLIT_FP32_TILES
    tile = Tile(bm, *table[bd])
    # A page per key block of PAGED_TILE (TMA), unless the query tiles alone make more than
    # SPLIT_TMA_MAX_WAVES waves (one split each: pointer loads with the table's tile).
    tiles = p.batch * p.kv_heads * cdiv(rows, bm)
    few = tiles <= T.SPLIT_TMA_MAX_WAVES * p.target.sms
    if p.half and few and p.page_size % tile.block_n and p.page_size % T.PAGED_TILE[0] == 0:
        return Tile(bm, *T.PAGED_TILE, tma=True)
    return tile


def check_fwd(p: Problem, cfg: FwdConfig) -> FwdConfig:
    """`cfg` if its kernel can run problem `p`, else a ValueError saying why."""
    module = {FWD_TRITON: triton_fwd, FWD_SPLIT: triton_split_kv, FWD_GLUON: gluon_fwd}.get(
        cfg.kernel
    )
    reason = f"unknown kernel {cfg.kernel!r}" if module is None else module.can_implement(p, cfg)
    if reason is not None:
        raise ValueError(f"config: {cfg} cannot run this call: {reason}")
    return cfg


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def choose_bwd(p: Problem) -> BwdConfig:
    """The backward's config for problem `p`."""
    _, dkdv, dq = table_tiles(p)
    gluon = None if p.empty else _gluon_bwd_wanted(p)
    why = "nothing to compute" if p.empty else "the tables' tiles"
    if gluon is not None:
        tile, dq_mode, why = gluon
        cfg = gluon_bwd_config(p, tile, dq_mode, dq, why)
        reason = gluon_bwd.can_implement(p, cfg)
        if reason is None:
            return cfg
        why = f"the Gluon backward cannot run: {reason}"
    return portable_bwd_config(p, dkdv, dq, why)


def portable_bwd_config(p: Problem, dkdv: Tile, dq: Tile, why: str = "given tiles") -> BwdConfig:
    """The portable dk/dv and dq kernels with these tiles, TMA loads where a tile asks for them
    and the inputs allow, padded row vectors by `_pad_rows`."""
    return BwdConfig(BWD_TRITON, dkdv, dkdv.tma and p.tma_q and p.tma_do, DQ_KERNEL, dq,
                     dq.tma and p.tma_kv, _pad_rows(p), True, _fast_tanh(p), why=why)  # fmt: skip


def _gluon_bwd_wanted(p: Problem) -> tuple[Tile, int, str] | None:
    """(dk/dv tile, dq mode, why) of the Gluon backward where the tables ask for it: summing dq
    from FUSED_DQ_MIN_N query rows in a fixed order (with deterministic=False in any order from
    ANY_ORDER_DQ_MIN_N rows, where that measured faster, and below them as by default), d128
    below them (and for GQA causal in the fixed order, ORDERED_GQA_CAUSAL_DQ_KERNEL_D) with the
    dq kernel beside it; half precision (softcap too: tanh.approx), no packing."""
    if not p.half or p.packed or p.target.interpreter:
        return None
    fixed_n = T.FUSED_DQ_MIN_N.get(p.block_d, (None, None))[p.causal]
    any_n = T.ANY_ORDER_DQ_MIN_N.get(p.block_d, (None, None))[p.causal]
    any_order = not p.deterministic and any_n is not None and p.nq >= any_n
    min_n = any_n if any_order else fixed_n
    fused = min_n is not None and p.nq >= min_n
    gqa_keeps_dq_kernel = fused and (not any_order and p.causal and not p.local
                                     and p.kv_heads < p.heads
                                     and p.block_d in T.ORDERED_GQA_CAUSAL_DQ_KERNEL_D)  # fmt: skip
    if fused and not gqa_keeps_dq_kernel:
        mode = DQ_ANY_ORDER if any_order else DQ_ORDERED
        order = "in any order" if any_order else "in a fixed order"
        by = "its consumers" if p.block_d > T.GLUON_FUSED_DQ_MAX_D else "a dq warpgroup"
        return (
            T.FUSED_DQ_DKDV,
            mode,
            f"Gluon dk/dv summing dq {order} (by {by}): from {min_n} query rows",
        )
    tiles = T.GLUON_DKDV_TILES.get(p.block_d)
    if tiles is None:
        return None
    why = f"Gluon dk/dv at d{p.block_d}, dq kernel beside it"
    if gqa_keeps_dq_kernel:
        why += f" (GQA causal from {min_n} query rows: faster than dq sums in a fixed order)"
    return tiles[p.causal], DQ_KERNEL, why


def gluon_bwd_config(p: Problem, tile: Tile, dq_mode: int, dq: Tile | None = None,
                     why: str = "") -> BwdConfig:  # fmt: skip
    """The Gluon backward's config for `p`: dk/dv `tile` (2 x 64 keys), dq by the dq kernel
    with tile `dq` (DQ_KERNEL; default the tables') or summed in the kernel (DQ_ANY_ORDER,
    DQ_ORDERED): by a dq warpgroup with K/V in registers up to GLUON_FUSED_DQ_MAX_D, above it
    by the consumers in column halves (`dq_halves`); one program per SM for the dq-kernel
    variant up to GLUON_BWD_PERSISTENT_MAX_N query rows and for fused dq on windows of up to
    FUSED_PERSISTENT_MAX_WINDOW keys or, summing in the fixed order, up to
    FUSED_PERSISTENT_MAX_N rows (d64 causal; any length otherwise), which takes its tiles from
    a counter (`dynamic`: its sums wait on tiles before them); the tile order (`tile_heads`)."""
    fused = dq_mode != DQ_KERNEL
    ordered = dq_mode == DQ_ORDERED
    halves = fused and p.block_d > T.GLUON_FUSED_DQ_MAX_D
    dq = None if fused else dq or table_tiles(p)[2]
    short_window = fused and _short_window(p, T.FUSED_PERSISTENT_MAX_WINDOW.get(p.block_d, 0))
    most_rows = T.FUSED_PERSISTENT_MAX_N.get(p.block_d, (0, 0))[p.causal]  # (None: any length)
    short_rows = ordered and (most_rows is None or max(p.nq, p.nk) <= most_rows)
    short_dq_kernel = not fused and p.nq <= T.GLUON_BWD_PERSISTENT_MAX_N
    persistent = bool(short_dq_kernel or short_window or short_rows)
    if short_window:
        why += (f"; one program per SM taking tiles from a counter (a window of at most"
                f" {T.FUSED_PERSISTENT_MAX_WINDOW[p.block_d]} keys)")  # fmt: skip
    elif short_rows:
        bound = "" if most_rows is None else f"at most {most_rows} rows, "
        why += f"; one program per SM taking tiles from a counter ({bound}dq in a fixed order)"
    heads = tile_heads(p.batch * p.kv_heads, cdiv(p.nk, tile.block_n), p.target.sms, p.causal,
                       persistent, ordered)  # fmt: skip
    return BwdConfig(BWD_GLUON, tile, True, dq_mode, dq, dq is not None and dq.tma and p.tma_kv,
                     True, True, _fast_tanh(p), kv_regs=fused and not halves,
                     persistent=persistent, tile_heads=heads, dq_halves=halves,
                     dynamic=fused and persistent, why=why)  # fmt: skip


def _short_window(p: Problem, max_keys: int) -> bool:
    """Whether every row of `p` sees at most `max_keys` keys through a window with both edges
    (a left edge, causal or a right edge): its backward tiles are short and of one length."""
    return bool(p.local and p.causal and p.left + p.right + 1 <= max_keys)


def tile_heads(bhk: int, key_blocks: int, sms: int, causal: bool, persistent: bool,
               ordered: bool) -> int:  # fmt: skip
    """(batch, kv head)s per tile group of the Gluon backward (`gluon/bwd.py`, the tile walk): the
    largest divisor of bhk that keeps about one wave of programs on a group, so that the
    programs running at once share q, do and dq's sums in L2; negative (each group from its
    last key block down) for causal dq sums in a fixed order; bhk (one group, key-block-major)
    for persistent causal tiles, whose programs would otherwise get all-long or all-short
    tiles."""
    if causal and persistent and not ordered:
        return bhk
    want = max(1, cdiv(sms, key_blocks))
    group = max(g for g in range(1, min(want, bhk) + 1) if bhk % g == 0)
    return -group if causal and ordered else group


def _pad_rows(p: Problem) -> bool:
    """Padded row vectors for packed batches, ragged lengths and BLOCK_D <= 64 (block-multiple
    d128 non-causal measured 3% slower with them)."""
    return bool(p.packed or p.nq % ROW_PAD != 0 or p.block_d_max <= 64)


def check_bwd(p: Problem, cfg: BwdConfig) -> BwdConfig:
    """`cfg` if its kernels can run problem `p`, else a ValueError saying why."""
    module = {BWD_TRITON: triton_bwd, BWD_GLUON: gluon_bwd}.get(cfg.kernel)
    reason = f"unknown kernel {cfg.kernel!r}" if module is None else module.can_implement(p, cfg)
    if reason is not None:
        raise ValueError(f"config: {cfg} cannot run this call: {reason}")
    return cfg
