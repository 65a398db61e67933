"""Gluon backward of flash-attn for Hopper (sm_90a): dk, dv of one 128-key block per program,
dq by the portable dq kernel beside it (triton/bwd.py) or summed here; and its launch.

A tile = BLOCK_N = 2 x 64 keys of one kv head; one program per tile, or with PERSISTENT (the
dk/dv-only kernel up to tables.GLUON_BWD_PERSISTENT_MAX_N rows) one per SM walking its
share of the tiles. Three partitions:
- a producer warp loads each tile's K and V block (once the consumers are done with the last
  tile's), then for each (query head of the GQA group, query block) step the BLOCK_M-row
  tiles of q and do into a STAGES-deep ring (4-D (B, N, H, D) descriptors: batch and heads
  are coordinates, not new descriptors);
- two consumer warpgroups own 64 keys each and run, per step, the transposed products
  S^T = K q^T and dP^T = V do^T (both asynchronous: the softmax of S^T runs under dP^T),
  then dV += P^T do and dK += dS^T q with P^T / dS^T as register A operands (dV runs under
  dS^T). K and V stay in shared memory as wgmma operands; the portable dk/dv kernel holds
  them in registers, which made its d = 128 tiles spill. Softcap (SOFTCAP, tanh.approx): P
  (the dV product's operand) and P (1 - tanh^2), the cap's derivative folded in, are held in
  16 bits (scaled by 2^15: P_SCALE_LOG2) until dS (with P and the tanh in float32 across the
  dP^T wait the consumers spilled, and that variant lost to the portable backward: NOTES.md).
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

from triton._C.libtriton import ir as _tt_ir
from triton.experimental.gluon.language._core import builtin as _builtin

from kernelkit.shared.runtime import cdiv

from ..config import DQ_KERNEL, DQ_ORDERED, BwdConfig, Problem, Scores
from ..strides import strides, tma_strides
from ..tables import GLUON_FUSED_DQ_MAX_D
from .common import (
    MaybeConstexpr,
    aggregate,
    fence_async_shared,
    gl,
    gluon,
    maybe_constexpr,
    mbarrier,
    tanh_approx,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BWD_WG_KEYS = gl.constexpr(64)  # keys per consumer warpgroup (one m64 wgmma row block)
SEM_ROWS = gl.constexpr(64)  # query rows per dq semaphore (DQ_MODE 2; triton/bwd.py SEM_ROWS)
# Registers per thread with dq summed in the kernel: 4 warpgroups share 512 (the default
# consumer gets what the others leave: 208, also with a second reducer warp); below 72 the dq
# warpgroup spills, below 208 the consumers (sm_90a, Triton 3.6).
FUSED_CONSUMER_REGS = gl.constexpr(208)
DQ_WARPGROUP_REGS = gl.constexpr(72)
REDUCER_WARP_REGS = gl.constexpr(24)
# Softcap: P and P (1 - tanh^2) are computed 2^15 times too large (lse2 - 15 in the exponent)
# and held in 16 bits so (P <= 1: at most 32768 < 65504). Unscaled, float16 P (1 - tanh^2)
# lost bits below 2^-14 and flushed to 0 below 2^-24, which zeroed the dk rows of keys
# attended only with P < ~1e-8 (bfloat16 dS reaches 1e-38); scaled, it is normal down to
# 2^-29. The 2^-15 goes into dV's store and into dS's fma, dP 2^-15 + (-delta 2^-15), whose
# row vector (and lse2 - 15) the preprocess writes (`scaled_rows`): no instruction per score
# over the unscaled dP - delta (negating delta here, 16 values per thread per step, cost the
# issue-bound d64 consumers 2%).
P_SCALE_LOG2 = gl.constexpr(15.0)
P_UNSCALE = gl.constexpr(2.0**-15)
# With DQ_HALVES (no dq warpgroup: each consumer computes half of dq's columns) three
# warpgroups share 512: the consumers 240 each, the producer's and reducers' 24.
HALVES_CONSUMER_REGS = gl.constexpr(240)
# dq parts in flight between the dq warpgroup and the reducer warps (4: the same speed on the
# H100, session 23)
DQ_BUFFERS = gl.constexpr(2)
# Reducer warps of the fixed-order sums (DQ_MODE 2), each adding every other step's part (so
# each owns one of the DQ_BUFFERS): a warp waits for its add to be performed before it counts
# it, so one warp alone had one add in flight at a time. H200, session 24, backward TFLOP/s one
# / two warps: leaderboard 405 / 408, 8k B2 H32 375 / 384, GQA 8k H32/8 352 / 385, 4k 298 /
# 309; any order lost with two (8k 428 / 405) and keeps one.
ORDERED_DQ_REDUCERS = gl.constexpr(2)


@_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add of a shared-memory tile into global memory. Gluon 3.6's IR builder
    has the op (cp.reduce.async.bulk.tensor on sm_90); its Hopper Python API does not wrap it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        _tt_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def _asm_with_effect(asm: gl.constexpr, x):
    """An instruction kept for its side effect (a fence, a wait); x: any int32 scalar."""
    return gl.inline_asm_elementwise(asm + "\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _ld_acquire(ptr):
    return gl.inline_asm_elementwise(
        "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@gluon.jit
def _red_release_add(ptr):
    """Each thread adds 1 (release: what it ordered before is visible before its count is)."""
    return gl.inline_asm_elementwise(
        "red.release.gpu.global.add.s32 [$1], 1;\n\tmov.b32 $0, 0;", "=r,l", [ptr],
        dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@aggregate
class BwdTile:
    """One tile of the program's (`BwdArgs.tile`): batch b, kv head hk, key block pid_n and its
    first key start_n, the first query block m_lo (causal: the first with a row that sees a key
    of the block), n_m query blocks from it (a window: up to the last with a row that sees one)
    and n_iter = GROUP x n_m steps."""

    b: gl.tensor
    hk: gl.tensor
    pid_n: gl.tensor
    start_n: gl.tensor
    m_lo: gl.tensor
    n_m: gl.tensor
    n_iter: gl.tensor

    @gluon.constexpr_function
    def __init__(self, b, hk, pid_n, start_n, m_lo, n_m, n_iter):
        self.b, self.hk, self.pid_n, self.start_n = b, hk, pid_n, start_n
        self.m_lo, self.n_m, self.n_iter = m_lo, n_m, n_iter


@aggregate
class BwdArgs:
    """What the partitions share, built once per program by the kernel: the TMA descriptors,
    shared memory and mbarriers, the row vectors, outputs and their strides, the problem's
    scalars and the compile-time switches (`attn_bwd_gluon_kernel`'s). Keep the fields' order:
    a worker partition captures the fields it reads in this order (the compiler flattens an
    aggregate into its fields), and another order gives an equivalent but different kernel."""

    # TMA descriptors over the whole (B, N, H, D) tensors (the producer's) and over the float32
    # dq sums (the reducer warps'; DQ_MODE > 0, else a stand-in).
    q_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    dq_desc: tma.tensor_descriptor
    # Shared memory: STAGES-deep rings of q and do tiles (BLOCK_M rows each), the tile's K and
    # V (BLOCK_N keys); with DQ_MODE > 0 two dS^T buffers (one per step parity) and DQ_BUFFERS
    # dq parts (DQ_HALVES: each as two column halves; else stand-ins, never read). Barriers:
    # kv_bar (K, V landed) / kv_empty (every warpgroup reading them is done), ready[s] /
    # empty[s] (the ring's slots), ds_ready / ds_free and dq_ready / dq_free (the dS^T and dq
    # hand-offs).
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    ds_ready: gl.shared_memory_descriptor
    ds_free: gl.shared_memory_descriptor
    dq_ready: gl.shared_memory_descriptor
    dq_free: gl.shared_memory_descriptor
    # The padded row vectors; dk, dv (outputs) and K, V (KV_REGS: read into registers) as
    # (B, Nk, Hkv, D) with their strides; the row vectors' row length.
    LSE2: gl.tensor
    DELTA: gl.tensor
    DK: gl.tensor
    DV: gl.tensor
    K: gl.tensor
    V: gl.tensor
    stride_dkb: MaybeConstexpr
    stride_dkn: MaybeConstexpr
    stride_dkh: MaybeConstexpr
    stride_dvb: MaybeConstexpr
    stride_dvn: MaybeConstexpr
    stride_dvh: MaybeConstexpr
    stride_kb: MaybeConstexpr
    stride_kn: MaybeConstexpr
    stride_kh: MaybeConstexpr
    stride_vb: MaybeConstexpr
    stride_vn: MaybeConstexpr
    stride_vh: MaybeConstexpr
    vec_stride: MaybeConstexpr
    # Heads, kv heads, query heads per kv head; lengths; tiles in all and their grouping
    # (`tile`); scales.
    H: MaybeConstexpr
    Hkv: MaybeConstexpr
    GROUP: MaybeConstexpr
    Nq: gl.tensor
    Nk: gl.tensor
    n_tiles: gl.tensor
    tile_heads: MaybeConstexpr
    qk_scale: gl.tensor
    sm_scale: gl.tensor
    # The reducer warps' semaphores (DQ_MODE 2, else None).
    SEM: MaybeConstexpr
    sem_stride: MaybeConstexpr
    # Softcap: scores tanh(s * cap_scale) (SOFTCAP). Query row i sees keys [i + lo_shift,
    # i + hi_shift] (LOCAL: the window's left edge; CAUSAL: its right edge, the causal diagonal
    # for hi_shift = Nk - Nq).
    cap_scale: gl.tensor
    lo_shift: gl.tensor
    hi_shift: gl.tensor
    CAUSAL: gl.constexpr
    LOCAL: gl.constexpr
    SOFTCAP: gl.constexpr
    ROWS_SCALED: gl.constexpr  # LSE2 / DELTA come as lse2 - 15, -delta 2^-15 (`scaled_rows`)
    HEAD_DIM: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_D: gl.constexpr
    STAGES: gl.constexpr
    DQ_MODE: gl.constexpr
    DQ_HALVES: gl.constexpr
    KV_REGS: gl.constexpr
    PERSISTENT: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_desc, do_desc, k_desc, v_desc, dq_desc, q_smem, do_smem, k_smem, v_smem,
                 ds_smem, dq_smem, kv_bar, kv_empty, ready, empty, ds_ready, ds_free, dq_ready,
                 dq_free, LSE2, DELTA, DK, DV, K, V, stride_dkb, stride_dkn, stride_dkh,
                 stride_dvb, stride_dvn, stride_dvh, stride_kb, stride_kn, stride_kh, stride_vb,
                 stride_vn, stride_vh, vec_stride, H, Hkv, GROUP, Nq, Nk, n_tiles, tile_heads,
                 qk_scale, sm_scale, SEM, sem_stride, cap_scale, lo_shift, hi_shift, CAUSAL,
                 LOCAL, SOFTCAP, ROWS_SCALED, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, STAGES,
                 DQ_MODE, DQ_HALVES, KV_REGS, PERSISTENT):  # fmt: skip
        self.q_desc, self.do_desc, self.k_desc, self.v_desc = q_desc, do_desc, k_desc, v_desc
        self.dq_desc = dq_desc
        self.q_smem, self.do_smem, self.k_smem, self.v_smem = q_smem, do_smem, k_smem, v_smem
        self.ds_smem, self.dq_smem = ds_smem, dq_smem
        self.kv_bar, self.kv_empty, self.ready, self.empty = kv_bar, kv_empty, ready, empty
        self.ds_ready, self.ds_free = ds_ready, ds_free
        self.dq_ready, self.dq_free = dq_ready, dq_free
        self.LSE2, self.DELTA, self.DK, self.DV, self.K, self.V = LSE2, DELTA, DK, DV, K, V
        self.stride_dkb = maybe_constexpr(stride_dkb)
        self.stride_dkn = maybe_constexpr(stride_dkn)
        self.stride_dkh = maybe_constexpr(stride_dkh)
        self.stride_dvb = maybe_constexpr(stride_dvb)
        self.stride_dvn = maybe_constexpr(stride_dvn)
        self.stride_dvh = maybe_constexpr(stride_dvh)
        self.stride_kb = maybe_constexpr(stride_kb)
        self.stride_kn = maybe_constexpr(stride_kn)
        self.stride_kh = maybe_constexpr(stride_kh)
        self.stride_vb = maybe_constexpr(stride_vb)
        self.stride_vn = maybe_constexpr(stride_vn)
        self.stride_vh = maybe_constexpr(stride_vh)
        self.vec_stride = maybe_constexpr(vec_stride)
        self.H = maybe_constexpr(H)
        self.Hkv = maybe_constexpr(Hkv)
        self.GROUP = maybe_constexpr(GROUP)
        self.Nq, self.Nk, self.n_tiles = Nq, Nk, n_tiles
        self.tile_heads = maybe_constexpr(tile_heads)
        self.qk_scale, self.sm_scale = qk_scale, sm_scale
        self.SEM, self.sem_stride = maybe_constexpr(SEM), maybe_constexpr(sem_stride)
        self.cap_scale, self.lo_shift, self.hi_shift = cap_scale, lo_shift, hi_shift
        self.CAUSAL, self.LOCAL = gl.constexpr(CAUSAL), gl.constexpr(LOCAL)
        self.SOFTCAP, self.HEAD_DIM = gl.constexpr(SOFTCAP), gl.constexpr(HEAD_DIM)
        self.ROWS_SCALED = gl.constexpr(ROWS_SCALED)
        self.BLOCK_M, self.BLOCK_N = gl.constexpr(BLOCK_M), gl.constexpr(BLOCK_N)
        self.BLOCK_D, self.STAGES = gl.constexpr(BLOCK_D), gl.constexpr(STAGES)
        self.DQ_MODE, self.KV_REGS = gl.constexpr(DQ_MODE), gl.constexpr(KV_REGS)
        self.DQ_HALVES = gl.constexpr(DQ_HALVES)
        self.PERSISTENT = gl.constexpr(PERSISTENT)

    @gluon.jit
    def tile(self, u):
        """Tile u (a `BwdTile`). The (batch, kv head)s go in groups of |tile_heads| (a divisor
        of B * Hkv); within a group the tiles of one key block are adjacent, the first key
        blocks first (causal: the longest), or with tile_heads < 0 the last first
        (`_bwd_reduce_tile`). The programs running at once then walk the q / do tiles and add
        into the dq sums of a few heads, which stay in L2."""
        BLOCK_M: gl.constexpr = self.BLOCK_M
        BLOCK_N: gl.constexpr = self.BLOCK_N
        n_kb = gl.cdiv(self.Nk, BLOCK_N)
        heads = gl.abs(self.tile_heads)
        group = u // (heads * n_kb)
        r = u % (heads * n_kb)
        pid_n = r // heads
        if self.tile_heads < 0:
            pid_n = n_kb - 1 - pid_n
        bhk = group * heads + r % heads
        start_n = pid_n * BLOCK_N
        # (causal: the first query block with a row that sees a key of this block; a window: the
        # last one, its left edge)
        if self.CAUSAL:  # noqa: SIM108 (constexpr branch)
            m_lo = gl.maximum(start_n - self.hi_shift, 0) // BLOCK_M
        else:
            m_lo = 0
        m_hi = gl.cdiv(self.Nq, BLOCK_M)
        if self.LOCAL:
            m_hi = gl.minimum(m_hi, gl.cdiv(gl.maximum(start_n + BLOCK_N - self.lo_shift, 0),
                                            BLOCK_M))  # fmt: skip
        n_m = gl.maximum(m_hi - m_lo, 0)
        return BwdTile(bhk // self.Hkv, bhk % self.Hkv, pid_n, start_n, m_lo, n_m, self.GROUP * n_m)


@gluon.jit
def _bwd_reduce_tile(a, t, bhq0, i0, descending, ORDERED: gl.constexpr, LANE: gl.constexpr,
                     REDUCERS: gl.constexpr):  # fmt: skip
    """Reducer warp LANE's steps of tile t, i = LANE mod REDUCERS (bhq0: the row of its first
    query head in the row vectors; i0: the program's steps before it): adds step i's dq part (in
    dq_smem, from the dq warpgroup or with DQ_HALVES the consumers' two halves) into the float32
    sums with TMA reduce-adds;
    ORDERED: once the parts of the key blocks before pid_n are in (the semaphore counts 32 per
    part: one per thread of a warp); key blocks 0, 1, ... (a window: from the first that reaches
    the query block), or with `descending` (tile_heads < 0,
    a constexpr where tile_heads is) from the last one that reaches the query block down
    (causal: key block j then finds block j + 1's part in, as that one started two query blocks
    below it). A part is counted once its add is performed: the next key block waits on
    that (counting it a step late, once the next add was issued, cost 4-5% on the H100:
    NOTES.md)."""
    BLOCK_M: gl.constexpr = a.BLOCK_M
    BLOCK_N: gl.constexpr = a.BLOCK_N
    PARTS: gl.constexpr = 2 if a.DQ_HALVES else 1  # dq_smem buffers per part
    N_BUF: gl.constexpr = a.dq_smem.shape[0] // PARTS
    dq_smem = a.dq_smem
    Nk, pid_n, n_m = a.Nk, t.pid_n, t.n_m
    for it in range((LANE - i0 % REDUCERS + REDUCERS) % REDUCERS, t.n_iter, REDUCERS):
        i = i0 + it
        par = i % N_BUF
        g = it // n_m
        m0 = (t.m_lo + it - g * n_m) * BLOCK_M
        bhq = bhq0 + g
        mbarrier.wait(a.dq_ready.index(par), (i // N_BUF) & 1)
        if ORDERED:
            sem = a.SEM + bhq.to(gl.int64) * a.sem_stride + m0 // SEM_ROWS
            ahead = pid_n
            if a.LOCAL:  # the key blocks before pid_n with a tile on this query block
                ahead = pid_n - gl.maximum(m0 + a.lo_shift, 0) // BLOCK_N
            if descending:  # the key blocks after pid_n with a tile on this query block
                last = gl.cdiv(Nk, BLOCK_N) - 1
                if a.CAUSAL:
                    last = gl.minimum(last, gl.cdiv(m0 + BLOCK_M + a.hi_shift, BLOCK_N) - 1)
                ahead = last - pid_n
            while _ld_acquire(sem) != ahead * 32:
                pass
            _asm_with_effect("fence.proxy.async.global;", pid_n)  # then the async proxy's add
        row = (bhq * a.vec_stride + m0).to(gl.int32)
        for h in gl.static_range(PARTS):  # (DQ_HALVES: the consumers' column halves)
            _tma_reduce_add(a.dq_desc, [row, h * dq_smem.shape[2]], dq_smem.index(par * PARTS + h))
        tma.store_wait(0)  # its source read: the buffer is free
        mbarrier.arrive(a.dq_free.index(par))
        if ORDERED:  # the add performed, then counted
            _asm_with_effect("cp.async.bulk.wait_group 0;", pid_n)
            _asm_with_effect("fence.proxy.async.global;", pid_n)
            _red_release_add(sem)


@gluon.jit
def _bwd_dq_reducer(a, ORDERED: gl.constexpr, LANE: gl.constexpr, REDUCERS: gl.constexpr):
    """Reducer warp LANE of REDUCERS: `_bwd_reduce_tile` for the program's tile, or with
    PERSISTENT tile after tile of its share."""
    if a.PERSISTENT:
        i = 0
        for u in range(gl.program_id(0), a.n_tiles, gl.num_programs(0)):
            t = a.tile(u)
            _bwd_reduce_tile(a, t, t.b * a.H + t.hk * a.GROUP, i, a.tile_heads < 0, ORDERED, LANE,
                             REDUCERS)  # fmt: skip
            i += t.n_iter
    else:
        t = a.tile(gl.program_id(0))
        _bwd_reduce_tile(a, t, t.b * a.H + t.hk * a.GROUP, 0, a.tile_heads < 0, ORDERED, LANE,
                         REDUCERS)  # fmt: skip


@gluon.jit
def _bwd_load_tile(a, t, c, i0):
    """The producer's loads of tile t: K and V of its key block once both consumers are done
    with the previous tile's (c: the program's tiles before it); then q and do of each step
    (query head hq0 + it // n_m, query block m_lo + it % n_m) into ring slot i % STAGES
    (i = i0 + it: the program's steps) once both consumers have released its previous tiles (a
    fresh barrier passes the first wait)."""
    tile4: gl.constexpr = a.q_desc.layout
    kv4: gl.constexpr = a.k_desc.layout
    dtype: gl.constexpr = a.q_smem.dtype
    BLOCK_M: gl.constexpr = a.BLOCK_M
    BLOCK_D: gl.constexpr = a.BLOCK_D
    STAGES: gl.constexpr = a.STAGES
    q_desc, do_desc, ready = a.q_desc, a.do_desc, a.ready
    b, start_n, n_m = t.b, t.start_n, t.n_m
    mbarrier.wait(a.kv_empty, (c & 1) ^ 1)
    mbarrier.expect(a.kv_bar, 2 * a.k_desc.block_type.nbytes)
    k_dst = a.k_smem._reinterpret(dtype, [1, a.BLOCK_N, 1, BLOCK_D], kv4)
    v_dst = a.v_smem._reinterpret(dtype, [1, a.BLOCK_N, 1, BLOCK_D], kv4)
    tma.async_copy_global_to_shared(a.k_desc, [b, start_n, t.hk, 0], a.kv_bar, k_dst)
    tma.async_copy_global_to_shared(a.v_desc, [b, start_n, t.hk, 0], a.kv_bar, v_dst)
    hq0 = t.hk * a.GROUP
    for it in range(t.n_iter):
        i = i0 + it
        s = i % STAGES
        g = it // n_m
        m0 = (t.m_lo + it - g * n_m) * BLOCK_M
        mbarrier.wait(a.empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        q_dst = a.q_smem.index(s)._reinterpret(dtype, [1, BLOCK_M, 1, BLOCK_D], tile4)
        do_dst = a.do_smem.index(s)._reinterpret(dtype, [1, BLOCK_M, 1, BLOCK_D], tile4)
        tma.async_copy_global_to_shared(q_desc, [b, m0, hq0 + g, 0], ready.index(s), q_dst)
        tma.async_copy_global_to_shared(do_desc, [b, m0, hq0 + g, 0], ready.index(s), do_dst)


@gluon.jit
def _bwd_producer(a):
    """TMA loads (`_bwd_load_tile`) of the program's tile, or with PERSISTENT tile after tile of
    its share: the next tile's K/V and first q / do tiles then load while the consumers finish
    the current one."""
    if a.PERSISTENT:
        i = 0
        c = 0
        for u in range(gl.program_id(0), a.n_tiles, gl.num_programs(0)):
            t = a.tile(u)
            _bwd_load_tile(a, t, c, i)
            i += t.n_iter
            c += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    else:
        _bwd_load_tile(a, a.tile(gl.program_id(0)), 0, 0)


@gluon.jit
def _bwd_keep(a, keys, queries):
    """Which (key, query) pairs of a masked block are seen: keys before Nk, right of the window's
    left edge (LOCAL), not right of the diagonal (CAUSAL)."""
    keep = keys[:, None] < a.Nk
    if a.CAUSAL:
        keep = keep & (keys[:, None] <= queries[None, :] + a.hi_shift)
    if a.LOCAL:
        keep = keep & (keys[:, None] >= queries[None, :] + a.lo_shift)
    return keep


@gluon.jit
def _bwd_tile_steps(a, t, c, i0, WG: gl.constexpr):
    """Keys [start_n + WG * 64, +64) of tile t: the step loop (the ring and dq buffers at the
    program's step i0; c: its tiles before this one), then dk (scaled) and dv to global memory.
    Row vectors (LSE2 in log2 units, DELTA) are the preprocess's padded copies: +inf / 0 past
    Nq, so query rows past the end add nothing and need no check. KV_REGS: the warpgroup's K and
    V rows are the S^T / dP^T wgmmas' A operands in registers (loaded from global memory), which
    halves those products' shared-memory reads; used with DQ_MODE > 0 only (the dk/dv-only
    variant gave wrong dk / dv with them on the H100, loaded from global or from the shared
    tile: `can_implement` refuses them there). DQ_HALVES: each step also this warpgroup's half of
    dq's columns from both halves of dS^T, handed to the reducer warps."""
    BLOCK_M: gl.constexpr = a.BLOCK_M
    BLOCK_D: gl.constexpr = a.BLOCK_D
    STAGES: gl.constexpr = a.STAGES
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_D, 16]
    )
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    per_query: gl.constexpr = gl.SliceLayout(0, st_layout)
    per_key: gl.constexpr = gl.SliceLayout(1, st_layout)
    dtype: gl.constexpr = a.q_smem.dtype
    Nk, n_m = a.Nk, t.n_m

    # The kv head's bases of dk, dv, K and V; its first query head's row in the row vectors.
    b64 = t.b.to(gl.int64)
    hk64 = t.hk.to(gl.int64)
    kv_phase = c & 1  # the K/V barrier's phase
    DK = a.DK + b64 * a.stride_dkb + hk64 * a.stride_dkh
    DV = a.DV + b64 * a.stride_dvb + hk64 * a.stride_dvh
    K = a.K + b64 * a.stride_kb + hk64 * a.stride_kh
    V = a.V + b64 * a.stride_vb + hk64 * a.stride_vh
    bhq0 = t.b * a.H + t.hk * a.GROUP
    kw0 = t.start_n + WG * BWD_WG_KEYS
    k_w = a.k_smem.slice(WG * BWD_WG_KEYS, BWD_WG_KEYS)
    v_w = a.v_smem.slice(WG * BWD_WG_KEYS, BWD_WG_KEYS)
    keys = kw0 + gl.arange(0, BWD_WG_KEYS, layout=per_key)
    ragged = kw0 + BWD_WG_KEYS > Nk
    zero_st = gl.zeros([BWD_WG_KEYS, BLOCK_M], gl.float32, st_layout)
    dk = gl.zeros([BWD_WG_KEYS, BLOCK_D], gl.float32, acc_layout)
    dv = gl.zeros([BWD_WG_KEYS, BLOCK_D], gl.float32, acc_layout)
    if a.DQ_HALVES:
        HALF: gl.constexpr = BLOCK_D // 2
        N_BUF: gl.constexpr = a.dq_smem.shape[0] // 2
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        zero_dq = gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout)
    if a.KV_REGS:
        kv_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2)
        rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        kv_r = kw0 + gl.arange(0, BWD_WG_KEYS, layout=gl.SliceLayout(1, rows_l))
        kv_c = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, rows_l))
        kv_in = (kv_r[:, None] < Nk) & (kv_c[None, :] < a.HEAD_DIM)
        kv_off = kv_r[:, None].to(gl.int64) * a.stride_kn + kv_c[None, :]
        k_w = gl.convert_layout(gl.load(K + kv_off, mask=kv_in, other=0.0), kv_op)
        kv_off = kv_r[:, None].to(gl.int64) * a.stride_vn + kv_c[None, :]
        v_w = gl.convert_layout(gl.load(V + kv_off, mask=kv_in, other=0.0), kv_op)
    mbarrier.wait(a.kv_bar, kv_phase)
    for it in range(t.n_iter):
        i = i0 + it
        s = i % STAGES
        g = it // n_m
        m0 = (t.m_lo + it - g * n_m) * BLOCK_M
        q_s = a.q_smem.index(s)
        do_s = a.do_smem.index(s)
        bhq = bhq0 + g
        queries = m0 + gl.arange(0, BLOCK_M, layout=per_query)
        lse2 = gl.load(a.LSE2 + bhq.to(gl.int64) * a.vec_stride + queries)
        delta = gl.load(a.DELTA + bhq.to(gl.int64) * a.vec_stride + queries)
        if a.SOFTCAP and not a.ROWS_SCALED:  # (the portable dq kernel reads them unscaled)
            lse2 = lse2 - P_SCALE_LOG2
            delta = delta * -P_UNSCALE
        mbarrier.wait(a.ready.index(s), (i // STAGES) & 1)
        st_tok = warpgroup_mma(k_w, q_s.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_w, do_s.permute((1, 0)), zero_st, use_acc=False,
                                is_async=True)  # fmt: skip
        s_t = warpgroup_mma_wait(1, deps=(st_tok,))  # S^T done; dP^T may still run
        masked = ragged
        if a.CAUSAL:  # some key of this warpgroup's block lies right of some row's diagonal
            masked = masked | (m0 + a.hi_shift < kw0 + BWD_WG_KEYS - 1)
        if a.LOCAL:  # some key lies left of some row's window
            masked = masked | (kw0 < m0 + BLOCK_M - 1 + a.lo_shift)
        if a.SOFTCAP:  # 2^15 P and 2^15 P (1 - tanh^2) (the cap's derivative), 16 bits each
            cap = tanh_approx(s_t * a.cap_scale)
            p_f = gl.exp2(cap * a.qk_scale - lse2[None, :])
            p_t = (p_f * (1.0 - cap * cap)).to(gl.float16)
            p16 = p_f.to(dtype)
            if masked:  # (selects: a masked score's P may be inf, its product with 0 NaN)
                keep = _bwd_keep(a, keys, queries)
                p16 = gl.where(keep, p16, 0.0)
                p_t = gl.where(keep, p_t, 0.0)
            p_op = gl.convert_layout(p16, op_layout)
        else:
            if masked:
                p_t = gl.where(_bwd_keep(a, keys, queries),
                               gl.exp2(s_t * a.qk_scale - lse2[None, :]), 0.0)  # fmt: skip
            else:
                p_t = gl.exp2(s_t * a.qk_scale - lse2[None, :])
            p_op = gl.convert_layout(p_t.to(dtype), op_layout)
        dv_tok = warpgroup_mma(p_op, do_s, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dpt_tok,))  # dP^T done; dV may still run
        # dP - delta (softcap: times 2^-15, one fma with delta holding -delta 2^-15); dS = P' dd
        dd = gl.fma(dp_t, P_UNSCALE, delta[None, :]) if a.SOFTCAP else dp_t - delta[None, :]
        ds_t = (p_t.to(gl.float32) * dd).to(dtype)
        ds_op = gl.convert_layout(ds_t, op_layout)
        if not a.DQ_HALVES:  # (DQ_HALVES: after the dq part's product, below)
            dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
        if a.DQ_MODE > 0:  # this warpgroup's half of dS^T to the dq product
            par = i % 2
            mbarrier.wait(a.ds_free.index(par), ((i // 2) & 1) ^ 1)  # step i - 2's dq read it
            ds_buf = a.ds_smem.index(par)
            ds_buf.slice(WG * BWD_WG_KEYS, BWD_WG_KEYS).store(ds_t)
            fence_async_shared()
            gl.thread_barrier()  # every warp's rows are written before the arrival
            mbarrier.arrive(a.ds_ready.index(par))
        if a.DQ_HALVES:  # dq's columns [WG * HALF, +HALF) = dS (all 128 keys) K[:, those]
            mbarrier.wait(a.ds_ready.index(par), (i // 2) & 1)  # the other half is in too
            dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), a.k_smem.slice(WG * HALF, HALF, 1),
                                   zero_dq, use_acc=False, is_async=True)  # fmt: skip
            # dK after the dq part's product: the part goes out to the reducer while dK runs
            # (issued before it, the store waited for all three: 1-5% slower, NOTES.md).
            dk_tok = warpgroup_mma(ds_op, q_s, dk, is_async=True)
            dv, dq = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok))
            mbarrier.arrive(a.ds_free.index(par))
            buf = i % N_BUF  # free once the reducer's adds of its last parts have read it
            mbarrier.wait(a.dq_free.index(buf), ((i // N_BUF) & 1) ^ 1)
            a.dq_smem.index(buf * 2 + WG).store(dq * a.sm_scale)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(a.dq_ready.index(buf))
            dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dk_tok, p_op, ds_op))
            mbarrier.arrive(a.empty.index(s))
        else:
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
            mbarrier.arrive(a.empty.index(s))
    mbarrier.arrive(a.kv_empty)  # every product of the tile has read K and V

    rows = kw0 + gl.arange(0, BWD_WG_KEYS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, acc_layout))
    keep = (rows[:, None] < Nk) & (cols[None, :] < a.HEAD_DIM)
    gl.store(DK + rows[:, None].to(gl.int64) * a.stride_dkn + cols[None, :],
             (dk * a.sm_scale).to(dtype), mask=keep)  # fmt: skip
    if a.SOFTCAP:  # dV summed 2^15 P^T dO
        dv = dv * P_UNSCALE
    gl.store(DV + rows[:, None].to(gl.int64) * a.stride_dvn + cols[None, :], dv.to(dtype),
             mask=keep)  # fmt: skip


@gluon.jit
def _bwd_consumer(a, WG: gl.constexpr):
    """Keys [start_n + WG * 64, +64) of the program's tile (`_bwd_tile_steps`), or with
    PERSISTENT of each tile of its share in the producer's order (i: the program's steps so
    far; c: its tiles so far, whose parity is the K/V barrier's phase)."""
    if a.PERSISTENT:
        i = 0
        c = 0
        for u in range(gl.program_id(0), a.n_tiles, gl.num_programs(0)):
            t = a.tile(u)
            _bwd_tile_steps(a, t, c, i, WG)
            i += t.n_iter
            c += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    else:
        _bwd_tile_steps(a, a.tile(gl.program_id(0)), 0, 0, WG)


@gluon.jit
def _bwd_dq_tile(a, t, c, i0):
    """The dq warpgroup's steps of tile t (i0, c: the program's steps and tiles before it):
    once both consumers have written their halves of step i's dS^T (ds_smem[i % 2]), dq's part
    = dS (BLOCK_M x 128 keys) K, scaled, into dq_smem[i % DQ_BUFFERS] for the reducer warp. The
    consumers never wait for it, only for a dS^T buffer it has read two steps back."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, a.BLOCK_D, 16]
    )
    dq_smem = a.dq_smem
    zero_dq = gl.zeros([a.BLOCK_M, a.BLOCK_D], gl.float32, acc_layout)
    mbarrier.wait(a.kv_bar, c & 1)
    for it in range(t.n_iter):
        i = i0 + it
        par = i % 2
        ds_buf = a.ds_smem.index(par)
        mbarrier.wait(a.ds_ready.index(par), (i // 2) & 1)
        dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), a.k_smem, zero_dq, use_acc=False,
                               is_async=True)  # fmt: skip
        dq = warpgroup_mma_wait(0, deps=(dq_tok,))
        mbarrier.arrive(a.ds_free.index(par))
        buf = i % dq_smem.shape[0]  # free once the reducer's add of its last part has read it
        mbarrier.wait(a.dq_free.index(buf), ((i // dq_smem.shape[0]) & 1) ^ 1)
        dq_smem.index(buf).store(dq * a.sm_scale)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(a.dq_ready.index(buf))
    mbarrier.arrive(a.kv_empty)  # its last product has read K


@gluon.jit
def _bwd_dq_warpgroup(a):
    """`_bwd_dq_tile` for the program's tile, or with PERSISTENT tile after tile of its share."""
    if a.PERSISTENT:
        i = 0
        c = 0
        for u in range(gl.program_id(0), a.n_tiles, gl.num_programs(0)):
            t = a.tile(u)
            _bwd_dq_tile(a, t, c, i)
            i += t.n_iter
            c += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    else:
        _bwd_dq_tile(a, a.tile(gl.program_id(0)), 0, 0)


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
):
    """dk, dv of the B * Hkv * cdiv(Nk, BLOCK_N) tiles of 128 keys of one kv head (bottom-right
    causal mask or none, a sliding window (win_left with LOCAL, win_right with CAUSAL: the
    portable kernels' window), softcap through tanh.approx (SOFTCAP, cap_scale), GQA, any Nq
    and Nk): tile program_id, or with PERSISTENT tiles program_id, + num_programs, ... (one
    program per SM; `BwdArgs.tile` orders them); launched
    with num_warps = 4 (the default partition), 9 warps in all (14 with DQ_MODE 1, 15 with 2,
    whose reducer warps take turns; with DQ_HALVES 10 and 11). LSE2 / DELTA: (B * H, vec_stride) padded row vectors
    (triton/bwd.py, attn_bwd_preprocess_kernel with ROWVEC; with ROWS_SCALED lse2 - 15 and
    -delta 2^-15, `scaled_rows`). tile_heads: (batch, kv head)s per tile
    group, negative for descending key blocks (`BwdArgs.tile`). DQ_MODE > 0: also dq's float32
    sums, scaled, into DQACC ((dq_rows = B * H * vec_stride, BLOCK_D), zeroed before, as is
    SEM: (B * H, sem_stride)), one program per tile: a third warpgroup computes each step's dq
    part from the consumers' dS^T (`_bwd_dq_tile`; BLOCK_D <= 64), or with DQ_HALVES each
    consumer half of its columns (`_bwd_tile_steps`), a reducer warp adds it
    (DQ_MODE 2: two, taking turns, each waiting for the part of the key block before it in the
    sums' order, whose tile was launched before it: `_bwd_reduce_tile`). The TMA descriptors
    span the whole (B, N, H, D) tensors: built once per program."""
    gl.static_assert(BLOCK_N == 2 * BWD_WG_KEYS, "two consumer warpgroups of 64 keys")
    gl.static_assert(DQ_MODE == 0 or DQ_HALVES or BLOCK_D <= 64,
                     "the dq warpgroup's registers hold d <= 64")  # fmt: skip
    gl.static_assert(not DQ_HALVES or DQ_MODE > 0, "dq halves: dq summed in the kernel")
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
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], tile2)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], tile2)
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

    a = BwdArgs(q_desc, do_desc, k_desc, v_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, ds_smem,
                dq_smem, kv_bar, kv_empty, ready, empty, ds_ready, ds_free, dq_ready, dq_free, LSE2,
                DELTA, DK, DV, K, V, stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn,
                stride_dvh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                vec_stride, H, Hkv, GROUP, Nq, Nk, n_tiles, tile_heads, qk_scale, sm_scale, SEM,
                sem_stride, cap_scale, lo_shift, hi_shift, CAUSAL, LOCAL, SOFTCAP, ROWS_SCALED,
                HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, STAGES, DQ_MODE, DQ_HALVES, KV_REGS,
                PERSISTENT)  # fmt: skip
    # Three partition lists (fixed-order dq: two reducer warps; any order: one; dk/dv only):
    # Gluon takes the (function, args) pairs as a literal list. (One list with a second reducer
    # warp idle in any order would do, but that variant was never timed.)
    if DQ_HALVES and DQ_MODE == 2:
        gl.warp_specialize(
            [
                (_bwd_consumer, (a, gl.constexpr(0))),
                (_bwd_consumer, (a, gl.constexpr(1))),
                (_bwd_producer, (a,)),
                (_bwd_dq_reducer, (a, gl.constexpr(True), gl.constexpr(0), ORDERED_DQ_REDUCERS)),
                (_bwd_dq_reducer, (a, gl.constexpr(True), gl.constexpr(1), ORDERED_DQ_REDUCERS)),
            ],
            [4, 1, 1, 1],
            [HALVES_CONSUMER_REGS, 24, REDUCER_WARP_REGS, REDUCER_WARP_REGS],
        )
    elif DQ_HALVES:
        gl.warp_specialize(
            [
                (_bwd_consumer, (a, gl.constexpr(0))),
                (_bwd_consumer, (a, gl.constexpr(1))),
                (_bwd_producer, (a,)),
                (_bwd_dq_reducer, (a, gl.constexpr(False), gl.constexpr(0), gl.constexpr(1))),
            ],
            [4, 1, 1],
            [HALVES_CONSUMER_REGS, 24, REDUCER_WARP_REGS],
        )
    elif DQ_MODE == 2:
        gl.static_assert(ORDERED_DQ_REDUCERS == 2, "the list below spells out two reducer warps")
        gl.warp_specialize(
            [
                (_bwd_consumer, (a, gl.constexpr(0))),
                (_bwd_consumer, (a, gl.constexpr(1))),
                (_bwd_dq_warpgroup, (a,)),
                (_bwd_producer, (a,)),
                (_bwd_dq_reducer, (a, gl.constexpr(True), gl.constexpr(0), ORDERED_DQ_REDUCERS)),
                (_bwd_dq_reducer, (a, gl.constexpr(True), gl.constexpr(1), ORDERED_DQ_REDUCERS)),
            ],
            [4, 4, 1, 1, 1],
            [FUSED_CONSUMER_REGS, DQ_WARPGROUP_REGS, 24, REDUCER_WARP_REGS, REDUCER_WARP_REGS],
        )
    elif DQ_MODE == 1:
        gl.warp_specialize(
            [
                (_bwd_consumer, (a, gl.constexpr(0))),
                (_bwd_consumer, (a, gl.constexpr(1))),
                (_bwd_dq_warpgroup, (a,)),
                (_bwd_producer, (a,)),
                (_bwd_dq_reducer, (a, gl.constexpr(False), gl.constexpr(0), gl.constexpr(1))),
            ],
            [4, 4, 1, 1],
            [FUSED_CONSUMER_REGS, DQ_WARPGROUP_REGS, 24, REDUCER_WARP_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_bwd_consumer, (a, gl.constexpr(0))),
                (_bwd_consumer, (a, gl.constexpr(1))),
                (_bwd_producer, (a,)),
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
    if cfg.dq_mode != DQ_KERNEL and cfg.persistent:
        return "the fused-dq variants run one program per tile"
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
    ops.launch(
        attn_bwd_gluon_kernel, (min(tiles, p.target.sms) if cfg.persistent else tiles,),
        Q=q, K=k, V=v, DO=do, LSE2=lse2, DELTA=delta, DK=dk, DV=dv, DQACC=dq_acc, SEM=sem,
        **tma_strides("q", q), **tma_strides("k", k), **tma_strides("v", v),
        **tma_strides("do", do), **strides("dk", dk), **strides("dv", dv),
        vec_stride=width, sem_stride=width // sem_rows, dq_rows=p.batch * p.heads * width,
        tile_heads=cfg.tile_heads, B=p.batch, H=p.heads, Hkv=p.kv_heads,
        GROUP=p.heads // p.kv_heads, Nq=p.nq, Nk=p.nk, qk_scale=s.qk_scale,
        sm_scale=s.sm_scale, cap_scale=s.cap_scale, win_left=max(p.left, 0), win_right=p.right,
        HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        CAUSAL=p.causal, LOCAL=p.local, SOFTCAP=s.softcap == 2, STAGES=t.stages,
        DQ_MODE=cfg.dq_mode, ROWS_SCALED=rows_scaled, DQ_HALVES=cfg.dq_halves, KV_REGS=cfg.kv_regs,
        PERSISTENT=cfg.persistent, num_warps=t.warps,
    )  # fmt: skip
