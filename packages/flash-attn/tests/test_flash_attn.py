"""flash-attn: outputs, LSE and gradients of dense calls against a float64 evaluation of the
reference: shapes, causal, dtypes, grouped heads, layouts, scales, rows that see no key,
gradient plumbing, other tile shapes, softcap and sliding windows (with the forward-config rules
they touch).

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter (the kernelkit pytest plugin switches it on before the kernels are imported), where
shapes stay small and the tiles are small too (tables.INTERPRETER_*), so that N = 17 or 40
already walks several blocks, the causal diagonal and the ragged sequence ends of every kernel.
Tests marked `gpu` use sizes only a GPU gets through quickly.

What runs is decided once per call by the chooser (choose.py: a `Problem` in, a `FwdConfig` /
`BwdConfig` out). Tests that want another choice pass a config of their own to
`launch.forward` / `launch.backward` (`dataclasses.replace` on the chosen one); tests that ask
what an H100 would run pass `target=H100` (config.py) to the chooser or the probes
(`families.probe_*`), from any machine.

The rest, by job: test_varlen.py (packed variable-length batches), test_split_kv.py (the split-KV
forward for decoding), test_gluon.py (the Gluon kernels, the config checks and the chooser's
rules for them), test_api.py (the course interface, registration, torch.compile, the CPU
fallback, errors), test_gpu_sizes.py (GPU-only sizes); the shared helpers are in fa_testing.py.
"""

import math
from dataclasses import replace

import pytest
import torch
from fa_testing import (
    NO_GLUON,
    check,
    finite,
    make,
    meta_problem,
    problems,
    qkv,
    run_fwd_bwd,
    table_fwd,
)

from kernelkit.flash_attn import flash_attn
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
)
from kernelkit.flash_attn.config import (
    BWD_GLUON,
    BWD_TRITON,
    DQ_KERNEL,
    FWD_GLUON,
    FWD_SPLIT,
    FWD_TRITON,
    H100,
    Target,
    Tile,
    use_tma,
)
from kernelkit.flash_attn.reference import attention_reference
from kernelkit.shared.testing import assert_close

# ------------------------------------------------------------------------------------------
# Shapes, causal, dtypes
# ------------------------------------------------------------------------------------------

# (B, Nq, Nk, H, Hkv, D)
SHAPES = [
    (1, 1, 1, 1, 1, 16),  # N = 1
    (2, 17, 17, 2, 2, 64),  # N = 17: ragged last block everywhere
    (1, 17, 40, 2, 2, 64),  # Nq < Nk
    (1, 40, 17, 2, 2, 64),  # Nq > Nk: causal rows that see no key
    (1, 1, 33, 1, 1, 32),  # one query row
    (1, 33, 1, 1, 1, 32),  # one key
    (1, 64, 64, 1, 1, 80),  # D = 80: padded to 128
    (1, 32, 48, 1, 1, 128),  # even blocks, D = 128
    (1, 17, 19, 1, 1, 256),  # D = 256
    (1, 300, 300, 1, 1, 16),  # N = 300
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}-hkv{}-d{}".format(*s))
def test_shapes(shape, causal, device):
    check(*qkv(*shape, torch.bfloat16, device), causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dtypes(dtype, causal, device):
    check(*qkv(2, 33, 47, 2, 1, 64, dtype, device), causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (6, 3)], ids=["gqa-4-2", "mqa-3-1", "gqa-6-3"])
def test_grouped_query_heads(heads, causal, device):
    h, hkv = heads
    check(*qkv(2, 33, 41, h, hkv, 32, torch.bfloat16, device), causal=causal)


def test_gqa_matches_repeated_kv_heads(device):
    """GQA equals plain attention over kv heads repeated per group (dk/dv summed per group)."""
    q, k, v = qkv(1, 21, 21, 4, 2, 32, torch.float32, device)
    o, _, (dq, dk, dv) = run_fwd_bwd(flash_attn, q, k, v, torch.ones_like(q), None, causal=True)
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    o_r, _, (dq_r, dk_r, dv_r) = run_fwd_bwd(
        flash_attn, q, kr, vr, torch.ones_like(q), None, causal=True
    )
    assert_close(o, o_r, name="o")
    assert_close(dq, dq_r, name="dq")
    assert_close(dk, dk_r.unflatten(2, (2, 2)).sum(3), name="dk")
    assert_close(dv, dv_r.unflatten(2, (2, 2)).sum(3), name="dv")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_three_dim_inputs(causal, device):
    q, k, v = (t.squeeze(2) for t in qkv(2, 37, 45, 1, 1, 48, torch.bfloat16, device))
    o, lse, _ = check(q, k, v, causal=causal)
    o4, lse4 = flash_attn(q[:, :, None], k[:, :, None], v[:, :, None], causal, return_lse=True)
    assert torch.equal(o, o4.squeeze(2)) and torch.equal(lse, lse4.squeeze(1))


# ------------------------------------------------------------------------------------------
# Layouts, scales, special rows, gradient plumbing
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout", ["packed-qkv", "bhnd-transposed", "strided-head-dim"], ids=lambda s: s
)
def test_strided_inputs(layout, device):
    b, n, h, d = 2, 29, 2, 32
    if layout == "packed-qkv":  # slices of one (B, N, 3, H, D) projection output
        packed = make((b, n, 3, h, d), torch.bfloat16, device, seed=3)
        q, k, v = packed.unbind(2)
    elif layout == "bhnd-transposed":  # (B, H, N, D) storage viewed as (B, N, H, D)
        q, k, v = (make((b, h, n, d), torch.bfloat16, device, s).transpose(1, 2) for s in (4, 5, 6))
    else:  # D not contiguous: copied by the op
        q, k, v = (make((b, n, d, h), torch.bfloat16, device, s).transpose(2, 3) for s in (4, 5, 6))
    assert not q.is_contiguous()
    check(q, k, v, causal=True)


@pytest.mark.parametrize("case", ["aligned", "head-dim-20", "q-offset-by-one"])
def test_tma_and_pointer_loads(case, device):
    """The loops read K/V (forward, dq) and Q/dO (dk/dv) through TMA descriptors when every row
    starts 16-byte aligned, else through pointer loads; either path, and a mix, is exact."""
    d = 20 if case == "head-dim-20" else 32
    q, k, v = qkv(1, 37, 41, 2, 1, d, torch.bfloat16, device)
    if case == "q-offset-by-one":  # q starts 2 bytes past an aligned address
        buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)
        q = buf[1:].view(q.shape).copy_(q)
    target = Target.of(q.device)
    assert use_tma(target, torch.empty(1, 8, dtype=q.dtype, device=device)) == target.tma
    assert use_tma(target, k, v) == (target.tma and case != "head-dim-20")
    assert use_tma(target, q) == (target.tma and case == "aligned")
    # What an H100 would do with these tensors: the same, as the rows decide.
    assert use_tma(H100, k, v) == (case != "head-dim-20")
    assert use_tma(H100, q) == (case == "aligned")
    pf = problems(q, k, v, causal=True)[0]
    assert (pf.tma_q, pf.tma_kv) == (use_tma(target, q), use_tma(target, k, v))
    check(q, k, v, causal=True)


@pytest.mark.parametrize("scale", [0.3, 0.0, -0.5])
def test_softmax_scale(scale, device):
    check(*qkv(1, 19, 23, 2, 2, 32, torch.float32, device), causal=True, softmax_scale=scale)


def test_rows_that_see_no_key(device):
    """Causal with Nq > Nk: the first Nq - Nk query rows see nothing -> zeros, LSE -inf, and
    gradients that are finite (zero dq on those rows)."""
    q, k, v = qkv(1, 45, 20, 2, 2, 32, torch.bfloat16, device)
    o, lse, (dq, dk, dv) = check(q, k, v, causal=True)
    assert (o[:, :25] == 0).all() and torch.isneginf(lse[:, :, :25]).all()
    assert torch.isfinite(lse[:, :, 25:]).all()
    assert (dq[:, :25] == 0).all()
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_gradient_of_output_only_and_lse_only(device):
    q, k, v = qkv(1, 23, 31, 2, 1, 32, torch.float32, device)
    check(q, k, v, causal=True, with_dlse=False)
    # Only the LSE feeds the loss: the output's gradient is None inside the backward.
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attn(*leaves, return_lse=True)[1].sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref, return_lse=True)[1].sum().backward()
    for a, r, name in zip(leaves[:2], ref[:2], ("dq", "dk")):
        assert_close(a.grad, r.grad, name=f"{name} of sum(lse)")
    assert (leaves[2].grad == 0).all()


def test_expanded_output_gradient(device):
    """o.sum().backward() hands the backward a stride-0 gradient."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 18, 18, 2, 2, 16, torch.float32, device))
    flash_attn(q, k, v, causal=True).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref, causal=True).sum().backward()
    for a, r, name in zip((q, k, v), ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=name)


def test_gradient_broadcast_over_the_sequence(device):
    """A gradient with stride 0 along N (e.g. from o.mean(1)) and a unit last stride reaches the
    kernels uncopied; its rows overlap, so it must not reach a TMA descriptor: the kernels that
    read it take pointer loads. d = 128 bf16 uses TMA tiles (on Hopper and here)."""
    q, k, v = qkv(1, 40, 40, 2, 2, 128, torch.bfloat16, device)
    do = make((1, 1, 2, 128), torch.bfloat16, device, seed=3).expand(q.shape)
    assert do.stride(1) == 0 and not use_tma(H100, do) and not use_tma(Target.of(device), do)
    p = fa_launch.backward_problem(do, q, k, v, True, target=H100)
    assert p.tma_q and p.tma_kv and not p.tma_do
    assert not choose_bwd(p).dkdv_tma  # (on an H100 too: the portable dk/dv kernel, pointers)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        check_bwd(p, gluon_bwd_config(p, T.GLUON_DKDV_TILES[128][1], DQ_KERNEL))
    grads = run_fwd_bwd(flash_attn, q, k, v, do, None, causal=True)[2]
    grads64 = run_fwd_bwd(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=True
    )[2]
    grads_l = run_fwd_bwd(attention_reference, q, k, v, do, None, causal=True)[2]
    for g, g64, gl, name in zip(grads, grads64, grads_l, ("dq", "dk", "dv")):
        assert_close(g, g64, ref_lowp=gl, name=name)


def test_no_grad_forward(device):
    q, k, v = qkv(1, 20, 20, 1, 1, 32, torch.bfloat16, device)
    with torch.no_grad():
        o = flash_attn(q.requires_grad_(), k, v)
    assert o.grad_fn is None
    assert_close(o, attention_reference(q.double(), k.double(), v.double()), name="o")


# (forward, dk/dv, dq) tiles; TMA loads where a tile asks for them (and the rows allow them).
OTHER_TILES = [
    tuple(Tile(*t, tma=True) for t in ((16, 32, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1))),
    (Tile(32, 32, 4, 1, tma=False),) * 3,
    tuple(Tile(*t, tma=False) for t in ((32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1))),
]


@pytest.mark.parametrize(
    "tiles",
    OTHER_TILES,
    ids=["kv-tiles-wider-tma", "square-tiles-pointer", "interpreter-tiles-pointer"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_other_tile_shapes(tiles, causal, device):
    """The block bookkeeping (diagonal ranges, ragged ends) for other tile aspect ratios, with
    TMA and with pointer loads: configs with these tiles through launch.forward / backward."""
    q, k, v = qkv(1, 45, 37, 2, 1, 32, torch.float32, device)
    do = make(q.shape, q.dtype, device, seed=9)
    scale = 1 / math.sqrt(32)
    pf, pb = problems(q, k, v, causal)
    fwd, bwd = portable_fwd_config(pf, tiles[0]), portable_bwd_config(pb, *tiles[1:])
    assert fwd.tma == bwd.dkdv_tma == bwd.dq_tma == (tiles[0].tma and Target.of(device).tma)
    o, lse = fa_launch.forward(q, k, v, causal, scale, config=fwd)
    grads = fa_launch.backward(do, q, k, v, o, lse, None, causal, scale, config=bwd)
    o64, lse64, grads64 = run_fwd_bwd(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    assert_close(o, o64, name="o")
    assert_close(finite(lse), finite(lse64), name="lse")
    for g, g64, name in zip(grads, grads64, ("dq", "dk", "dv")):
        assert_close(g, g64, name=name)


def test_deterministic(device):
    """Same inputs, bit-identical outputs and gradients (no atomics anywhere)."""
    q, k, v = qkv(2, 70, 70, 4, 2, 32, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=5)
    first = run_fwd_bwd(flash_attn, q, k, v, do, None, causal=True)
    second = run_fwd_bwd(flash_attn, q, k, v, do, None, causal=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# Softcap (Gemma 2): scores -> softcap * tanh(scores / softcap) before the softmax
# ------------------------------------------------------------------------------------------

# (softcap, causal, dtype, shape): q is scaled by 3 so that small caps saturate (tanh ~ +-1).
SOFTCAP_CASES = [
    (0.5, True, torch.bfloat16, (1, 37, 41, 2, 1, 32)),
    (5.0, False, torch.float32, (1, 37, 41, 2, 1, 32)),
    (30.0, True, torch.float16, (2, 21, 21, 2, 2, 64)),
    (2.0, True, torch.bfloat16, (2, 1, 100, 4, 1, 32)),  # decoding: the split-KV forward
    # d = 128 half precision: the Gluon forward on an sm_90 GPU (causal and not, GQA, Nq != Nk)
    (4.0, True, torch.bfloat16, (2, 200, 260, 4, 2, 128)),
    (50.0, False, torch.float16, (1, 130, 150, 2, 1, 128)),
]


@pytest.mark.parametrize(
    "case", SOFTCAP_CASES, ids=lambda c: f"cap{c[0]}-causal{int(c[1])}-{c[2]}-q{c[3][1]}"
)
def test_softcap(case, device):
    softcap, causal, dtype, shape = case
    q, k, v = qkv(*shape, dtype, device)
    check((q.double() * 3).to(dtype), k, v, causal=causal, softcap=softcap)


def test_softcap_changes_the_scores(device):
    """The cap is applied (a capped run differs from the uncapped reference by far more than the
    tolerance), and softcap=0 is the uncapped kernel bit for bit."""
    q, k, v = qkv(1, 19, 23, 2, 2, 32, torch.float32, device)
    q = q * 3
    o_cap = flash_attn(q, k, v, causal=True, softcap=1.0)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
    assert (o_cap.double() - ref).norm() > 0.1 * ref.norm()
    assert torch.equal(flash_attn(q, k, v, causal=True, softcap=0.0), flash_attn(q, k, v, True))


@pytest.mark.parametrize("softcap", [5.0, 50.0], ids=["cap5", "cap50"])
def test_softcap_saturated_rows(softcap, device):
    """Rows whose capped scores all sit at the cap's two ends: +cap (weights 1 under the fixed
    shift) and -cap (the smallest weights it makes, 2^-100 at softcap 50: `config.fixed_row_shift`
    lowers the shift there), each a uniform average of v, with v small (|v| ~ 1e-3, products
    near 2^-110). bf16 takes the fixed shift (`FwdConfig.fixed_shift`), at d = 128 the Gluon
    forward on an sm_90 GPU; every output finite and within FlashAttention's rule."""
    q, k, v = qkv(1, 130, 150, 2, 1, 128, torch.bfloat16, device)
    u = torch.nn.functional.normalize(torch.randn(128, device=device), dim=0)
    k = (k.float() * 0.01 + u * 4).to(k.dtype)  # every key near u
    q = q.float()
    q[:, :40] = u * 400  # scores ~ +1600 * scale: tanh = +1
    q[:, 40:80] = -u * 400  # ~ -1600 * scale: tanh = -1
    q = q.to(torch.bfloat16)
    v = (v.float() * 1e-3).to(v.dtype)
    p = fa_launch.forward_problem(q, k, v, True, softcap)
    assert choose_fwd(p).fixed_shift
    o, _, _ = check(q, k, v, causal=True, softcap=softcap)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("softcap", [0.0, 5.0, 55.0, 56.0])
def test_softcap_fixed_shift_where_it_fits(dtype, softcap):
    """The forward shifts capped scores by a fixed value (no row maxima) only where the weights
    stay in float32's range (`config.fixed_shift_unfit`): bf16 and float32 up to a cap of 55.4,
    never float16 (P in float16 spans too few powers of two); a config asking for it elsewhere
    is refused, naming fixed_shift. The Gluon forward (as on an H100) and the portable one."""
    q, k, v = qkv(1, 300, 300, 2, 2, 128, dtype, "cpu")
    for target in (H100, Target.of(q.device)):
        p = fa_launch.forward_problem(q, k, v, True, softcap, target=target)
        cfg = choose_fwd(p)
        fits = softcap > 0 and dtype != torch.float16 and softcap <= 55.4
        assert cfg.fixed_shift == fits
        if not fits:
            with pytest.raises(ValueError, match="cannot run this call: fixed_shift"):
                check_fwd(p, replace(cfg, fixed_shift=True))


# ------------------------------------------------------------------------------------------
# Sliding windows: query i sees keys i + Nk - Nq - left ..= i + Nk - Nq + right
# ------------------------------------------------------------------------------------------

# (shape, window_size, causal, dtype). The interpreter's tiles are 32 x 16 (forward, dq) and
# 16 x 32 (dk/dv): these windows cut blocks on one or both sides, are narrower than a block, or
# leave rows that see no key (Nq > Nk with a right bound).
WINDOW_CASES = [
    ((1, 70, 60, 2, 1, 16), (5, 3), False, torch.bfloat16),
    ((2, 45, 45, 2, 2, 32), (0, 0), False, torch.float32),  # the diagonal only
    ((1, 50, 80, 2, 1, 16), (7, -1), False, torch.float16),  # left edge only
    ((1, 80, 50, 4, 2, 16), (-1, 9), False, torch.bfloat16),  # right edge only, empty rows
    ((1, 70, 70, 2, 1, 16), (20, -1), True, torch.bfloat16),  # window with causal
    ((1, 40, 90, 2, 2, 16), (3, 11), False, torch.float32),
    ((2, 1, 100, 4, 1, 32), (10, -1), True, torch.bfloat16),  # decoding: split-KV forward
    ((1, 3, 77, 4, 2, 32), (20, 5), False, torch.float32),  # split-KV, both edges
]


@pytest.mark.parametrize(
    "case",
    WINDOW_CASES,
    ids=lambda c: "q{}-k{}-w{}_{}-causal{}".format(c[0][1], c[0][2], *c[1], c[2]),
)
def test_window(case, device):
    shape, window, causal, dtype = case
    check(*qkv(*shape, dtype, device), causal=causal, window_size=window)


def test_window_with_softcap(device):
    q, k, v = qkv(1, 37, 53, 2, 1, 32, torch.bfloat16, device)
    check((q.double() * 3).to(dtype=q.dtype), k, v, window_size=(9, 4), softcap=1.5)


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["keys-left-of-every-window", "queries-that-see-no-key"])
def test_window_skips_blocks_outside(case, half, device):
    """Blocks outside every window are never loaded: NaN in them (keys left of every query's
    window; queries whose window holds no key) must not reach any output, and dk/dv of keys
    no query sees are zeros. P is a multiple of every tile size in use. bf16 at d = 128 takes the
    Gluon kernels on an sm_90 GPU (elsewhere the portable ones, as float32 does)."""
    p = 160 if device.type == "cpu" else 1024
    if case == "keys-left-of-every-window":  # keys < P + 14 are seen by no query
        nq, nk, causal, window, poison = 16, p + 40, True, (10, 0), ("k", "v")
    else:  # queries < P + 21 see no key
        nq, nk, causal, window, poison = p + 40, 16, False, (-1, 3), ("q", "do")
    dtype, d = (torch.bfloat16, 128) if half else (torch.float32, 16)
    clean = dict(zip("qkv", qkv(1, nq, nk, 2, 1, d, dtype, device)))
    clean["do"] = make(clean["q"].shape, dtype, device, seed=9)
    bad = {name: t.clone() for name, t in clean.items()}
    for name in poison:
        bad[name][:, :p] = math.nan
    scale, window_arg = 0.25, fa_validation.window_for(window, causal, nq, nk)
    pf, pb = problems(bad["q"], bad["k"], bad["v"], causal, window_size=window)
    fwd, bwd = table_fwd(pf), choose_bwd(pb)  # the dense forward (not split-KV), its table tile
    if half and pf.target.gluon:
        fwd = gluon_fwd_config(pf)
        assert bwd.kernel == BWD_GLUON
    o, lse = fa_launch.forward(bad["q"], bad["k"], bad["v"], causal, scale, window=window_arg,
                               config=fwd)  # fmt: skip
    grads = fa_launch.backward(bad["do"], bad["q"], bad["k"], bad["v"], o, lse, None, causal,
                               scale, window=window_arg, config=bwd)  # fmt: skip
    ref64 = {name: t.double() for name, t in clean.items()}
    o64, lse64, grads64 = run_fwd_bwd(attention_reference, ref64["q"], ref64["k"], ref64["v"],
                               ref64["do"], None, causal=causal, softmax_scale=scale,
                               window_size=window)  # fmt: skip
    assert_close(o, o64, name="o")
    assert_close(finite(lse), finite(lse64), name="lse")
    for g, g64, name in zip(grads, grads64, ("dq", "dk", "dv")):
        assert_close(g, g64, name=name)
    # The automatic forward (split-KV for the 16 decoding rows) skips them too.
    o_auto = flash_attn(bad["q"], bad["k"], bad["v"], causal, scale, window_size=window)
    assert_close(o_auto, o64, name="o (automatic forward)")


def test_masked_forward_config():
    """Windows with a left edge and packed batches read K/V through TMA in the portable
    forward at d >= 128 (their pointer tile spills; NOTES.md): packed batches as on an H100,
    windows where the Gluon forward cannot run (a GPU with TMA but not sm_90); on an H100 a
    window takes the Gluon forward like a dense call."""
    for masked, target in ((dict(window_size=(256, -1)), NO_GLUON), (dict(packed=True), H100)):
        p = meta_problem(2, 1024, 1024, 8, 2, 128, causal=True, target=target, **masked)
        cfg = choose_fwd(p)
        assert cfg.kernel == FWD_TRITON and replace(cfg.tile, tma=False) == T.FWD_TILES[128]
        assert cfg.tma
        assert "Gluon" not in cfg.why or "cannot run" in cfg.why
        cfg = choose_fwd(meta_problem(2, 1024, 1024, 8, 2, 64, target=target, **masked))
        assert cfg.kernel == FWD_TRITON and not cfg.tma
    for window in ((-1, -1), (256, -1)):
        cfg = choose_fwd(meta_problem(2, 1024, 1024, 8, 2, 128, causal=True, window_size=window))
        assert cfg.kernel == FWD_GLUON and cfg.tile == T.GLUON_FWD_TILE


def test_small_grid_forward_config():
    """d = 64 half-precision forwards take the 64-row tile where the table's 128-row tile would
    launch fewer than 2 waves of programs (8 when causal; a causal Gluon tile only under one
    wave); other head dims, float32 and large grids keep the table's tile. As on an H100
    (132 SMs); bh (sequence, head) pairs of nq query rows."""
    small = T.SMALL_GRID_FWD[64][0]
    table = T.FWD_TILES[64]
    assert H100.sms == 132

    def fwd(d, causal, bh, nq, dtype=torch.bfloat16):
        cfg = choose_fwd(meta_problem(1, nq, nq, bh, bh, d, dtype, causal))
        assert (cfg.kernel == FWD_GLUON) == (cfg.tile == T.GLUON_FWD_TILE), cfg
        assert cfg.kernel != FWD_SPLIT and cfg.why, cfg
        return cfg.tile

    assert fwd(64, False, 1, 16384) == small  # 128 programs: 0.97 waves
    assert fwd(64, False, 2, 16384) == small  # 256: 1.94
    assert fwd(64, False, 12, 4096) == table  # 384: 2.9
    # From GLUON_FWD_MIN_N query rows on (non-causal, causal), a grid that is not small takes
    # the Gluon tile.
    assert fwd(64, False, 3, 16384) == T.GLUON_FWD_TILE
    assert fwd(64, True, 18, 8192) == T.GLUON_FWD_TILE
    # A causal Gluon tile that fills a wave stays (the persistent kernel balances its tiles).
    assert fwd(64, True, 8, 16384) == T.GLUON_FWD_TILE  # 1024: 7.8
    assert fwd(64, True, 1, 16384) == small  # 128 Gluon tiles: under a wave
    assert fwd(64, True, 1, 4096) == small  # 32 Gluon tiles
    assert fwd(64, True, 36, 4096) == T.GLUON_FWD_TILE  # 1152: 8.7
    assert fwd(64, True, 256, 1024) == table  # 2048: 15.5, below GLUON_FWD_MIN_N (causal)
    assert fwd(64, True, 9, 16384) == T.GLUON_FWD_TILE
    assert fwd(64, True, 1, 16384, torch.float32) == T.FP32_TILES[64][0]
    assert fwd(128, False, 1, 1024) == T.GLUON_FWD_TILE
    assert choose_fwd(meta_problem(1, 16384, 16384, 1, 1, 64)).why.startswith("a 64-row tile")
    # The rule only changes the forward's tile (below FUSED_DQ_MIN_N rows: the portable
    # backward's table tiles).
    n = T.FUSED_DQ_MIN_N[64][True] - 1
    assert fwd(64, True, 1, n) == small
    cfg = choose_bwd(meta_problem(1, n, n, 1, 1, 64, causal=True))
    assert cfg.kernel == BWD_TRITON and (cfg.dkdv, cfg.dq) == T.CAUSAL_TILES[64][1:]


def test_window_size_normalisation():
    """Bounds no row can reach are dropped (plain kernels); causal is right = 0."""
    assert fa_validation.window_for((-1, -1), False, 10, 20) == (-1, -1)
    assert fa_validation.window_for((19, 9), False, 10, 20) == (-1, -1)
    assert fa_validation.window_for((18, 8), False, 10, 20) == (18, 8)
    assert fa_validation.window_for((5, -1), True, 10, 20) == (5, 0)
    assert fa_validation.window_for([3, 0], True, 1, 20) == (3, 0)  # causal stays causal
