"""flash-attn: the Gluon kernels on Hopper (gluon/fwd.py, gluon/bwd.py: the FWD_GLUON /
BWD_GLUON configs), and the config checks and rules around them: their launches probed as on an
H100 and compile-checked on CPU, the chooser's fallback where they cannot run, check_fwd /
check_bwd errors naming the reason, the chooser's rules (Gluon kernels, tile groups, dq summed
in the kernel, the deterministic option).

Gluon has no interpreter: tests that run these kernels need an sm_90 GPU (`need_sm90`); the GPU
sizes are in test_gpu_sizes.py, the helpers in fa_testing.py.
"""

import itertools
import math
from dataclasses import replace

import pytest
import torch
from fa_testing import (
    INTERPRETER,
    NO_GLUON,
    check_launches,
    check_with_configs,
    launch_names,
    meta_problem,
    need_sm90,
    problems,
    qkv,
)

from kernelkit.flash_attn import families, flash_attn
from kernelkit.flash_attn import launch as fa_launch
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn import validation as fa_validation
from kernelkit.flash_attn.choose import (
    check_bwd,
    check_fwd,
    choose_bwd,
    choose_fwd,
    gluon_bwd_config,
    gluon_fwd_config,
    portable_bwd_config,
    portable_fwd_config,
    split_config,
    tile_heads,
)
from kernelkit.flash_attn.config import (
    BWD_GLUON,
    BWD_TRITON,
    DQ_ANY_ORDER,
    DQ_KERNEL,
    DQ_ORDERED,
    FWD_GLUON,
    FWD_TRITON,
    H100,
    FwdConfig,
    Split,
    Target,
    Tile,
)
from kernelkit.flash_attn.families import kernel_name
from kernelkit.shared import replay
from kernelkit.shared.testing import assert_close

EPS32 = torch.finfo(torch.float32).eps

# ------------------------------------------------------------------------------------------
# The Gluon kernels on Hopper (gluon/fwd.py, gluon/bwd.py: the FWD_GLUON / BWD_GLUON configs).
# GPU-only: Gluon has no interpreter; their launches are compile-checked on CPU below, from the
# host path probed as on an H100 (`target=H100`).
# ------------------------------------------------------------------------------------------


def _probe_backward_as_on_h100(cfg, do, q, k, v, causal, deterministic=True, softcap=0.0,
                               window=(-1, -1)) -> replay.Probe:  # fmt: skip
    """The backward's launches with config `cfg` for CPU tensors taken as on an H100 (TMA-aligned
    on sm_90), recorded instead of run; q stands in for the output, zeros for the LSE."""
    probe = replay.Probe()
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    fa_launch._backward(probe, do, q, k, v, q, lse, None, causal, 0.125, softcap, window, None,
                        deterministic, cfg, H100)  # fmt: skip
    return probe


def test_gluon_forward_launches_are_compile_checked():
    """The Gluon forward (gluon/fwd.py) runs only on an sm_90 GPU (Gluon has no interpreter):
    here its launches are probed as on an H100 (`target=H100`: CPU tensors taken as TMA-aligned
    on Hopper, softcap through tanh.approx as for half precision on a GPU) and recorded for the
    end-of-session compile check, which lowers them to TTGIR for sm_90. GQA, Nq != Nk, ragged
    ends, a padded head dim, causal (single tiles, and pairs of a long and a short query block),
    softcap (scores shifted by a fixed value, and above its bound by the running maximum),
    sliding windows (causal; both edges off the diagonal)."""
    from kernelkit.shared.compile_check import record_launch

    launches = []
    cases = [(64, False, (128, 64, 3), 0.0, 300, (-1, -1)),
             (80, False, (128, 128, 2), 0.0, 300, (-1, -1)),
             (128, True, (128, 128, 2), 30.0, 300, (-1, -1)),
             (64, True, (128, 128, 2), 0.0, 256, (-1, -1)),
             (128, True, (128, 128, 2), 30.0, 256, (64, 0)),
             (64, False, (128, 128, 2), 0.0, 300, (32, 16)),
             (128, True, (128, 128, 2), 0.0, 256, (100, 0)),
             (128, True, (128, 128, 2), 60.0, 300, (-1, -1))]  # fmt: skip
    for d, causal, tile, softcap, nq, window in cases:
        q, k, v = qkv(2, nq, 260, 4, 2, d, torch.bfloat16, "cpu")
        p = fa_launch.forward_problem(q, k, v, causal, softcap, window, target=H100)
        cfg = gluon_fwd_config(p, Tile(*tile[:2], 4, tile[2], tma=True))
        assert cfg.fast_tanh == (softcap > 0)
        assert cfg.fixed_shift == (0 < softcap <= 55)  # bf16: the running maximum above 55.4
        assert cfg.pairs == (causal and nq == 256 and window == (-1, -1))
        assert cfg.dynamic == (window[0] >= 0)  # a window's tiles from the atomic counter
        if window == (100, 0):  # a window in pairs: the chooser never pairs it; a config may
            cfg = replace(cfg, pairs=True)
        if window == (64, 0):  # the fixed-stride walk with a window: a config, not chosen
            cfg = replace(cfg, dynamic=False)
        cfg = check_fwd(p, cfg)
        probe = replay.Probe()
        fa_launch._forward(probe, q, k, v, causal, 0.125, softcap, window, None, cfg, H100)
        launches += probe.launches
    names = [kernel_name(kernel) for kernel, *_ in launches]
    assert names.count("zero_counter_kernel") == 2  # before each dynamic walk
    launches = [x for x in launches if kernel_name(x[0]) != "zero_counter_kernel"]
    assert [kernel_name(kernel) for kernel, *_ in launches] == ["attn_fwd_gluon_kernel"] * 8
    assert [kw["DYNAMIC"] for *_, kw in launches] == [False] * 5 + [True, True, False]
    assert [kw["SOFTCAP"] for *_, kw in launches] == [False, False, True, False, True, False,
                                                      False, True]  # fmt: skip
    assert [kw["FIXED_SHIFT"] for *_, kw in launches] == [False, False, True, False, True, False,
                                                          False, False]  # fmt: skip
    assert [kw["PAIRS"] for *_, kw in launches] == [False, False, False, True, False, False, True,
                                                    False]  # fmt: skip
    assert [kw["LOCAL"] for *_, kw in launches] == [False] * 4 + [True] * 3 + [False]
    assert [kw["CAUSAL"] for *_, kw in launches] == [False, False] + [True] * 6
    assert [(kw["win_left"], kw["win_right"]) for *_, kw in launches[4:7]] == [(64, 0), (32, 16),
                                                                               (100, 0)]  # fmt: skip
    for kernel, _, args, kwargs in launches:
        record_launch(kernel, args, kwargs)


def test_softcap_row_vectors_scaled_where_only_the_gluon_kernel_reads_them(device):
    """Softcap on the Gluon backward with dq summed in it: the preprocess writes lse2 - 15 and
    -delta 2^-15 (gluon/bwd.py `scaled_rows`) and the Gluon launch reads them as such
    (ROWS_SCALED); beside the portable dq kernel (which reads them too) and without softcap,
    both stay unscaled. The scaled preprocess, run here under the interpreter: exactly the
    unscaled row vectors shifted and scaled, +inf and -0 on the padded rows (on `device`)."""
    from kernelkit.shared.runtime import launch as run_launch

    torch.manual_seed(0)
    cases = [  # (kv heads, causal, softcap, dq mode, scaled)
        (2, True, 30.0, DQ_ORDERED, True),  # MHA causal: dq in column halves
        (1, True, 30.0, DQ_KERNEL, False),  # GQA causal, fixed order: the dq kernel beside
        (2, True, 0.0, DQ_ORDERED, False),
    ]
    for hkv, causal, softcap, dq_mode, scaled in cases:
        q, do = (torch.randn(1, 2100, 2, 128, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(1, 2100, hkv, 128, dtype=torch.bfloat16) for _ in range(2))
        p = fa_launch.backward_problem(do, q, k, v, causal, softcap, (-1, -1), None, True, H100)
        cfg = choose_bwd(p)
        assert (cfg.kernel, cfg.dq_mode, cfg.pad_rows) == (BWD_GLUON, dq_mode, True)
        probe = _probe_backward_as_on_h100(cfg, do, q, k, v, causal, softcap=softcap)
        pre, grid, args, kw = probe.launches[0]
        gluon = next(kw for kernel, *_, kw in probe.launches
                     if kernel_name(kernel) == "attn_bwd_gluon_kernel")  # fmt: skip
        expected = (15.0, -(2.0**-15)) if scaled else (0.0, 1.0)
        assert (kw["LSE2_SHIFT"], kw["DELTA_SCALE"], gluon["ROWS_SCALED"]) == (*expected, scaled)
        if not scaled:
            continue
        # run the recorded preprocess, scaled and not, on a real LSE
        kw = {n: t.to(device) if isinstance(t, torch.Tensor) else t
              for n, t in dict(kw, LSE=torch.randn(1, 2, 2100) * 3).items()}  # fmt: skip
        rows = {}
        for shift, factor in ((0.0, 1.0), expected):
            lse2, delta = torch.full_like(kw["LSE2"], 7.0), torch.full_like(kw["DELTA"], 7.0)
            run_launch(pre)[grid](*args, **dict(kw, LSE2=lse2, DELTA=delta, DLSE=delta,
                                                 LSE2_SHIFT=shift, DELTA_SCALE=factor))  # fmt: skip
            rows[shift] = lse2, delta
        (lse2, delta), (lse2_s, delta_s) = rows[0.0], rows[15.0]
        assert lse2.shape[-1] > 2100  # padded rows
        # (lse2 - 15 within one float32 rounding of it: a GPU build fuses the preprocess's
        # lse * log2(e) - 15 into one fma, the interpreter rounds twice; delta's factor is exact)
        finite = torch.isfinite(lse2)
        assert torch.equal(lse2_s[~finite], lse2[~finite] - 15.0)
        near = (lse2_s - (lse2 - 15.0)).abs() <= EPS32 * (lse2.abs() + 15.0)
        assert near[finite].all() and torch.equal(delta_s, delta * -(2.0**-15))
        assert torch.isinf(lse2[..., 2100:]).all() and (delta_s[..., 2100:] == 0).all()
        assert torch.isfinite(lse2[..., :2100]).all() and (delta[..., :2100] != 0).any()


def test_gluon_backward_launches_are_compile_checked():
    """The Gluon dk/dv kernel (gluon/bwd.py, attn_bwd_gluon_kernel) runs only on an sm_90 GPU:
    its launches are probed as on an H100 and recorded for the compile check, as the forward's
    above. GQA with ragged ends and Nq != Nk (causal), a padded head dim, both ring depths,
    sliding windows (causal; both edges off the diagonal), softcap (tanh.approx); dq summed in
    the kernel in both orders, with and without a window, with and without softcap."""
    from kernelkit.shared.compile_check import record_launch

    gluon = []
    cases = [(64, True, 2, (300, 260), 0.0, (-1, -1)), (80, False, 3, (300, 300), 0.0, (-1, -1)),
             (128, True, 2, (260, 300), 0.0, (-1, -1)), (128, False, 3, (256, 256), 0.0, (-1, -1)),
             (128, True, 2, (300, 260), 0.0, (64, 0)), (64, False, 2, (300, 300), 0.0, (32, 16)),
             (128, True, 2, (300, 260), 5.0, (-1, -1)),
             (128, False, 3, (300, 300), 5.0, (32, 16))]  # fmt: skip
    for d, causal, stages, (nq, nk), softcap, window in cases:
        q, k, v = qkv(2, nq, nk, 4, 2, d, torch.bfloat16, "cpu")
        do = torch.randn_like(q)
        p = fa_launch.backward_problem(do, q, k, v, causal, softcap, window, target=H100)
        tile = Tile(64, 128, 4, stages, tma=True)
        cfg = check_bwd(p, gluon_bwd_config(p, tile, DQ_KERNEL, T.INTERPRETER_DQ))
        assert cfg.persistent and not cfg.kv_regs and cfg.dq == T.INTERPRETER_DQ
        probe = _probe_backward_as_on_h100(cfg, do, q, k, v, causal, softcap=softcap,
                                           window=window)  # fmt: skip
        assert launch_names(probe) == ["attn_bwd_preprocess_kernel", "attn_bwd_gluon_kernel",
                                 "attn_bwd_dq_kernel"]  # fmt: skip
        gluon.append(probe.launches[1])
    assert [kw["CAUSAL"] for *_, kw in gluon] == [True, False, True, False, True, True, True, True]
    assert [kw["STAGES"] for *_, kw in gluon] == [2, 3, 2, 3, 2, 2, 2, 3]
    assert [kw["LOCAL"] for *_, kw in gluon] == [False] * 4 + [True] * 2 + [False, True]
    assert [kw["SOFTCAP"] for *_, kw in gluon] == [False] * 6 + [True] * 2
    # dq summed in the Gluon kernel: its launches run only there, the portable preprocess
    # (ZERO_DQ) and dq conversion included; the window's tiles and dq order too.
    # (d64: by a dq warpgroup with K/V in registers; d128 and the padded d96: by the consumers
    # in column halves)
    fused, kernels = [], []
    for d, (deterministic, softcap, window) in itertools.product(
        (64, 128, 96),
        ((True, 0.0, (-1, -1)), (False, 0.0, (-1, -1)), (True, 0.0, (64, 0)),
         (False, 0.0, (32, 16)), (True, 5.0, (64, 0)), (False, 5.0, (-1, -1))),
    ):  # fmt: skip
        q, k, v = qkv(2, 300, 260, 4, 2, d, torch.bfloat16, "cpu")
        do = torch.randn_like(q)
        p = fa_launch.backward_problem(do, q, k, v, True, softcap, window,
                                       deterministic=deterministic, target=H100)  # fmt: skip
        mode = DQ_ORDERED if deterministic else DQ_ANY_ORDER
        cfg = check_bwd(p, gluon_bwd_config(p, T.FUSED_DQ_DKDV, mode))
        launches = _probe_backward_as_on_h100(cfg, do, q, k, v, True, deterministic, softcap,
                                              window).launches  # fmt: skip
        # (a dynamic walk's counter zeroed before the Gluon kernel)
        counter = ["zero_counter_kernel"] if cfg.dynamic else []
        assert [kernel_name(kernel) for kernel, *_ in launches] == [
            "attn_bwd_preprocess_kernel", *counter, "attn_bwd_gluon_kernel",
            "attn_bwd_dq_convert_kernel"]  # fmt: skip
        fused += launches
        kernels.append(launches[-2][-1])
    assert [kw["DQ_MODE"] for kw in kernels] == [2, 1, 2, 1, 2, 1] * 3
    assert [kw["KV_REGS"] for kw in kernels] == [True] * 6 + [False] * 12
    assert [kw["DQ_HALVES"] for kw in kernels] == [False] * 6 + [True] * 12
    assert [kw["BLOCK_D"] for kw in kernels] == [64] * 6 + [128] * 12
    assert [kw["LOCAL"] for kw in kernels] == [False, False, True, True, True, False] * 3
    assert [kw["SOFTCAP"] for kw in kernels] == ([False] * 4 + [True] * 2) * 3
    # (on these short windows in either order, and in the fixed order on these short rows: one
    # program per SM taking tiles from a counter, tables.FUSED_PERSISTENT_MAX_WINDOW / _MAX_N)
    walked = [True, False, True, True, True, False] * 3
    assert [kw["PERSISTENT"] for kw in kernels] == walked
    assert [kw["DYNAMIC"] for kw in kernels] == walked
    assert [kw["ZERO_DQ"] for *_, kw in fused if "ZERO_DQ" in kw] == [True] * 18
    # causal in the fixed order on rows too long for that walk at d64
    # (tables.FUSED_PERSISTENT_MAX_N), with a window too long for it and without one: one
    # program per tile; d128 walks its tiles from the counter at any length
    assert T.FUSED_PERSISTENT_MAX_N[128] == (None, None)
    long_rows = []
    for d in (64, 128):
        n = T.FUSED_PERSISTENT_MAX_N[64][True] + 256
        q, k, v = qkv(1, n, n, 2, 1, d, torch.bfloat16, "cpu")
        do = torch.randn_like(q)
        for window in ((T.FUSED_PERSISTENT_MAX_WINDOW[d], 0), (-1, -1)):
            p = fa_launch.backward_problem(do, q, k, v, True, 0.0, window, target=H100)
            cfg = check_bwd(p, gluon_bwd_config(p, T.FUSED_DQ_DKDV, DQ_ORDERED))
            launches = _probe_backward_as_on_h100(cfg, do, q, k, v, True, True, 0.0,
                                                  window).launches  # fmt: skip
            long_rows += [launch for launch in launches
                          if kernel_name(launch[0]) == "attn_bwd_gluon_kernel"]  # fmt: skip
    assert [(kw["LOCAL"], kw["PERSISTENT"], kw["DYNAMIC"], kw["DQ_HALVES"])
            for *_, kw in long_rows] == [(True, False, False, False), (False, False, False, False),
                                         (True, True, True, True), (False, True, True, True)]  # fmt: skip
    for kernel, _, args, kwargs in gluon + fused + long_rows:
        record_launch(kernel, args, kwargs)


def test_chooser_falls_back_where_gluon_cannot_run(device):
    """Where the tables ask for a Gluon kernel that cannot run (a GPU other than sm_90, inputs
    not TMA-aligned), the chooser takes the portable kernels with the table's tiles, and `why`
    says so; that config runs correctly (here too: the CPU runs it under the interpreter)."""
    q, k, v = qkv(1, 70, 90, 2, 1, 128, torch.bfloat16, device)
    pf, pb = problems(q, k, v, True, target=NO_GLUON)
    fwd, bwd = choose_fwd(pf), choose_bwd(pb)
    assert fwd.kernel == FWD_TRITON and fwd.tile == T.FWD_TILES[128]
    assert fwd.why == "the Gluon forward cannot run: not an sm_90 GPU (or under the interpreter)"
    assert bwd.kernel == BWD_TRITON and bwd.dq_mode == DQ_KERNEL
    assert (bwd.dkdv, bwd.dq) == T.CAUSAL_TILES[128][1:] and bwd.dkdv_tma and bwd.dq_tma
    assert bwd.why == "the Gluon backward cannot run: not an sm_90 GPU (or under the interpreter)"
    # On an H100: q starting 2 bytes past an aligned address cannot be read through TMA.
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)
    q1 = buf[1:].view(q.shape).copy_(q)
    for cfg in (choose_fwd(problems(q1, k, v, True, target=H100)[0]),
                choose_bwd(problems(q1, k, v, True, target=H100)[1])):  # fmt: skip
        assert cfg.kernel == "triton" and cfg.why.endswith("rows not 16-byte aligned for TMA")
    # Head dim 68 in rows padded to 72: q, k, v, do TMA-aligned, but o, dk and dv (68 elements
    # a row, 136 bytes) cannot take the Gluon kernels' TMA stores; the portable kernels run it.
    q68, k68, v68 = (torch.nn.functional.pad(t, (0, 4))[..., :68]
                     for t in qkv(1, 70, 90, 2, 1, 68, torch.bfloat16, device))  # fmt: skip
    do68 = torch.nn.functional.pad(q68, (0, 4))[..., :68]
    p68, pb68 = problems(q68, k68, v68, True, target=H100, do=do68)
    assert p68.tma_q and p68.tma_kv and p68.block_d == 128
    assert pb68.tma_q and pb68.tma_kv and pb68.tma_do
    assert fa_launch.gluon_fwd.can_implement(p68, gluon_fwd_config(p68)) == (
        "o rows not 16-byte aligned for the TMA store"
    )
    gluon68 = gluon_bwd_config(pb68, T.GLUON_DKDV_TILES[128][True], DQ_KERNEL)
    assert fa_launch.gluon_bwd.can_implement(pb68, gluon68) == (
        "dk, dv rows not 16-byte aligned for the TMA store"
    )
    fwd68, bwd68 = choose_fwd(p68), choose_bwd(pb68)
    assert fwd68.kernel == FWD_TRITON and fwd68.why.endswith("aligned for the TMA store")
    assert bwd68.kernel == BWD_TRITON and bwd68.why.endswith("aligned for the TMA store")
    check_launches(*(f(p) for f, p in zip((choose_fwd, choose_bwd), problems(q68, k68, v68, True))),
                   q68, k68, v68, True)  # fmt: skip
    # float32 inputs: the tables never ask for the Gluon kernels; the float32 tiles.
    cfg = choose_bwd(meta_problem(1, 100, 100, 2, 2, 128, torch.float32, causal=True))
    assert cfg.kernel == BWD_TRITON and cfg.dkdv == T.FP32_TILES[128][1] and cfg.dkdv_tma
    assert cfg.why == "the tables' tiles"
    check_launches(fwd, bwd, q, k, v, True)
    # d64: the portable causal dk/dv tile (what a Gluon one fell back to before configs), with
    # the interpreter's forward and dq tiles, on any device.
    q, k, v = qkv(1, 70, 90, 2, 1, 64, torch.bfloat16, device)
    pf, pb = problems(q, k, v, True)
    fwd = portable_fwd_config(pf, T.INTERPRETER_FWD)
    check_launches(
        fwd, portable_bwd_config(pb, T.CAUSAL_TILES[64][1], T.INTERPRETER_DQ), q, k, v, True
    )


def test_explicit_gluon_configs_raise_where_they_cannot_run(device):
    """A config passed in runs as given or not at all: the H100's Gluon configs for this call
    are a ValueError naming the reason wherever the Gluon kernels cannot run (the interpreter,
    a GPU other than sm_90), not a silent fallback; on an sm_90 GPU they run, correctly."""
    q, k, v = qkv(1, 70, 90, 2, 1, 128, torch.bfloat16, device)
    pf, pb = problems(q, k, v, True, target=H100)
    fwd, bwd = choose_fwd(pf), choose_bwd(pb)
    assert fwd.kernel == FWD_GLUON and bwd.kernel == BWD_GLUON
    if Target.of(device).gluon:
        check_launches(fwd, bwd, q, k, v, True)
        return
    scale = 1 / math.sqrt(128)
    reason = r"cannot run this call: not an sm_90 GPU \(or under the interpreter\)"
    with pytest.raises(ValueError, match=f"config: gluon 128x128 w4 s2 tma .*{reason}"):
        fa_launch.forward(q, k, v, True, scale, config=fwd)
    o, lse = fa_launch.forward(q, k, v, True, scale)
    with pytest.raises(ValueError, match=f"config: gluon 64x128 w4 s2 tma, dq .*{reason}"):
        fa_launch.backward(torch.ones_like(q), q, k, v, o, lse, None, True, scale, config=bwd)


def _check_error_cases():
    """(check function, problem, config, the reason the error names)."""
    p = meta_problem(2, 1024, 1024, 8, 2, 128, causal=True)
    p64 = replace(p, head_dim=64, head_dim_v=64)
    fwd, bwd = choose_fwd(p), choose_bwd(p)
    fused = gluon_bwd_config(p64, T.FUSED_DQ_DKDV, DQ_ORDERED)  # (persistent, dynamic)
    assert fused.persistent and fused.dynamic
    halves = gluon_bwd_config(p, T.FUSED_DQ_DKDV, DQ_ORDERED)  # (persistent, dynamic)
    assert halves.persistent and halves.dynamic
    portable = portable_bwd_config(p, *T.CAUSAL_TILES[128][1:])
    interp = meta_problem(1, 100, 100, 2, 1, 32, torch.float32, causal=True, softcap=5.0,
                          target=INTERPRETER)  # fmt: skip
    packed = meta_problem(2, 100, 100, 2, 1, 64, packed=True)
    split = split_config(meta_problem(2, 1, 4096, 8, 2, 64))
    return [
        # Gluon forward
        (check_fwd, replace(p, dtype=torch.float32), fwd, "float32 inputs"),
        (check_fwd, replace(p, head_dim=256, head_dim_v=256), fwd,
         "head dim 256 (BLOCK_D 64 or 128 only)"),
        (check_fwd, replace(p, head_dim_v=64), fwd, "the value head dim must equal the query's"),
        (check_fwd, replace(p, tma_q=False), fwd, "q, k, v rows not 16-byte aligned for TMA"),
        (check_fwd, replace(p, packed=True), fwd, "a packed batch"),
        (check_fwd, replace(p, softcap=True), fwd, "softcap only through tanh.approx"),
        (check_fwd, p, replace(fwd, tile=Tile(64, 128, 4, 2, tma=True)), "BLOCK_M must be 128"),
        (check_fwd, replace(p, target=NO_GLUON), fwd, "not an sm_90 GPU"),
        (check_fwd, p, replace(fwd, tma=False), "through TMA (config tma=False)"),
        (check_fwd, replace(p, causal=False), fwd, "pairs need a causal problem"),
        (check_fwd, replace(p, nq=640), fwd, "an even number of query blocks"),
        # Gluon backward
        (check_bwd, replace(p, dtype=torch.float32), bwd, "float32 inputs"),
        (check_bwd, replace(p, tma_do=False), bwd, "q, k, v, do rows not 16-byte aligned"),
        (check_bwd, replace(p, head_dim_v=64), bwd, "the value head dim must equal the query's"),
        (check_bwd, p, replace(bwd, dkdv_tma=False), "through TMA (config dkdv_tma=False)"),
        (check_bwd, p, replace(bwd, tile_heads=0), "tile_heads 0: must divide the 4"),
        (check_bwd, p, replace(bwd, tile_heads=3), "tile_heads 3: must divide the 4"),
        (check_bwd, p, replace(bwd, tile_heads=-4), "descending tiles (tile_heads < 0) only"),
        (check_bwd, replace(p, softcap=True), bwd, "softcap only through tanh.approx"),
        (check_bwd, replace(p, packed=True), bwd, "a packed batch"),
        (check_bwd, p, replace(bwd, dkdv=Tile(64, 64, 4, 2, tma=True)), "BLOCK_N must be 128"),
        (check_bwd, p, replace(fused, dkdv=bwd.dkdv), "dq summed by a dq warpgroup only up to BLOCK_D 64"),
        (check_bwd, p, replace(bwd, dq_halves=True), "dq_halves: dq summed in the kernel, K and V in"),
        (check_bwd, p64, replace(fused, dq_halves=True), "dq_halves: dq summed in the kernel, K and V in"),
        (check_bwd, p, replace(bwd, kv_regs=True), "a dq tile and K/V in shared memory"),
        (check_bwd, p, replace(bwd, dq=None), "a dq tile and K/V in shared memory"),
        (check_bwd, p, replace(halves, dynamic=False), "take their tiles from a counter"),
        (check_bwd, p64, replace(fused, dynamic=False), "take their tiles from a counter"),
        (check_bwd, p64, replace(fused, persistent=False), "a dynamic walk needs persistent programs"),
        (check_bwd, p, replace(bwd, pad_rows=False), "reads the padded row vectors"),
        (check_bwd, replace(p, target=NO_GLUON), bwd, "not an sm_90 GPU"),
        # portable kernels
        (check_fwd, p, FwdConfig(FWD_TRITON, Tile(48, 64, 4, 2), False), "powers of two >= 16"),
        (check_fwd, p, FwdConfig(FWD_TRITON, Tile(64, 8, 4, 2), False), "powers of two >= 16"),
        (check_fwd, replace(p, tma_kv=False), FwdConfig(FWD_TRITON, T.FWD_TILES[128], True),
         "TMA loads need 16-byte aligned K/V rows"),
        (check_fwd, interp, FwdConfig(FWD_TRITON, T.INTERPRETER_FWD, True, fast_tanh=True),
         "tanh.approx does not run under the interpreter"),
        (check_fwd, p, replace(fwd, kernel="cutlass"), "unknown kernel 'cutlass'"),
        (check_bwd, p, replace(portable, dkdv=Tile(256, 64, 4, 2)), "above the row vectors' padding (128)"),
        (check_bwd, p, replace(portable, dq=Tile(128, 24, 4, 2)), "powers of two >= 16"),
        (check_bwd, replace(p, tma_do=False), portable, "TMA loads need 16-byte aligned q and do rows"),
        (check_bwd, replace(p, tma_kv=False), portable, "TMA loads need 16-byte aligned K/V rows"),
        (check_bwd, p, replace(portable, dq_mode=DQ_ORDERED), "by the dq kernel beside the portable"),
        (check_bwd, p, replace(portable, dq=None), "by the dq kernel beside the portable"),
        (check_bwd, interp, replace(portable_bwd_config(interp, T.INTERPRETER_DKDV, T.INTERPRETER_DQ),
                                    fast_tanh=True), "tanh.approx does not run under the interpreter"),
        (check_bwd, p, replace(portable, kernel="cutlass"), "unknown kernel 'cutlass'"),
        # split-KV
        (check_fwd, packed, split, "packed batches take the dense forward"),
        (check_fwd, p, replace(split, split=None), "no split given"),
        (check_fwd, p, replace(split, split=Split(0, 128)), "no split given"),
        (check_fwd, replace(p, tma_kv=False), split, "TMA loads need 16-byte aligned K/V rows"),
        (check_fwd, interp, replace(split_config(interp, num_splits=2), fast_tanh=True),
         "tanh.approx does not run under the interpreter"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(49))
def test_check_errors_name_the_reason(case):
    """check_fwd / check_bwd (what launch.forward / backward do with a config passed in) accept
    a config only where its kernels can run the call, else raise a ValueError naming the config
    and the reason (the backend's `can_implement`)."""
    cases = _check_error_cases()
    assert len(cases) == 49
    check, p, cfg, reason = cases[case]
    with pytest.raises(ValueError) as error:
        check(p, cfg)
    message = str(error.value)
    assert message.startswith(f"config: {cfg} cannot run this call: "), message
    assert reason in message, message


def test_check_accepts_the_chosen_configs():
    """Every config the chooser returns passes its own check (launch.forward / backward run
    them through check_* when passed in), as on an H100 and under the interpreter."""
    for target in (H100, NO_GLUON, INTERPRETER):
        for d, causal, nq, extra in ((128, True, 1024, {}), (64, False, 8192, {}),
                                     (64, True, 1, {}), (64, False, 300, dict(packed=True)),
                                     (128, True, 300, dict(window_size=(64, -1), softcap=5.0)),
                                     (32, False, 300, dict(dtype=torch.float32))):  # fmt: skip
            p = meta_problem(2, nq, 4096 if nq == 1 else nq, 8, 2, d, causal=causal,
                             target=target, **extra)  # fmt: skip
            assert check_fwd(p, choose_fwd(p)) == choose_fwd(p)
            assert check_bwd(p, choose_bwd(p)) == choose_bwd(p)


def test_chooser_takes_the_gluon_kernels_by_rule():
    """Where the Gluon kernels ship (choose.py, tables.py; H100 A/B), as on an H100: below
    FUSED_DQ_MIN_N rows the d128 dk/dv kernel with the dq kernel beside it, causal or not, with
    a window or softcap too (tanh.approx), not for a packed batch, nor d64 at these lengths or
    float32; the d64 forward from GLUON_FWD_MIN_N query rows on (causal: fewer) for a grid that
    fills the GPU."""
    for causal in (False, True):
        n = T.FUSED_DQ_MIN_N[128][causal] // 2
        assert n < T.FUSED_DQ_MIN_N[64][causal]
        cfg = choose_bwd(meta_problem(2, n, n, 8, 2, 128, causal=causal))
        assert cfg.kernel == BWD_GLUON and cfg.dq_mode == DQ_KERNEL
        assert cfg.dkdv == T.GLUON_DKDV_TILES[128][causal] and cfg.why
        for variant in (dict(window_size=(64, -1)), dict(softcap=30.0)):
            p = meta_problem(2, n, n, 8, 2, 128, causal=causal, **variant)
            bwd = choose_bwd(p)
            assert (choose_fwd(p).kernel, bwd.kernel) == (FWD_GLUON, BWD_GLUON)
            assert bwd.fast_tanh == bool(p.softcap) and bwd.dq_mode == DQ_KERNEL
        p = meta_problem(2, n, n, 8, 2, 128, causal=causal, packed=True)
        assert (choose_fwd(p).kernel, choose_bwd(p).kernel) == (FWD_TRITON, BWD_TRITON)
        assert choose_bwd(meta_problem(2, n, n, 8, 2, 64, causal=causal)).kernel == BWD_TRITON
        p = meta_problem(2, n, n, 8, 2, 128, torch.float32, causal=causal)
        assert choose_bwd(p).kernel == BWD_TRITON

    def fwd(bh, nq, causal, dtype=torch.bfloat16):
        return choose_fwd(meta_problem(1, nq, nq, bh, bh, 64, dtype, causal=causal)).kernel

    n = T.GLUON_FWD_MIN_N[64][True]
    assert fwd(256, n, True) == FWD_GLUON
    assert fwd(256, n // 2, True) == FWD_TRITON
    n = T.GLUON_FWD_MIN_N[64][False]
    assert fwd(64, n, False) == FWD_GLUON
    assert fwd(64, n // 2, False) == FWD_TRITON
    assert fwd(64, n, False, torch.float32) == FWD_TRITON
    assert T.GLUON_FWD_MIN_N[64][True] < T.GLUON_FWD_MIN_N[64][False]


def test_bwd_tile_heads():
    """The Gluon dk/dv kernel's tile groups (`choose.tile_heads`): the largest divisor of the
    (batch, kv head) count that keeps about one wave of programs (sms / key blocks) on a group;
    one group where persistent causal tiles stay key-block-major; negative (each group from its
    last key block down) for causal dq sums in a fixed order."""
    assert tile_heads(16, 128, 132, False, False, False) == 2  # 16k rows: 2 heads x 128
    assert tile_heads(128, 32, 132, False, False, False) == 4  # 4k: want 5, divides 128
    assert tile_heads(7, 32, 132, False, False, False) == 1  # a prime count
    assert tile_heads(3, 8, 132, False, False, False) == 3  # all heads fit one wave
    assert tile_heads(128, 32, 132, True, True, False) == 128  # persistent causal
    assert tile_heads(128, 32, 132, False, True, False) == 4  # persistent, not causal
    assert tile_heads(128, 32, 132, True, False, False) == 4  # causal, dq in any order
    assert tile_heads(128, 32, 132, True, False, True) == -4  # causal, dq in a fixed order
    assert tile_heads(128, 32, 132, False, False, True) == 4
    # The chooser's: bhk = 2 x 2 kv heads, 8 key blocks at 1024 rows.
    assert choose_bwd(meta_problem(2, 1024, 1024, 8, 2, 128, causal=True)).tile_heads == 4
    assert choose_bwd(meta_problem(2, 8192, 8192, 8, 2, 64, causal=True)).tile_heads == -2


def test_fused_dq_rule():
    """Half-precision backwards from FUSED_DQ_MIN_N query rows on sum dq in the Gluon kernel in
    a fixed order, with deterministic=False in any order from ANY_ORDER_DQ_MIN_N rows on (and
    below them as by default): d64 by a dq warpgroup (K/V in registers), d128 by the consumers
    in column halves. Shorter ones keep the portable kernels (d64) or the Gluon dk/dv kernel
    with the dq kernel beside it (d128, persistent). MHA here; GQA causal in the fixed order:
    test_gqa_causal_keeps_dq_kernel. As on an H100."""
    for deterministic, table, mode in ((True, T.FUSED_DQ_MIN_N, DQ_ORDERED),
                                       (False, T.ANY_ORDER_DQ_MIN_N, DQ_ANY_ORDER)):  # fmt: skip
        for d, causal in itertools.product((64, 128), (False, True)):
            opts = dict(causal=causal, deterministic=deterministic)
            n = table[d][causal]
            p = meta_problem(1, n, n, 2, 2, d, **opts)
            cfg = choose_bwd(p)
            assert cfg == gluon_bwd_config(p, T.FUSED_DQ_DKDV, mode)
            assert (cfg.kernel, cfg.dkdv, cfg.dq_mode, cfg.dq) == (BWD_GLUON, T.FUSED_DQ_DKDV,
                                                                   mode, None)  # fmt: skip
            assert (cfg.kv_regs, cfg.dq_halves) == (d == 64, d == 128)
            # (in the fixed order: from the counter, up to FUSED_PERSISTENT_MAX_N rows; None:
            # any length)
            most = T.FUSED_PERSISTENT_MAX_N[d][causal]
            walked = deterministic and (most is None or n <= most)
            assert cfg.persistent == cfg.dynamic == walked and f"from {n} query rows" in cfg.why
            assert ("one program per SM" in cfg.why) == walked
            by = "its consumers" if d == 128 else "a dq warpgroup"
            assert f"(by {by})" in cfg.why
            long = meta_problem(1, 1 << 20, 1 << 20, 2, 2, d, **opts)
            assert choose_bwd(long) == gluon_bwd_config(long, T.FUSED_DQ_DKDV, mode)
            assert choose_bwd(long).persistent == (walked and most is None)
            if walked and most is not None:  # the last row count walked, then one tile a program
                for rows, want in ((most, True), (most + 1, False)):
                    cfg = choose_bwd(meta_problem(1, rows, rows, 2, 2, d, **opts))
                    assert cfg.persistent == cfg.dynamic == want and cfg.dq_mode == mode
            below = meta_problem(1, n - 1, n - 1, 2, 2, d, **opts)
            shorter = choose_bwd(below)
            if not deterministic:  # below the any-order bound: the default's plan
                assert shorter == choose_bwd(replace(below, deterministic=True))
                assert shorter.dq_mode == DQ_ORDERED or n - 1 < T.FUSED_DQ_MIN_N[d][causal]
            elif d == 64:
                tables = T.CAUSAL_TILES[64][1:] if causal else (T.DKDV_TILES[64], T.DQ_TILES[64])
                assert shorter.kernel == BWD_TRITON and (shorter.dkdv, shorter.dq) == tables
            else:
                assert (shorter.kernel, shorter.dq_mode) == (BWD_GLUON, DQ_KERNEL)
                assert shorter.dkdv == T.GLUON_DKDV_TILES[128][causal] and shorter.persistent
            # The forward does not read `deterministic`.
            assert choose_fwd(p) == choose_fwd(replace(p, deterministic=not deterministic))
    for causal in (False, True):
        for d in (64, 128):  # (None: the walk at any length)
            most = T.FUSED_PERSISTENT_MAX_N[d][causal]
            assert most is None or T.FUSED_DQ_MIN_N[d][causal] <= most
        assert T.FUSED_DQ_MIN_N[128][causal] <= T.GLUON_BWD_PERSISTENT_MAX_N


def test_gqa_causal_keeps_dq_kernel():
    """d128 GQA causal in the fixed order (ORDERED_GQA_CAUSAL_DQ_KERNEL_D) keeps the dq kernel
    beside the Gluon dk/dv one at every length (persistent up to GLUON_BWD_PERSISTENT_MAX_N
    rows), and says why; in any order, non-causal, with a window's left edge, or MHA the
    consumers sum dq. As on an H100."""
    assert 128 in T.ORDERED_GQA_CAUSAL_DQ_KERNEL_D
    for n in (T.FUSED_DQ_MIN_N[128][1], T.ANY_ORDER_DQ_MIN_N[128][1], 8192, 1 << 20):
        gqa = meta_problem(1, n, n, 4, 1, 128, causal=True)
        cfg = choose_bwd(gqa)
        assert (cfg.kernel, cfg.dq_mode) == (BWD_GLUON, DQ_KERNEL)
        assert cfg.dkdv == T.GLUON_DKDV_TILES[128][1] and not cfg.dq_halves
        assert cfg.persistent == (n <= T.GLUON_BWD_PERSISTENT_MAX_N)
        assert "GQA causal" in cfg.why
        assert cfg == gluon_bwd_config(gqa, T.GLUON_DKDV_TILES[128][1], DQ_KERNEL)
        fused = {DQ_ORDERED: meta_problem(1, n, n, 4, 1, 128)}
        if n >= T.ANY_ORDER_DQ_MIN_N[128][1]:
            fused[DQ_ANY_ORDER] = meta_problem(1, n, n, 4, 1, 128, causal=True,
                                               deterministic=False)  # fmt: skip
        local = meta_problem(1, n, n, 4, 1, 128, causal=True, window_size=(256, 0))
        mha = meta_problem(1, n, n, 4, 4, 128, causal=True)
        for mode, p in [*fused.items(), (DQ_ORDERED, local), (DQ_ORDERED, mha)]:
            chosen = choose_bwd(p)
            assert (chosen.dq_mode, chosen.dq_halves) == (mode, True), (p, chosen)
    # below FUSED_DQ_MIN_N rows: the dq kernel as for MHA, without the GQA note
    n = T.FUSED_DQ_MIN_N[128][1] - 1
    assert "GQA" not in choose_bwd(meta_problem(1, n, n, 4, 1, 128, causal=True)).why


def test_fused_persistent_window_rule():
    """The fused-dq backward (d64: a dq warpgroup; d128: dq halves) walks its tiles with one
    program per SM where a window with both edges spans at most FUSED_PERSISTENT_MAX_WINDOW[d]
    keys, in either order, and says so; longer windows, a left edge alone and no window run
    one program per tile (rows beyond FUSED_PERSISTENT_MAX_N's d64 causal bound: the fixed
    order walks shorter rows from the counter whatever the window, and the rest at any length).
    As on an H100."""
    most, most128 = T.FUSED_PERSISTENT_MAX_WINDOW[64], T.FUSED_PERSISTENT_MAX_WINDOW[128]
    n = T.FUSED_PERSISTENT_MAX_N[64][True] + 256
    for det in (True, False):
        for left, right, causal, d, want in ((most - 1, -1, True, 64, True),
                                             (most - 65, 64, False, 64, True),
                                             (most, -1, True, 64, False),
                                             (256, -1, False, 64, False),
                                             (-1, -1, True, 64, False),
                                             (255, -1, True, 128, True),
                                             (most128 - 65, 64, False, 128, True),
                                             (most128, -1, True, 128, False),
                                             (256, -1, False, 128, False),
                                             (-1, -1, False, 128, False)):  # fmt: skip
            p = meta_problem(1, n, n, 4, 2, d, causal=causal, window_size=(left, right),
                             deterministic=det)  # fmt: skip
            cfg = choose_bwd(p)
            assert cfg.kernel == BWD_GLUON and cfg.dq_mode != DQ_KERNEL, (left, right, d, cfg)
            rows = det and T.FUSED_PERSISTENT_MAX_N[d][p.causal] is None  # (fixed order)
            assert cfg.persistent == (want or rows), (left, right, causal, d, det, cfg)
            assert cfg.dynamic == cfg.persistent  # (a fixed order's waits: tiles from a counter)
            assert ("one program per SM" in cfg.why) == cfg.persistent
            assert ("a window of at most" in cfg.why) == want
            assert check_bwd(p, cfg) == cfg


def test_deterministic_option_launches():
    """As on an H100: a d64 causal backward of ANY_ORDER_DQ_MIN_N rows runs the Gluon kernel
    summing dq in any order (DQ_MODE 1, K/V in registers) and no dq kernel with
    deterministic=False; by default the dq kernel below FUSED_DQ_MIN_N rows and from them the
    Gluon kernel summing dq in a fixed order (DQ_MODE 2, its tiles from a counter); with a
    sliding window too. Probed on meta tensors (nothing allocated or launched)."""

    def backward(n, window, deterministic):
        q = torch.empty(1, n, 2, 64, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, n, 1, 64, dtype=torch.bfloat16, device="meta")
        lse = torch.empty(1, 2, n, device="meta")
        w = fa_validation.window_for(window, True, n, n)
        probe = families.probe_backward(q, q, k, k, q, lse, None, True, 0.125, 0.0, w, None,
                                        deterministic, H100)  # fmt: skip
        gluon = [kw for kernel, _, _, kw in probe.launches
                 if kernel_name(kernel) == "attn_bwd_gluon_kernel"]  # fmt: skip
        return launch_names(probe), [(kw["DQ_MODE"], kw["KV_REGS"]) for kw in gluon]

    def backward128(n, deterministic):
        q = torch.empty(1, n, 2, 128, dtype=torch.bfloat16, device="meta")
        lse = torch.empty(1, 2, n, device="meta")
        probe = families.probe_backward(q, q, q, q, q, lse, None, True, 0.125, 0.0, (-1, 0),
                                        None, deterministic, H100)  # fmt: skip
        gluon = [kw for kernel, _, _, kw in probe.launches
                 if kernel_name(kernel) == "attn_bwd_gluon_kernel"]  # fmt: skip
        return launch_names(probe), [(kw["DQ_MODE"], kw["DQ_HALVES"]) for kw in gluon]

    n = T.ANY_ORDER_DQ_MIN_N[64][1]
    names, modes = backward(n, (-1, -1), False)
    assert "attn_bwd_dq_kernel" not in names and "attn_bwd_dq_convert_kernel" in names
    assert modes == [(1, True)] and "zero_counter_kernel" not in names  # (one program a tile)
    names, modes = backward(T.FUSED_DQ_MIN_N[64][1] - 1, (-1, -1), True)
    assert "attn_bwd_dq_kernel" in names and modes == []  # (d64 dk/dv: the portable kernel)
    names, modes = backward(T.FUSED_DQ_MIN_N[64][1], (-1, -1), True)
    assert "attn_bwd_dq_kernel" not in names and modes == [(2, True)]
    assert "zero_counter_kernel" in names  # (walked from the counter: FUSED_PERSISTENT_MAX_N)
    names, modes = backward(n, (100, 0), False)  # a window: the same kernels
    assert "attn_bwd_dq_kernel" not in names and modes == [(1, True)]
    # d128: the consumers sum dq in column halves from FUSED_DQ_MIN_N rows (ANY_ORDER_DQ_MIN_N
    # with deterministic=False)
    for deterministic, table in ((True, T.FUSED_DQ_MIN_N), (False, T.ANY_ORDER_DQ_MIN_N)):
        names, modes = backward128(table[128][1], deterministic)
        assert "attn_bwd_dq_kernel" not in names and "attn_bwd_dq_convert_kernel" in names
        assert modes == [(2 if deterministic else 1, True)]
    names, modes = backward128(T.FUSED_DQ_MIN_N[128][1] - 1, True)
    assert "attn_bwd_dq_kernel" in names and modes == [(0, False)]


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_option(causal, device):
    """The public option: deterministic=False gives the same gradients within rounding (on CPU
    and under the interpreter it runs the same kernels); a non-bool is an error naming it."""
    q, k, v = (t.requires_grad_() for t in qkv(2, 70, 90, 4, 2, 64, torch.float32, device))
    grads = []
    for deterministic in (True, False):
        o = flash_attn(q, k, v, causal=causal, deterministic=deterministic)
        grads.append(torch.autograd.grad(o.square().sum(), (q, k, v)))
    for a, b, name in zip(*grads, ("dq", "dk", "dv")):
        assert_close(b, a, bound=1e-5, name=name)
    with pytest.raises(ValueError, match="deterministic"):
        flash_attn(q, k, v, deterministic=1)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "any-order"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_fused_dq_by_rule(d, causal, deterministic, device):
    """The Gluon kernel summing dq (d64: a dq warpgroup, K/V in registers; d128: the consumers
    in column halves) where the chooser takes it: from FUSED_DQ_MIN_N / ANY_ORDER_DQ_MIN_N
    query rows on (probed at that length, as on an H100); that config (gluon_bwd_config) run at
    a test's size, below the rule, through the op's autograd path, with GQA, Nq != Nk and the
    LSE's gradient; deterministic: bitwise the same gradients on a second run."""
    table, mode = ((T.FUSED_DQ_MIN_N, DQ_ORDERED) if deterministic
                   else (T.ANY_ORDER_DQ_MIN_N, DQ_ANY_ORDER))  # fmt: skip
    n = table[d][causal]
    # (GQA causal in the fixed order keeps the dq kernel at ORDERED_GQA_CAUSAL_DQ_KERNEL_D: MHA)
    keeps = causal and deterministic and d in T.ORDERED_GQA_CAUSAL_DQ_KERNEL_D
    rule = meta_problem(2, n, n + 100, 8, 8 if keeps else 2, d, causal=causal,
                        deterministic=deterministic)  # fmt: skip
    assert choose_bwd(rule) == gluon_bwd_config(rule, T.FUSED_DQ_DKDV, mode)
    need_sm90(device)
    nq = T.FUSED_DQ_MIN_N[d][causal] - 112  # (below both rules)
    q, k, v = qkv(2, nq, nq + 100, 8, 2, d, torch.bfloat16, device)
    pb = problems(q, k, v, causal, deterministic=deterministic)[1]
    cfg = check_bwd(pb, gluon_bwd_config(pb, T.FUSED_DQ_DKDV, mode))
    assert (cfg.kv_regs, cfg.dq_halves) == (d == 64, d == 128) and cfg.dq is None
    assert choose_bwd(pb).dq_mode == DQ_KERNEL  # (at this length)
    _, _, grads = check_with_configs(q, k, v, causal, bwd=cfg, deterministic=deterministic)
    if deterministic:
        _, _, again = check_with_configs(q, k, v, causal, bwd=cfg, deterministic=deterministic)
        for g, h, name in zip(grads, again, ("dq", "dk", "dv")):
            assert torch.equal(g, h), name
