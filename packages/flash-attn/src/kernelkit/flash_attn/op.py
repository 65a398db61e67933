"""Validation, launch plans, torch.library registration and autograd for `flash_attn`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton

from kernelkit.shared.packed import check_cu_seqlens
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

try:  # Gluon (triton.experimental.gluon) is newer than the oldest Triton this package accepts
    from . import kernels_gluon as KG
except ImportError:  # pragma: no cover
    KG = None
from .reference import attention_reference, attention_varlen_reference

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q: dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on device {t.device}, but q is on {q.device}")


def _check_head_dim(q, k) -> int:
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: head dim {k.shape[-1]} differs from q's {q.shape[-1]}")
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D={d} outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    return d


def _check_heads(h: int, hkv: int) -> None:
    if h < 1 or hkv < 1:
        raise ValueError(f"q, k: need at least one head, got H={h}, Hkv={hkv}")
    if h % hkv:
        raise ValueError(f"k: q's H={h} heads are not a multiple of k/v's Hkv={hkv} heads")


def _check_scale(causal, softmax_scale, d: int) -> float:
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: must be finite, got {softmax_scale}")
    return float(softmax_scale)


def validate(q, k, v, causal, softmax_scale) -> float:
    """Check the arguments of `flash_attn`; returns the softmax scale to use."""
    _check_tensors(q, k, v)
    if q.dim() not in (3, 4):
        raise ValueError(f"q: expected shape (B, Nq, H, D) or (B, Nq, D), got {tuple(q.shape)}")
    layout = "(B, Nk, Hkv, D)" if q.dim() == 4 else "(B, Nk, D)"
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(f"{name}: expected {layout} like q, got shape {tuple(t.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)} {layout}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: batch size {k.shape[0]} differs from q's {q.shape[0]}")
    d = _check_head_dim(q, k)
    if q.shape[1] < 1:
        raise ValueError("q: the query sequence is empty (Nq must be >= 1)")
    if k.shape[1] < 1:
        raise ValueError("k: the key sequence is empty (Nk must be >= 1)")
    if q.dim() == 4:
        _check_heads(q.shape[2], k.shape[2])
    return _check_scale(causal, softmax_scale, d)


def validate_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
) -> float:
    """Check the arguments of `flash_attn_varlen`; returns the softmax scale to use.

    Always checked (host metadata only): tensors, dtypes, devices, shapes, cu_seqlens int32 and
    1-D with at least two entries, max_seqlen ints >= 1. The values of cu_seqlens (first entry 0,
    non-decreasing, last entry = total rows, lengths <= max_seqlen) are checked only where that
    is free: cu_seqlens on the CPU outside torch.compile tracing. Reading CUDA values would
    synchronise with the device (and break CUDA-graph capture), so there, as in FlashAttention,
    they are the caller's contract."""
    _check_tensors(q, k, v)
    if q.dim() != 3:
        raise ValueError(f"q: expected shape (total_q, H, D), got {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name}: expected shape (total_k, Hkv, D), got {tuple(t.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    d = _check_head_dim(q, k)
    _check_heads(q.shape[1], k.shape[1])
    lengths = [
        check_cu_seqlens(cu, t.shape[0], q.device, name=name)
        for name, cu, t in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k))
    ]
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k: {cu_seqlens_k.shape[0] - 1} sequences, cu_seqlens_q has "
            f"{cu_seqlens_q.shape[0] - 1}"
        )
    for name, m, lens in zip(
        ("max_seqlen_q", "max_seqlen_k"), (max_seqlen_q, max_seqlen_k), lengths
    ):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)):
            raise ValueError(f"{name}: expected an int, got {type(m).__name__}")
        if m < 1:
            raise ValueError(f"{name}: must be >= 1, got {m}")
        if lens is not None and max(lens) > m:
            raise ValueError(f"{name}: {m} is less than the longest sequence ({max(lens)})")
    return _check_scale(causal, softmax_scale, d)


def window_for(window_size, causal: bool, nq: int, nk: int) -> tuple[int, int]:
    """(left, right) of a sliding window, -1 = unbounded: query i sees keys j with
    i + Nk - Nq - left <= j <= i + Nk - Nq + right (FlashAttention's convention). causal=True
    is right = 0; an explicit right > 0 with it is an error. Bounds that no row of an (Nq, Nk)
    problem can reach (left >= Nk - 1, or an explicit right >= Nq - 1) become -1, so such
    windows run the plain kernels."""
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise ValueError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size: sizes must be >= 0, or -1 for unbounded; got ({left}, {right})"
        )
    if causal:
        if right > 0:
            raise ValueError(
                f"window_size: right={right} conflicts with causal=True (causal means right = 0;"
                " for a window that looks ahead pass causal=False)"
            )
        right = 0
    elif right >= nq - 1:
        right = -1
    if left >= nk - 1:
        left = -1
    return left, right


def check_softcap(softcap) -> float:
    """`softcap` as a float: 0 (off) or a positive finite cap."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap: expected a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be finite and >= 0 (0 = no cap), got {softcap}")
    return float(softcap)


# ---------------------------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """Tile of one kernel: BLOCK_M query rows x BLOCK_N keys, warps and pipeline stages; tma:
    read the loop's tiles through TMA descriptors where the inputs allow it (`use_tma`), else
    with pointer loads; gluon (forward only): the Gluon kernel of kernels_gluon.py (BLOCK_M =
    128, `stages` deep K/V ring) where `_gluon_flag` allows it, else `FWD_TILES`' portable tile."""

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
# registers); the forward measured the same either way and keeps pointer loads. d = 16, 32 and
# 256 were not timed: their tiles are the d = 64 ones scaled by the register budget.
FWD_TILES = {
    16: Tile(128, 64, 4, 3),
    32: Tile(128, 64, 4, 3),
    64: Tile(128, 64, 8, 3),
    128: Tile(128, 128, 8, 3),
    256: Tile(128, 32, 8, 2),
}
# The Gluon forward (kernels_gluon.py: a TMA producer warp feeding a 2-deep K/V ring, two
# 64-row consumer warpgroups with asynchronous warpgroup MMAs) where it measured faster on an
# H100 (benchmarks/hopper_ab.py): d = 128 non-causal, 502 -> 644 TFLOP/s at N = 16k (cuDNN 605),
# 461 -> 566 at 4k. d = 64 measured equal or slower, causal was not verified: portable tiles.
GLUON_FWD_TILES = {128: Tile(128, 128, 4, 2, tma=True, gluon=True)}
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
    32: Tile(128, 64, 8, 3),
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
# small tiles, (fwd, dk/dv, dq) by BLOCK_D.
FP32_TILES = {
    16: (Tile(64, 32, 4, 2), Tile(32, 32, 4, 1), Tile(32, 32, 4, 1)),
    32: (Tile(64, 32, 4, 2), Tile(32, 32, 4, 1), Tile(32, 32, 4, 1)),
    64: (Tile(64, 32, 4, 2), Tile(32, 32, 4, 1), Tile(32, 32, 4, 1)),
    128: (Tile(32, 32, 8, 1), Tile(16, 32, 8, 1), Tile(32, 32, 8, 1)),
    256: (Tile(16, 16, 4, 1), Tile(16, 16, 4, 1), Tile(16, 16, 4, 1)),
}
PREPROCESS_BLOCK_M = 64
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


def plan_for(d: int, causal: bool, dtype: torch.dtype, masked_fwd: bool = False) -> Plan:
    """The tiles used for head dim d (padded to a power of two), causal (or any right-bounded
    window) or not, dtype; masked_fwd: a forward with more masked code (a window's left edge,
    or per-sequence lengths)."""
    if interpreting():
        return Plan(INTERPRETER_FWD, INTERPRETER_DKDV, INTERPRETER_DQ)
    bd = block_d_for(d)
    if dtype == torch.float32:
        return Plan(*FP32_TILES[bd])
    fwd, dkdv, dq = CAUSAL_TILES.get(bd, (None, None, None)) if causal else (None, None, None)
    if not (causal or masked_fwd):
        fwd = GLUON_FWD_TILES.get(bd)
    fwd = fwd or FWD_TILES[bd]
    if masked_fwd and bd >= MASKED_FWD_TMA_MIN_D:
        fwd = replace(fwd, tma=True)
    return Plan(fwd, dkdv or DKDV_TILES[bd], dq or DQ_TILES[bd])


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
    return device.type == "cuda" and _sm90(device.index or 0)


def _forward_gluon(q, k, v, o, lse, tile: Tile, scale: float) -> None:
    """The Gluon forward (dense, non-causal, no softcap, window or packing: the cases it was
    written and measured for)."""
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    launch(KG.attn_fwd_gluon_kernel)[(cdiv(nq, tile.block_m) * b * h,)](
        q, k, v, o, lse, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(o), h,
        h // hkv, nq, nk, scale * LOG2E, HEAD_DIM=d, BLOCK_D=block_d_for(d),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, CAUSAL=False,
        EVEN_M=bool(nq % tile.block_m == 0), EVEN_N=bool(nk % tile.block_n == 0),
        DOT_PREC=dot_precision(q.dtype), TMA=True, STAGES=tile.stages, num_warps=tile.warps,
        num_stages=tile.stages,
    )  # fmt: skip


# Softcap on half-precision inputs on the GPU uses the tanh.approx.f32 instruction (one MUFU op,
# as FlashAttention does); float32 inputs and the interpreter an exact float32 formula. False:
# the exact formula everywhere (an A/B switch; NOTES.md).
FAST_TANH = True


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
    the split-KV one; a `plan` alone runs the dense forward with its tile, a `split` the split-KV
    forward (dense batches only)."""
    q, k, v = _unit_d(q), _unit_d(k), _unit_d(v)
    d = int(q.shape[-1])  # compile-time in the kernels: specialise on it under dynamic shapes
    if varlen is None:
        b, nq, h = q.shape[:3]
        nk, hkv = k.shape[1], k.shape[2]
        o = torch.empty((b, nq, h, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
        lse_strides = lse.stride(0), lse.stride(1)
        if b == 0:
            return o, lse
        if plan is None and split is None:
            split = split_plan(q, k, left=window[0])
        if split is not None:
            _forward_split(q, k, v, o, lse, causal, scale, split, softcap, window)
            return o, lse
    else:
        b, nq, nk = varlen.cu_q.shape[0] - 1, varlen.max_q, varlen.max_k
        h, hkv = q.shape[1], k.shape[1]
        o = torch.empty((q.shape[0], h, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((h, q.shape[0]), dtype=torch.float32, device=q.device)
        lse_strides = 0, lse.stride(0)
        if q.shape[0] == 0 or k.shape[0] == 0:  # no rows, or rows that see no key
            return o.zero_(), lse.fill_(-math.inf)
    upper, local, win_left, win_right = _window_args(causal, window)
    plan = plan or plan_for(d, upper, q.dtype, local or varlen is not None)
    t = plan.fwd
    if t.gluon:
        if _gluon_flag(t, q, k, v) and not (upper or local or softcap or varlen is not None):
            _forward_gluon(q, k, v, o, lse, t, scale)
            return o, lse
        t = FWD_TILES[block_d_for(d)]  # not an sm_90 GPU, or a case the Gluon kernel lacks
    qk_scale, cap_scale, softcap_mode = _score_args(scale, softcap, q)
    grid = (cdiv(nq, t.block_m) * b * h,)
    launch(K.attn_fwd_kernel)[grid](
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
    o_part = torch.empty(
        (b * hkv, split.splits, rows_pad, bd), dtype=torch.float32, device=q.device
    )
    lse_part = torch.empty((b * hkv, split.splits, rows_pad), dtype=torch.float32, device=q.device)
    qk_scale, cap_scale, softcap_mode = _score_args(scale, softcap, q)
    upper, local, win_left, win_right = _window_args(causal, window)
    launch(K.attn_fwd_split_kernel)[(row_blocks * split.splits * b * hkv,)](
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
    launch(K.attn_fwd_combine_kernel)[(cdiv(group * nq, block_r) * b * hkv,)](
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
):
    """(dq, dk, dv) from the saved q, k, v, o, lse; dlse (or None) is the LSE's gradient.
    Layouts as in `forward` (packed with `varlen`)."""
    do, q, k, v, o = (_unit_d(t) for t in (do, q, k, v, o))
    d = int(q.shape[-1])
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
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
            return dq.zero_(), dk.zero_(), dv.zero_()
    upper, local, win_left, win_right = _window_args(causal, window)
    plan = plan or plan_for(d, upper, q.dtype, local or varlen is not None)
    bd = block_d_for(d)
    prec = dot_precision(q.dtype)
    qk_scale, cap_scale, softcap_mode = _score_args(scale, softcap, q)
    lse = lse.contiguous()
    # delta like the LSE: (B, H, Nq), or (1, H, total_q) for a packed batch (whose rows the
    # preprocess walks as one sequence); both read through (batch, head) strides.
    delta = torch.empty((rows_b, h, rows), dtype=torch.float32, device=q.device)
    lse_strides = (delta.stride(0) if varlen is None else 0), delta.stride(1)
    cu_q, cu_k = (None, None) if varlen is None else (varlen.cu_q, varlen.cu_k)
    pre_m = INTERPRETER_FWD.block_m if interpreting() else PREPROCESS_BLOCK_M
    launch(K.attn_bwd_preprocess_kernel)[(cdiv(rows, pre_m) * rows_b * h,)](
        o,
        do,
        delta if dlse is None else dlse.contiguous(),
        delta,
        *_seq_strides(o, varlen),
        *_seq_strides(do, varlen),
        h,
        rows,
        HAS_DLSE=dlse is not None,
        HEAD_DIM=d,
        BLOCK_D=bd,
        BLOCK_M=pre_m,
        num_warps=4,
    )
    t = plan.dkdv
    launch(K.attn_bwd_dkdv_kernel)[(cdiv(nk, t.block_n) * b * hkv,)](
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
        num_warps=t.warps,
        num_stages=t.stages,
    )
    t = plan.dq
    launch(K.attn_bwd_dq_kernel)[(cdiv(nq, t.block_m) * b * h,)](
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
        num_warps=t.warps,
        num_stages=t.stages,
    )
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Registered ops
# ---------------------------------------------------------------------------------------------


@define_op("kernelkit_flash_attn::attn_fwd")
def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    if not use_triton(q):
        o, lse = attention_reference(
            q, k, v, causal, scale, return_lse=True, window_size=window, softcap=softcap
        )
        return o, lse.float()
    return forward(q, k, v, causal, scale, softcap=softcap, window=window)


def _reference_grads(reference, do, dlse, q, k, v, *args, **kwargs):
    """(dq, dk, dv) through `reference(q, k, v, *args, **kwargs)`: the CPU fallback's backward."""
    with torch.enable_grad():
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        o, lse = reference(*qkv, *args, return_lse=True, **kwargs)
        outs, grads = [o], [do]
        if dlse is not None:
            outs.append(lse)
            grads.append(dlse.to(lse.dtype))
        dqkv = torch.autograd.grad(outs, qkv, grads, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(dqkv, qkv))


@define_op("kernelkit_flash_attn::attn_bwd")
def attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    if not use_triton(q):
        return _reference_grads(attention_reference, do, dlse, q, k, v, causal, scale,
                                window_size=window, softcap=softcap)  # fmt: skip
    return backward(do, q, k, v, o, lse, dlse, causal, scale, softcap=softcap, window=window)


def _autograd(bwd_op, n_tensors: int):
    """(backward, setup_context) of a forward op whose first n_tensors inputs are tensors (q, k,
    v, then cu_seqlens for the packed op) and the rest options: the backward op gets
    (do, q, k, v, o, lse, dlse, *other tensors, *options)."""

    def setup(ctx, inputs, output):
        # The eager path passes only the arguments given (trailing defaults may be missing).
        ctx.options = tuple(inputs[n_tensors:])
        ctx.save_for_backward(*inputs[:3], *output, *inputs[3:n_tensors])
        # An unused output's gradient arrives as None instead of a tensor of zeros.
        ctx.set_materialize_grads(False)

    def backward(ctx, do, dlse):
        q, k, v, o, lse, *tensors = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = bwd_op(do, q, k, v, o, lse, dlse, *tensors, *ctx.options)
        return dq, dk, dv, *(None,) * (len(tensors) + len(ctx.options))

    return backward, setup


_backward, _setup = _autograd(attn_bwd, 3)
attn_fwd.register_autograd(_backward, setup_context=_setup)


@define_op("kernelkit_flash_attn::attn_varlen_fwd")
def attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    if not use_triton(q):
        o, lse = attention_varlen_reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=scale,
            window_size=window, softcap=softcap, return_lse=True,
        )  # fmt: skip
        return o, lse.float()
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return forward(q, k, v, causal, scale, softcap=softcap, window=window, varlen=varlen)


@define_op("kernelkit_flash_attn::attn_varlen_bwd")
def attn_varlen_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    softcap: float = 0.0,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    if not use_triton(q):
        return _reference_grads(attention_varlen_reference, do, dlse, q, k, v, cu_seqlens_q,
                                cu_seqlens_k, causal=causal, softmax_scale=scale,
                                window_size=window, softcap=softcap)  # fmt: skip
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return backward(do, q, k, v, o, lse, dlse, causal, scale, softcap=softcap, window=window,
                    varlen=varlen)  # fmt: skip


_varlen_backward, _varlen_setup = _autograd(attn_varlen_bwd, 5)
attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
):
    """Exact softmax attention, FlashAttention-2 style (the N x N scores never reach memory).

    q (B, Nq, H, D), k/v (B, Nk, Hkv, D) with H % Hkv == 0 (query head h reads kv head
    h // (H / Hkv)), or 3-D (B, N, D) tensors (one head). float16/bfloat16 (float32 accepted).
    causal: query i sees keys j <= i + Nk - Nq; a row that sees no key outputs zeros.
    Returns o like q, and with return_lse=True also the natural-log LSE (B, H, Nq) float32
    ((B, Nq) for 3-D inputs; -inf on rows that see no key).
    window_size=(left, right): sliding-window (local) attention, -1 = unbounded: query i sees
    keys j with i + Nk - Nq - left <= j <= i + Nk - Nq + right; causal=True means right = 0
    (a conflicting right > 0 is a ValueError). Key blocks outside the window are skipped.
    softcap > 0: the scores (q.k * scale) become softcap * tanh(scores / softcap) before the
    softmax (Gemma 2); 0 = off.
    Decoding shapes (few query rows, long key sequences) run a split-KV forward (`split_plan`).
    """
    scale = validate(q, k, v, causal, softmax_scale)
    softcap = check_softcap(softcap)
    left, right = window_for(window_size, causal, q.shape[1], k.shape[1])
    three_d = q.dim() == 3
    if three_d:
        q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    if scale < 0:  # the kernels assume scale >= 0 (max of the raw scores); negate q instead
        q, scale = -q, -scale
    o, lse = attn_fwd(q, k, v, causal, scale, softcap, left, right)
    if three_d:
        o, lse = o.squeeze(2), lse.squeeze(1)
    return (o, lse) if return_lse else o


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """`flash_attn` over a packed batch of variable-length sequences (no padding).

    q (total_q, H, D), k/v (total_k, Hkv, D); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v (int32 prefix sums (num_seqs + 1,) on q's
    device, starting at 0; sequences may be empty); max_seqlen_q/k >= the longest sequence (they
    size the launch). Sequences never see each other; causal and window_size apply per
    sequence, bottom-right aligned (shift = its Nk - Nq). Returns o (total_q, H, D) and with
    return_lse=True the LSE (H, total_q) float32. What is validated and what is the caller's
    contract (cu_seqlens values on the GPU): `validate_varlen`.
    """
    scale = validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
    )
    softcap = check_softcap(softcap)
    left, right = window_for(window_size, causal, max_seqlen_q, max_seqlen_k)
    if scale < 0:  # as in flash_attn
        q, scale = -q, -scale
    o, lse = attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             causal, scale, softcap, left, right)  # fmt: skip
    return (o, lse) if return_lse else o


__all__ = [
    "attn_bwd",
    "attn_fwd",
    "attn_varlen_bwd",
    "attn_varlen_fwd",
    "backward",
    "flash_attn",
    "flash_attn_varlen",
    "forward",
    "plan_for",
    "split_plan",
    "validate",
    "validate_varlen",
    "window_for",
]
