"""The measured tables `choose.py` reads: tiles by head dim (BLOCK_D) and dtype, and the
thresholds of its rules. Data only: the numbers that decided each entry are in NOTES.md
("The kernels and when each runs", "Decisions kept"); `benchmarks/tune.py` and
`benchmarks/tune_decode.py` regenerate them."""

from __future__ import annotations

from .config import Tile

# ---------------------------------------------------------------------------------------------
# Portable kernels (triton/), half precision on Hopper
# ---------------------------------------------------------------------------------------------

# Forward. Screened for sm_90a (registers, spills, shared memory), timed with tune.py at
# N = 4k..32k (H100, H200); d16/32 from the flash-table sweep. Pointer loads: TMA measured the
# same. d256 not timed.
FWD_TILES = {
    16: Tile(64, 128, 4, 3),
    32: Tile(64, 128, 4, 3),
    64: Tile(128, 64, 8, 3),
    128: Tile(128, 128, 8, 3),
    256: Tile(128, 32, 8, 2),
}
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
# Causal (or right-bounded) overrides, (fwd, dk/dv, dq), None = the tables above: the diagonal's
# masked steps and the uneven work per program favour other shapes (NOTES: "Causal tiles differ").
CAUSAL_TILES: dict[int, tuple[Tile | None, Tile | None, Tile | None]] = {
    64: (None, Tile(64, 64, 4, 3, tma=True), Tile(128, 64, 8, 4, tma=True)),
    128: (None, Tile(64, 128, 8, 3, tma=True), Tile(128, 64, 8, 4, tma=True)),
}
# float32 inputs (tf32x3: three products per dot need about three times the operand registers),
# (fwd, dk/dv, dq): winners of the H100 flash-table sweep.
FP32_TILES = {
    16: (Tile(64, 64, 4, 2), Tile(32, 32, 4, 1), Tile(32, 32, 4, 1)),
    32: (Tile(64, 64, 4, 2), Tile(32, 64, 4, 2), Tile(64, 64, 4, 2)),
    64: (Tile(32, 64, 4, 2), Tile(32, 32, 4, 1), Tile(32, 64, 4, 2)),
    128: (Tile(32, 64, 8, 1), Tile(64, 32, 8, 1, tma=True), Tile(16, 32, 4, 2, tma=True)),
    256: (Tile(16, 16, 4, 1), Tile(16, 16, 4, 1), Tile(16, 16, 4, 1)),
}
# Small grids: a half-precision forward whose table tile would launch fewer than `waves`
# (non-causal) / `causal_waves` programs per SM takes the 64-row tile (twice the programs).
# BLOCK_D -> (tile, waves, causal_waves). d128: none (the Gluon forward won everywhere).
SMALL_GRID_FWD = {64: (Tile(64, 128, 4, 3), 2.0, 8.0)}
# Masked forwards (a window's left edge, packed batches) at BLOCK_D >= this read K/V through
# TMA: with pointer loads the d128 tile needs 1.7-1.9 KB of stack (register screen).
MASKED_FWD_TMA_MIN_D = 128

# Under the interpreter: small, unequal tiles, so that tests at small N walk several blocks, the
# causal diagonal and the sequence ends in every kernel; TMA loads (the pointer path runs where
# inputs are misaligned, and in tests that pass a config).
INTERPRETER_FWD = Tile(32, 16, 4, 1, tma=True)
INTERPRETER_DKDV = Tile(16, 32, 4, 1, tma=True)
INTERPRETER_DQ = Tile(32, 16, 4, 1, tma=True)

# ---------------------------------------------------------------------------------------------
# Gluon kernels (gluon/), half precision on sm_90
# ---------------------------------------------------------------------------------------------

# Forward (2 x 64 query rows, a `stages`-deep K/V ring): d128 always; d64 from these query rows
# (non-causal, causal).
GLUON_FWD_TILE = Tile(128, 128, 4, 2, tma=True)
GLUON_FWD_MIN_N = {64: (8192, 2048), 128: (0, 0)}
# The q tile in registers (the S product's A operand) up to this BLOCK_D (d128 would spill).
GLUON_FWD_Q_REGS_MAX_D = 64
# dk/dv with the dq kernel beside it (2 x 64 keys, BLOCK_M query rows per step): d128, (non-causal,
# causal) tiles. One program per SM up to GLUON_BWD_PERSISTENT_MAX_N query rows.
GLUON_DKDV_TILES = {128: (Tile(64, 128, 4, 3, tma=True), Tile(64, 128, 4, 2, tma=True))}
GLUON_BWD_PERSISTENT_MAX_N = 4096
# dq summed in the Gluon dk/dv kernel from these query rows (non-causal, causal): in a fixed
# order (deterministic, the default), in any order (deterministic=False). Up to
# GLUON_FUSED_DQ_MAX_D by a dq warpgroup with K and V in registers; above it by the consumer
# warpgroups, each computing half of dq's columns (`BwdConfig.dq_halves`: a dq warpgroup's
# 64 x 128 float32 part would spill). d128 from 2k rows (0.13.0): H200, 2k-16k, faster than the dq
# kernel beside the Gluon dk/dv one in every cell but GQA causal in the fixed order
# (ORDERED_GQA_CAUSAL_DQ_KERNEL_D below; NOTES.md, sessions 34-35). d64 from 2k rows in the
# fixed order since its tiles come from a counter up to FUSED_PERSISTENT_MAX_N rows (session
# 40: the portable kernels were 14-17% slower at 2k-4k causal); from 4k in any order. Both
# from 512 rows in the fixed order since the row vectors come through the ring and d128 walks
# from the counter too (0.17.1; H200, session 42, 16k tokens, interleaved ms, the chooser's
# backward then / fused from the counter: d64 h32 1k causal 0.764 / 0.612, non-causal 1.042 /
# 0.882, 512 causal 0.539 / 0.473; d128 h16 1k causal 0.677 / 0.611, non-causal 0.974 / 0.861,
# 512 causal 0.504 / 0.471; `lab/flash-attn/logs/session42-H200-short-rows-ab.log`). Below
# 512 not measured; in any order the fused kernel runs one program per tile (1k causal d128
# 0.721 against the dq kernel's 0.677): not moved.
GLUON_FUSED_DQ_MAX_D = 64
FUSED_DQ_MIN_N = {64: (512, 512), 128: (512, 512)}
ANY_ORDER_DQ_MIN_N = {64: (4096, 4096), 128: (2048, 2048)}
# Head dims (BLOCK_D) where GQA causal (no window) in the fixed order keeps the dq kernel
# beside the Gluon dk/dv one at every length: the fused sums' wait chain grows with the query
# heads per kv head (H200, session 35, 32 heads on 8 / 4 kv heads, TFLOP/s fused / dq kernel:
# 8k 384 / 421 and 344 / 403, 16k 384 / 437 and 354 / 415, 4k 351 / 338 and 307 / 325, 2k
# 318 / 310 and 280 / 301; 16 / 16 heads causal: fused 6-12% faster from 2k to 16k).
ORDERED_GQA_CAUSAL_DQ_KERNEL_D = (128,)
FUSED_DQ_DKDV = Tile(64, 128, 4, 2, tma=True)
# Fused-dq backwards whose window (both edges: causal with a left edge) spans at most this many
# keys per row walk their tiles with one program per SM, taking them from a counter
# (BwdConfig.dynamic): the tiles are short and of one length, and the per-program costs weigh.
# d64 (a dq warpgroup), H200, session 39, causal 16k, interleaved ms, one program per tile / per
# SM by program id / per SM from the counter: window 512 0.972 / 0.772 / 0.775, 1k 1.305 /
# 1.124 / 1.118, 2k 1.951 / 1.837 / 1.800, 3k 2.562 / 2.547 / 2.407, 4k 3.162 / 3.280 / 3.065
# (spread 3-5%), 8k 5.022 / 5.498 / 4.928 (2-4%): kept where the gain is beyond the spread
# (NOTES.md). d128 (dq halves) since its row vectors come through the ring (0.17.0; its
# consumers spilled in the tile loop before, and lost 10-28%): H200, session 41, causal 16k,
# one program per tile / from the counter, ms, fixed order (two runs): window 1k 1.033 / 0.926,
# 1.070 / 0.936; 2k 1.719 / 1.532; 4k 2.669 / 2.555; 8k 4.451 / 4.239; softcap 30 with a 1k
# window 1.118 / 1.043; any order: 1k 1.018 / 0.936, 4k 2.635 / 2.594
# (`lab/flash-attn/logs/session41-H200-rows-smem-ab*.log`, `...-d128-dynamic-softcap-ab.log`).
# d64 past 3k since the ring (0.17.1; H200, session 42, causal 16k, per tile / from the counter,
# ms, fixed order): window 2k 1.787 / 1.519, 3k 2.355 / 2.079, 4k 2.878 / 2.582, 6k 3.738 /
# 3.524, 8k 4.477 / 4.238, 4k at 64k rows 12.184 / 11.568; any order 4k 2.739 / 2.688
# (`lab/flash-attn/logs/session42-H200-d64-windows-dynamic-ab.log`).
FUSED_PERSISTENT_MAX_WINDOW = {64: 8192, 128: 8192}
# Fused-dq backwards summing dq in the fixed order walk their tiles from a
# counter up to this many rows (queries and keys) too: one program per tile leaves the causal
# tiles unbalanced and the last wave part-empty at a few tiles per SM, and the counter hands out
# each head's tiles in the sums' order. H200, session 40, d64, 32 heads, 16k tokens,
# interleaved ms, the chooser's backward then (portable below 8k) / fused, one program per
# tile / fused from the counter (`lab/flash-attn/logs/session40-H200-d64-lengths-ab.log`):
# causal 2k 1.240 / 1.284 / 1.071, 4k 2.203 / 2.047 / 1.835, 8k 3.514 (fused per tile) /
# 3.556 / 3.410, 16k 6.532 / 6.516 / 6.560 (a tie: not taken); non-causal 4k 3.689 / 3.415 /
# 3.192. In any order the counter lost (causal 4k 1.924 per tile / 2.261): not taken. d128 (dq
# halves, 0.17.0, the row vectors through the ring), H200, session 41, 16k tokens, 16 heads,
# per tile / from the counter, two runs, ms: causal 2k 1.028 / 0.914, 1.043 / 0.918; 4k 1.686 /
# 1.582, 1.748 / 1.591; 8k 3.071 / 2.969; 16k 5.642 / 5.391, 5.800 / 5.687 (2-4%, within the
# spread: not taken); non-causal 2k 1.581 / 1.499, 1.700 / 1.557; 4k 2.934 / 2.831, 3.002 /
# 2.919; 8k 5.640 / 5.457; 16k 10.735 / 10.532, 10.894 / 10.828; softcap 30 causal 2k 1.117 /
# 1.012, 4k 1.853 / 1.743, 8k 3.343 / 3.190, non-causal 4k 3.192 / 3.034. d64 at 16k with the
# ring: causal 5.645 / 5.559, non-causal 10.961 / 10.690 (within the spread: not taken).
# d128 at any length since 0.17.4: with 0.17.3's TMA stores of dk and dv a walked program starts
# its next tile under its last one's stores (one program per tile waits for them before it
# exits). H200, sessions 44 and 45, fixed order, 7 interleaved rounds, ms per tile / walked,
# gradients bitwise equal: causal 16k 5.576 / 5.273 and 5.711 / 5.413, 32k 21.337 / 21.163 and
# 22.335 / 21.692; a 12k window 5.315 / 5.060; non-causal 16k 10.265 / 10.301 and 10.580 /
# 10.505; GQA 32 / 8 non-causal 16k 20.812 / 21.143 (the spread, 10-19%). d64 non-causal at any
# length too (0.17.4; the third run 11 rounds): 16k 10.959 / 10.654, 11.332 / 10.891 and
# 11.146 / 10.901; the leaderboard shape (B 16, H 1) 5.584 / 5.470 and 5.561 / 5.422; GQA 32 / 8
# 11.145 / 10.949. d64 causal keeps 8k: the leaderboard shape 2.929 / 2.948 and 2.860 / 2.906,
# GQA 32 / 8 6.178 / 6.350 and 6.112 / 6.250, 32k 22.178 / 22.087, 22.177 / 22.438 and 22.086 /
# 22.457, against 16k 5.679 / 5.608, 5.802 / 5.717 and 5.754 / 5.688, 12k (B 2, H 16) 3.347 /
# 3.241 (`lab/flash-attn/logs/session44-H200-long-rows-walk-ab.log`, `session45-...`).
# By BLOCK_D: (non-causal, causal) bounds; None: any length.
FUSED_PERSISTENT_MAX_N = {64: (None, 8192), 128: (None, None)}

# ---------------------------------------------------------------------------------------------
# Split-KV forward (decoding)
# ---------------------------------------------------------------------------------------------

# By BLOCK_D: (BLOCK_N, warps, stages, tma) of the tile whose BLOCK_M rows hold the packed
# (query head of the group, query) rows of one kv head, 16..64 of them; more rows take the
# dense forward's tile. Memory-bound: TMA loads, two stages ahead, little shared memory.
SPLIT_TILES = {16: (128, 4, 3, True), 32: (128, 4, 3, True), 64: (128, 4, 3, True),
               128: (128, 4, 2, True), 256: (32, 8, 3, True)}  # fmt: skip
SPLIT_FP32_TILES = {16: (32, 4, 2, True), 32: (32, 4, 2, True), 64: (32, 4, 2, True),
                    128: (32, 4, 2, True), 256: (16, 8, 2, True)}  # fmt: skip
# Splits: as many as keep the launch within SPLIT_WAVES programs per SM, at most SPLIT_MAX,
# each of at least max(SPLIT_MIN_KEYS, SPLIT_KEYS_PER_ROW * padded rows) keys (its float32
# partial then costs at most 1/8 of the K/V bytes it reads).
SPLIT_WAVES, SPLIT_MIN_KEYS, SPLIT_KEYS_PER_ROW, SPLIT_MAX = 1, 256, 16, 128
# Launches of more than this many waves of programs read K/V with pointer loads: TMA lost 8% at
# B 64 (512 programs, one split; H100, d128, 1.52 vs 1.41 ms), and tied at one wave.
SPLIT_TMA_MAX_WAVES = 2
# A paged KV cache whose pages are not whole key blocks of the tile: pages of a multiple of
# PAGED_TILE's BLOCK_N take that tile through TMA (a page per block; H100, B 8, page 64: 205 vs
# 229 us at 16k keys, within 5% of a contiguous cache), except in launches of more than
# SPLIT_TMA_MAX_WAVES waves (B 64: 10% slower than the table's tile with pointer loads, which
# they keep); others (16, 32 rows) read a page per row
# with pointer loads over PAGED_ROWS_SPLIT_WAVES times the splits (more loads in flight: 205
# vs 234 us at page 16).
PAGED_TILE = (64, 4, 6)
PAGED_ROWS_SPLIT_WAVES = 2
# Nq up to this always takes the split kernel (even unsplit): the dense one would read each K/V
# byte once per query head and fill 128-row tiles with a few rows.
DECODE_MAX_NQ = 16
# Under the interpreter (4 stand-in SMs): small tiles and splits, so that tests with a few dozen
# keys already take several splits.
INTERPRETER_SPLIT = (16, 4, 1, True)
INTERPRETER_SPLIT_RULE = (2, 32, 1, 128)
# Packed rows per program of the merge (at most the split tile's BLOCK_M, which it divides).
COMBINE_BLOCK_R = 16
