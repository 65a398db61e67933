"""Gluon backward of flash-attn for Hopper (sm_90a): dk, dv of one 128-key block per program,
dq by the portable dq kernel beside it (triton/bwd.py) or summed here. This file holds the
kernel (its shared memory, barriers and partitions) and its host side (`can_implement`,
`launch`); the partitions' code is in bwd_partitions.py.

A tile = BLOCK_N = 2 x 64 keys of one kv head; one program per tile, or with PERSISTENT (the
dk/dv-only kernel up to tables.GLUON_BWD_PERSISTENT_MAX_N rows; fused dq on short windows,
tables.FUSED_PERSISTENT_MAX_WINDOW, and in the fixed order on rows up to
FUSED_PERSISTENT_MAX_N, d64 causal, any otherwise) one per SM walking its share of the tiles;
fused dq (DYNAMIC) takes each next tile from a counter, so that tiles go out in increasing
order to programs that run: a tile waits on the dq sums of tiles before it only, so the first
unfinished tile always runs, however few programs are resident. Three partitions:
- a producer warp loads each tile's K and V block (once the consumers are done with the last
  tile's), then for each (query head of the GQA group, query block) step the BLOCK_M-row
  tiles of q and do and their rows' lse2 and delta into a STAGES-deep ring (4-D (B, N, H, D)
  descriptors: batch and heads are coordinates, not new descriptors; 1-D ones over the padded
  row vectors);
- two consumer warpgroups own 64 keys each and run, per step, the transposed products
  S^T = K q^T and dP^T = V do^T (both asynchronous: the softmax of S^T runs under dP^T),
  then dV += P^T do and dK += dS^T q with P^T / dS^T as register A operands (dV runs under
  dS^T). K and V stay in shared memory as wgmma operands; the portable dk/dv kernel holds
  them in registers, which made its d = 128 tiles spill. At a tile's end each writes its dk, dv
  into shared memory and hands them to TMA stores (`_store_dkdv`), then starts the next. Softcap
  (SOFTCAP, tanh.approx): P (the dV product's operand) and P (1 - tanh^2), the cap's derivative
  folded in, are held in 16 bits (scaled by 2^15: P_SCALE_LOG2) until dS (with P and the tanh in
  float32 across the dP^T wait the consumers spilled, and that variant lost to the portable
  backward: NOTES.md).
The same 4 block products per tile pair as the portable kernel, summed in the same order
(dk, dv bitwise equal to it on the H100 without softcap).

DQ_MODE > 0 (choose.choose_bwd; NOTES.md) sums dq here too: a fifth product per step,
dq_part = dS K over all 128 keys. Both consumers write their half of dS^T into a shared
buffer (one per step parity). At d <= 64 they go on, and a third warpgroup, which does
nothing else, waits for both halves, runs the product and hands the part, scaled, to a
reducer warp through a shared-memory buffer. With DQ_HALVES (d128, whose 64 x 128 float32 part
a third warpgroup's registers cannot hold) there is no such warpgroup: each consumer waits for
the other's half and computes half of the part's columns, dS K[:, WG * 64 : +64], under its
dV product and before its dK product, and stores it into its half of the buffer while dK runs.
The reducer warp adds the part into a float32 dq buffer with TMA reduce-adds
(cp.reduce.async.bulk.tensor). DQ_MODE 1 adds in any order; DQ_MODE 2 key block after key
block (bitwise reproducible sums): a semaphore per query block counts the parts added, and
only the reducer warps (two, taking turns) wait on it. (Parts added with atomics by the
consumers themselves were slower; so were parts of 64 keys, and the consumers taking turns at
the product: NOTES.md.)

Tiles go in groups of a few heads (`BwdArgs.tile`) so that the programs running at once share
q, do and the dq sums in L2 (persistent causal tiles stay key-block-major over all heads:
choose.tile_heads). Causal sums in a fixed order go from each query block's last key
block down, and the tiles launch in that order: a program waits only on one launched before
it, which started two query blocks below it and so is ahead.
"""

import torch

from kernelkit.shared.runtime import cdiv

from ..config import DQ_KERNEL, DQ_ORDERED, BwdConfig, Problem, Scores
from ..strides import tma_strides
from ..tables import GLUON_FUSED_DQ_MAX_D
from .bwd_partitions import (
    BWD_WG_KEYS,
    DQ_BUFFERS,
    DQ_WARPGROUP_REGS,
    FUSED_CONSUMER_REGS,
    HALVES_CONSUMER_REGS,
    ID_SLOTS,
    ORDERED_DQ_REDUCERS,
    P_SCALE_LOG2,
    P_UNSCALE,
    REDUCER_WARP_REGS,
    BwdArgs,
    bwd_consumer,
    bwd_dq_reducer,
    bwd_dq_warpgroup,
    bwd_producer,
    id_readers,
)
from .common import gl, gluon, mbarrier, tma, zero_counter_kernel


@gluon.jit(do_not_specialize=["Nq", "Nk", "win_left", "win_right"])
def attn_bwd_gluon_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    DQACC,
    SEM,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    vec_stride,
    sem_stride,
    dq_rows,
    tile_heads,
    B,
    H,
    Hkv,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    sm_scale,
    cap_scale,
    win_left,
    win_right,
    HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    LOCAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    STAGES: gl.constexpr,
    DQ_MODE: gl.constexpr,
    ROWS_SCALED: gl.constexpr = False,
    DQ_HALVES: gl.constexpr = False,
    KV_REGS: gl.constexpr = False,
    PERSISTENT: gl.constexpr = False,
    TILE_CTR=None,
    DYNAMIC: gl.constexpr = False,
):
    """dk, dv of the B * Hkv * cdiv(Nk, BLOCK_N) tiles of 128 keys of one kv head (bottom-right
    causal mask or none, a sliding window (win_left with LOCAL, win_right with CAUSAL: the
    portable kernels' window), softcap through tanh.approx (SOFTCAP, cap_scale), GQA, any Nq
    and Nk): tile program_id, or with PERSISTENT tiles program_id, + num_programs, ... (one
    program per SM; `BwdArgs.tile` orders them); launched with num_warps = 4 (the default
    partition), 9 warps in all (14 with DQ_MODE 1, 15 with 2, whose reducer warps take turns;
    with DQ_HALVES 10 and 11). LSE2 / DELTA: (B * H, vec_stride) padded row vectors
    (triton/bwd.py, attn_bwd_preprocess_kernel with ROWVEC; with ROWS_SCALED lse2 - 15 and
    -delta 2^-15, `scaled_rows`), read through 1-D TMA descriptors by the producer.
    tile_heads: (batch, kv head)s per tile group, negative for descending key blocks
    (`BwdArgs.tile`). DQ_MODE > 0: also dq's float32 sums, scaled, into DQACC ((dq_rows =
    B * H * vec_stride, BLOCK_D), zeroed before, as is SEM: (B * H, sem_stride)): a third
    warpgroup computes each step's dq part from the consumers' dS^T (`_bwd_dq_tile`;
    BLOCK_D <= 64), or with DQ_HALVES each consumer half of its columns (`_bwd_tile_steps`), a
    reducer warp adds it
    (DQ_MODE 2: two, taking turns, each waiting for the part of the key block before it in the
    sums' order, whose tile was launched before it: `_bwd_reduce_tile`). DYNAMIC (PERSISTENT
    only): the programs take their tiles from the counter TILE_CTR (one int32, zeroed before)
    instead of by program id (`bwd_producer`). The TMA descriptors span the whole (B, N, H, D)
    tensors: built once per program."""
    gl.static_assert(BLOCK_N == 2 * BWD_WG_KEYS, "two consumer warpgroups of 64 keys")
    gl.static_assert(DQ_MODE == 0 or DQ_HALVES or BLOCK_D <= 64,
                     "the dq warpgroup's registers hold d <= 64")  # fmt: skip
    gl.static_assert(not DQ_HALVES or DQ_MODE > 0, "dq halves: dq summed in the kernel")
    gl.static_assert(not DYNAMIC or PERSISTENT, "a dynamic walk: persistent programs")
    qk_scale = qk_scale.to(gl.float32)
    sm_scale = sm_scale.to(gl.float32)
    cap_scale = cap_scale.to(gl.float32)
    lo_shift = Nk - Nq - win_left
    hi_shift = Nk - Nq + win_right
    bhk_count = B * Hkv
    n_tiles = bhk_count * gl.cdiv(Nk, BLOCK_N)
    dtype: gl.constexpr = Q.dtype.element_ty
    tile4: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, 1, BLOCK_D], dtype)
    tile2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    kv4: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, 1, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    q_desc = tma.make_tensor_descriptor(Q, [B, Nq, H, HEAD_DIM],
                                        [stride_qb, stride_qn, stride_qh, 1],
                                        [1, BLOCK_M, 1, BLOCK_D], tile4)  # fmt: skip
    do_desc = tma.make_tensor_descriptor(DO, [B, Nq, H, HEAD_DIM],
                                         [stride_dob, stride_don, stride_doh, 1],
                                         [1, BLOCK_M, 1, BLOCK_D], tile4)  # fmt: skip
    k_desc = tma.make_tensor_descriptor(K, [B, Nk, Hkv, HEAD_DIM],
                                        [stride_kb, stride_kn, stride_kh, 1],
                                        [1, BLOCK_N, 1, BLOCK_D], kv4)  # fmt: skip
    v_desc = tma.make_tensor_descriptor(V, [B, Nk, Hkv, HEAD_DIM],
                                        [stride_vb, stride_vn, stride_vh, 1],
                                        [1, BLOCK_N, 1, BLOCK_D], kv4)  # fmt: skip
    # dk, dv: each consumer stores its 64 keys (`_store_dkdv`)
    out4: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BWD_WG_KEYS, 1, BLOCK_D], dtype)
    out2: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BWD_WG_KEYS, BLOCK_D], dtype)
    dk_desc = tma.make_tensor_descriptor(DK, [B, Nk, Hkv, HEAD_DIM],
                                         [stride_dkb, stride_dkn, stride_dkh, 1],
                                         [1, BWD_WG_KEYS, 1, BLOCK_D], out4)  # fmt: skip
    dv_desc = tma.make_tensor_descriptor(DV, [B, Nk, Hkv, HEAD_DIM],
                                         [stride_dvb, stride_dvn, stride_dvh, 1],
                                         [1, BWD_WG_KEYS, 1, BLOCK_D], out4)  # fmt: skip
    # the padded row vectors as flat (B * H * vec_stride,) float32 tensors, BLOCK_M rows a load
    rows_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                     rank=1)  # fmt: skip
    lse_desc = tma.make_tensor_descriptor(LSE2, [B * H * vec_stride], [1], [BLOCK_M], rows_layout)
    delta_desc = tma.make_tensor_descriptor(DELTA, [B * H * vec_stride], [1], [BLOCK_M],
                                            rows_layout)  # fmt: skip
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], tile2)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], tile2)
    rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], rows_layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    # one arrival per warpgroup reading K (a dq warpgroup too)
    mbarrier.init(kv_empty, count=3 if DQ_MODE > 0 and not DQ_HALVES else 2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    # a dq part: BLOCK_M rows of all its columns, or (DQ_HALVES) of half of them per consumer
    DQ_PARTS: gl.constexpr = 2 if DQ_HALVES else 1
    DQ_COLS: gl.constexpr = BLOCK_D // DQ_PARTS
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS], gl.float32)
    if DQ_MODE > 0:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS * DQ_PARTS, BLOCK_M, DQ_COLS],
                                            dq_layout)  # fmt: skip
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_ready = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
        dq_free = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)  # both halves of dS^T written
            mbarrier.init(ds_free.index(i), count=DQ_PARTS)  # each dq product has read them
        for i in gl.static_range(DQ_BUFFERS):
            mbarrier.init(dq_ready.index(i), count=DQ_PARTS)
            mbarrier.init(dq_free.index(i), count=1)
        dq_desc = tma.make_tensor_descriptor(DQACC, [dq_rows, BLOCK_D], [BLOCK_D, 1],
                                             [BLOCK_M, DQ_COLS], dq_layout)  # fmt: skip
    else:  # unused: stand-ins, so that the dk/dv-only kernel allocates nothing more
        ds_smem, dq_smem = k_smem, v_smem
        ds_ready, ds_free, dq_ready, dq_free = kv_bar, kv_bar, kv_bar, kv_bar
        dq_desc = q_desc
    # dk, dv on their way out: slot 2 j + WG (j = 0 dk, 1 dv); DQ_HALVES: the dq buffers (its
    # shared memory is full: 225.5 KB)
    if DQ_HALVES:
        out_smem = dq_smem
    else:
        out_smem = gl.allocate_shared_memory(dtype, [4, BWD_WG_KEYS, BLOCK_D], out2)
    if DYNAMIC:
        ids = gl.allocate_shared_memory(gl.int32, [ID_SLOTS, 1],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # fmt: skip
        id_ready = gl.allocate_shared_memory(gl.int64, [ID_SLOTS, 1], mbarrier.MBarrierLayout())
        id_free = gl.allocate_shared_memory(gl.int64, [ID_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(ID_SLOTS):
            mbarrier.init(id_ready.index(i), count=1)
            mbarrier.init(id_free.index(i), count=id_readers(DQ_MODE, DQ_HALVES))
    else:  # unused: stand-ins
        ids, id_ready, id_free = kv_bar, kv_bar, kv_bar

    a = BwdArgs(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc, dk_desc, dv_desc,
                q_smem, do_smem, rows_smem, k_smem, v_smem, ds_smem, dq_smem, out_smem, kv_bar,
                kv_empty, ready, empty, ds_ready, ds_free, dq_ready, dq_free, K, V, stride_kb,
                stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, vec_stride, H, Hkv, GROUP,
                Nq, Nk, n_tiles, tile_heads, qk_scale, sm_scale, SEM, sem_stride, cap_scale,
                lo_shift, hi_shift, CAUSAL, LOCAL, SOFTCAP, ROWS_SCALED, HEAD_DIM, BLOCK_M, BLOCK_N,
                BLOCK_D, STAGES, DQ_MODE, DQ_HALVES, KV_REGS, PERSISTENT, TILE_CTR, ids, id_ready,
                id_free, DYNAMIC)  # fmt: skip
    # Three partition lists (fixed-order dq: two reducer warps; any order: one; dk/dv only):
    # Gluon takes the (function, args) pairs as a literal list. (One list with a second reducer
    # warp idle in any order would do, but that variant was never timed.)
    if DQ_HALVES and DQ_MODE == 2:
        gl.warp_specialize(
            [
                (bwd_consumer, (a, gl.constexpr(0))),
                (bwd_consumer, (a, gl.constexpr(1))),
                (bwd_producer, (a,)),
                (bwd_dq_reducer, (a, gl.constexpr(True), gl.constexpr(0), ORDERED_DQ_REDUCERS)),
                (bwd_dq_reducer, (a, gl.constexpr(True), gl.constexpr(1), ORDERED_DQ_REDUCERS)),
            ],
            [4, 1, 1, 1],
            [HALVES_CONSUMER_REGS, 24, REDUCER_WARP_REGS, REDUCER_WARP_REGS],
        )
    elif DQ_HALVES:
        gl.warp_specialize(
            [
                (bwd_consumer, (a, gl.constexpr(0))),
                (bwd_consumer, (a, gl.constexpr(1))),
                (bwd_producer, (a,)),
                (bwd_dq_reducer, (a, gl.constexpr(False), gl.constexpr(0), gl.constexpr(1))),
            ],
            [4, 1, 1],
            [HALVES_CONSUMER_REGS, 24, REDUCER_WARP_REGS],
        )
    elif DQ_MODE == 2:
        gl.static_assert(ORDERED_DQ_REDUCERS == 2, "the list below spells out two reducer warps")
        gl.warp_specialize(
            [
                (bwd_consumer, (a, gl.constexpr(0))),
                (bwd_consumer, (a, gl.constexpr(1))),
                (bwd_dq_warpgroup, (a,)),
                (bwd_producer, (a,)),
                (bwd_dq_reducer, (a, gl.constexpr(True), gl.constexpr(0), ORDERED_DQ_REDUCERS)),
                (bwd_dq_reducer, (a, gl.constexpr(True), gl.constexpr(1), ORDERED_DQ_REDUCERS)),
            ],
            [4, 4, 1, 1, 1],
            [FUSED_CONSUMER_REGS, DQ_WARPGROUP_REGS, 24, REDUCER_WARP_REGS, REDUCER_WARP_REGS],
        )
    elif DQ_MODE == 1:
        gl.warp_specialize(
            [
                (bwd_consumer, (a, gl.constexpr(0))),
                (bwd_consumer, (a, gl.constexpr(1))),
                (bwd_dq_warpgroup, (a,)),
                (bwd_producer, (a,)),
                (bwd_dq_reducer, (a, gl.constexpr(False), gl.constexpr(0), gl.constexpr(1))),
            ],
            [4, 4, 1, 1],
            [FUSED_CONSUMER_REGS, DQ_WARPGROUP_REGS, 24, REDUCER_WARP_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (bwd_consumer, (a, gl.constexpr(0))),
                (bwd_consumer, (a, gl.constexpr(1))),
                (bwd_producer, (a,)),
            ],
            [4, 1],
            [232, 24],
        )


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------


def can_implement(p: Problem, cfg: BwdConfig) -> str | None:
    """None if the Gluon backward can run `cfg` for problem `p`, else why not: an sm_90 GPU,
    half precision, BLOCK_D 64 or 128, v's head dim equal to q's, TMA-aligned q, k, v, do;
    no packed batch, softcap only through tanh.approx; 2 x 64 keys per
    tile; dq summed here by a dq warpgroup only up to GLUON_FUSED_DQ_MAX_D (above it by the
    consumers, `dq_halves`), and K/V in registers only with the dq warpgroup (the dq-kernel
    variant computed wrong dk / dv with them on the H100: a miscompile not understood)."""
    if not p.target.gluon:
        return "not an sm_90 GPU (or under the interpreter)"
    if not p.half:
        return "float32 inputs"
    if p.head_dim_v != p.head_dim:
        return "the value head dim must equal the query's"
    if p.block_d not in (64, 128):
        return f"head dim {p.head_dim} (BLOCK_D 64 or 128 only)"
    if not cfg.dkdv_tma:
        return "the Gluon backward reads q, k, v, do through TMA (config dkdv_tma=False)"
    if not (p.tma_q and p.tma_kv and p.tma_do):
        return "q, k, v, do rows not 16-byte aligned for TMA"
    if p.head_dim * p.dtype.itemsize % 16:
        return "dk, dv rows not 16-byte aligned for the TMA store"
    if p.packed:
        return "a packed batch"
    if p.softcap and not cfg.fast_tanh:
        return "softcap only through tanh.approx"
    if cfg.dkdv.block_n != 2 * BWD_WG_KEYS.value:
        return f"tile {cfg.dkdv}: BLOCK_N must be {2 * BWD_WG_KEYS.value}"
    if cfg.dq_mode != DQ_KERNEL and p.block_d > GLUON_FUSED_DQ_MAX_D and not cfg.dq_halves:
        return (
            f"dq summed by a dq warpgroup only up to BLOCK_D {GLUON_FUSED_DQ_MAX_D} (dq_halves:"
            " by the consumers)"
        )
    if cfg.dq_halves and (cfg.dq_mode == DQ_KERNEL or cfg.kv_regs):
        return "dq_halves: dq summed in the kernel, K and V in shared memory"
    if cfg.dq_mode == DQ_KERNEL and (cfg.dq is None or cfg.kv_regs):
        return "the dq-kernel variant needs a dq tile and K/V in shared memory"
    if cfg.dynamic and not cfg.persistent:
        return "a dynamic walk needs persistent programs"
    if cfg.dq_mode != DQ_KERNEL and cfg.persistent and not cfg.dynamic:
        # (in a fixed order a statically walked program waits on tiles of programs that may not
        # be resident; any order would not wait, but one walk is kept for both)
        return "persistent fused-dq programs take their tiles from a counter (dynamic)"
    if not cfg.pad_rows:
        return "the Gluon backward reads the padded row vectors"
    bhk = p.batch * p.kv_heads
    if cfg.tile_heads == 0 or bhk % abs(cfg.tile_heads):
        return f"tile_heads {cfg.tile_heads}: must divide the {bhk} (batch, kv head)s"
    if cfg.tile_heads < 0 and not (p.causal and cfg.dq_mode == DQ_ORDERED):
        return "descending tiles (tile_heads < 0) only for causal dq sums in a fixed order"
    return None


def scaled_rows(cfg: BwdConfig, s: Scores) -> tuple[float, float] | None:
    """(shift of lse2, factor of delta) the preprocess applies to the row vectors for this
    kernel, or None (it writes them as they are): with softcap, P's 2^15 (P_SCALE_LOG2) folded in
    as lse2 - 15 and -delta 2^-15, where dq is summed here so that nothing else reads them (the
    portable dq kernel beside it, DQ_KERNEL, reads them unscaled; the consumers scale them)."""
    if s.softcap == 2 and cfg.dq_mode != DQ_KERNEL:
        return P_SCALE_LOG2.value, -P_UNSCALE.value
    return None


def launch(ops, p: Problem, cfg: BwdConfig, s: Scores, q, k, v, do, lse2, delta, dk, dv,
           dq_acc, sem, width: int, sem_rows: int, rows_scaled: bool) -> None:  # fmt: skip
    """Launch the Gluon dk/dv kernel (summing dq into dq_acc where cfg.dq_mode says so);
    rows_scaled: the preprocess wrote lse2 and delta as `scaled_rows` says."""
    t = cfg.dkdv
    tiles = cdiv(p.nk, t.block_n) * p.batch * p.kv_heads
    ctr = None
    if cfg.dynamic:
        ctr = ops.empty((1,), torch.int32, q.device)
        ops.launch(zero_counter_kernel, (1,), CTR=ctr, num_warps=1)
    ops.launch(
        attn_bwd_gluon_kernel, (min(tiles, p.target.sms) if cfg.persistent else tiles,),
        Q=q, K=k, V=v, DO=do, LSE2=lse2, DELTA=delta, DK=dk, DV=dv, DQACC=dq_acc, SEM=sem,
        **tma_strides("q", q), **tma_strides("k", k), **tma_strides("v", v),
        **tma_strides("do", do), **tma_strides("dk", dk), **tma_strides("dv", dv),
        vec_stride=width, sem_stride=width // sem_rows, dq_rows=p.batch * p.heads * width,
        tile_heads=cfg.tile_heads, B=p.batch, H=p.heads, Hkv=p.kv_heads,
        GROUP=p.heads // p.kv_heads, Nq=p.nq, Nk=p.nk, qk_scale=s.qk_scale,
        sm_scale=s.sm_scale, cap_scale=s.cap_scale, win_left=max(p.left, 0), win_right=p.right,
        HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        CAUSAL=p.causal, LOCAL=p.local, SOFTCAP=s.softcap == 2, STAGES=t.stages,
        DQ_MODE=cfg.dq_mode, ROWS_SCALED=rows_scaled, DQ_HALVES=cfg.dq_halves, KV_REGS=cfg.kv_regs,
        PERSISTENT=cfg.persistent, TILE_CTR=ctr, DYNAMIC=cfg.dynamic, num_warps=t.warps,
    )  # fmt: skip
