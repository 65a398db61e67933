"""flash-attn at GPU sizes: the real tiles (128-row blocks), several of them per sequence;
dtypes, softcap (tanh.approx), windows, 64-bit offsets, the split-KV forward, CUDA graphs, the
Gluon kernels' configs and schedules, and packed batches. Every test here is marked `gpu`
(skipped without one); the same paths at interpreter sizes are in the other test files, the
helpers in fa_testing.py.
"""

import math
import time
from dataclasses import replace

import pytest
import torch
from fa_testing import (
    NO_GLUON,
    check,
    check_launches,
    check_varlen,
    check_with_configs,
    finite,
    launch_names,
    make,
    meta_problem,
    need_sm90,
    packed,
    problems,
    qkv,
    random_lengths,
    run_fwd_bwd,
    table_fwd,
)
from sm_hold import HOLD_SMEM, hold_kernel

from kernelkit.flash_attn import families, flash_attn, flash_attn_varlen
from kernelkit.flash_attn import launch as fa_launch
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn.choose import (
    check_bwd,
    check_fwd,
    choose_bwd,
    choose_fwd,
    gluon_bwd_config,
    gluon_fwd_config,
    portable_bwd_config,
    split_config,
    table_tiles,
    tile_heads,
)
from kernelkit.flash_attn.config import (
    BWD_GLUON,
    DQ_ANY_ORDER,
    DQ_KERNEL,
    DQ_ORDERED,
    FWD_GLUON,
    FWD_SPLIT,
    FWD_TRITON,
    Target,
    Tile,
    block_d_for,
)
from kernelkit.flash_attn.reference import attention_reference
from kernelkit.shared import replay
from kernelkit.shared.testing import assert_close, assert_graph_replays

# ------------------------------------------------------------------------------------------
# GPU sizes: the real tiles (128-row blocks), several of them per sequence
# ------------------------------------------------------------------------------------------

GPU_SHAPES = [
    (2, 1024, 1024, 8, 2, 128),
    (1, 2048, 1000, 4, 4, 64),
    (1, 1000, 2048, 4, 1, 64),
    (1, 4096, 4096, 2, 2, 64),
    (2, 777, 777, 3, 3, 80),
    (1, 1500, 1500, 2, 2, 96),
    (1, 1024, 1024, 2, 1, 256),
    (1, 333, 1024, 2, 2, 32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}-hkv{}-d{}".format(*s))
def test_gpu_shapes(shape, causal, device):
    check(*qkv(*shape, torch.bfloat16, device), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_dtypes(dtype, d, device):
    check(*qkv(2, 1024, 1024, 4, 2, d, dtype, device), causal=True)


# (d, dtype, causal, softcap, tanh.approx): GPU softcap uses the approximate instruction for half
# precision (the configs' fast_tanh, as the chooser sets it); the exact formula is what float32
# and CPU runs use, and what configs with fast_tanh=False run (the Gluon forward has only the
# approximate one: the portable forward then).
GPU_SOFTCAP = [
    (128, torch.bfloat16, True, 30.0, True),
    (64, torch.float16, False, 5.0, True),
    (128, torch.bfloat16, True, 30.0, False),
    (64, torch.float16, True, 0.5, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", GPU_SOFTCAP, ids=lambda c: "d{}-{}-causal{}-cap{}-fast{}".format(*c)
)
def test_gpu_softcap(case, device):
    d, dtype, causal, softcap, fast = case
    q, k, v = qkv(2, 1000, 1024, 8, 2, d, dtype, device)
    q = (q.double() * 3).to(dtype)
    pf, pb = problems(q, k, v, causal, softcap=softcap)
    fwd, bwd = choose_fwd(pf), choose_bwd(pb)
    assert fwd.fast_tanh and bwd.fast_tanh  # (half precision on a GPU)
    if not fast:  # the exact float32 tanh: the portable kernels (Gluon's is tanh.approx only)
        fwd = replace(table_fwd(pf) if fwd.kernel == FWD_GLUON else fwd, fast_tanh=False)
        if bwd.kernel == BWD_GLUON:
            bwd = portable_bwd_config(pb, *table_tiles(pb)[1:])
        bwd = replace(bwd, fast_tanh=False)
    check_with_configs(q, k, v, causal, fwd, bwd, softcap=softcap)


# (shape, window_size, causal, dtype)
GPU_WINDOWS = [
    ((2, 2048, 2048, 8, 2, 128), (256, 0), True, torch.bfloat16),
    ((1, 2048, 2048, 4, 4, 64), (100, 37), False, torch.bfloat16),
    ((1, 1000, 2048, 4, 1, 128), (1000, -1), False, torch.float16),
    ((1, 2048, 1000, 4, 2, 64), (-1, 300), False, torch.bfloat16),  # empty rows
    ((2, 777, 777, 3, 3, 80), (129, 0), True, torch.bfloat16),
    ((4, 1, 4096, 32, 8, 128), (1023, 0), True, torch.bfloat16),  # decoding: split-KV
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    GPU_WINDOWS,
    ids=lambda c: "q{}-k{}-d{}-w{}_{}-causal{}".format(*c[0][1:3], c[0][5], *c[1], c[2]),
)
def test_gpu_window(case, device):
    shape, window, causal, dtype = case
    check(*qkv(*shape, dtype, device), causal=causal, window_size=window)


@pytest.mark.gpu
def test_gpu_large_batch_offsets(device):
    """A batch stride past 2^31 elements: base offsets must be 64-bit."""
    n, d = 64, 64
    stride_b = 2**31 + 64  # elements between batch 0 and batch 1 of q
    big = torch.empty(stride_b + n * d, dtype=torch.bfloat16, device=device).normal_()
    q = big.as_strided((2, n, 1, d), (stride_b, d, d, 1))
    k = make((2, n, 1, d), torch.bfloat16, device, seed=1)
    v = make((2, n, 1, d), torch.bfloat16, device, seed=2)
    check(q, k, v, causal=True)


# (B, Nq, Nk, H, Hkv, D, dtype): the split-KV forward at GPU sizes (its real tiles and split rule)
GPU_SPLIT_SHAPES = [
    (8, 1, 4099, 32, 8, 128, torch.bfloat16),  # decode, GQA 32/8, ragged Nk
    (2, 5, 3001, 16, 2, 80, torch.float16),  # speculative, D = 80 (TMA, padded head dim)
    (2, 16, 2048, 8, 8, 64, torch.bfloat16),  # no grouping, 16 queries
    (1, 64, 65536, 1, 1, 128, torch.bfloat16),  # larger Nq that underfills the GPU
    (2, 1, 1000, 4, 1, 20, torch.bfloat16),  # D = 20: rows not 16-byte aligned, pointer loads
    (4, 2, 2500, 8, 2, 128, torch.float32),  # float32 (tf32x3)
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "case", GPU_SPLIT_SHAPES, ids=lambda c: "b{}-q{}-k{}-h{}-hkv{}-d{}-{}".format(*c)
)
def test_gpu_split_kv(case, causal, device):
    *shape, dtype = case
    q, k, v = qkv(*shape, dtype, device)
    assert choose_fwd(problems(q, k, v, causal)[0]).kernel == FWD_SPLIT
    check(q, k, v, causal=causal)


@pytest.mark.gpu
def test_gpu_split_kv_cache_slice(device):
    """A decode step against the filled prefix of a (B, cap, Hkv, D) cache, forced split counts
    against the dense forward."""
    cache = make((2, 4, 5120, 8, 128), torch.bfloat16, device, seed=3)
    k, v = cache[0, :, :5000], cache[1, :, :5000]
    q = make((4, 1, 32, 128), torch.bfloat16, device, seed=4)
    check(q, k, v, causal=True)
    scale = 1 / math.sqrt(128)
    p = problems(q, k, v, True)[0]
    dense = gluon_fwd_config(p) if p.target.gluon else table_fwd(p)  # (as for Nq > 16 rows)
    o_d, lse_d = fa_launch.forward(q, k, v, True, scale, config=dense)
    for n in (1, 3, 16, 79):
        o, lse = fa_launch.forward(q, k, v, True, scale, config=split_config(p, num_splits=n))
        assert_close(o, o_d, name=f"o vs dense, {n} splits")
        assert_close(lse, lse_d, bound=2e-5, name=f"lse vs dense, {n} splits")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(2, 1, 4096, 16, 4, 128), (1, 300, 300, 4, 2, 64)],
    ids=["split-decode", "dense"],
)
def test_gpu_cuda_graph(shape, device):
    """Forward and backward captured in one CUDA graph and replayed on new inputs give exactly
    what eager calls give (no host sync, allocation or device query breaks the capture)."""
    q, k, v = qkv(*shape, torch.bfloat16, device)
    assert (choose_fwd(problems(q, k, v, True)[0]).kernel == FWD_SPLIT) == (shape[1] == 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    do = make(q.shape, q.dtype, device, seed=5)

    def step():
        o, lse = flash_attn(*leaves, causal=True, return_lse=True)
        return (o, lse, *torch.autograd.grad(o, leaves, do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and allocate outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (10, 20):  # new inputs into the captured buffers, then replay
        with torch.no_grad():
            for t, new in zip(leaves, qkv(*shape, torch.bfloat16, device, seed=seed)):
                t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, step()):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_tma_scratch_per_stream(device):
    """Kernels that build TMA descriptors in global scratch memory (the Gluon forward and
    backward, the split-KV forward) keep that memory per stream (kernelkit-shared's direct
    launch path) and a captured graph keeps its own: forward and backward on two streams at
    once, and a graph replaying on one stream while eager calls run on another, each give
    what they give alone, bitwise."""
    inputs = []
    for i, shape in enumerate([(2, 2048, 2048, 8, 2, 128), (2, 1, 4096, 16, 4, 128)]):
        do = make((shape[0], shape[1], shape[3], shape[5]), torch.bfloat16, device, seed=7 + i)
        inputs.append((qkv(*shape, torch.bfloat16, device, seed=10 * i), do))

    def fresh(i):
        """Call i (Gluon forward / split-KV decode, then the backward) on leaves of its own:
        autograd keeps the stream a leaf was first used on, and a capture must not meet the
        legacy stream (all work here runs on side streams)."""
        tensors, do = inputs[i]
        leaves = [t.clone().requires_grad_() for t in tensors]

        def step():
            o = flash_attn(*leaves, causal=True)
            return (o, *torch.autograd.grad(o, leaves, do))

        return step

    firsts, steps, (graphed, eager) = (
        [fresh(i) for i in range(2)],
        [fresh(i) for i in range(2)],
        (fresh(0), fresh(0)),
    )
    side, *streams = (torch.cuda.Stream() for _ in range(3))
    for s in (side, *streams):
        s.wait_stream(torch.cuda.current_stream())  # the leaves' copies are there
    with torch.cuda.stream(side):
        alone = [step() for step in firsts]
    together: list[list] = [[], []]
    for _ in range(4):
        for out, s, step in zip(together, streams, steps):
            with torch.cuda.stream(s):
                out.append(step())
    with torch.cuda.stream(side):  # warm up outside the capture
        graphed()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = graphed()
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(streams[0]):
        for _ in range(4):
            graph.replay()
    with torch.cuda.stream(streams[1]):
        beside = [eager() for _ in range(4)]
    torch.cuda.synchronize()
    for out, ref in zip(together, alone):
        for got in out:
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
    for got in (captured, *beside):
        assert all(torch.equal(a, b) for a, b in zip(got, alone[0]))


# GQA/MQA, Nq != Nk both ways, ragged ends, a padded head dim, one short sequence.
HOPPER_GPU_SHAPES = [
    (2, 1024, 1024, 8, 2, 128),
    (1, 1000, 2048, 4, 1, 64),
    (1, 2048, 1000, 4, 4, 64),
    (2, 780, 777, 3, 3, 80),
    (1, 100, 100, 2, 2, 64),
]

# (lengths of q, lengths of k, H, Hkv, D, dtype, causal, window_size, softcap)
GPU_VARLEN = [
    (random_lengths(12, 2048, 5), None, 8, 2, 128, torch.bfloat16, True, (-1, -1), 0.0),
    (random_lengths(10, 2000, 6), random_lengths(10, 2000, 7), 4, 4, 64, torch.bfloat16, False,
     (256, 64), 30.0),
    (random_lengths(6, 1500, 8), None, 4, 1, 80, torch.float16, True, (-1, -1), 0.0),
    (random_lengths(5, 700, 9), random_lengths(5, 900, 10), 2, 1, 64, torch.float32, True,
     (100, -1), 0.0),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", HOPPER_GPU_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}-hkv{}-d{}".format(*s)
)
@pytest.mark.parametrize("tile", [(128, 128, 2), (128, 64, 3)], ids=["128x128s2", "128x64s3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_gluon_forward(shape, tile, causal, device):
    """The Gluon forward (gluon/fwd.py) as a config (gluon_fwd_config), non-causal and causal,
    at every head dim it takes (d128; d64 from GLUON_FWD_MIN_N rows; here also d80 and short
    rows), with the shipped 128 x 128 x 2-stage tile and a 128 x 64 x 3-stage one (its backward:
    the chooser's)."""
    need_sm90(device)
    q, k, v = qkv(*shape, torch.bfloat16, device)
    p = problems(q, k, v, causal)[0]
    fwd = check_fwd(p, gluon_fwd_config(p, Tile(*tile[:2], 4, tile[2], tma=True)))
    assert fwd.kernel == FWD_GLUON and fwd.persistent
    check_launches(fwd, None, q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_gluon_forward_d64_by_rule(causal, device):
    """The d64 Gluon forward where the chooser takes it: from GLUON_FWD_MIN_N query rows on, for
    a grid that fills the GPU (probed at that length, as on an H100); that config
    (gluon_fwd_config: q in registers, GLUON_FWD_Q_REGS_MAX_D) run at a test's size, GQA,
    Nq != Nk, with and without softcap (tanh.approx)."""
    n = T.GLUON_FWD_MIN_N[64][causal]
    for softcap in (0.0, 30.0):
        rule = meta_problem(16, n, n + 24, 16, 4, 64, causal=causal, softcap=softcap)
        assert choose_fwd(rule) == gluon_fwd_config(rule) and choose_fwd(rule).q_regs
    need_sm90(device)
    q, k, v = qkv(16, 1000, 1024, 16, 4, 64, torch.bfloat16, device)  # a grid of 16 waves
    q3 = (q.double() * 3).to(q.dtype)
    for q_, softcap in ((q, 0.0), (q3, 30.0)):
        p = problems(q_, k, v, causal, softcap=softcap)[0]
        fwd = check_fwd(p, gluon_fwd_config(p))
        assert fwd.q_regs and fwd.fast_tanh == (softcap > 0) and choose_fwd(p).kernel == FWD_TRITON
        check_with_configs(q_, k, v, causal, fwd, None, softcap=softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq", [1000, 1100], ids=["even-blocks", "odd-blocks"])
def test_gpu_gluon_forward_schedules_agree(nq, causal, device):
    """The persistent Gluon forward (one program per SM walking tiles, causal ones in pairs of a
    long and a short query block where their number is even) computes each tile as one program
    per tile does: bitwise the same o and LSE for the config's schedule flags (persistent,
    pairs) either way, and right against the reference."""
    need_sm90(device)
    q, k, v = qkv(8, nq, 1024, 16, 4, 128, torch.bfloat16, device)  # 8 or 9 blocks, 8+ waves
    scale = 1 / math.sqrt(128)
    chosen = choose_fwd(problems(q, k, v, causal)[0])
    assert chosen.kernel == FWD_GLUON and chosen.persistent
    assert chosen.pairs == (causal and nq == 1000)
    runs = []
    for persistent, pairs in ((False, False), (True, False), (True, True), (False, True)):
        cfg = replace(chosen, persistent=persistent, pairs=pairs and chosen.pairs)
        runs.append(fa_launch.forward(q, k, v, causal, scale, config=cfg))
    for o, lse in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])
    # and right: the first sequence against the float64 reference (all of it would take GBs)
    o64, lse64 = attention_reference(*(t[:1].double() for t in (q, k, v)), causal, scale,
                                     return_lse=True)  # fmt: skip
    o_lowp = attention_reference(q[:1], k[:1], v[:1], causal, scale)
    assert_close(runs[0][0][:1], o64, ref_lowp=o_lowp, name="o")
    assert_close(finite(runs[0][1][:1]), finite(lse64), bound=2e-5, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_gluon_backward_schedules_agree(causal, device):
    """The d128 Gluon dk/dv kernel persistent (one program per SM walking tiles, as the chooser
    takes it up to tables.GLUON_BWD_PERSISTENT_MAX_N query rows) and with one program per tile
    (`persistent=False`, its tile groups) give bitwise the same gradients (each tile's
    arithmetic is the same), right against the reference."""
    need_sm90(device)
    nq = T.FUSED_DQ_MIN_N[128][causal] - 112  # (below it: the dq kernel beside)
    q, k, v = qkv(10, nq, nq + 100, 16, 4, 128, torch.bfloat16, device)
    blocks = -(-(nq + 100) // 128)
    do = make(q.shape, q.dtype, device, seed=7)
    scale = 1 / math.sqrt(128)
    p = problems(q, k, v, causal, do=do)[1]
    assert blocks * 40 > p.target.sms  # (more tiles than programs: some walk several)
    chosen = choose_bwd(p)
    assert chosen.kernel == BWD_GLUON and chosen.dq_mode == DQ_KERNEL and chosen.persistent
    heads = tile_heads(40, blocks, p.target.sms, causal, False, False)
    per_tile = replace(chosen, persistent=False, tile_heads=heads)
    o, lse = fa_launch.forward(q, k, v, causal, scale)
    grads = [fa_launch.backward(do, q, k, v, o, lse, None, causal, scale, config=cfg)
             for cfg in (per_tile, chosen)]  # fmt: skip
    for a, b, name in zip(*grads, ("dq", "dk", "dv")):
        assert torch.equal(a, b), name
    check(q[:1], k[:1], v[:1], causal=causal)  # the default (persistent at this length)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window_size, causal", [((300, -1), True), ((200, 40), False)],
                         ids=["causal", "right-edge"])  # fmt: skip
def test_gpu_fused_short_window_walks_agree(window_size, causal, d, device):
    """The fused-dq backward on a short window (d64: a dq warpgroup; d128: dq in column halves):
    walked with one program per SM (as the chooser takes it, tables.FUSED_PERSISTENT_MAX_WINDOW)
    and with one program per tile, the dq sums in the same fixed order: bitwise the same
    gradients, right against the reference. GQA, a ragged last key block."""
    need_sm90(device)
    n = T.FUSED_DQ_MIN_N[d][True] + 40
    q, k, v = qkv(1, n, n, 4, 2, d, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=7)
    scale = 1 / math.sqrt(d)
    p = problems(q, k, v, causal, window_size=window_size, do=do)[1]
    chosen = choose_bwd(p)
    assert (chosen.kernel, chosen.dq_mode, chosen.persistent, chosen.dynamic) == (
        BWD_GLUON, DQ_ORDERED, True, True)  # fmt: skip
    heads = tile_heads(2, -(-n // chosen.dkdv.block_n), p.target.sms, True, False, True)
    per_tile = replace(chosen, persistent=False, dynamic=False, tile_heads=heads)
    window = (p.left, p.right)  # as flash_attn passes it on (validation.window_for)
    o, lse = fa_launch.forward(q, k, v, causal, scale, window=window)
    grads = [fa_launch.backward(do, q, k, v, o, lse, None, causal, scale, window=window,
                                config=cfg) for cfg in (per_tile, chosen)]  # fmt: skip
    for a, b, name in zip(*grads, ("dq", "dk", "dv")):
        assert torch.equal(a, b), name
    check(q, k, v, causal=causal, window_size=window_size)  # the default (walked persistently)


class _CounterOps:
    """`replay.DIRECT` whose one-int32 allocation (a dynamic walk's tile counter) is `ctr`."""

    def __init__(self, ctr):
        self.ctr = ctr

    def empty(self, shape, dtype, device):
        if tuple(shape) == (1,) and dtype == torch.int32:
            return self.ctr
        return replay.DIRECT.empty(shape, dtype, device)

    def __getattr__(self, name):
        return getattr(replay.DIRECT, name)


def test_hold_kernel_is_compile_checked():
    """`sm_hold.hold_kernel` (Gluon) runs only in the GPU test below: its launch is recorded for
    the end-of-session sm_90 compile check on CPU, as the Gluon kernels' launches are."""
    from kernelkit.shared.compile_check import record_launch

    ctr, out = torch.zeros(1, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)
    record_launch(hold_kernel, (), dict(WATCH=ctr, until=256, TIMED_OUT=out, limit_ns=10**10,
                                        SMEM=HOLD_SMEM, num_warps=4))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_dynamic_walk_runs_on_part_of_the_gpu(d, device):
    """The fused-dq backward on a short window (d64: a dq warpgroup; d128: dq in column halves;
    persistent programs taking their tiles from a counter, dq summed in a fixed order) goes
    through every tile on 4 SMs while a kernel on another stream holds all the others
    (`sm_hold`): most of its programs cannot start, and no tile waits on them. A static walk
    would wait there on the dq sums of tiles owned by programs that cannot start (until the
    holders' time limit: NOTES.md). Gradients bitwise those of one program per tile."""
    need_sm90(device)
    n = max(T.FUSED_DQ_MIN_N[d][True], 2048)  # (rows past the window: it stays)
    q, k, v = qkv(1, n, n, 8, 4, d, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=3)
    scale = 1 / math.sqrt(d)
    p = problems(q, k, v, True, window_size=(1023, -1), do=do)[1]
    assert p.local
    chosen = choose_bwd(p)
    assert (chosen.dq_mode, chosen.persistent, chosen.dynamic) == (DQ_ORDERED, True, True)
    window = (p.left, p.right)
    heads = tile_heads(4, -(-n // chosen.dkdv.block_n), p.target.sms, True, False, True)
    per_tile = replace(chosen, persistent=False, dynamic=False, tile_heads=heads)
    o, lse = fa_launch.forward(q, k, v, True, scale, window=window)
    want = fa_launch.backward(do, q, k, v, o, lse, None, True, scale, window=window,
                              config=per_tile)  # fmt: skip
    tiles = -(-n // chosen.dkdv.block_n) * 4
    ctr = torch.zeros(1, dtype=torch.int32, device=device)
    held = p.target.sms - 4
    timed_out = torch.ones(held, dtype=torch.int32, device=device)
    ops = _CounterOps(ctr)

    def backward():
        return fa_launch._backward(ops, do, q, k, v, o, lse, None, True, scale, 0.0, window, None,
                                   True, chosen)  # fmt: skip

    backward()  # compiled before the holders hold the SMs, and so is the holder
    hold_kernel[(1,)](ctr, 0, timed_out, 0, SMEM=HOLD_SMEM, num_warps=4)
    ctr.zero_()
    torch.cuda.synchronize()
    holders, walk = torch.cuda.Stream(device), torch.cuda.Stream(device)
    with torch.cuda.stream(holders):
        hold_kernel[(held,)](ctr, tiles, timed_out, 10**10, SMEM=HOLD_SMEM, num_warps=4)
    time.sleep(0.2)  # the holders resident before the walk starts
    with torch.cuda.stream(walk):
        got = backward()
    torch.cuda.synchronize()
    assert timed_out.sum().item() == 0  # every tile was taken while they held their SMs
    for a, b, name in zip(want, got, ("dq", "dk", "dv")):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "d, mode",
    [(128, "dkdv"), (64, "ordered"), (64, "any-order"), (128, "ordered"), (128, "any-order")],
)
def test_gpu_gluon_backward_tile_groups(d, mode, causal, device):
    """The Gluon dk/dv kernel's tiles in groups of a few (batch, kv head)s (here 2 groups of 8:
    choose.tile_heads) and in one group of all heads (`tile_heads` = all 16; negative: from
    the last key block down), one program per tile: the d128 dk/dv-only kernel, dq summed in
    the kernel (d64: by a dq warpgroup, d128: by the consumers in column halves) in a fixed
    order (causal: from the last key block down either way) and in any order. Right against the reference; bitwise the same gradients either way where the order
    of the sums is fixed."""
    need_sm90(device)
    deterministic = mode != "any-order"
    q, k, v = qkv(4, 1000, 1100, 16, 4, d, torch.bfloat16, device)  # 9 key blocks x 16
    do = make(q.shape, q.dtype, device, seed=9)
    scale = 1 / math.sqrt(d)
    p = problems(q, k, v, causal, deterministic=deterministic, do=do)[1]
    if mode == "dkdv":
        base = gluon_bwd_config(p, T.GLUON_DKDV_TILES[128][causal], DQ_KERNEL)
    else:
        base = gluon_bwd_config(p, T.FUSED_DQ_DKDV, DQ_ORDERED if deterministic else DQ_ANY_ORDER)
    sign = -1 if causal and mode == "ordered" else 1
    grouped = tile_heads(16, 9, p.target.sms, causal, False, mode == "ordered")
    assert grouped == 8 * sign
    o, lse = fa_launch.forward(q, k, v, causal, scale)
    _, _, grads64 = run_fwd_bwd(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    _, _, grads_l = run_fwd_bwd(attention_reference, q, k, v, do, None, causal=causal)
    grads = []
    for heads in (16 * sign, grouped):
        cfg = check_bwd(p, replace(base, persistent=False, dynamic=False, tile_heads=heads))
        assert (cfg.dq_mode == DQ_KERNEL) == (mode == "dkdv")
        assert cfg.dq_halves == (d == 128 and mode != "dkdv")
        grads.append(fa_launch.backward(do, q, k, v, o, lse, None, causal, scale,
                                        deterministic=deterministic, config=cfg))  # fmt: skip
        for g, g64, gl, name in zip(grads[-1], grads64, grads_l, ("dq", "dk", "dv")):
            assert_close(g, g64, ref_lowp=gl, name=name)
    if mode != "any-order":
        for a, b, name in zip(*grads, ("dq", "dk", "dv")):
            assert torch.equal(a, b), name


# The dk/dv kernel's own edges besides HOPPER_GPU_SHAPES: fewer query rows than a step and
# fewer keys than one warpgroup's 64 (the second warpgroup sees none), a padded head dim with
# GQA; those run in float16.
GLUON_BWD_FP16_SHAPES = [(2, 50, 60, 4, 2, 80), (1, 130, 40, 6, 3, 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    HOPPER_GPU_SHAPES + GLUON_BWD_FP16_SHAPES,
    ids=lambda s: "b{}-q{}-k{}-h{}-hkv{}-d{}".format(*s),
)
@pytest.mark.parametrize("stages", [2, 3], ids=["s2", "s3"])
def test_gpu_gluon_backward(shape, causal, stages, device):
    """The Gluon dk/dv kernel (gluon/bwd.py, attn_bwd_gluon_kernel; the dq kernel beside it) as
    a config (gluon_bwd_config) with both ring depths, at d64 too (it ships for d128): GQA,
    Nq != Nk (bottom-right causal), ragged ends, a padded head dim (with GQA; in float16), one
    key block, fewer than 64 keys or query rows."""
    need_sm90(device)
    dtype = torch.float16 if shape in GLUON_BWD_FP16_SHAPES else torch.bfloat16
    q, k, v = qkv(*shape, dtype, device)
    p = problems(q, k, v, causal)[1]
    bwd = check_bwd(p, gluon_bwd_config(p, Tile(64, 128, 4, stages, tma=True), DQ_KERNEL))
    assert bwd.kernel == BWD_GLUON and bwd.dq == choose_bwd(replace(p, target=NO_GLUON)).dq
    check_launches(None, bwd, q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "any-order"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape", HOPPER_GPU_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}-hkv{}-d{}".format(*s)
)
def test_gpu_gluon_fused_dq(shape, causal, deterministic, device):
    """dq summed in the Gluon dk/dv kernel (DQ_ORDERED / DQ_ANY_ORDER configs): up to
    tables.GLUON_FUSED_DQ_MAX_D by a dq warpgroup, above it by the consumers in column halves
    (`dq_halves`; without them such a config is an error): against the reference; in a fixed
    order the gradients are bitwise the same from run to run."""
    need_sm90(device)
    q, k, v = qkv(*shape, torch.bfloat16, device)
    p = problems(q, k, v, causal, deterministic=deterministic)[1]
    tile = Tile(64, 128, 4, 2, tma=True)
    bwd = check_bwd(p, gluon_bwd_config(p, tile, DQ_ORDERED if deterministic else DQ_ANY_ORDER))
    halves = block_d_for(shape[-1]) > T.GLUON_FUSED_DQ_MAX_D
    assert bwd.dq_halves == halves and bwd.kv_regs == (not halves)
    if halves:
        with pytest.raises(ValueError, match="dq summed by a dq warpgroup only up to BLOCK_D 64"):
            check_bwd(p, replace(bwd, dq_halves=False))
    o, lse, grads = check_launches(None, bwd, q, k, v, causal, deterministic)
    if deterministic:
        do = make(q.shape, q.dtype, q.device, seed=9)  # (check_launches')
        again = fa_launch.backward(do, q, k, v, o, lse, None, causal, 1 / math.sqrt(shape[-1]),
                                   config=bwd)  # fmt: skip
        for g, h, name in zip(grads, again, ("dq", "dk", "dv")):
            assert torch.equal(g, h), name


@pytest.mark.gpu
def test_gpu_default_config_takes_gluon_where_it_ships(device):
    """d = 128 half precision on an sm_90 GPU, non-causal or causal (also Nq != Nk: the
    bottom-right diagonal): the chooser's forward and dk/dv kernels are the Gluon ones; d = 64
    keeps the portable kernels at these lengths."""
    hopper = Target.of(device).gluon
    for d, causal, nk in ((128, False, 300), (128, True, 300), (128, True, 420), (64, False, 300),
                          (64, True, 300)):  # fmt: skip
        q, k, v = qkv(2, 300, nk, 4, 2, d, torch.bfloat16, device)
        fwd, bwd = families.probe_call(q, k, v, causal)
        assert ("attn_fwd_gluon_kernel" in launch_names(fwd)) == (d == 128 and hopper)
        assert ("attn_bwd_gluon_kernel" in launch_names(bwd)) == (d == 128 and hopper)
        gluon = (fwd.config.kernel == FWD_GLUON, bwd.config.kernel == BWD_GLUON)
        assert gluon == (d == 128 and hopper,) * 2
        check(q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", GPU_VARLEN, ids=["d128-causal", "d64-window-softcap", "d80-fp16-causal", "d64-fp32"]
)
def test_gpu_varlen(case, device):
    lens_q, lens_k, h, hkv, d, dtype, causal, window, softcap = case
    q, k, v, kw = packed(lens_q, lens_k or lens_q, h, hkv, d, dtype, device)
    check_varlen(q, k, v, causal=causal, window_size=window, softcap=softcap, **kw)


@pytest.mark.gpu
def test_gpu_varlen_cuda_graph(device):
    lens_q, lens_k = [700, 0, 1, 1300, 64], [700, 5, 1, 1300, 100]
    q, _, _, kw = packed(lens_q, lens_k, 8, 2, 128, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=5)

    def fwd_bwd(q, k, v):
        o, lse = flash_attn_varlen(q, k, v, causal=True, return_lse=True, **kw)
        return (o, lse, *torch.autograd.grad(o, (q, k, v), do))

    def inputs(seed):
        return [t.requires_grad_() for t in packed(lens_q, lens_k, 8, 2, 128, torch.bfloat16,
                                                   device, seed=seed)[:3]]  # fmt: skip

    assert_graph_replays(fwd_bwd, inputs(0), [inputs(10), inputs(20)])
