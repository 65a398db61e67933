"""The partitions of the Gluon backward (gluon/bwd.py, `attn_bwd_gluon_kernel`): what they
share (`BwdArgs`, `BwdTile`), the producer warp's loads (`bwd_producer`), the consumer
warpgroups' steps (`bwd_consumer`), the dq warpgroup (`bwd_dq_warpgroup`), the reducer warps'
dq sums (`bwd_dq_reducer`), and the tile walks: one tile per program, tiles by program id
(PERSISTENT), or from a counter (DYNAMIC: `_publish_tile`, `_next_tile`), which the partitions
but the producer take through `_walk`. The design is in
bwd.py's docstring."""

from triton._C.libtriton import ir as _tt_ir
from triton.experimental.gluon.language._core import builtin as _builtin

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
    wgmma_layout,
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
# DYNAMIC: tile ids in flight from the producer to the other partitions (the producer runs up
# to this many tiles ahead of the slowest of them: a tile with no step may pass at once).
ID_SLOTS = gl.constexpr(2)


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

    # TMA descriptors over the whole (B, N, H, D) tensors and the flat padded row vectors (the
    # producer's), over the float32 dq sums (the reducer warps'; DQ_MODE > 0, else a
    # stand-in), and over dk and dv (B, Nk, Hkv, D) (the consumers' stores, 64 keys a box).
    q_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    lse_desc: tma.tensor_descriptor
    delta_desc: tma.tensor_descriptor
    dq_desc: tma.tensor_descriptor
    dk_desc: tma.tensor_descriptor
    dv_desc: tma.tensor_descriptor
    # Shared memory: STAGES-deep rings of q and do tiles (BLOCK_M rows each) and of their rows'
    # lse2 and delta (`rows_smem`: slot 2 s lse2, 2 s + 1 delta), the tile's K and V (BLOCK_N
    # keys); with DQ_MODE > 0 two dS^T buffers (one per step parity) and DQ_BUFFERS dq parts
    # (DQ_HALVES: each as two column halves; else stand-ins, never read); the consumers' dk
    # and dv tiles on their way out (`out_smem`: slot 2 j + WG, j = 0 dk, 1 dv; with DQ_HALVES
    # the dq buffers of the same slots, reinterpreted, `_out_buf`). Barriers:
    # kv_bar (K, V landed) / kv_empty (every warpgroup reading them is done), ready[s] /
    # empty[s] (the ring's slots), ds_ready / ds_free and dq_ready / dq_free (the dS^T and dq
    # hand-offs).
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    rows_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    out_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    ds_ready: gl.shared_memory_descriptor
    ds_free: gl.shared_memory_descriptor
    dq_ready: gl.shared_memory_descriptor
    dq_free: gl.shared_memory_descriptor
    # K, V (KV_REGS: read into registers) as (B, Nk, Hkv, D) with their strides; the padded row
    # vectors' row length.
    K: gl.tensor
    V: gl.tensor
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
    # DYNAMIC: the tile counter (int32, zeroed before the launch) and a ring of ID_SLOTS tile
    # ids from the producer to the other partitions, with its barriers (else stand-ins).
    CTR: MaybeConstexpr
    ids: gl.shared_memory_descriptor
    id_ready: gl.shared_memory_descriptor
    id_free: gl.shared_memory_descriptor
    DYNAMIC: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc, dk_desc,
                 dv_desc, q_smem, do_smem, rows_smem, k_smem, v_smem, ds_smem, dq_smem, out_smem,
                 kv_bar, kv_empty, ready, empty, ds_ready, ds_free, dq_ready, dq_free, K, V,
                 stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, vec_stride, H,
                 Hkv, GROUP, Nq, Nk, n_tiles, tile_heads, qk_scale, sm_scale, SEM, sem_stride,
                 cap_scale, lo_shift, hi_shift, CAUSAL, LOCAL, SOFTCAP, ROWS_SCALED, HEAD_DIM,
                 BLOCK_M, BLOCK_N, BLOCK_D, STAGES, DQ_MODE, DQ_HALVES, KV_REGS, PERSISTENT, CTR,
                 ids, id_ready, id_free, DYNAMIC):  # fmt: skip
        self.q_desc, self.do_desc, self.k_desc, self.v_desc = q_desc, do_desc, k_desc, v_desc
        self.lse_desc, self.delta_desc, self.dq_desc = lse_desc, delta_desc, dq_desc
        self.dk_desc, self.dv_desc = dk_desc, dv_desc
        self.q_smem, self.do_smem, self.rows_smem = q_smem, do_smem, rows_smem
        self.k_smem, self.v_smem = k_smem, v_smem
        self.ds_smem, self.dq_smem, self.out_smem = ds_smem, dq_smem, out_smem
        self.kv_bar, self.kv_empty, self.ready, self.empty = kv_bar, kv_empty, ready, empty
        self.ds_ready, self.ds_free = ds_ready, ds_free
        self.dq_ready, self.dq_free = dq_ready, dq_free
        self.K, self.V = K, V
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
        self.CTR = maybe_constexpr(CTR)
        self.ids, self.id_ready, self.id_free = ids, id_ready, id_free
        self.DYNAMIC = gl.constexpr(DYNAMIC)

    @gluon.jit
    def step(self, t, it):
        """(g, m0) of step `it` of tile t: its query head hq0 + g of the kv head's GROUP and its
        first query row m0, each query head's blocks in turn (it = g n_m + block). (Each query
        block's heads in turn was 5-10% slower GQA causal: NOTES.md.)"""
        g = it // t.n_m
        return g, (t.m_lo + it - g * t.n_m) * self.BLOCK_M

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


@gluon.constexpr_function
def id_readers(DQ_MODE, DQ_HALVES):
    """DYNAMIC: the partitions that read each tile id: the consumers, the dq warpgroup, the
    reducer warps."""
    reducers = 0 if DQ_MODE == 0 else ORDERED_DQ_REDUCERS.value if DQ_MODE == 2 else 1
    return gl.constexpr(2 + int(DQ_MODE > 0 and not DQ_HALVES) + reducers)


@gluon.jit
def _publish_tile(a, c, uid):
    """DYNAMIC, the producer: the id of the program's c-th tile (-1: no more) into the id ring's
    slot c % ID_SLOTS, once every reader has taken the id the slot held before."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slot = c % ID_SLOTS
    mbarrier.wait(a.id_free.index(slot), ((c // ID_SLOTS) & 1) ^ 1)
    a.ids.index(slot).store(gl.full([1], uid, gl.int32, one))
    gl.thread_barrier()
    mbarrier.arrive(a.id_ready.index(slot))


@gluon.jit
def _next_tile(a, c, WARPS: gl.constexpr):
    """DYNAMIC, a partition of WARPS warps other than the producer: the id of the program's c-th
    tile (-1: none), the slot released once all its warps have read it."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    slot = c % ID_SLOTS
    mbarrier.wait(a.id_ready.index(slot), (c // ID_SLOTS) & 1)
    uid = gl.max(a.ids.index(slot).load(layout), axis=0)
    gl.thread_barrier()
    mbarrier.arrive(a.id_free.index(slot))
    return uid


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
    Nk, pid_n = a.Nk, t.pid_n
    for it in range((LANE - i0 % REDUCERS + REDUCERS) % REDUCERS, t.n_iter, REDUCERS):
        i = i0 + it
        par = i % N_BUF
        g, m0 = a.step(t, it)
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
def bwd_dq_reducer(a, ORDERED: gl.constexpr, LANE: gl.constexpr, REDUCERS: gl.constexpr):
    """Reducer warp LANE of REDUCERS: `_bwd_reduce_tile` for each tile the program walks
    (`_walk`)."""
    _walk(a, _bwd_reduce_step, 1, (ORDERED, LANE, REDUCERS))


@gluon.jit
def _bwd_reduce_step(a, t, c, i0, args: gl.constexpr):
    """`_walk`'s body for a reducer warp: args = (ORDERED, LANE, REDUCERS)."""
    _bwd_reduce_tile(a, t, t.b * a.H + t.hk * a.GROUP, i0, a.tile_heads < 0, args[0], args[1],
                     args[2])  # fmt: skip


@gluon.jit
def _walk(a, body: gl.constexpr, WARPS: gl.constexpr, args: gl.constexpr = None):
    """The tiles a partition of WARPS warps other than the producer walks, in the producer's
    order: body(a, t, c, i[, args]) for the program's tile, or with PERSISTENT for each tile of
    its share (DYNAMIC: the producer's ids, until -1); i: the program's steps before tile t, c:
    its tiles before it (whose parity is the K/V barrier's phase)."""
    if a.DYNAMIC:
        i = 0
        c = 0
        u = _next_tile(a, 0, WARPS)
        while u >= 0:
            t = a.tile(u)
            _walk_body(a, body, t, c, i, args)
            i += t.n_iter
            c += 1
            u = _next_tile(a, c, WARPS)
    elif a.PERSISTENT:
        i = 0
        c = 0
        for u in range(gl.program_id(0), a.n_tiles, gl.num_programs(0)):
            t = a.tile(u)
            _walk_body(a, body, t, c, i, args)
            i += t.n_iter
            c += 1  # noqa: SIM113 (Gluon loops have no enumerate)
    else:
        _walk_body(a, body, a.tile(gl.program_id(0)), 0, 0, args)


@gluon.jit
def _walk_body(a, body: gl.constexpr, t, c, i, args: gl.constexpr):
    if args is None:
        body(a, t, c, i)
    else:
        body(a, t, c, i, args)


@gluon.jit
def _bwd_load_tile(a, t, c, i0):
    """The producer's loads of tile t: K and V of its key block once both consumers are done
    with the previous tile's (c: the program's tiles before it); then q, do and their rows' lse2
    and delta of each step (`BwdArgs.step`: query head hq0 + g, rows from m0) into ring
    slot i % STAGES (i = i0 + it: the program's steps) once both consumers have released its
    previous tiles (a fresh barrier passes the first wait)."""
    tile4: gl.constexpr = a.q_desc.layout
    kv4: gl.constexpr = a.k_desc.layout
    dtype: gl.constexpr = a.q_smem.dtype
    BLOCK_M: gl.constexpr = a.BLOCK_M
    BLOCK_D: gl.constexpr = a.BLOCK_D
    STAGES: gl.constexpr = a.STAGES
    q_desc, do_desc, ready = a.q_desc, a.do_desc, a.ready
    b, start_n = t.b, t.start_n
    mbarrier.wait(a.kv_empty, (c & 1) ^ 1)
    mbarrier.expect(a.kv_bar, 2 * a.k_desc.block_type.nbytes)
    k_dst = a.k_smem._reinterpret(dtype, [1, a.BLOCK_N, 1, BLOCK_D], kv4)
    v_dst = a.v_smem._reinterpret(dtype, [1, a.BLOCK_N, 1, BLOCK_D], kv4)
    tma.async_copy_global_to_shared(a.k_desc, [b, start_n, t.hk, 0], a.kv_bar, k_dst)
    tma.async_copy_global_to_shared(a.v_desc, [b, start_n, t.hk, 0], a.kv_bar, v_dst)
    hq0 = t.hk * a.GROUP
    step_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + 2 * a.lse_desc.block_type.nbytes)  # fmt: skip
    for it in range(t.n_iter):
        i = i0 + it
        s = i % STAGES
        g, m0 = a.step(t, it)
        row0 = (b * a.H + hq0 + g) * a.vec_stride + m0  # (in the flat row vectors)
        mbarrier.wait(a.empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), step_bytes)
        q_dst = a.q_smem.index(s)._reinterpret(dtype, [1, BLOCK_M, 1, BLOCK_D], tile4)
        do_dst = a.do_smem.index(s)._reinterpret(dtype, [1, BLOCK_M, 1, BLOCK_D], tile4)
        tma.async_copy_global_to_shared(q_desc, [b, m0, hq0 + g, 0], ready.index(s), q_dst)
        tma.async_copy_global_to_shared(do_desc, [b, m0, hq0 + g, 0], ready.index(s), do_dst)
        tma.async_copy_global_to_shared(a.lse_desc, [row0], ready.index(s),
                                        a.rows_smem.index(2 * s))  # fmt: skip
        tma.async_copy_global_to_shared(a.delta_desc, [row0], ready.index(s),
                                        a.rows_smem.index(2 * s + 1))  # fmt: skip


@gluon.jit
def bwd_producer(a):
    """TMA loads (`_bwd_load_tile`) of the program's tile, or with PERSISTENT tile after tile of
    its share: the next tile's K/V and first q / do tiles then load while the consumers finish
    the current one. DYNAMIC: each tile is the next the counter hands out, its id published to
    the other partitions first (`_publish_tile`), then -1. Tiles go out in increasing order, each
    to a program that is running: every tile before it is done or under way, so the fixed
    order's waits always end, whichever programs are resident."""
    if a.DYNAMIC:
        i = 0
        c = 0
        u = gl.atomic_add(a.CTR, 1)
        while u < a.n_tiles:
            _publish_tile(a, c, u)
            t = a.tile(u)
            _bwd_load_tile(a, t, c, i)
            i += t.n_iter
            c += 1
            u = gl.atomic_add(a.CTR, 1)
        _publish_tile(a, c, -1)
    elif a.PERSISTENT:
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
    Row vectors (lse2 in log2 units, delta) are the preprocess's padded copies, +inf / 0 past
    Nq, so query rows past the end add nothing and need no check; the producer loads each
    step's into the ring beside q and do, and each is read from there when it is needed (lse2
    after S^T, delta after dP^T): read from global memory, both were in registers across the
    step's first products, and their load's latency was the step's at d64 (NOTES.md). KV_REGS:
    the warpgroup's K and V rows are the S^T / dP^T wgmmas' A operands in registers (loaded
    from global memory), which halves those products' shared-memory reads; used with
    DQ_MODE > 0 only (the dk/dv-only variant gave wrong dk / dv with them on the H100, loaded
    from global or from the shared tile: `can_implement` refuses them there). DQ_HALVES: each
    step also this warpgroup's half of dq's columns from both halves of dS^T, handed to the
    reducer warps."""
    BLOCK_M: gl.constexpr = a.BLOCK_M
    BLOCK_D: gl.constexpr = a.BLOCK_D
    STAGES: gl.constexpr = a.STAGES
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(BLOCK_D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    per_query: gl.constexpr = gl.SliceLayout(0, st_layout)
    per_key: gl.constexpr = gl.SliceLayout(1, st_layout)
    dtype: gl.constexpr = a.q_smem.dtype
    Nk = a.Nk

    # The kv head's bases of K and V.
    b64 = t.b.to(gl.int64)
    hk64 = t.hk.to(gl.int64)
    kv_phase = c & 1  # the K/V barrier's phase
    K = a.K + b64 * a.stride_kb + hk64 * a.stride_kh
    V = a.V + b64 * a.stride_vb + hk64 * a.stride_vh
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
        dq_layout: gl.constexpr = wgmma_layout(HALF)
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
        _, m0 = a.step(t, it)
        q_s = a.q_smem.index(s)
        do_s = a.do_smem.index(s)
        queries = m0 + gl.arange(0, BLOCK_M, layout=per_query)
        mbarrier.wait(a.ready.index(s), (i // STAGES) & 1)
        st_tok = warpgroup_mma(k_w, q_s.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_w, do_s.permute((1, 0)), zero_st, use_acc=False,
                                is_async=True)  # fmt: skip
        s_t = warpgroup_mma_wait(1, deps=(st_tok,))  # S^T done; dP^T may still run
        lse2 = a.rows_smem.index(2 * s).load(per_query)
        if a.SOFTCAP and not a.ROWS_SCALED:  # (the portable dq kernel reads them unscaled)
            lse2 = lse2 - P_SCALE_LOG2
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
        delta = a.rows_smem.index(2 * s + 1).load(per_query)
        if a.SOFTCAP and not a.ROWS_SCALED:
            delta = delta * -P_UNSCALE
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
            tma.store_wait(0)  # the last tile's dk, dv have left it (`_store_dkdv`)
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
    _store_dkdv(a, t, i0 + t.n_iter, dk, dv, WG)


@gluon.jit
def _out_buf(a, j: gl.constexpr, WG: gl.constexpr):
    """The warpgroup's buffer for dk (j = 0) or dv (j = 1), 64 keys x BLOCK_D: slot 2 j + WG of
    `out_smem`, or with DQ_HALVES (whose shared memory is full) its half of dq buffer j,
    reinterpreted (64 x 64 float32: the same 16 KB)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BWD_WG_KEYS, a.BLOCK_D],
                                                                a.q_smem.dtype)  # fmt: skip
    if a.DQ_HALVES:
        buf = a.dq_smem.index(2 * j + WG)
        return buf._reinterpret(a.q_smem.dtype, [BWD_WG_KEYS, a.BLOCK_D], layout)
    else:
        return a.out_smem.index(2 * j + WG)


@gluon.jit
def _store_dkdv(a, t, i, dk, dv, WG: gl.constexpr):
    """dk (scaled) and dv of the warpgroup's 64 keys of tile t out through shared memory and
    TMA stores (rows past Nk and columns past the head dim clipped by the descriptors), which
    run while the next tile starts; a register store of the two tiles cost 3-12% of the
    backward, most on short tiles (NOTES.md). The buffers (`_out_buf`) are free once the last
    tile's stores have read them, with DQ_HALVES once the reducer's adds have read the dq parts
    of the tile's last two steps: the waits of the program's next steps i and i + 1, which
    those steps repeat at no cost; the dq parts then wait for these stores
    (`tma.store_wait` before each)."""
    dtype: gl.constexpr = a.q_smem.dtype
    if a.DQ_HALVES:
        N_BUF: gl.constexpr = a.dq_smem.shape[0] // 2
        gl.static_assert(N_BUF == 2, "dk and dv in the warpgroup's halves of the 2 dq buffers")
        for j in gl.static_range(N_BUF):
            mbarrier.wait(a.dq_free.index((i + j) % N_BUF), (((i + j) // N_BUF) & 1) ^ 1)
    else:
        tma.store_wait(0)  # the last tile's have left the buffers
    dk_buf = _out_buf(a, 0, WG)
    dv_buf = _out_buf(a, 1, WG)
    dk_buf.store((dk * a.sm_scale).to(dtype))
    if a.SOFTCAP:  # dV summed 2^15 P^T dO
        dv = dv * P_UNSCALE
    dv_buf.store(dv.to(dtype))
    fence_async_shared()
    box: gl.constexpr = [1, BWD_WG_KEYS, 1, a.BLOCK_D]
    at = [t.b, t.start_n + WG * BWD_WG_KEYS, t.hk, 0]
    tma.async_copy_shared_to_global(a.dk_desc, at,
                                    dk_buf._reinterpret(dtype, box, a.dk_desc.layout))  # fmt: skip
    tma.async_copy_shared_to_global(a.dv_desc, at,
                                    dv_buf._reinterpret(dtype, box, a.dv_desc.layout))  # fmt: skip


@gluon.jit
def bwd_consumer(a, WG: gl.constexpr):
    """Keys [start_n + WG * 64, +64) of each tile the program walks (`_walk`,
    `_bwd_tile_steps`)."""
    _walk(a, _bwd_tile_steps, 4, WG)
    tma.store_wait(0)  # the last tile's dk, dv have left shared memory


@gluon.jit
def _bwd_dq_tile(a, t, c, i0):
    """The dq warpgroup's steps of tile t (i0, c: the program's steps and tiles before it):
    once both consumers have written their halves of step i's dS^T (ds_smem[i % 2]), dq's part
    = dS (BLOCK_M x 128 keys) K, scaled, into dq_smem[i % DQ_BUFFERS] for the reducer warp. The
    consumers never wait for it, only for a dS^T buffer it has read two steps back."""
    acc_layout: gl.constexpr = wgmma_layout(a.BLOCK_D)
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
def bwd_dq_warpgroup(a):
    """`_bwd_dq_tile` for each tile the program walks (`_walk`)."""
    _walk(a, _bwd_dq_tile, 4)
