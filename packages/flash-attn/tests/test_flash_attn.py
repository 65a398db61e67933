"""flash-attn: outputs, LSE and gradients against a float64 evaluation of the reference.

Runs the real Triton kernels: on the GPU when there is one, otherwise under the Triton
interpreter (the kernelkit pytest plugin switches it on before the kernels are imported), where
shapes stay small and the tiles are small too (plans.INTERPRETER_*), so that N = 17 or 40 already
walks several blocks, the causal diagonal and the ragged sequence ends of every kernel.
Tests marked `gpu` use sizes only a GPU gets through quickly.
"""

import functools
import math
from dataclasses import replace

import pytest
import torch

from kernelkit.flash_attn import FlashAttentionFunction, flash_attn, flash_attn_varlen
from kernelkit.flash_attn import launchers as fa_launchers
from kernelkit.flash_attn import op as fa_op
from kernelkit.flash_attn import plans as fa_plans
from kernelkit.flash_attn import validation as fa_validation
from kernelkit.flash_attn.reference import (
    attention_reference,
    attention_reference_grads,
    attention_varlen_reference,
    attention_varlen_reference_grads,
)
from kernelkit.shared import replay, runtime
from kernelkit.shared.runtime import interpreting
from kernelkit.shared.testing import assert_close, assert_graph_replays, run_without_interpreter

HALF = (torch.float16, torch.bfloat16)


def _as_on_gpu(monkeypatch):
    """Plans and launches as on a GPU: the tile tables and rules, not the interpreter's."""
    for module in (fa_plans, fa_launchers):
        monkeypatch.setattr(module, "interpreting", lambda: False)


def make(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def qkv(b, nq, nk, h, hkv, d, dtype, device, seed=0):
    return (
        make((b, nq, h, d), dtype, device, seed),
        make((b, nk, hkv, d), dtype, device, seed + 1),
        make((b, nk, hkv, d), dtype, device, seed + 2),
    )


def _finite(t):
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _run(fn, q, k, v, do, dlse, **kw):
    """Forward and backward of fn on leaves aliasing q, k, v (strides kept, unlike a clone):
    (o, lse, (dq, dk, dv))."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*leaves, return_lse=True, **kw)
    outs, grads = [o], [do.to(o.dtype)]
    if dlse is not None:  # the LSE is differentiable too; empty rows (-inf) are left out
        outs.append(_finite(lse))
        grads.append(dlse.to(lse.dtype))
    dq, dk, dv = torch.autograd.grad(outs, leaves, grads)
    return o, lse, (dq, dk, dv)


def check(q, k, v, causal=False, softmax_scale=None, with_dlse=True, **options):
    """flash_attn vs the float64 reference (and, for half precision, the reference evaluated in
    q.dtype: the error may be at most 2x that one's): o, LSE, dq, dk, dv. options: softcap,
    window_size."""
    lse_shape = (q.shape[0], q.shape[1]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    kw = dict(causal=causal, softmax_scale=softmax_scale, **options)
    return _check(flash_attn, attention_reference, q, k, v, lse_shape, with_dlse, **kw)


def _check(fn, reference, q, k, v, lse_shape, with_dlse, **kw):
    do = make(q.shape[:-1] + (v.shape[-1],), q.dtype, q.device, seed=7)
    dlse = make(lse_shape, torch.float32, q.device, seed=8) if with_dlse else None
    o, lse, grads = _run(fn, q, k, v, do, dlse, **kw)
    o64, lse64, grads64 = _run(reference, q.double(), k.double(), v.double(), do, dlse, **kw)
    lowp = q.dtype in HALF
    if lowp:
        o_l, _, grads_l = _run(reference, q, k, v, do, dlse, **kw)
    assert o.dtype == q.dtype and o.shape == q.shape[:-1] + (v.shape[-1],)
    assert lse.dtype == torch.float32 and lse.shape == lse_shape
    assert_close(o, o64, ref_lowp=o_l if lowp else None, name="o")
    # Rows that see no key: LSE -inf exactly where the reference has it, output zeros.
    empty = torch.isneginf(lse64.cpu())
    assert torch.equal(torch.isneginf(lse.cpu()), empty), "LSE -inf rows differ"
    assert not torch.isnan(lse).any()
    assert_close(_finite(lse), _finite(lse64), bound=2e-5, name="lse")
    for g, g64, name, i in zip(grads, grads64, ("dq", "dk", "dv"), range(3)):
        assert g.dtype == q.dtype and g.shape == (q, k, v)[i].shape
        assert_close(g, g64, ref_lowp=grads_l[i] if lowp else None, name=name)
    return o, lse, grads


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
    o, _, (dq, dk, dv) = _run(flash_attn, q, k, v, torch.ones_like(q), None, causal=True)
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    o_r, _, (dq_r, dk_r, dv_r) = _run(flash_attn, q, kr, vr, torch.ones_like(q), None, causal=True)
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
    tma = fa_plans.use_tma(torch.empty(1, 8, dtype=q.dtype, device=device))  # this device has TMA
    assert fa_plans.use_tma(k, v) == (tma and case != "head-dim-20")
    assert fa_plans.use_tma(q) == (tma and case == "aligned")
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
    assert do.stride(1) == 0 and not fa_plans.use_tma(do)
    grads = _run(flash_attn, q, k, v, do, None, causal=True)[2]
    grads64 = _run(attention_reference, q.double(), k.double(), v.double(), do, None, causal=True)[
        2
    ]
    grads_l = _run(attention_reference, q, k, v, do, None, causal=True)[2]
    for g, g64, gl, name in zip(grads, grads64, grads_l, ("dq", "dk", "dv")):
        assert_close(g, g64, ref_lowp=gl, name=name)


def test_no_grad_forward(device):
    q, k, v = qkv(1, 20, 20, 1, 1, 32, torch.bfloat16, device)
    with torch.no_grad():
        o = flash_attn(q.requires_grad_(), k, v)
    assert o.grad_fn is None
    assert_close(o, attention_reference(q.double(), k.double(), v.double()), name="o")


@pytest.mark.parametrize(
    "plan",
    [
        fa_plans.Plan(
            *(fa_plans.Tile(*t, tma=True) for t in ((16, 32, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)))
        ),
        fa_plans.Plan(*(fa_plans.Tile(32, 32, 4, 1, tma=False),) * 3),
        fa_plans.Plan(
            *(
                fa_plans.Tile(*t, tma=False)
                for t in ((32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1))
            )
        ),
    ],
    ids=["kv-tiles-wider-tma", "square-tiles-pointer", "interpreter-tiles-pointer"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_other_tile_shapes(plan, causal, device):
    """The block bookkeeping (diagonal ranges, ragged ends) for other tile aspect ratios, with
    TMA and with pointer loads."""
    q, k, v = qkv(1, 45, 37, 2, 1, 32, torch.float32, device)
    do = make(q.shape, q.dtype, device, seed=9)
    scale = 1 / math.sqrt(32)
    o, lse = fa_launchers.forward(q, k, v, causal, scale, plan)
    grads = fa_launchers.backward(do, q, k, v, o, lse, None, causal, scale, plan)
    o64, lse64, grads64 = _run(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    assert_close(o, o64, name="o")
    assert_close(_finite(lse), _finite(lse64), name="lse")
    for g, g64, name in zip(grads, grads64, ("dq", "dk", "dv")):
        assert_close(g, g64, name=name)


def test_deterministic(device):
    """Same inputs, bit-identical outputs and gradients (no atomics anywhere)."""
    q, k, v = qkv(2, 70, 70, 4, 2, 32, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=5)
    first = _run(flash_attn, q, k, v, do, None, causal=True)
    second = _run(flash_attn, q, k, v, do, None, causal=True)
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


@pytest.mark.parametrize("case", ["keys-left-of-every-window", "queries-that-see-no-key"])
def test_window_skips_blocks_outside(case, device):
    """Blocks outside every window are never loaded: NaN in them (keys left of every query's
    window; queries whose window holds no key) must not reach any output, and dk/dv of keys
    no query sees are zeros. P is a multiple of every tile size in use."""
    p = 160 if device.type == "cpu" else 1024
    if case == "keys-left-of-every-window":  # keys < P + 14 are seen by no query
        nq, nk, causal, window, poison = 16, p + 40, True, (10, 0), ("k", "v")
    else:  # queries < P + 21 see no key
        nq, nk, causal, window, poison = p + 40, 16, False, (-1, 3), ("q", "do")
    clean = dict(zip("qkv", qkv(1, nq, nk, 2, 1, 16, torch.float32, device)))
    clean["do"] = make(clean["q"].shape, torch.float32, device, seed=9)
    bad = {name: t.clone() for name, t in clean.items()}
    for name in poison:
        bad[name][:, :p] = math.nan
    scale, window_arg = 0.25, fa_validation.window_for(window, causal, nq, nk)
    plan = fa_plans.plan_for(16, True, torch.float32)
    o, lse = fa_launchers.forward(
        bad["q"], bad["k"], bad["v"], causal, scale, plan, window=window_arg
    )
    grads = fa_launchers.backward(bad["do"], bad["q"], bad["k"], bad["v"], o, lse, None, causal, scale,
                           plan, window=window_arg)  # fmt: skip
    ref64 = {name: t.double() for name, t in clean.items()}
    o64, lse64, grads64 = _run(attention_reference, ref64["q"], ref64["k"], ref64["v"],
                               ref64["do"], None, causal=causal, softmax_scale=scale,
                               window_size=window)  # fmt: skip
    assert_close(o, o64, name="o")
    assert_close(_finite(lse), _finite(lse64), name="lse")
    for g, g64, name in zip(grads, grads64, ("dq", "dk", "dv")):
        assert_close(g, g64, name=name)
    # The automatic forward (split-KV for the 16 decoding rows) skips them too.
    o_auto = flash_attn(bad["q"], bad["k"], bad["v"], causal, scale, window_size=window)
    assert_close(o_auto, o64, name="o (automatic forward)")


def test_masked_forward_plan(monkeypatch):
    """Windows with a left edge and packed batches read K/V through TMA in the forward at
    d >= 128 (their pointer tile spills; NOTES.md)."""
    _as_on_gpu(monkeypatch)
    assert fa_plans.plan_for(128, True, torch.bfloat16, masked_fwd=True).fwd.tma
    assert fa_plans.plan_for(128, True, torch.bfloat16).fwd == fa_plans.GLUON_CAUSAL_FWD_TILES[128]
    assert not fa_plans.plan_for(64, False, torch.bfloat16, masked_fwd=True).fwd.tma


def test_small_grid_forward_plan(monkeypatch):
    """d = 64 half-precision forwards take the 64-row tile where the table's 128-row tile would
    launch fewer than 2 waves of programs (8 when causal; a causal Gluon tile only under one
    wave); other head dims, float32 and large grids keep the table's tile."""
    _as_on_gpu(monkeypatch)
    small = fa_plans.SMALL_GRID_FWD[64][0]
    table = fa_plans.FWD_TILES[64]
    sms = 132

    def fwd(d, causal, bh, nq, dtype=torch.bfloat16):
        return fa_plans.plan_for(d, causal, dtype, grid=(bh, nq, sms)).fwd

    assert fwd(64, False, 1, 16384) == small  # 128 programs: 0.97 waves
    assert fwd(64, False, 2, 16384) == small  # 256: 1.94
    assert fwd(64, False, 12, 4096) == table  # 384: 2.9
    # From GLUON_FWD_MIN_N / GLUON_CAUSAL_FWD_MIN_N query rows on, a grid that is not small takes
    # the Gluon tile.
    assert fwd(64, False, 3, 16384) == fa_plans.GLUON_FWD_TILES[128]
    assert fwd(64, True, 18, 8192) == fa_plans.GLUON_CAUSAL_FWD_TILES[128]
    # A causal Gluon tile that fills a wave stays (the persistent kernel balances its tiles).
    assert fwd(64, True, 8, 16384) == fa_plans.GLUON_CAUSAL_FWD_TILES[128]  # 1024: 7.8
    assert fwd(64, True, 1, 16384) == small  # 128 Gluon tiles: under a wave
    assert fwd(64, True, 1, 4096) == small  # 32 Gluon tiles
    assert fwd(64, True, 36, 4096) == fa_plans.GLUON_CAUSAL_FWD_TILES[128]  # 1152: 8.7
    assert fwd(64, True, 256, 1024) == table  # 2048: 15.5, below GLUON_CAUSAL_FWD_MIN_N
    assert fwd(64, True, 9, 16384) == fa_plans.GLUON_CAUSAL_FWD_TILES[128]
    assert fwd(64, True, 1, 16384, torch.float32) == fa_plans.FP32_TILES[64][0]
    assert fwd(128, False, 1, 1024) == fa_plans.plan_for(128, False, torch.bfloat16).fwd
    # The rule only changes the forward's tile.
    plan = fa_plans.plan_for(64, True, torch.bfloat16, grid=(1, 1024, sms))
    assert (plan.dkdv, plan.dq) == fa_plans.CAUSAL_TILES[64][1:]


def test_window_size_normalisation():
    """Bounds no row can reach are dropped (plain kernels); causal is right = 0."""
    assert fa_validation.window_for((-1, -1), False, 10, 20) == (-1, -1)
    assert fa_validation.window_for((19, 9), False, 10, 20) == (-1, -1)
    assert fa_validation.window_for((18, 8), False, 10, 20) == (18, 8)
    assert fa_validation.window_for((5, -1), True, 10, 20) == (5, 0)
    assert fa_validation.window_for([3, 0], True, 1, 20) == (3, 0)  # causal stays causal


# ------------------------------------------------------------------------------------------
# Packed variable-length batches (flash_attn_varlen)
# ------------------------------------------------------------------------------------------


def cu_seqlens(lengths, device):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def packed(lens_q, lens_k, h, hkv, d, dtype, device, seed=0):
    """q (total_q, H, D), k/v (total_k, Hkv, D) and flash_attn_varlen's cu_seqlens/max_seqlen
    keyword arguments."""
    q = make((sum(lens_q), h, d), dtype, device, seed)
    k = make((sum(lens_k), hkv, d), dtype, device, seed + 1)
    v = make((sum(lens_k), hkv, d), dtype, device, seed + 2)
    kw = dict(cu_seqlens_q=cu_seqlens(lens_q, device), cu_seqlens_k=cu_seqlens(lens_k, device),
              max_seqlen_q=max(1, *lens_q), max_seqlen_k=max(1, *lens_k))  # fmt: skip
    return q, k, v, kw


def random_lengths(n, longest, seed):
    """n lengths in 0..longest, with a 0 and a 1 among them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest + 1, (n,), generator=g).tolist()
    lengths[seed % n], lengths[(seed + 2) % n] = 0, 1
    return lengths


def check_varlen(q, k, v, with_dlse=True, **kw):
    """flash_attn_varlen against the loop over sequences of the dense reference."""
    lse_shape = (q.shape[1], q.shape[0])
    return _check(flash_attn_varlen, attention_varlen_reference, q, k, v, lse_shape, with_dlse,
                  **kw)  # fmt: skip


# (name, lengths of q, lengths of k, H, Hkv, D, dtype, causal, window_size, softcap)
VARLEN_CASES = [
    ("same-lengths", [5, 1, 33, 0, 17, 64], [5, 1, 33, 0, 17, 64], 4, 2, 32, torch.bfloat16,
     False, (-1, -1), 0.0),
    # Nq != Nk per sequence; a sequence with keys and no queries next to one with queries and no
    # keys (its rows see nothing: zeros, LSE -inf), bottom-right causal per sequence.
    ("causal-nq-ne-nk", [3, 0, 20, 1, 40, 9], [10, 5, 0, 1, 37, 9], 4, 2, 32, torch.bfloat16,
     True, (-1, -1), 0.0),
    ("random-window-softcap", random_lengths(7, 70, 1), random_lengths(7, 70, 2), 2, 1, 16,
     torch.float32, False, (6, 2), 2.0),
    ("random-causal-window", random_lengths(8, 70, 3), random_lengths(8, 70, 4), 6, 3, 16,
     torch.float16, True, (12, -1), 0.0),
]  # fmt: skip


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c[0])
def test_varlen(case, device):
    _, lens_q, lens_k, h, hkv, d, dtype, causal, window, softcap = case
    q, k, v, kw = packed(lens_q, lens_k, h, hkv, d, dtype, device)
    o, lse, (dq, dk, dv) = check_varlen(q, k, v, causal=causal, window_size=window,
                                        softcap=softcap, **kw)  # fmt: skip
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if k0 == k1:  # queries without keys
            assert (o[q0:q1] == 0).all() and torch.isneginf(lse[:, q0:q1]).all()
            assert (dq[q0:q1] == 0).all()
        if q0 == q1:  # keys without queries
            assert (dk[k0:k1] == 0).all() and (dv[k0:k1] == 0).all()


def test_varlen_equals_dense_on_equal_lengths(device):
    """Equal lengths packed = the dense batch (same tiles; per-sequence bounds)."""
    b, n, h, hkv, d = 3, 37, 4, 2, 32
    q, k, v = qkv(b, n, n, h, hkv, d, torch.float32, device)
    do = make(q.shape, q.dtype, device, seed=5)
    kw = dict(causal=True, window_size=(9, -1))
    o, lse, grads = _run(flash_attn, q, k, v, do, None, **kw)
    cu = cu_seqlens([n] * b, device)
    flat = [t.flatten(0, 1) for t in (q, k, v, do)]
    o_p, lse_p, grads_p = _run(flash_attn_varlen, *flat[:3], flat[3], None, cu_seqlens_q=cu,
                               cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n, **kw)  # fmt: skip
    assert_close(o_p, o.flatten(0, 1), name="o")
    assert_close(lse_p, lse.transpose(0, 1).flatten(1), name="lse")
    for g_p, g, name in zip(grads_p, grads, ("dq", "dk", "dv")):
        assert_close(g_p, g.flatten(0, 1), name=name)


def test_varlen_deterministic(device):
    q, k, v, kw = packed([30, 0, 45, 7], [12, 20, 45, 1], 4, 2, 32, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=5)
    first = _run(flash_attn_varlen, q, k, v, do, None, causal=True, **kw)
    second = _run(flash_attn_varlen, q, k, v, do, None, causal=True, **kw)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [True, False])
def test_peel_ragged_tail_switch(causal, device, monkeypatch):
    """launchers.PEEL_RAGGED_TAIL (the backward's partial last block checked on its own) gives
    the gradients of the all-checked loops: packed ragged lengths, and a ragged dense batch whose
    k/v rows are misaligned (pointer loads: the dq loop's key checks are peeled too)."""
    q, k, v, kw = packed([70, 33, 0, 64, 5], [70, 40, 9, 64, 5], 4, 2, 32, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=5)
    q2, do2 = (make((2, 45, 2, 16), torch.float32, device, s) for s in (0, 5))
    k2, v2 = (make((2, 71, 1, 17), torch.float32, device, s)[..., 1:] for s in (1, 2))
    runs = []
    for peel in (True, False):
        monkeypatch.setattr(fa_launchers, "PEEL_RAGGED_TAIL", peel)
        runs.append(_run(flash_attn_varlen, q, k, v, do, None, causal=causal, **kw)[2]
                    + _run(flash_attn, q2, k2, v2, do2, None, causal=causal)[2])  # fmt: skip
    for a, b, name in zip(*runs, ("dq", "dk", "dv") * 2):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("causal", [True, False])
def test_pad_row_vectors_switch(causal, device, monkeypatch):
    """launchers.PAD_ROW_VECTORS (the backward reads lse2 and delta from padded copies, without
    row checks) gives the gradients of the checked reads, bitwise: packed ragged lengths with
    an empty sequence and rows that see no key, a ragged dense batch read through TMA, and one
    through pointers (misaligned q and do) with a window; all with an LSE gradient."""
    q, k, v, kw = packed([70, 33, 0, 64, 5], [70, 20, 9, 64, 5], 4, 2, 32, torch.bfloat16, device)
    do, dlse = make(q.shape, q.dtype, device, seed=5), make((4, 172), torch.float32, device, 6)
    q2, k2, v2, do2 = (make((2, 45, 2, 32), torch.bfloat16, device, s) for s in range(4))
    q3, do3 = (make((2, 45, 2, 17), torch.float32, device, s)[..., 1:] for s in (0, 5))
    k3, v3 = (make((2, 71, 1, 16), torch.float32, device, s) for s in (1, 2))
    dlse2 = make((2, 2, 45), torch.float32, device, seed=7)
    runs = []
    for pad in (True, False):
        monkeypatch.setattr(fa_launchers, "PAD_ROW_VECTORS", pad)
        runs.append(_run(flash_attn_varlen, q, k, v, do, dlse, causal=causal, **kw)[2]
                    + _run(flash_attn, q2, k2, v2, do2, dlse2, causal=causal)[2]
                    + _run(flash_attn, q3, k3, v3, do3, dlse2, causal=causal,
                           window_size=(20, 0 if causal else 3))[2])  # fmt: skip
    for a, b, name in zip(*runs, ("dq", "dk", "dv") * 3):
        assert torch.equal(a, b), name


def test_pad_row_vectors_rule(monkeypatch):
    """Padded row vectors for packed batches, ragged lengths and BLOCK_D <= 64; dense
    block-multiple d >= 128 keeps the plain ones; the switch turns them off everywhere."""
    packed_batch = fa_launchers.Varlen(None, None, 256, 256)
    assert fa_launchers._pad_row_vectors(packed_batch, 256, 128)
    assert fa_launchers._pad_row_vectors(None, 1000, 128)
    assert fa_launchers._pad_row_vectors(None, 1024, 64)
    assert not fa_launchers._pad_row_vectors(None, 1024, 128)
    monkeypatch.setattr(fa_launchers, "PAD_ROW_VECTORS", False)
    assert not fa_launchers._pad_row_vectors(packed_batch, 1000, 64)


def test_varlen_empty_batches(device):
    """No query rows at all, or no keys at all: outputs of the right shapes, zeros / -inf."""
    q, k, v, kw = packed([0, 0], [3, 4], 2, 1, 16, torch.float32, device)
    o, lse = flash_attn_varlen(q, k, v, return_lse=True, **kw)
    assert o.shape == (0, 2, 16) and lse.shape == (2, 0)
    q, k, v, kw = packed([3, 4], [0, 0], 2, 1, 16, torch.float32, device)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    o, lse = flash_attn_varlen(*leaves, causal=True, return_lse=True, **kw)
    assert (o == 0).all() and torch.isneginf(lse).all()
    o.sum().backward()
    assert (leaves[0].grad == 0).all() and leaves[1].grad.shape == (0, 1, 16)


def _varlen_errors(device):
    def i32(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    q = torch.zeros(10, 4, 32, device=device)
    kv = torch.zeros(12, 2, 32, device=device)
    kv3 = torch.zeros(12, 3, 32, device=device)
    good = dict(cu_seqlens_q=i32(0, 4, 10), cu_seqlens_k=i32(0, 5, 12), max_seqlen_q=6,
                max_seqlen_k=7)  # fmt: skip
    host = device.type == "cpu"  # values are checked only where they are free to read
    cases = [
        ((q[None], kv, kv), {}, r"q: expected shape \(total_q, H, D\)"),
        ((q, kv[None], kv), {}, r"k: expected shape \(total_k, Hkv, D\)"),
        ((q, kv, kv[:11]), {}, "v: shape"),
        ((q, kv3, kv3), {}, "not a multiple"),
        ((q, kv, kv), dict(cu_seqlens_q=[0, 4, 10]), "cu_seqlens_q: expected a torch.Tensor"),
        ((q, kv, kv), dict(cu_seqlens_q=i32(0, 4, 10).long()), "cu_seqlens_q: dtype must be"),
        ((q, kv, kv), dict(cu_seqlens_k=i32(0, 5, 12)[None]), r"cu_seqlens_k: expected shape"),
        ((q, kv, kv), dict(cu_seqlens_k=i32(0)), r"cu_seqlens_k: expected shape"),
        ((q, kv, kv), dict(cu_seqlens_k=i32(0, 12)), "cu_seqlens_k: 1 sequences, cu_seqlens_q"),
        ((q, kv, kv), dict(cu_seqlens_q=i32(0, 9, 4, 9, 10)[::2]), "cu_seqlens_q: must be contig"),
        ((q, kv, kv), dict(max_seqlen_q=0), "max_seqlen_q: must be >= 1"),
        ((q, kv, kv), dict(max_seqlen_k=7.0), "max_seqlen_k: expected an int"),
        ((q, kv, kv), dict(causal=True, window_size=(3, 1)), "window_size: right=1 conflicts"),
        ((q, kv, kv), dict(softcap=-2.0), "softcap: must"),
    ]  # fmt: skip
    if host:
        cases += [
            ((q, kv, kv), dict(cu_seqlens_q=i32(1, 4, 10)), "cu_seqlens_q: must start at 0"),
            ((q, kv, kv), dict(cu_seqlens_q=i32(0, 11, 10)), "cu_seqlens_q: must be non-decreasing"),
            ((q, kv, kv), dict(cu_seqlens_k=i32(0, 5, 11)), "cu_seqlens_k: last entry 11 must"),
            ((q, kv, kv), dict(max_seqlen_k=6), "max_seqlen_k: 6 is less than the longest"),
        ]  # fmt: skip
    return [(args, {**good, **over}, match) for args, over, match in cases]


@pytest.mark.parametrize("case", range(17))
def test_varlen_errors(case, device):
    cases = _varlen_errors(device)
    if case >= len(cases):
        pytest.skip("cu_seqlens values are the caller's contract on the GPU (no sync)")
    args, kw, match = cases[case]
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen(*args, **kw)


def test_varlen_opcheck(device):
    q, k, v, kw = packed([5, 0, 19], [8, 3, 21], 2, 1, 32, torch.float32, device)
    cu_q, cu_k, mq, mk = kw.values()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    args = (q, k, v, cu_q, cu_k, mq, mk, True, 0.25)
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_varlen_fwd, args)
    o, lse = fa_op.attn_varlen_fwd(q.detach(), k.detach(), v.detach(), *args[3:])
    do = make(o.shape, o.dtype, device, seed=3)
    dlse = make(lse.shape, lse.dtype, device, seed=4)
    bwd = (do, q.detach(), k.detach(), v.detach(), o, lse, dlse, cu_q, cu_k, mq, mk, False, 0.25,
           1.5, 4, 2)  # fmt: skip
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_varlen_bwd, bwd)


def test_varlen_torch_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    q, k, v, kw = packed([5, 0, 30, 1], [8, 3, 30, 1], 4, 2, 32, torch.float32, device)

    def f(q, k, v, cu_q, cu_k):
        o, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, 30, 30, causal=True, softcap=4.0,
                                   return_lse=True)  # fmt: skip
        return o * 2.0, lse

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = compiled(*leaves, kw["cu_seqlens_q"], kw["cu_seqlens_k"])
    o.sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_varlen_reference(*ref, kw["cu_seqlens_q"], kw["cu_seqlens_k"],
                                            causal=True, softcap=4.0, return_lse=True)  # fmt: skip
    (o64 * 2.0).sum().backward()
    assert_close(o, o64 * 2.0, name="compiled o")
    assert_close(_finite(lse), _finite(lse64), name="compiled lse")
    for a, r, name in zip(leaves, ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=f"compiled {name}")


def test_varlen_cpu_tensors_without_interpreter_use_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, kw = packed([4, 0, 9], [6, 2, 9], 2, 1, 16, torch.float32, "cpu")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = flash_attn_varlen(q, k, v, causal=True, return_lse=True, **kw)
    o.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_r, lse_r = attention_varlen_reference(*ref, causal=True, return_lse=True, **kw)
    assert torch.equal(o, o_r) and torch.equal(lse, lse_r.float())
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_varlen_reference(*ref, causal=True, **kw).sum().backward()
    for a, r, name in zip((q, k, v), ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=name)


# ------------------------------------------------------------------------------------------
# Split-KV forward (decoding): keys split across programs, partials merged through their LSEs.
# Under the interpreter num_sms is 4 and the split rule small (plans.INTERPRETER_SPLIT_RULE), so
# a few dozen keys already take several splits; the backward is the dense kernels' either way.
# ------------------------------------------------------------------------------------------


def _meta(b, nq, nk, h, hkv, d, dtype=torch.bfloat16):
    return (
        torch.empty(b, nq, h, d, dtype=dtype, device="meta"),
        torch.empty(b, nk, hkv, d, dtype=dtype, device="meta"),
    )


def test_split_plan_rule(monkeypatch):
    """The GPU rule, for an H100's 132 SMs."""
    _as_on_gpu(monkeypatch)
    monkeypatch.setattr(fa_plans, "num_sms", lambda device: 132)
    decode = fa_plans.Tile(16, *fa_plans.SPLIT_TILES[128])
    # Decode, GQA 32/8: 64 query tiles; one wave: 132 // 64 = 2 splits of 128-key blocks.
    assert fa_plans.split_plan(*_meta(8, 1, 4096, 32, 8, 128)) == fa_plans.SplitPlan(
        decode, 2, 2048
    )
    assert fa_plans.split_plan(*_meta(8, 1, 32768, 32, 8, 128)) == fa_plans.SplitPlan(
        decode, 2, 16384
    )
    # Speculative decoding: 4 query heads x 16 queries = 64 packed rows, one tile.
    plan = fa_plans.split_plan(*_meta(8, 16, 8192, 32, 8, 128))
    assert plan.tile.block_m == 64 and plan.splits == 2
    # Training shapes fill the GPU: the dense forward.
    assert fa_plans.split_plan(*_meta(8, 4096, 4096, 32, 8, 128)) is None
    assert fa_plans.split_plan(*_meta(1, 4096, 4096, 32, 32, 128)) is None
    # Few query rows but many batches: the split kernel, unsplit (GQA packing still pays).
    assert fa_plans.split_plan(*_meta(128, 1, 4096, 32, 8, 128)).splits == 1
    # Larger Nq that still underfills: 64 rows need 16 * 64 keys per split.
    assert fa_plans.split_plan(*_meta(1, 64, 65536, 1, 1, 128)).splits == 64
    # 128 packed rows take the dense forward's tile.
    plan = fa_plans.split_plan(*_meta(8, 32, 4096, 32, 8, 128))
    assert plan.tile == fa_plans.FWD_TILES[128] and plan.splits == 2
    assert fa_plans.split_plan(*_meta(8, 1, 4096, 32, 8, 128, torch.float32)).tile == fa_plans.Tile(
        16, *fa_plans.SPLIT_FP32_TILES[128]
    )
    # A forced count: runs of whole key blocks of one length (5 blocks in 4 splits: 2, 2, 1).
    forced = fa_plans.split_plan(*_meta(1, 1, 600, 4, 1, 64), num_splits=4)
    assert (forced.splits, forced.split_len) == (3, 256)
    assert fa_plans.split_plan(*_meta(1, 1, 600, 4, 1, 64), num_splits=99).splits == 5
    # A sliding window: only the keys from the first query's window on are split.
    assert fa_plans.split_plan(*_meta(8, 1, 32768, 32, 8, 128), left=4095) == fa_plans.SplitPlan(
        decode, 2, 2048, 28672
    )


# (B, Nq, Nk, H, Hkv, D, dtype, causal)
def takes_split_path(q, k) -> bool:
    """The automatic plan takes the split-KV forward. Under the interpreter (a 4-SM stand-in)
    these small shapes split the keys several ways; a real GPU gives them one split (several
    splits are forced in test_split_counts_agree_with_dense and run at large shapes on the GPU)."""
    plan = fa_plans.split_plan(q, k)
    return plan is not None and (plan.splits >= 2 or not interpreting())


SPLIT_CASES = [
    (2, 1, 100, 4, 1, 128, torch.bfloat16, True),  # decode, MQA; Nk no multiple of tile/split
    (1, 3, 77, 4, 2, 80, torch.float16, True),  # GQA, D = 80 (padded), causal Nq = 3
    (1, 16, 130, 4, 1, 64, torch.float32, True),  # Nq = 16: 64 packed rows, two row blocks
    (2, 1, 67, 2, 2, 32, torch.bfloat16, False),  # no grouping, not causal
]


@pytest.mark.parametrize(
    "case", SPLIT_CASES, ids=lambda c: "b{}-q{}-k{}-h{}-hkv{}-d{}-{}-causal{}".format(*c)
)
def test_split_kv(case, device):
    """The automatic plan takes the split path; o, LSE and gradients (through the dense
    backward, from the split forward's o and LSE) against the reference."""
    *shape, dtype, causal = case
    q, k, v = qkv(*shape, dtype, device)
    assert takes_split_path(q, k)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize(
    "shape",
    [(1, 40, 45, 2, 1, 32), (1, 40, 21, 1, 1, 32)],
    ids=["masked-splits", "rows-that-see-no-key"],
)
def test_split_counts_agree_with_dense(shape, device):
    """Forced split counts (and pointer loads) against the dense forward and the reference.
    Causal with several row blocks: the first blocks' queries see none of the later splits'
    keys (neutral partials, LSE -inf); with Nq > Nk the first rows see no key at all."""
    q, k, v = qkv(*shape, torch.float32, device)
    scale = 1 / math.sqrt(q.shape[-1])
    o_d, lse_d = fa_launchers.forward(q, k, v, True, scale, fa_plans.plan_for(32, True, q.dtype))
    o64, lse64 = attention_reference(q.double(), k.double(), v.double(), True, return_lse=True)
    pointer = fa_plans.Tile(32, 16, 4, 1, tma=False)
    for n, tile in ((1, None), (2, None), (3, pointer), (5, None)):
        split = fa_plans.split_plan(q, k, num_splits=n, tile=tile)
        o, lse = fa_launchers.forward(q, k, v, True, scale, split=split)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse64)), f"{n} splits"
        assert_close(o, o64, name=f"o, {n} splits")
        assert_close(o, o_d, name=f"o vs dense, {n} splits")
        assert_close(_finite(lse), _finite(lse64), bound=2e-5, name=f"lse, {n} splits")
        assert_close(_finite(lse), _finite(lse_d), bound=2e-5, name=f"lse vs dense, {n} splits")
    assert (o[:, : max(0, shape[1] - shape[2])] == 0).all()


@pytest.mark.parametrize("layout", ["sequence-major", "heads-major"])
def test_split_kv_cache_slices(layout, device):
    """Decoders pass k/v as the filled prefix of a preallocated cache (and q from a (B, H, N, D)
    projection): strided views, read in place."""
    b, nq, nk, h, hkv, d, cap = 2, 2, 70, 4, 2, 64, 96
    if layout == "sequence-major":  # (2, B, cap, Hkv, D): k and v caches in one buffer
        cache = make((2, b, cap, hkv, d), torch.bfloat16, device, seed=3)
        k, v = cache[0, :, :nk], cache[1, :, :nk]
    else:  # (B, Hkv, cap, D) per cache, viewed as (B, N, Hkv, D)
        k, v = (
            make((b, hkv, cap, d), torch.bfloat16, device, s)[:, :, :nk].transpose(1, 2)
            for s in (4, 5)
        )
    q = make((b, h, nq, d), torch.bfloat16, device, seed=6).transpose(1, 2)
    assert not k.is_contiguous() and takes_split_path(q, k)
    check(q, k, v, causal=True)


def test_split_kv_deterministic(device):
    q, k, v = qkv(2, 1, 90, 4, 2, 32, torch.bfloat16, device)
    assert takes_split_path(q, k)
    first = flash_attn(q, k, v, causal=True, return_lse=True)
    second = flash_attn(q, k, v, causal=True, return_lse=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_split_kv_opcheck(device):
    """The registered forward on a split-path shape (fake tensors, dynamic shapes)."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, 70, 4, 2, 32, torch.float32, device))
    assert takes_split_path(q, k)
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_fwd, (q, k, v, True, 0.25))


def test_split_kv_torch_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(
        lambda q, k, v: flash_attn(q, k, v, causal=True, return_lse=True),
        fullgraph=True,
        backend=backend,
    )
    q, k, v = qkv(1, 2, 70, 4, 2, 32, torch.float32, device)
    assert takes_split_path(q, k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = compiled(*leaves)
    o.sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_reference(*ref, causal=True, return_lse=True)
    o64.sum().backward()
    assert_close(o, o64, name="compiled o")
    assert_close(lse, lse64, name="compiled lse")
    for a, r, name in zip(leaves, ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=f"compiled {name}")


# ------------------------------------------------------------------------------------------
# The Gluon forward on Hopper (kernels_gluon.py, chosen by Tile.gluon; GPU-only: Gluon has no
# interpreter; its launches are compile-checked on CPU below).
# ------------------------------------------------------------------------------------------


def _launched_kernels(monkeypatch):
    """The names of the kernels the op launches from now on."""
    names, launch = [], runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda k: names.append(k.fn.__name__) or launch(k))
    return names


def _check_plan(plan, q, k, v, causal):
    """fa_launchers.forward/backward with `plan` against the float64 reference and, no worse than twice
    its error, the reference evaluated in q's dtype."""
    do = make(q.shape, q.dtype, q.device, seed=9)
    scale = 1 / math.sqrt(q.shape[-1])
    o, lse = fa_launchers.forward(q, k, v, causal, scale, plan)
    grads = fa_launchers.backward(do, q, k, v, o, lse, None, causal, scale, plan)
    o64, lse64, grads64 = _run(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    o_l, _, grads_l = _run(attention_reference, q, k, v, do, None, causal=causal)
    assert_close(o, o64, ref_lowp=o_l, name="o")
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(lse64.cpu()))
    assert_close(_finite(lse), _finite(lse64), bound=2e-5, name="lse")
    for g, g64, gl, name in zip(grads, grads64, grads_l, ("dq", "dk", "dv")):
        assert_close(g, g64, ref_lowp=gl, name=name)


def _capture_launches_as_on_hopper(monkeypatch) -> list:
    """From now on the op's launches are captured as (kernel, args, kwargs) instead of run, with
    CPU tensors taken as TMA-aligned on an sm_90 GPU (the Gluon kernels allowed)."""
    calls = []

    class Capture:  # stands in for launch(kernel)[grid](*args, **kwargs)
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.kernel, args, kwargs))

    monkeypatch.setattr(runtime, "launch", Capture)
    monkeypatch.setattr(fa_plans, "use_tma", lambda *t: True)
    monkeypatch.setattr(fa_plans, "_gluon_device", lambda device: True)
    return calls


def test_gluon_forward_launches_are_compile_checked(monkeypatch):
    """The Gluon forward (kernels_gluon.py) runs only on an sm_90 GPU (Gluon has no interpreter):
    here its launches are captured as on one (CPU tensors taken as TMA-aligned on Hopper) and
    recorded for the end-of-session compile check, which lowers them to TTGIR for sm_90.
    GQA, Nq != Nk, ragged ends, a padded head dim, causal and softcap (tanh.approx, as for
    half precision on a GPU)."""
    from kernelkit.shared.compile_check import record_launch

    calls = _capture_launches_as_on_hopper(monkeypatch)
    score_args = fa_launchers._score_args

    def fast_score_args(scale, softcap, q):  # tanh.approx as on a GPU (CPU: the exact formula)
        qk_scale, cap_scale, mode = score_args(scale, softcap, q)
        return qk_scale, cap_scale, 2 if mode else 0

    monkeypatch.setattr(fa_launchers, "_score_args", fast_score_args)
    cases = [(64, False, (128, 64, 3), 0.0), (80, False, (128, 128, 2), 0.0),
             (128, True, (128, 128, 2), 30.0)]  # fmt: skip
    for d, causal, tile, softcap in cases:
        q, k, v = qkv(2, 300, 260, 4, 2, d, torch.bfloat16, "cpu")
        plan = fa_plans.Plan(
            fa_plans.Tile(*tile[:2], 4, tile[2], tma=True, gluon=True), *([None] * 2)
        )
        fa_launchers.forward(q, k, v, causal, 0.125, plan, softcap=softcap)
    assert [kernel.fn.__name__ for kernel, _, _ in calls] == ["attn_fwd_gluon_kernel"] * 3
    assert calls[-1][2]["SOFTCAP"] and not calls[0][2]["SOFTCAP"]
    for kernel, args, kwargs in calls:
        record_launch(kernel, args, kwargs)


def test_gluon_backward_launches_are_compile_checked(monkeypatch):
    """The Gluon dk/dv kernel (kernels_gluon.attn_bwd_gluon_kernel) runs only on an sm_90 GPU:
    its launches are captured as on one and recorded for the compile check, as the forward's
    above. GQA with ragged ends and Nq != Nk (causal), a padded head dim, both ring depths."""
    from kernelkit.shared.compile_check import record_launch

    calls = _capture_launches_as_on_hopper(monkeypatch)
    cases = [(64, True, 2, (300, 260)), (80, False, 3, (300, 300)), (128, True, 2, (260, 300)),
             (128, False, 3, (256, 256))]  # fmt: skip
    for d, causal, stages, (nq, nk) in cases:
        q, k, v = qkv(2, nq, nk, 4, 2, d, torch.bfloat16, "cpu")
        do = torch.randn_like(q)
        lse = torch.zeros(2, 4, nq)
        tile = fa_plans.Tile(64, 128, 4, stages, tma=True, gluon=True)
        plan = fa_plans.Plan(fa_plans.INTERPRETER_FWD, tile, fa_plans.INTERPRETER_DQ)
        fa_launchers.backward(do, q, k, v, q, lse, None, causal, 0.125, plan)
    gluon = [
        (kernel, a, kw) for kernel, a, kw in calls if kernel.fn.__name__.endswith("gluon_kernel")
    ]
    assert [kw["CAUSAL"] for _, _, kw in gluon] == [True, False, True, False]
    assert [kernel.fn.__name__ for kernel, _, _ in calls].count("attn_bwd_dkdv_kernel") == 0
    # dq summed in the Gluon kernel: its launches run only there, the portable preprocess
    # (ZERO_DQ) and dq conversion included.
    fused = len(calls)
    for deterministic in (True, False):
        q, k, v = qkv(2, 300, 260, 4, 2, 64, torch.bfloat16, "cpu")
        tile = fa_plans.Tile(64, 128, 4, 2, tma=True, gluon=True)
        plan = fa_plans.Plan(fa_plans.INTERPRETER_FWD, tile, fa_plans.GLUON_FUSED_DQ)
        fa_launchers.backward(torch.randn_like(q), q, k, v, q, torch.zeros(2, 4, 300), None, True,
                              0.125, plan, deterministic=deterministic)  # fmt: skip
    names = [kernel.fn.__name__ for kernel, _, _ in calls[fused:]]
    assert names == ["attn_bwd_preprocess_kernel", "attn_bwd_gluon_kernel",
                     "attn_bwd_dq_convert_kernel"] * 2  # fmt: skip
    assert [kw.get("DQ_MODE") for _, _, kw in calls[fused:]][1::3] == [2, 1]
    for kernel, args, kwargs in gluon + calls[fused:]:
        record_launch(kernel, args, kwargs)


def test_gluon_dkdv_tile_falls_back_where_it_cannot_run(device, monkeypatch):
    """A plan with a Gluon dk/dv tile runs the portable dk/dv kernel (`portable_dkdv`) where
    Gluon cannot run (the interpreter; here also a GPU taken as not sm_90), correctly."""
    monkeypatch.setattr(fa_plans, "_gluon_device", lambda device: False)
    launched = _launched_kernels(monkeypatch)
    q, k, v = qkv(1, 70, 90, 2, 1, 64, torch.bfloat16, device)
    tile = fa_plans.Tile(64, 128, 4, 2, tma=True, gluon=True)
    fallback = fa_plans.portable_dkdv(64, True)
    assert not fallback.gluon and fallback == fa_plans.CAUSAL_TILES[64][1]
    _check_plan(fa_plans.Plan(fa_plans.INTERPRETER_FWD, tile, fa_plans.INTERPRETER_DQ), q, k, v,
                True)  # fmt: skip
    assert "attn_bwd_dkdv_kernel" in launched and "attn_bwd_gluon_kernel" not in launched
    # float32 inputs get a float32 tile; a Gluon tile asking for pointer loads keeps them.
    assert fa_plans.portable_dkdv(128, True, torch.float32) == fa_plans.FP32_TILES[128][1]


def test_gluon_dkdv_fallback_keeps_dtype_and_pointer_loads(monkeypatch):
    """Where the Gluon dk/dv tile cannot run, the portable tile replacing it is the float32 one
    for float32 inputs, and reads through pointers when the tile asked for that (`tune.py`'s
    pointer-load plans): captured launches, as on an sm_90 GPU."""
    calls = _capture_launches_as_on_hopper(monkeypatch)
    gluon = fa_plans.GLUON_CAUSAL_DKDV_TILES[128]
    for dtype, tile in ((torch.float32, gluon), (torch.bfloat16, replace(gluon, tma=False))):
        q, k, v = qkv(1, 100, 100, 2, 2, 128, dtype, "cpu")
        plan = fa_plans.Plan(fa_plans.INTERPRETER_FWD, tile, fa_plans.INTERPRETER_DQ)
        fa_launchers.backward(torch.randn_like(q), q, k, v, q, torch.zeros(1, 2, 100), None, True,
                              0.125, plan)  # fmt: skip
    dkdv = [(a, kw) for kernel, a, kw in calls if kernel.fn.__name__ == "attn_bwd_dkdv_kernel"]
    assert len(dkdv) == 2
    f32 = fa_plans.FP32_TILES[128][1]
    assert (dkdv[0][1]["BLOCK_M"], dkdv[0][1]["BLOCK_N"]) == (f32.block_m, f32.block_n)
    assert dkdv[1][1]["TMA"] is False


def test_default_plans_take_the_gluon_kernels_by_rule(monkeypatch):
    """Where the Gluon kernels ship (plans.py, H100 A/B): the d128 dk/dv kernel, causal or not,
    not for a window's left edge or a packed batch; the d64 forward from GLUON_CAUSAL_FWD_MIN_N
    (causal) or GLUON_FWD_MIN_N query rows on (for a grid that fills the GPU)."""
    monkeypatch.setattr(fa_plans, "interpreting", lambda: False)
    for causal in (False, True):
        assert fa_plans.plan_for(128, causal, torch.bfloat16).dkdv.gluon
        assert not fa_plans.plan_for(128, causal, torch.bfloat16, True).dkdv.gluon
        assert not fa_plans.plan_for(64, causal, torch.bfloat16).dkdv.gluon
        assert not fa_plans.plan_for(128, causal, torch.float32).dkdv.gluon
    n = fa_plans.GLUON_CAUSAL_FWD_MIN_N[64]
    assert fa_plans.plan_for(64, True, torch.bfloat16, grid=(256, n, 132)).fwd.gluon
    assert not fa_plans.plan_for(64, True, torch.bfloat16, grid=(256, n // 2, 132)).fwd.gluon
    n = fa_plans.GLUON_FWD_MIN_N[64]
    assert fa_plans.plan_for(64, False, torch.bfloat16, grid=(64, n, 132)).fwd.gluon
    assert not fa_plans.plan_for(64, False, torch.bfloat16, grid=(64, n // 2, 132)).fwd.gluon
    assert not fa_plans.plan_for(64, False, torch.float32, grid=(64, n, 132)).fwd.gluon


def test_bwd_tile_heads():
    """The Gluon dk/dv kernel's tile groups: the largest divisor of the (batch, kv head) count
    that keeps about one wave of programs (sms / key blocks) on a group; one group where the
    tiles stay key-block-major."""
    assert fa_launchers._bwd_tile_heads(16, 128, 132, False) == 2  # 16k rows: 2 heads x 128
    assert fa_launchers._bwd_tile_heads(128, 32, 132, False) == 4  # 4k: want 5, divides 128
    assert fa_launchers._bwd_tile_heads(7, 32, 132, False) == 1  # a prime count
    assert fa_launchers._bwd_tile_heads(3, 8, 132, False) == 3  # all heads fit one wave
    assert fa_launchers._bwd_tile_heads(128, 32, 132, True) == 128


def test_fused_dq_plan_rule(monkeypatch):
    """Half-precision d64 backwards from FUSED_DQ_MIN_N query rows on sum dq in the Gluon kernel
    in a fixed order; with deterministic=False from ANY_ORDER_DQ_MIN_N rows on (fewer); shorter
    ones and d128 keep their plan."""
    monkeypatch.setattr(fa_plans, "interpreting", lambda: False)
    fused = (fa_plans.FUSED_DQ_DKDV, fa_plans.GLUON_FUSED_DQ)
    for deterministic, table in ((True, fa_plans.FUSED_DQ_MIN_N),
                                 (False, fa_plans.ANY_ORDER_DQ_MIN_N)):  # fmt: skip
        for causal in (False, True):
            base = fa_plans.plan_for(64, causal, torch.bfloat16)
            n = table[64][causal]
            if n is None:
                plan = fa_plans.fused_dq_plan(base, 64, causal, 1 << 20, deterministic)
                assert plan == base
                continue
            plan = fa_plans.fused_dq_plan(base, 64, causal, n, deterministic)
            assert plan.fwd == base.fwd and (plan.dkdv, plan.dq) == fused
            assert fa_plans.fused_dq_plan(base, 64, causal, n - 1, deterministic) == base
            base128 = fa_plans.plan_for(128, causal, torch.bfloat16)
            assert fa_plans.fused_dq_plan(base128, 128, causal, 1 << 20, deterministic) == base128
    for causal in (False, True):
        assert fa_plans.ANY_ORDER_DQ_MIN_N[64][causal] < fa_plans.FUSED_DQ_MIN_N[64][causal]


def test_deterministic_option_launches(monkeypatch):
    """As on an H100: a d64 causal backward of ANY_ORDER_DQ_MIN_N rows runs the Gluon kernel
    summing dq in any order (DQ_MODE 1, K/V in registers) and no dq kernel with
    deterministic=False, the dq kernel by default; from FUSED_DQ_MIN_N rows on the default sums
    dq in the Gluon kernel in a fixed order (DQ_MODE 2). A window's left edge keeps the dq
    kernel."""
    calls = _capture_launches_as_on_hopper(monkeypatch)
    monkeypatch.setattr(fa_plans, "interpreting", lambda: False)
    monkeypatch.setattr(fa_launchers, "interpreting", lambda: False)

    def backward(n, window, deterministic):  # with the default plan, not replayed
        q, k, v = qkv(1, n, n, 2, 1, 64, torch.bfloat16, "cpu")
        calls.clear()
        fa_launchers._backward(replay.DIRECT, torch.randn_like(q), q, k, v, q, torch.zeros(1, 2, n),
                               None, True, 0.125, None, 0.0, window, None, deterministic)  # fmt: skip
        names = [kernel.fn.__name__ for kernel, _, _ in calls]
        gluon = [kw for kernel, _, kw in calls if kernel.fn.__name__ == "attn_bwd_gluon_kernel"]
        return names, [(kw["DQ_MODE"], kw["KV_REGS"]) for kw in gluon]

    n = fa_plans.ANY_ORDER_DQ_MIN_N[64][1]
    names, modes = backward(n, (-1, -1), False)
    assert "attn_bwd_dq_kernel" not in names and "attn_bwd_dq_convert_kernel" in names
    assert modes == [(1, True)]
    names, modes = backward(n, (-1, -1), True)
    assert "attn_bwd_dq_kernel" in names and modes == []  # (d64 dk/dv: the portable kernel)
    names, modes = backward(fa_plans.FUSED_DQ_MIN_N[64][1], (-1, -1), True)
    assert "attn_bwd_dq_kernel" not in names and modes == [(2, True)]
    names, modes = backward(n, (100, 0), False)
    assert "attn_bwd_dq_kernel" in names and modes == []


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
def test_gpu_fused_dq_by_rule(causal, deterministic, device, monkeypatch):
    """flash_attn through autograd where the default plan sums dq in the Gluon kernel (its
    minimum lengths lowered to reach it at a test's size; K/V in registers), GQA and
    Nq != Nk; deterministic: bitwise the same gradients on a second run."""
    launched = _launched_kernels(monkeypatch)
    monkeypatch.setattr(fa_plans, "FUSED_DQ_MIN_N", {64: (1, 1)})
    monkeypatch.setattr(fa_plans, "ANY_ORDER_DQ_MIN_N", {64: (1, 1)})
    q, k, v = qkv(2, 1000, 1100, 8, 2, 64, torch.bfloat16, device)
    fn = functools.partial(flash_attn, deterministic=deterministic)
    _, _, grads = _check(fn, attention_reference, q, k, v, (2, 8, 1000), True, causal=causal)
    if torch.cuda.get_device_capability()[0] == 9:
        assert "attn_bwd_gluon_kernel" in launched and "attn_bwd_dq_kernel" not in launched
        if deterministic:
            _, _, again = _check(fn, attention_reference, q, k, v, (2, 8, 1000), True,
                                 causal=causal)  # fmt: skip
            for g, h, name in zip(grads, again, ("dq", "dk", "dv")):
                assert torch.equal(g, h), name


# ------------------------------------------------------------------------------------------
# The course assignment's interface
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_attention_function_adapter(is_causal, device):
    """What the assignment's tests check: one saved (B, Nq) tensor holding the LSE, the output,
    and the gradients of the plain attention."""
    q, k, v = (t.squeeze(2) for t in qkv(4, 64, 64, 1, 1, 32, torch.float32, device))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = FlashAttentionFunction.apply(q, k, v, is_causal)
    saved = [t for t in o.grad_fn.saved_tensors if t.shape == (q.shape[0], q.shape[1])]
    assert len(saved) == 1
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_reference(*ref, causal=is_causal, return_lse=True)
    assert_close(o, o64, name="o")
    assert_close(saved[0], lse64, name="L")
    do = make(o.shape, o.dtype, device, seed=11)
    o.backward(do)
    o64.backward(do.double())
    for a, r, name in zip((q, k, v), ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=name)


# ------------------------------------------------------------------------------------------
# Registration, compile, fallback, errors
# ------------------------------------------------------------------------------------------


def test_opcheck(device):
    q, k, v = (t.requires_grad_() for t in qkv(1, 19, 21, 2, 1, 32, torch.float32, device))
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_fwd, (q, k, v, True, 0.25))
    o, lse = fa_op.attn_fwd(q.detach(), k.detach(), v.detach(), True, 0.25)
    do = make(o.shape, o.dtype, device, seed=3)
    dlse = make(lse.shape, lse.dtype, device, seed=4)
    args = (do, q.detach(), k.detach(), v.detach(), o, lse)
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_bwd, (*args, dlse, True, 0.25))
    # The options after the scale (softcap, window left and right), passed explicitly.
    torch.library.opcheck(
        torch.ops.kernelkit_flash_attn.attn_bwd, (*args, None, False, 0.25, 2.0, 3, 5)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_with_gpu_tiles(dtype, device, monkeypatch):
    """Dynamic-shape tracing (opcheck's aot_dispatch_dynamic) through the GPU tile tables, which
    the interpreter otherwise bypasses: the head dim and block flags must be concrete."""
    _as_on_gpu(monkeypatch)
    q, k, v = (t.requires_grad_() for t in qkv(1, 19, 21, 2, 1, 32, dtype, device))
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_fwd, (q, k, v, True, 0.25))


@pytest.mark.parametrize("causal", [True], ids=["causal"])  # the flag is a constant to the graph
def test_torch_compile_fullgraph(causal, device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"

    def f(q, k, v):
        o, lse = flash_attn(q, k, v, causal=causal, return_lse=True)
        return o * 2.0, lse

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    q, k, v = qkv(1, 33, 33, 2, 1, 32, torch.float32, device)
    do = make(q.shape, q.dtype, device, seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = compiled(*leaves)
    (o * do).sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_reference(*ref, causal=causal, return_lse=True)
    (o64 * 2.0 * do.double()).sum().backward()
    assert_close(o, o64 * 2.0, name="compiled o")
    assert_close(lse, lse64, name="compiled lse")
    for a, r, name in zip(leaves, ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=f"compiled {name}")


def test_torch_compile_window_softcap(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(
        lambda q, k, v: flash_attn(q, k, v, True, window_size=(12, -1), softcap=3.0),
        fullgraph=True,
        backend=backend,
    )
    q, k, v = qkv(1, 40, 40, 2, 1, 32, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64 = attention_reference(*ref, causal=True, window_size=(12, -1), softcap=3.0)
    o64.sum().backward()
    for a, r, name in zip(leaves, ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=f"compiled {name}")


def test_cpu_tensors_without_interpreter_use_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.requires_grad_() for t in qkv(1, 9, 12, 2, 1, 16, torch.float32, "cpu"))
    o, lse = flash_attn(q, k, v, causal=True, return_lse=True)
    o.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_r, lse_r = attention_reference(*ref, causal=True, return_lse=True)
    assert torch.equal(o, o_r) and torch.equal(lse, lse_r)
    # The backward is the closed form (attention_reference_grads), checked against float64.
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_reference(*ref, causal=True).sum().backward()
    for a, r, name in zip((q, k, v), ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=name)


# The CPU fallback's backward in closed form (reference.attention_reference_grads) against
# autograd through the reference, in float64: GQA, softcap, windows, rows that see no key and
# an LSE gradient. (B, Nq, Nk, H, Hkv, D), causal, window_size, softcap.
REFERENCE_GRAD_CASES = [
    ((2, 9, 12, 4, 2, 16), True, (-1, -1), 0.0),
    ((1, 14, 6, 2, 1, 24), True, (-1, -1), 2.5),  # Nq > Nk: rows that see no key
    ((1, 11, 11, 3, 1, 16), False, (3, 2), 0.0),
    ((2, 7, 13, 2, 2, 8), False, (-1, -1), 1.5),
]


@pytest.mark.parametrize("case", REFERENCE_GRAD_CASES, ids=lambda c: str(c[0]))
def test_reference_grads_closed_form(case):
    (b, nq, nk, h, hkv, d), causal, window, softcap = case
    q, k, v = qkv(b, nq, nk, h, hkv, d, torch.float64, "cpu")
    do = make((b, nq, h, d), torch.float64, "cpu", seed=5)
    dlse = make((b, h, nq), torch.float64, "cpu", seed=6)
    kw = dict(causal=causal, softmax_scale=0.3, softcap=softcap, window_size=window)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_reference(*leaves, return_lse=True, **kw)
    expected = torch.autograd.grad([o, _finite(lse)], leaves, [do, dlse])
    got = attention_reference_grads(do, q, k, v, dlse=dlse, **kw)
    for g, e, name in zip(got, expected, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=name)
    # float32 inputs: computed in float32, returned as float32.
    got32 = attention_reference_grads(do.float(), q.float(), k.float(), v.float(), dlse=dlse, **kw)
    for g, e, name in zip(got32, expected, ("dq", "dk", "dv")):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5, msg=name)


def test_varlen_reference_grads_closed_form():
    q, k, v, kw = packed([4, 0, 9, 5], [6, 2, 9, 0], 4, 2, 16, torch.float64, "cpu")
    do = make(q.shape, torch.float64, "cpu", seed=5)
    dlse = make((q.shape[1], q.shape[0]), torch.float64, "cpu", seed=6)
    opts = dict(causal=True, softcap=2.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_varlen_reference(*leaves, return_lse=True, **opts, **kw)
    expected = torch.autograd.grad([o, _finite(lse)], leaves, [do, dlse])
    cu = (kw["cu_seqlens_q"], kw["cu_seqlens_k"])
    got = attention_varlen_reference_grads(do, q, k, v, *cu, dlse=dlse, **opts)
    for g, e, name in zip(got, expected, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=name)


_COMPILE_WITHOUT_INTERPRETER = """
import torch
from kernelkit.flash_attn import flash_attn
from kernelkit.flash_attn.reference import attention_reference
q, k, v = (torch.randn(2, 9, h, 16) for h in (4, 2, 2))
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
f = torch.compile(lambda *a: flash_attn(*a, causal=True, softcap=3.0), fullgraph=True,
                  backend="aot_eager")
f(*leaves).sum().backward()
ref = [t.double().requires_grad_() for t in (q, k, v)]
attention_reference(*ref, causal=True, softcap=3.0).sum().backward()
for a, r in zip(leaves, ref):
    torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-4, atol=1e-5)
print("ok")
"""


def test_torch_compile_backward_on_cpu_without_interpreter():
    """On CPU without the interpreter the ops run the PyTorch reference, and torch.compile
    traces their bodies (torch.library.triton_op): the backward must trace too. A fresh process,
    since the interpreter setting is read when the ops are registered."""
    assert run_without_interpreter(_COMPILE_WITHOUT_INTERPRETER).strip().endswith("ok")


def _errors(device):
    def t(*shape, dtype=torch.float32, dev=device):
        return torch.zeros(shape, dtype=dtype, device=dev)

    q = t(2, 8, 4, 32)
    kv = t(2, 8, 2, 32)
    return [
        ((q.tolist(), kv, kv), "q: expected a torch.Tensor"),
        ((t(2, 8, 4, 32, dtype=torch.int32), kv, kv), "q: dtype"),
        ((q, t(2, 8, 2, 32, dtype=torch.float16), kv), "k: dtype"),
        ((q, kv, t(2, 8, 2, 32, dtype=torch.bfloat16)), "v: dtype"),
        ((t(8, 32), t(8, 32), t(8, 32)), r"q: expected shape \(B, Nq, H, D\)"),
        ((q, t(2, 8, 32), kv), "k: expected"),
        ((q, kv, t(2, 9, 2, 32)), "v: shape"),
        ((q, t(3, 8, 2, 32), t(3, 8, 2, 32)), "k: batch size 3"),
        ((q, t(2, 8, 2, 64), t(2, 8, 2, 64)), "k: head dim 64"),
        ((q, t(2, 8, 3, 32), t(2, 8, 3, 32)), "not a multiple"),
        ((t(2, 8, 4, 8), t(2, 8, 2, 8), t(2, 8, 2, 8)), "D=8 outside 16..256"),
        ((t(2, 8, 4, 272), t(2, 8, 2, 272), t(2, 8, 2, 272)), "D=272 outside"),
        ((t(2, 0, 4, 32), kv, kv), "Nq must be >= 1"),
        ((q, t(2, 0, 2, 32), t(2, 0, 2, 32)), "Nk must be >= 1"),
        ((q, t(2, 8, 0, 32), t(2, 8, 0, 32)), "at least one head"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_errors(case, device):
    args, match = _errors(device)[case]
    with pytest.raises(ValueError, match=match):
        flash_attn(*args)


def test_argument_errors(device):
    q = torch.zeros(1, 4, 1, 16, device=device)
    with pytest.raises(ValueError, match="causal: expected a bool"):
        flash_attn(q, q, q, causal=1)
    with pytest.raises(ValueError, match="softmax_scale: must be finite"):
        flash_attn(q, q, q, softmax_scale=math.inf)
    with pytest.raises(ValueError, match="softmax_scale: expected a float"):
        flash_attn(q, q, q, softmax_scale="0.1")
    with pytest.raises(ValueError, match="q: expected"):
        FlashAttentionFunction.apply(q, q, q, False)
    for bad, match in ((-1.0, "softcap: must be finite and >= 0"), (math.nan, "softcap: must"),
                       (math.inf, "softcap: must"), ("50", "softcap: expected a float"),
                       (True, "softcap: expected a float")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            flash_attn(q, q, q, softcap=bad)
    for bad, match in ((4, "window_size: expected a pair"), ((1, 2, 3), "window_size: expected"),
                       ((1.0, 2), "window_size: expected"), ((True, 0), "window_size: expected"),
                       ((-2, 0), "window_size: sizes must be >= 0, or -1"),
                       ((0, -5), "window_size: sizes must")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            flash_attn(q, q, q, window_size=bad)
    with pytest.raises(ValueError, match="window_size: right=2 conflicts with causal=True"):
        flash_attn(q, q, q, causal=True, window_size=(4, 2))


@pytest.mark.gpu
def test_device_mismatch():
    q = torch.zeros(1, 4, 1, 16, device="cuda")
    with pytest.raises(ValueError, match="k: on device cpu"):
        flash_attn(q, q.cpu(), q)


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
# precision by default (launchers.FAST_TANH); the exact formula is what float32 and CPU runs use.
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
def test_gpu_softcap(case, device, monkeypatch):
    d, dtype, causal, softcap, fast = case
    monkeypatch.setattr(fa_launchers, "FAST_TANH", fast)
    q, k, v = qkv(2, 1000, 1024, 8, 2, d, dtype, device)
    check((q.double() * 3).to(dtype), k, v, causal=causal, softcap=softcap)


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
    assert fa_plans.split_plan(q, k) is not None
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
    o_d, lse_d = fa_launchers.forward(q, k, v, True, scale, fa_plans.plan_for(128, True, q.dtype))
    for n in (1, 3, 16, 79):
        o, lse = fa_launchers.forward(
            q, k, v, True, scale, split=fa_plans.split_plan(q, k, num_splits=n)
        )
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
    assert (fa_plans.split_plan(q, k) is not None) == (shape[1] == 1)
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
def test_gpu_gluon_forward(shape, tile, causal, device, monkeypatch):
    """The Gluon forward (kernels_gluon.py), non-causal and causal as it ships (d128; d64 causal
    from GLUON_CAUSAL_FWD_MIN_N rows), with the shipped 128 x 128 x 2-stage tile and a
    128 x 64 x 3-stage one (its backward: the current kernels)."""
    launched = _launched_kernels(monkeypatch)
    q, k, v = qkv(*shape, torch.bfloat16, device)
    base = fa_plans.plan_for(shape[-1], causal, q.dtype)
    gluon = fa_plans.Tile(*tile[:2], 4, tile[2], tma=True, gluon=True)
    _check_plan(fa_plans.Plan(gluon, base.dkdv, base.dq), q, k, v, causal)
    if torch.cuda.get_device_capability()[0] == 9:
        assert "attn_fwd_gluon_kernel" in launched


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_gluon_forward_d64_by_rule(causal, device, monkeypatch):
    """The d64 Gluon forward where the default plan takes it (its minimum lengths,
    GLUON_FWD_MIN_N / GLUON_CAUSAL_FWD_MIN_N, lowered to reach it at a test's size), q in
    registers (launchers.GLUON_FWD_Q_REGS_MAX_D), GQA, Nq != Nk, with and without softcap."""
    launched = _launched_kernels(monkeypatch)
    monkeypatch.setattr(fa_plans, "GLUON_FWD_MIN_N", {64: 1})
    monkeypatch.setattr(fa_plans, "GLUON_CAUSAL_FWD_MIN_N", {64: 1})
    q, k, v = qkv(16, 1000, 1024, 16, 4, 64, torch.bfloat16, device)  # a grid of 16 waves
    check(q, k, v, causal=causal)
    check((q.double() * 3).to(q.dtype), k, v, causal=causal, softcap=30.0)
    if torch.cuda.get_device_capability()[0] == 9:
        assert "attn_fwd_gluon_kernel" in launched and "attn_fwd_kernel" not in launched


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq", [1000, 1100], ids=["even-blocks", "odd-blocks"])
def test_gpu_gluon_forward_schedules_agree(nq, causal, device, monkeypatch):
    """The persistent Gluon forward (one program per SM walking tiles, causal ones in pairs of a
    long and a short query block where their number is even) computes each tile as one program
    per tile does: bitwise the same o and LSE, and right against the reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward runs on sm_90 only")
    q, k, v = qkv(8, nq, 1024, 16, 4, 128, torch.bfloat16, device)  # 8 or 9 blocks, 8+ waves
    tile = fa_plans.GLUON_FWD_TILES[128]
    scale = 1 / math.sqrt(128)
    runs = []
    for persistent, pairs in ((False, False), (True, False), (True, True), (False, True)):
        monkeypatch.setattr(fa_launchers, "GLUON_FWD_PERSISTENT", persistent)
        monkeypatch.setattr(fa_launchers, "GLUON_FWD_CAUSAL_PAIRS", pairs)
        base = fa_plans.plan_for(128, causal, q.dtype)
        runs.append(
            fa_launchers.forward(q, k, v, causal, scale, fa_plans.Plan(tile, base.dkdv, base.dq))
        )
    for o, lse in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])
    # and right: the first sequence against the float64 reference (all of it would take GBs)
    o64, lse64 = attention_reference(*(t[:1].double() for t in (q, k, v)), causal, scale,
                                     return_lse=True)  # fmt: skip
    o_lowp = attention_reference(q[:1], k[:1], v[:1], causal, scale)
    assert_close(runs[0][0][:1], o64, ref_lowp=o_lowp, name="o")
    assert_close(_finite(runs[0][1][:1]), _finite(lse64), bound=2e-5, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_gluon_backward_schedules_agree(causal, device, monkeypatch):
    """The d128 Gluon dk/dv kernel persistent (one program per SM walking tiles, up to
    launchers.GLUON_BWD_PERSISTENT_MAX_N query rows) and with one program per tile give bitwise
    the same gradients (each tile's arithmetic is the same), right against the reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on sm_90 only")
    launched = _launched_kernels(monkeypatch)
    q, k, v = qkv(4, 1000, 1100, 16, 4, 128, torch.bfloat16, device)  # 9 key blocks x 16 units
    do = make(q.shape, q.dtype, device, seed=7)
    scale = 1 / math.sqrt(128)
    o, lse = fa_launchers.forward(q, k, v, causal, scale)
    grads = []
    for max_n in (0, 1 << 30):
        monkeypatch.setattr(fa_launchers, "GLUON_BWD_PERSISTENT_MAX_N", max_n)
        grads.append(fa_launchers.backward(do, q, k, v, o, lse, None, causal, scale))
    assert "attn_bwd_gluon_kernel" in launched
    for a, b, name in zip(*grads, ("dq", "dk", "dv")):
        assert torch.equal(a, b), name
    check(q[:1], k[:1], v[:1], causal=causal)  # the default (persistent at this length)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, mode", [(128, "dkdv"), (64, "ordered"), (64, "any-order")])
def test_gpu_gluon_backward_tile_groups(d, mode, causal, device, monkeypatch):
    """The Gluon dk/dv kernel's tiles in groups of a few (batch, kv head)s (here 2 groups of 8:
    launchers._bwd_tile_heads) and in one group of all heads: the d128 dk/dv-only kernel (one
    program per tile), dq summed in the kernel in a fixed order (causal: from the last key
    block down either way) and in any order. Right against the reference; bitwise the same
    gradients either way where the order of the sums is fixed."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on sm_90 only")
    launched = _launched_kernels(monkeypatch)
    monkeypatch.setattr(fa_launchers, "GLUON_BWD_PERSISTENT_MAX_N", 0)
    q, k, v = qkv(4, 1000, 1100, 16, 4, d, torch.bfloat16, device)  # 9 key blocks x 16
    assert fa_launchers._bwd_tile_heads(16, 9, runtime.num_sms(device), False) == 8
    do = make(q.shape, q.dtype, device, seed=9)
    scale = 1 / math.sqrt(d)
    plan = fa_plans.plan_for(d, causal, torch.bfloat16)
    if mode != "dkdv":
        plan = fa_plans.Plan(plan.fwd, fa_plans.FUSED_DQ_DKDV, fa_plans.GLUON_FUSED_DQ)
    o, lse = fa_launchers.forward(q, k, v, causal, scale)
    _, _, grads64 = _run(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    _, _, grads_l = _run(attention_reference, q, k, v, do, None, causal=causal)
    grads = []
    for groups in (False, True):
        monkeypatch.setattr(fa_launchers, "GLUON_BWD_HEAD_GROUPS", groups)
        grads.append(fa_launchers.backward(do, q, k, v, o, lse, None, causal, scale, plan,
                                           deterministic=mode != "any-order"))  # fmt: skip
        for g, g64, gl, name in zip(grads[-1], grads64, grads_l, ("dq", "dk", "dv")):
            assert_close(g, g64, ref_lowp=gl, name=name)
    assert "attn_bwd_gluon_kernel" in launched
    assert ("attn_bwd_dq_kernel" in launched) == (mode == "dkdv")
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
def test_gpu_gluon_backward(shape, causal, stages, device, monkeypatch):
    """The Gluon dk/dv kernel (kernels_gluon.attn_bwd_gluon_kernel) with both ring depths, at
    d64 too (it ships for d128): GQA, Nq != Nk (bottom-right causal), ragged ends, a padded
    head dim (with GQA; in float16), one key block, fewer than 64 keys or query rows."""
    launched = _launched_kernels(monkeypatch)
    dtype = torch.float16 if shape in GLUON_BWD_FP16_SHAPES else torch.bfloat16
    q, k, v = qkv(*shape, dtype, device)
    base = fa_plans.plan_for(shape[-1], causal, q.dtype)
    gluon = fa_plans.Tile(64, 128, 4, stages, tma=True, gluon=True)
    _check_plan(fa_plans.Plan(base.fwd, gluon, base.dq), q, k, v, causal)
    if torch.cuda.get_device_capability()[0] == 9:
        assert "attn_bwd_gluon_kernel" in launched
        assert "attn_bwd_dkdv_kernel" not in launched


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "any-order"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape", HOPPER_GPU_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}-hkv{}-d{}".format(*s)
)
def test_gpu_gluon_fused_dq(shape, causal, deterministic, device, monkeypatch):
    """dq summed in the Gluon dk/dv kernel (`plans.GLUON_FUSED_DQ`; above
    launchers.GLUON_FUSED_DQ_MAX_D the dq kernel runs beside it): against the reference; in a
    fixed order the gradients are bitwise the same from run to run."""
    launched = _launched_kernels(monkeypatch)
    q, k, v = qkv(*shape, torch.bfloat16, device)
    base = fa_plans.plan_for(shape[-1], causal, q.dtype)
    tile = fa_plans.Tile(64, 128, 4, 2, tma=True, gluon=True)
    plan = fa_plans.Plan(base.fwd, tile, fa_plans.GLUON_FUSED_DQ)
    do = make(q.shape, q.dtype, q.device, seed=9)
    scale = 1 / math.sqrt(q.shape[-1])
    o, lse = fa_launchers.forward(q, k, v, causal, scale, plan)
    grads = fa_launchers.backward(do, q, k, v, o, lse, None, causal, scale, plan,
                                  deterministic=deterministic)  # fmt: skip
    _, _, grads64 = _run(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    _, _, grads_l = _run(attention_reference, q, k, v, do, None, causal=causal)
    for g, g64, gl, name in zip(grads, grads64, grads_l, ("dq", "dk", "dv")):
        assert_close(g, g64, ref_lowp=gl, name=name)
    if torch.cuda.get_device_capability()[0] == 9:
        fused = fa_plans.block_d_for(shape[-1]) <= fa_launchers.GLUON_FUSED_DQ_MAX_D
        assert "attn_bwd_gluon_kernel" in launched
        assert ("attn_bwd_dq_kernel" in launched) == (not fused)
        if deterministic:
            again = fa_launchers.backward(do, q, k, v, o, lse, None, causal, scale, plan)
            for g, h, name in zip(grads, again, ("dq", "dk", "dv")):
                assert torch.equal(g, h), name


@pytest.mark.gpu
def test_gpu_default_plan_takes_gluon_where_it_ships(device, monkeypatch):
    """d = 128 half precision on an sm_90 GPU, non-causal or causal (also Nq != Nk: the
    bottom-right diagonal): the default forward and dk/dv kernels are the Gluon ones; d = 64
    keeps the portable kernels at these lengths."""
    launched = _launched_kernels(monkeypatch)
    for d, causal, nk in ((128, False, 300), (128, True, 300), (128, True, 420), (64, False, 300),
                          (64, True, 300)):  # fmt: skip
        launched.clear()
        q, k, v = qkv(2, 300, nk, 4, 2, d, torch.bfloat16, device)
        check(q, k, v, causal=causal)
        hopper = torch.cuda.get_device_capability()[0] == 9
        assert ("attn_fwd_gluon_kernel" in launched) == (d == 128 and hopper)
        assert ("attn_bwd_gluon_kernel" in launched) == (d == 128 and hopper)


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


def test_replayed_launches_match_the_full_host_path():
    """Launch sequences recorded per layout and replayed (`replay`, through prepared launches)
    pass the same compiled kernels the same arguments, tensor for tensor, as the full host path
    through Triton's own launcher."""
    from pathlib import Path

    from kernelkit.shared.testing import assert_launch_paths_agree

    assert_launch_paths_agree(Path(__file__).with_name("launch_calls.py"))
