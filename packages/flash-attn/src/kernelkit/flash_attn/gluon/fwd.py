"""Gluon forward of flash-attn for Hopper (sm_90a): FlashAttention-3's schedule, written out.

Same contract as triton/fwd.attn_fwd_kernel (layout (B, N, H, D) through runtime strides, log2
scores, bottom-right causal mask, GQA, LSE, rows that see no key -> zeros and LSE -inf), for
half-precision inputs and BLOCK_D in {64, 128}; the host takes it only where every tensor is
TMA-aligned (config.use_tma) on an sm_90 GPU. Gluon does not run under the interpreter: CI compiles
it for sm_90a (tests) and the GPU tests run it.

A tile = BLOCK_M = 2 x 64 query rows of one head. The kernel is persistent: one program per SM
walks its share of the tiles (causal ones in pairs of a long and a short query block, so that
the programs stay in step on the same heads: `FwdArgs.tile`), in three partitions
(gl.warp_specialize):
- a producer warp issues the TMA loads: each tile's q into one of two buffers, then its K and V
  tiles into a STAGES-deep shared-memory ring, each slot guarded by a "ready" mbarrier (TMA
  transaction bytes) and an "empty" one (both consumers arrive when their MMAs have read it);
  so the next tile's loads run under the current tile's last products and epilogue;
- two consumer warpgroups (the default partition and one worker, 4 warps each) own 64 query rows
  each. Per key block j a consumer issues S_j = q K_j^T and O += P_{j-1} V_{j-1} as asynchronous
  wgmmas, waits for S_j only, computes the online softmax of block j while the P.V product is
  still on the tensor cores, then waits for it and rescales O (the intra-warpgroup overlap of
  FlashAttention-3). P stays in registers as the A operand of the P.V wgmma; K^T is a transposed
  shared-memory view. The two warpgroups are not forced into ping-pong order: the warp
  schedulers interleave one's softmax with the other's MMAs as they come (forcing it measured
  no faster: NOTES.md, session 22). A warpgroup's o leaves through shared memory and a TMA
  store, so the warpgroup goes on to its next tile while the copy runs (stored from registers,
  the epilogue cost a window-1k tile 16% of its time: NOTES.md, session 43).
A tile walks only the key blocks some row of it sees (a sliding window's: from its first row's
first key). Key blocks no mask can touch are walked without one; a block on the causal diagonal,
past Nk or across the window's left edge applies it (a run-time branch: Gluon has no automatic
pass to trip over). With softcap the scores are capped by tanh.approx; with FIXED_SHIFT they are
shifted by one fixed value (`Scores.row_shift`) instead of each row's running maximum, so the
loop keeps no maxima and never rescales o.
"""

import torch

from kernelkit.shared.runtime import cdiv

from ..config import FwdConfig, Problem, Scores, fixed_shift_unfit
from ..strides import strides, tma_strides
from .common import (
    LN2,
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
    zero_counter_kernel,
)

WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one m64 wgmma row block)


@aggregate
class FwdArgs:
    """What the partitions share, built once per program by the kernel: the TMA descriptors,
    shared memory and mbarriers, the output, the problem's scalars and the compile-time switches
    (`attn_fwd_gluon_kernel`'s). Keep the fields' order: a worker partition captures the fields
    it reads in this order (the compiler flattens an aggregate into its fields), and another
    order gives an equivalent but different kernel."""

    # The producer's TMA descriptors over the whole (B, N, H, D) tensors.
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    # Shared memory: two q tiles (BLOCK_M rows each) and a STAGES-deep ring of K and V tiles;
    # q_bar[b] / k_ready[s] / v_ready[s]: the TMA's bytes have landed; q_empty[b] / k_empty[s] /
    # v_empty[s]: both consumer warpgroups are done with the buffer.
    q_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    # DYNAMIC: the unit counter (int32, zeroed before the launch) and the unit id of each q
    # buffer's tile (the producer's hand-off to the consumers; -1: no more tiles); else None
    # and a stand-in.
    CTR: MaybeConstexpr
    ids: gl.shared_memory_descriptor
    # The output's TMA descriptor over the whole (B, Nq, H, D) o and each consumer warpgroup's
    # o tile on its way out (o_smem[WG]); the LSE rows (B * H, Nq).
    o_desc: tma.tensor_descriptor
    o_smem: gl.shared_memory_descriptor
    LSE: gl.tensor
    # Query blocks per head, tiles in all; heads, query heads per kv head; lengths; scales.
    num_m: gl.tensor
    n_tiles: gl.tensor
    H: MaybeConstexpr
    GROUP: MaybeConstexpr
    Nq: gl.tensor
    Nk: gl.tensor
    qk_scale: gl.tensor
    cap_scale: gl.tensor
    # Row i sees keys [i + lo_shift, i + hi_shift] (LOCAL: the window's left edge; CAUSAL: its
    # right edge, the causal diagonal for hi_shift = Nk - Nq).
    lo_shift: gl.tensor
    hi_shift: gl.tensor
    CAUSAL: gl.constexpr
    LOCAL: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_D: gl.constexpr
    STAGES: gl.constexpr
    SOFTCAP: gl.constexpr
    Q_REGS: gl.constexpr
    PAIRS: gl.constexpr
    DYNAMIC: gl.constexpr
    # FIXED_SHIFT (SOFTCAP): every score shifted by row_shift, not by its row's running maximum.
    row_shift: gl.tensor
    FIXED_SHIFT: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                 v_ready, k_empty, v_empty, CTR, ids, o_desc, o_smem, LSE, num_m,
                 n_tiles, H, GROUP, Nq, Nk, qk_scale, cap_scale, lo_shift, hi_shift, CAUSAL,
                 LOCAL, BLOCK_M, BLOCK_N, BLOCK_D, STAGES, SOFTCAP, Q_REGS, PAIRS,
                 DYNAMIC, row_shift, FIXED_SHIFT):  # fmt: skip
        self.q_desc, self.k_desc, self.v_desc = q_desc, k_desc, v_desc
        self.q_smem, self.k_smem, self.v_smem = q_smem, k_smem, v_smem
        self.q_bar, self.q_empty = q_bar, q_empty
        self.k_ready, self.v_ready, self.k_empty, self.v_empty = k_ready, v_ready, k_empty, v_empty
        self.CTR, self.ids = maybe_constexpr(CTR), ids
        self.o_desc, self.o_smem, self.LSE = o_desc, o_smem, LSE
        self.num_m, self.n_tiles = num_m, n_tiles
        self.H, self.GROUP = maybe_constexpr(H), maybe_constexpr(GROUP)
        self.Nq, self.Nk, self.qk_scale, self.cap_scale = Nq, Nk, qk_scale, cap_scale
        self.lo_shift, self.hi_shift = lo_shift, hi_shift
        self.CAUSAL, self.LOCAL = gl.constexpr(CAUSAL), gl.constexpr(LOCAL)
        self.BLOCK_M, self.BLOCK_N = gl.constexpr(BLOCK_M), gl.constexpr(BLOCK_N)
        self.BLOCK_D, self.STAGES = gl.constexpr(BLOCK_D), gl.constexpr(STAGES)
        self.SOFTCAP, self.Q_REGS = gl.constexpr(SOFTCAP), gl.constexpr(Q_REGS)
        self.PAIRS, self.DYNAMIC = gl.constexpr(PAIRS), gl.constexpr(DYNAMIC)
        self.row_shift, self.FIXED_SHIFT = row_shift, gl.constexpr(FIXED_SHIFT)

    @gluon.jit
    def tile(self, u, w):
        """Tile w of work unit u: (b, h, kv head, b * H + h, first query row, first key block,
        key blocks). A
        unit is one tile, or with PAIRS (causal, an even number of query blocks) two: query
        blocks num_m - 1 - j and j of a head, whose key blocks add up to the same count in every
        unit, so that programs walking units in step stay on the same heads. Units of one head
        are adjacent (its K/V stay in L2 while the programs share them); causal: the longest
        rows of each head first."""
        num_m = self.num_m
        if self.PAIRS:
            bh = u // (num_m // 2)
            pid_m = u % (num_m // 2)
            if w == 0:
                pid_m = num_m - 1 - pid_m
        else:
            bh = u // num_m
            pid_m = u % num_m
            if self.CAUSAL:
                pid_m = num_m - 1 - pid_m
        b = bh // self.H
        h = bh % self.H
        start_m = pid_m * self.BLOCK_M
        if self.CAUSAL:  # noqa: SIM108 (constexpr branch) the key blocks the last row sees
            hi = gl.minimum(start_m + self.BLOCK_M + self.hi_shift, self.Nk)
        else:
            hi = self.Nk
        j0 = 0
        if self.LOCAL:  # from the block of the first row's first key
            j0 = gl.maximum(start_m + self.lo_shift, 0) // self.BLOCK_N
        n_blocks = gl.maximum(gl.cdiv(gl.maximum(hi, 0), self.BLOCK_N) - j0, 0)
        return b, h, h // self.GROUP, bh, start_m, j0, n_blocks


@gluon.jit
def _load_tile(a, u, w, c, i):
    """The producer's loads of tile w of unit u, the program's c-th tile, whose key blocks start
    at ring position i: its q tile into q buffer c % 2 once both consumers have released it
    (DYNAMIC: with the tile's id u * per_unit + w beside it, visible once the buffer's barrier
    completes), then K_j and V_j into ring slot i % STAGES once both consumers have released
    the slot's previous tile (a fresh barrier passes the first wait). Returns its key blocks."""
    q_tile: gl.constexpr = a.q_desc.layout
    kv_tile: gl.constexpr = a.k_desc.layout
    dtype: gl.constexpr = a.q_smem.dtype
    BLOCK_N: gl.constexpr = a.BLOCK_N
    BLOCK_D: gl.constexpr = a.BLOCK_D
    STAGES: gl.constexpr = a.STAGES
    q_desc, k_desc, v_desc = a.q_desc, a.k_desc, a.v_desc
    q_bar, k_ready, v_ready = a.q_bar, a.k_ready, a.v_ready
    b, h, hk, _, start_m, j0, n_blocks = a.tile(u, w)
    qb = c % 2
    mbarrier.wait(a.q_empty.index(qb), ((c // 2) & 1) ^ 1)
    if a.DYNAMIC:
        _publish_id(a, qb, u * (2 if a.PAIRS else 1) + w)
    mbarrier.expect(q_bar.index(qb), q_desc.block_type.nbytes)
    q_dst = a.q_smem.index(qb)._reinterpret(dtype, [1, a.BLOCK_M, 1, BLOCK_D], q_tile)
    tma.async_copy_global_to_shared(q_desc, [b, start_m, h, 0], q_bar.index(qb), q_dst)
    for j in range(n_blocks):
        s = (i + j) % STAGES
        phase = ((i + j) // STAGES) & 1
        mbarrier.wait(a.k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        k_dst = a.k_smem.index(s)._reinterpret(dtype, [1, BLOCK_N, 1, BLOCK_D], kv_tile)
        tma.async_copy_global_to_shared(k_desc, [b, (j0 + j) * BLOCK_N, hk, 0], k_ready.index(s),
                                        k_dst)  # fmt: skip
        mbarrier.wait(a.v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        v_dst = a.v_smem.index(s)._reinterpret(dtype, [1, BLOCK_N, 1, BLOCK_D], kv_tile)
        tma.async_copy_global_to_shared(v_desc, [b, (j0 + j) * BLOCK_N, hk, 0], v_ready.index(s),
                                        v_dst)  # fmt: skip
    return n_blocks


@gluon.jit
def _publish_id(a, qb, uid):
    """DYNAMIC: the id of the tile about to load into q buffer qb (-1: none), stored before the
    producer's arrival on that buffer's barrier (which releases it to the consumers)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    a.ids.index(qb).store(gl.full([1], uid, gl.int32, one))
    gl.thread_barrier()


@gluon.jit
def _read_id(a, qb, phase):
    """DYNAMIC, a consumer: the id of the tile in q buffer qb, once its barrier completed."""
    wg: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mbarrier.wait(a.q_bar.index(qb), phase)
    return gl.max(a.ids.index(qb).load(wg), axis=0)


@gluon.jit
def _producer(a):
    """TMA loads (`_load_tile`), tile after tile of the program's: units program_id,
    + num_programs, ...; with DYNAMIC program_id first, then whatever the unit counter hands
    out next (num_programs + its count), and a last id -1 that ends the consumers' walk. So
    the next tile's q and first key blocks load while the consumers finish the current one."""
    i = 0
    c = 0
    per_unit: gl.constexpr = 2 if a.PAIRS else 1
    if a.DYNAMIC:
        n_units = a.n_tiles // per_unit
        u = gl.program_id(0)
        while u < n_units:
            for w in range(per_unit):
                i += _load_tile(a, u, w, c, i)
                c += 1
            u = gl.atomic_add(a.CTR, 1) + gl.num_programs(0)
        qb = c % 2
        mbarrier.wait(a.q_empty.index(qb), ((c // 2) & 1) ^ 1)
        _publish_id(a, qb, -1)
        mbarrier.arrive(a.q_bar.index(qb))
    else:
        for t in range(gl.program_id(0) * per_unit, a.n_tiles, gl.num_programs(0) * per_unit):
            for w in range(per_unit):
                i += _load_tile(a, t // per_unit, w, c, i)
                c += 1


@gluon.jit
def _masked(a, start_n, full_lo, full_hi):
    """Whether the key block from start_n needs a mask: from full_hi on (the causal diagonal,
    the end of Nk), with LOCAL before full_lo (the window's left edge)."""
    masked = start_n >= full_hi
    if a.LOCAL:
        masked = masked | (start_n < full_lo)
    return masked


@gluon.jit
def _keep(a, start_n, first, last, s_layout: gl.constexpr):
    """The visible scores of the key block from start_n: keys up to each row's `last`, with
    LOCAL from its `first`."""
    cols = start_n + gl.arange(0, a.BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    keep = cols[None, :] <= last[:, None]
    if a.LOCAL:
        keep = keep & (cols[None, :] >= first[:, None])
    return keep


@gluon.jit
def _softmax_step(a, s, m_i, l_i, start_n, first, last, full_lo, full_hi,
                  s_layout: gl.constexpr):  # fmt: skip
    """Online softmax of one score block s (raw q.k): (p, m_new, l_new, alpha). Blocks from
    full_hi on hide the keys past each row's `last` visible key (causal diagonal, end of Nk);
    with LOCAL, blocks before full_lo those before its `first` (the window's left edge).
    SOFTCAP: the scores are first capped, s -> tanh(s * cap_scale) (tanh.approx.f32, as the
    portable kernel's SOFTCAP == 2); qk_scale then carries softcap * log2(e)."""
    qk_scale = a.qk_scale
    if a.SOFTCAP:
        s = tanh_approx(s * a.cap_scale)
    if _masked(a, start_n, full_lo, full_hi):
        s = gl.where(_keep(a, start_n, first, last, s_layout), s * qk_scale, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 to avoid inf - inf.
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _shifted_step(a, s, m_i, l_i, start_n, first, last, full_lo, full_hi,
                  s_layout: gl.constexpr):  # fmt: skip
    """FIXED_SHIFT's `_softmax_step`: the capped scores of block s shifted by m_i, which holds
    row_shift for every row (`Scores.row_shift`), so no row maxima and no rescaling:
    (p, l_new)."""
    s = tanh_approx(s * a.cap_scale)
    if _masked(a, start_n, full_lo, full_hi):
        s = gl.where(_keep(a, start_n, first, last, s_layout), s * a.qk_scale, -float("inf"))
        p = gl.exp2(s - m_i[:, None])
    else:
        p = gl.exp2(s * a.qk_scale - m_i[:, None])
    return p, l_i + gl.sum(p, axis=1)


@gluon.jit
def _step(a, s, m_i, l_i, start_n, first, last, full_lo, full_hi, s_layout: gl.constexpr):
    """One key block's softmax: `_softmax_step`, or with FIXED_SHIFT `_shifted_step` (m_i
    stays; the caller does not rescale, and the alpha returned is not read)."""
    if a.FIXED_SHIFT:
        p, l_i = _shifted_step(a, s, m_i, l_i, start_n, first, last, full_lo, full_hi, s_layout)
        alpha = m_i  # not read: nothing to rescale
    else:
        p, m_i, l_i, alpha = _softmax_step(a, s, m_i, l_i, start_n, first, last, full_lo,
                                           full_hi, s_layout)  # fmt: skip
    return p, m_i, l_i, alpha


@gluon.jit
def _attend_tile(a, q_buf, q_bar, q_empty, q_phase, i, j0, n_blocks, b, h, row0, o_buf, LSE):
    """One warpgroup's 64 query rows from row0 of one tile of (batch b, head h) (its q rows in
    q_buf, with the q buffer's barriers and phase; the K/V ring at position i): the pipelined
    loop over the tile's n_blocks key blocks from block j0, then o to global memory through
    o_buf and a TMA store (rows past Nq are clipped), and the LSE (LSE: the head's row
    vector). Q_REGS: the q tile is the S wgmma's A operand from registers, not shared memory
    (its buffer is released at once)."""
    BLOCK_N: gl.constexpr = a.BLOCK_N
    BLOCK_D: gl.constexpr = a.BLOCK_D
    STAGES: gl.constexpr = a.STAGES
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(BLOCK_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_buf.dtype
    k_smem, v_smem = a.k_smem, a.v_smem
    k_ready, v_ready, k_empty, v_empty = a.k_ready, a.v_ready, a.k_empty, a.v_empty
    Nq, Nk = a.Nq, a.Nk

    rows = row0 + gl.arange(0, WG_ROWS, layout=row_s)
    if a.CAUSAL:
        last = gl.minimum(rows + a.hi_shift, Nk - 1)  # the last key each row sees
        full_hi = gl.maximum(row0 + a.hi_shift + 1, 0) // BLOCK_N * BLOCK_N
    else:
        last = gl.full([WG_ROWS], Nk - 1, gl.int32, layout=row_s)
        full_hi = Nk // BLOCK_N * BLOCK_N
    first = rows + a.lo_shift  # (LOCAL) the first key each row sees
    full_lo = row0 + WG_ROWS - 1 + a.lo_shift  # blocks from here on pass every row's first key
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    if a.FIXED_SHIFT:
        m_i = gl.full([WG_ROWS], 0.0, gl.float32, layout=row_s) + a.row_shift
    else:
        m_i = gl.full([WG_ROWS], -float("inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=row_s)
    p = s_zero
    o = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, o_layout)
    q = q_buf
    mbarrier.wait(q_bar, q_phase)
    if a.Q_REGS:
        q = q_buf.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        mbarrier.arrive(q_empty)
    if n_blocks > 0:  # block 0: its scores and softmax; no P.V product in flight yet
        slot = i % STAGES
        mbarrier.wait(k_ready.index(slot), (i // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(slot))
        p, m_i, l_i, alpha = _step(a, s, m_i, l_i, j0 * BLOCK_N, first, last, full_lo, full_hi,
                                   s_layout)  # fmt: skip
    for j in range(1, n_blocks):
        slot = (i + j) % STAGES
        prev = (i + j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), ((i + j) // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
        mbarrier.wait(v_ready.index(prev), ((i + j - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok,))  # S_j done; P_{j-1} V_{j-1} may still run
        mbarrier.arrive(k_empty.index(slot))
        p, m_i, l_i, alpha = _step(a, s, m_i, l_i, (j0 + j) * BLOCK_N, first, last, full_lo,
                                   full_hi, s_layout)  # fmt: skip
        o, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(prev))
        if not a.FIXED_SHIFT:
            o = o * gl.convert_layout(alpha, row_o)[:, None]
    if not a.Q_REGS:  # every S product of the tile has read q
        mbarrier.arrive(q_empty)
    if n_blocks > 0:  # the last block's P.V product
        last_slot = (i + n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last_slot), ((i + n_blocks - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(last_slot), o, is_async=True)
        o, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(last_slot))

    # A row that sees no key (causal, Nq > Nk) has l = 0: output zeros and LSE = -inf.
    l_o = gl.convert_layout(l_i, row_o)
    o = o / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    tma.store_wait(0)  # the warpgroup's previous tile has left o_buf
    o_buf.store(o.to(dtype))
    fence_async_shared()
    o_dst = o_buf._reinterpret(dtype, [1, WG_ROWS, 1, BLOCK_D], a.o_desc.layout)
    tma.async_copy_shared_to_global(a.o_desc, [b, row0, h, 0], o_dst)
    lse = (m_i + gl.log2(l_i)) * LN2
    gl.store(LSE + rows, lse, mask=rows < Nq)


@gluon.jit
def _consumer(a, WG: gl.constexpr):
    """Rows [start_m + WG * 64, +64) of each of the program's tiles, in the producer's order
    (q buffer c % 2 for its c-th tile; the ring's position i counts key blocks)."""
    i = 0
    c = 0
    per_unit: gl.constexpr = 2 if a.PAIRS else 1
    if a.DYNAMIC:  # the producer's ids, until -1
        uid = _read_id(a, 0, 0)
        while uid >= 0:
            i += _consume_tile(a, uid // per_unit, uid % per_unit, c, i, WG)
            c += 1
            uid = _read_id(a, c % 2, (c // 2) & 1)
    else:
        for t in range(gl.program_id(0) * per_unit, a.n_tiles, gl.num_programs(0) * per_unit):
            for w in range(per_unit):
                i += _consume_tile(a, t // per_unit, w, c, i, WG)
                c += 1
    tma.store_wait(0)  # the last tile's o has left shared memory


@gluon.jit
def _consume_tile(a, u, w, c, i, WG: gl.constexpr):
    """Warpgroup WG's rows of tile w of unit u, the program's c-th tile (q buffer c % 2), its
    key blocks from ring position i (`_attend_tile`). Returns its key blocks."""
    b, h, _, bh, start_m, j0, n_blocks = a.tile(u, w)
    qb = c % 2
    _attend_tile(a, a.q_smem.index(qb).slice(WG * WG_ROWS, WG_ROWS), a.q_bar.index(qb),
                 a.q_empty.index(qb), (c // 2) & 1, i, j0, n_blocks, b, h,
                 start_m + WG * WG_ROWS, a.o_smem.index(WG),
                 a.LSE + bh.to(gl.int64) * a.Nq)  # fmt: skip
    return n_blocks


@gluon.jit(do_not_specialize=["Nq", "Nk", "win_left", "win_right"])
def attn_fwd_gluon_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_on,
    stride_oh,
    B,
    H,
    GROUP,
    Nq,
    Nk,
    qk_scale,
    cap_scale,
    row_shift,
    win_left,
    win_right,
    HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    LOCAL: gl.constexpr,
    EVEN_M: gl.constexpr,
    EVEN_N: gl.constexpr,
    DOT_PREC: gl.constexpr,
    TMA: gl.constexpr,
    STAGES: gl.constexpr,
    SOFTCAP: gl.constexpr,
    Q_REGS: gl.constexpr = False,
    PAIRS: gl.constexpr = False,
    TILE_CTR=None,
    DYNAMIC: gl.constexpr = False,
    FIXED_SHIFT: gl.constexpr = False,
):
    """The B * H * cdiv(Nq, BLOCK_M) tiles of BLOCK_M (= 128) query rows of one head, tile
    t = program_id, + num_programs, ... (persistent when launched with fewer programs than
    tiles); launched with num_warps = 4 (the default partition), 12 warps in all. The
    arguments are triton/fwd.py attn_fwd_kernel's (EVEN_M, EVEN_N and DOT_PREC unused: the masks are
    run-time branches, half precision only; SOFTCAP 0 or 1: tanh.approx) plus B, STAGES,
    Q_REGS and PAIRS (`FwdArgs.tile`), DYNAMIC (TILE_CTR: the unit counter) and FIXED_SHIFT. The TMA descriptors span the whole (B, N, H, D) tensors:
    built once per program."""
    gl.static_assert(BLOCK_M == 2 * WG_ROWS, "two consumer warpgroups of 64 rows")
    gl.static_assert(TMA, "the host takes this kernel only where every tensor is TMA-aligned")
    qk_scale = qk_scale.to(gl.float32)  # torch.compile may pass Python floats as float64
    cap_scale = cap_scale.to(gl.float32)
    row_shift = row_shift.to(gl.float32)
    lo_shift = Nk - Nq - win_left
    hi_shift = Nk - Nq + win_right
    num_m = gl.cdiv(Nq, BLOCK_M)
    n_tiles = B * H * num_m
    Hkv = H // GROUP
    dtype: gl.constexpr = Q.dtype.element_ty
    q_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, 1, BLOCK_D], dtype)
    kv_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, 1, BLOCK_D], dtype)
    o_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, WG_ROWS, 1, BLOCK_D], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    q_desc = tma.make_tensor_descriptor(Q, [B, Nq, H, HEAD_DIM],
                                        [stride_qb, stride_qn, stride_qh, 1],
                                        [1, BLOCK_M, 1, BLOCK_D], q_tile)  # fmt: skip
    k_desc = tma.make_tensor_descriptor(K, [B, Nk, Hkv, HEAD_DIM],
                                        [stride_kb, stride_kn, stride_kh, 1],
                                        [1, BLOCK_N, 1, BLOCK_D], kv_tile)  # fmt: skip
    v_desc = tma.make_tensor_descriptor(V, [B, Nk, Hkv, HEAD_DIM],
                                        [stride_vb, stride_vn, stride_vh, 1],
                                        [1, BLOCK_N, 1, BLOCK_D], kv_tile)  # fmt: skip
    o_desc = tma.make_tensor_descriptor(O, [B, Nq, H, HEAD_DIM],
                                        [stride_ob, stride_on, stride_oh, 1],
                                        [1, WG_ROWS, 1, BLOCK_D], o_tile)  # fmt: skip
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_D], q_layout)
    o_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, BLOCK_D], o_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    if DYNAMIC:
        ids = gl.allocate_shared_memory(gl.int32, [2, 1],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # fmt: skip
    else:  # unused: a stand-in, so that the static walk allocates nothing more
        ids = q_bar

    a = FwdArgs(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                k_empty, v_empty, TILE_CTR, ids, o_desc, o_smem, LSE, num_m, n_tiles, H, GROUP,
                Nq, Nk, qk_scale, cap_scale, lo_shift, hi_shift, CAUSAL, LOCAL, BLOCK_M,
                BLOCK_N, BLOCK_D, STAGES, SOFTCAP, Q_REGS, PAIRS, DYNAMIC, row_shift,
                FIXED_SHIFT)  # fmt: skip
    gl.warp_specialize(
        [(_consumer, (a, gl.constexpr(0))), (_consumer, (a, gl.constexpr(1))), (_producer, (a,))],
        [4, 1],
        [232, 24],
    )


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------


def can_implement(p: Problem, cfg: FwdConfig) -> str | None:
    """None if the Gluon forward can run `cfg` for problem `p`, else why not: an sm_90 GPU,
    half precision, BLOCK_D 64 or 128, v's head dim equal to q's, TMA-aligned q, k, v, o rows
    16-byte aligned (o is contiguous: the TMA store needs head_dim * itemsize % 16 == 0);
    dense, no packed batch; softcap only through tanh.approx; 2 x 64 query rows per tile; pairs
    of tiles for causal problems with an even number of query blocks (any window: the chooser
    pairs them only without a left edge, `choose.gluon_fwd_config`)."""
    if not p.target.gluon:
        return "not an sm_90 GPU (or under the interpreter)"
    if not p.half:
        return "float32 inputs"
    if p.head_dim_v != p.head_dim:
        return "the value head dim must equal the query's"
    if p.block_d not in (64, 128):
        return f"head dim {p.head_dim} (BLOCK_D 64 or 128 only)"
    if not cfg.tma:
        return "the Gluon forward reads q, k, v through TMA (config tma=False)"
    if not (p.tma_q and p.tma_kv):
        return "q, k, v rows not 16-byte aligned for TMA"
    if p.head_dim * p.dtype.itemsize % 16:
        return "o rows not 16-byte aligned for the TMA store"
    if p.packed:
        return "a packed batch"
    if p.softcap and not cfg.fast_tanh:
        return "softcap only through tanh.approx"
    if cfg.fixed_shift and fixed_shift_unfit(p):
        return fixed_shift_unfit(p)
    if cfg.tile.block_m != 2 * WG_ROWS.value:
        return f"tile {cfg.tile}: BLOCK_M must be {2 * WG_ROWS.value}"
    if cfg.dynamic and not cfg.persistent:
        return "a dynamic walk needs persistent programs"
    if cfg.pairs and not (p.causal and cdiv(p.nq, cfg.tile.block_m) % 2 == 0):
        return "pairs need a causal problem with an even number of query blocks"
    return None


def launch(ops, p: Problem, cfg: FwdConfig, s: Scores, q, k, v, o, lse) -> None:
    """Launch the Gluon forward into o and lse: one program per tile, or per SM (persistent),
    causal tiles in pairs where asked; a dynamic walk's counter zeroed first."""
    t = cfg.tile
    num_m = cdiv(p.nq, t.block_m)
    units = num_m * p.batch * p.heads // (2 if cfg.pairs else 1)
    ctr = None
    if cfg.dynamic:
        ctr = ops.empty((1,), torch.int32, q.device)
        ops.launch(zero_counter_kernel, (1,), CTR=ctr, num_warps=1)
    ops.launch(
        attn_fwd_gluon_kernel, (min(units, p.target.sms) if cfg.persistent else units,),
        Q=q, K=k, V=v, O=o, LSE=lse,
        **tma_strides("q", q), **tma_strides("k", k), **tma_strides("v", v), **strides("o", o),
        B=p.batch, H=p.heads, GROUP=p.heads // p.kv_heads, Nq=p.nq, Nk=p.nk,
        qk_scale=s.qk_scale, cap_scale=s.cap_scale, row_shift=s.row_shift,
        win_left=max(p.left, 0), win_right=p.right,
        HEAD_DIM=p.head_dim, BLOCK_D=p.block_d, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        CAUSAL=p.causal, LOCAL=p.local, EVEN_M=bool(p.nq % t.block_m == 0), EVEN_N=bool(p.nk % t.block_n == 0),
        DOT_PREC="tf32", TMA=True, STAGES=t.stages, SOFTCAP=s.softcap == 2, Q_REGS=cfg.q_regs,
        PAIRS=cfg.pairs, TILE_CTR=ctr, DYNAMIC=cfg.dynamic, FIXED_SHIFT=cfg.fixed_shift,
        num_warps=t.warps,
        num_stages=t.stages,
    )  # fmt: skip
