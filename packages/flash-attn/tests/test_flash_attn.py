"""flash-attn: outputs, LSE and gradients against a float64 evaluation of the reference.

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
"""

import math
from dataclasses import replace

import pytest
import torch

from kernelkit.flash_attn import (
    FlashAttentionFunction,
    explain,
    families,
    flash_attn,
    flash_attn_varlen,
)
from kernelkit.flash_attn import launch as fa_launch
from kernelkit.flash_attn import op as fa_op
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
    table_tiles,
    tile_heads,
)
from kernelkit.flash_attn.config import (
    BWD_GLUON,
    BWD_TRITON,
    DQ_ANY_ORDER,
    DQ_KERNEL,
    DQ_ORDERED,
    FWD_GLUON,
    FWD_SPLIT,
    FWD_TRITON,
    H100,
    BwdConfig,
    FwdConfig,
    Problem,
    Split,
    Target,
    Tile,
    Varlen,
    block_d_for,
    use_tma,
)
from kernelkit.flash_attn.families import kernel_name
from kernelkit.flash_attn.reference import (
    attention_reference,
    attention_reference_grads,
    attention_varlen_reference,
    attention_varlen_reference_grads,
)
from kernelkit.shared import replay
from kernelkit.shared.testing import assert_close, assert_graph_replays, run_without_interpreter

HALF = (torch.float16, torch.bfloat16)
# A GPU with TMA on which the Gluon kernels cannot run (an sm_100, say): where the chooser falls
# back to the portable kernels.
NO_GLUON = Target(interpreter=False, tma=True, gluon=False, sms=132)
# The Triton interpreter on CPU tensors (4 stand-in SMs), whatever runs these tests.
INTERPRETER = Target(interpreter=True, tma=True, gluon=False, sms=4)


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


def problems(q, k, v, causal=False, softcap=0.0, window_size=(-1, -1), varlen=None,
             deterministic=True, target=None, do=None):  # fmt: skip
    """(forward, backward) `Problem` of a flash_attn call on q, k, v (4-D, or packed with
    `varlen`: window_size per sequence, as flash_attn_varlen takes it) as `target` sees it
    (None: their device), for the chooser; the backward's output gradient `do`, or one
    contiguous like the tests' (`_check`)."""
    nq, nk = (q.shape[1], k.shape[1]) if varlen is None else (varlen.max_q, varlen.max_k)
    window = fa_validation.window_for(window_size, causal, nq, nk)
    if do is None:
        do = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return (
        fa_launch.forward_problem(q, k, v, causal, softcap, window, varlen, target),
        fa_launch.backward_problem(
            do, q, k, v, causal, softcap, window, varlen, deterministic, target
        ),
    )


def meta_problem(b, nq, nk, h, hkv, d, dtype=torch.bfloat16, causal=False, window_size=(-1, -1),
                 softcap=0.0, packed=False, deterministic=True, target=H100) -> Problem:  # fmt: skip
    """The (backward's) `Problem` of a call on meta tensors (nothing allocated or read), as an
    H100 sees it by default; packed: b sequences of nq query and nk key rows. The forward's
    chooser reads the same fields."""
    if packed:
        q = torch.empty(b * nq, h, d, dtype=dtype, device="meta")
        k = torch.empty(b * nk, hkv, d, dtype=dtype, device="meta")
        cu = torch.empty(b + 1, dtype=torch.int32, device="meta")
        varlen = Varlen(cu, cu, nq, nk)
    else:
        q = torch.empty(b, nq, h, d, dtype=dtype, device="meta")
        k = torch.empty(b, nk, hkv, d, dtype=dtype, device="meta")
        varlen = None
    window = fa_validation.window_for(window_size, causal, nq, nk)
    return Problem.of(q, k, k, causal, window, softcap, varlen, q, deterministic, target)


def with_configs(fwd: FwdConfig | None = None, bwd: BwdConfig | None = None,
                 deterministic: bool = True):  # fmt: skip
    """flash_attn (4-D q, k, v) as the registered ops run it, but through
    `launch.forward(config=fwd)` and `launch.backward(config=bwd)` (None: the chooser's): for
    `_check` on configs of a test's own."""

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale, softcap, window):
            o, lse = fa_launch.forward(q, k, v, causal, scale, softcap=softcap, window=window,
                                       config=fwd)  # fmt: skip
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.options = causal, scale, softcap, window
            ctx.set_materialize_grads(False)  # an unused output's gradient stays None
            return o, lse

        @staticmethod
        def backward(ctx, do, dlse):
            q, k, v, o, lse = ctx.saved_tensors
            causal, scale, softcap, window = ctx.options
            if do is None:
                do = torch.zeros_like(o)
            grads = fa_launch.backward(do, q, k, v, o, lse, dlse, causal, scale, softcap=softcap,
                                       window=window, deterministic=deterministic, config=bwd)  # fmt: skip
            return (*grads, None, None, None, None)

    def fn(q, k, v, causal=False, softmax_scale=None, return_lse=False, window_size=(-1, -1),
           softcap=0.0):  # fmt: skip
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        window = fa_validation.window_for(window_size, causal, q.shape[1], k.shape[1])
        o, lse = Attention.apply(q, k, v, causal, scale, softcap, window)
        return (o, lse) if return_lse else o

    return fn


def check_with_configs(q, k, v, causal=False, fwd=None, bwd=None, deterministic=True, with_dlse=True,
                  **options):  # fmt: skip
    """`check` of a call through configs of the test's own (`with_configs`)."""
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    fn = with_configs(fwd, bwd, deterministic)
    return _check(fn, attention_reference, q, k, v, lse_shape, with_dlse, causal=causal, **options)


def table_fwd(p: Problem) -> FwdConfig:
    """The portable forward with the table's tile for `p` (the dense kernel, where the chooser
    might take the split-KV or the Gluon one)."""
    return portable_fwd_config(p, table_tiles(p)[0])


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
    pf, pb = problems(bad["q"], bad["k"], bad["v"], causal, window_size=window)
    fwd, bwd = table_fwd(pf), choose_bwd(pb)  # the dense forward (not split-KV), its table tile
    o, lse = fa_launch.forward(bad["q"], bad["k"], bad["v"], causal, scale, window=window_arg,
                               config=fwd)  # fmt: skip
    grads = fa_launch.backward(bad["do"], bad["q"], bad["k"], bad["v"], o, lse, None, causal,
                               scale, window=window_arg, config=bwd)  # fmt: skip
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


def test_masked_forward_config():
    """Windows with a left edge and packed batches read K/V through TMA in the forward at
    d >= 128 (their pointer tile spills; NOTES.md); as on an H100."""
    for masked in (dict(window_size=(256, -1)), dict(packed=True)):
        cfg = choose_fwd(meta_problem(2, 1024, 1024, 8, 2, 128, causal=True, **masked))
        assert cfg.kernel == FWD_TRITON and replace(cfg.tile, tma=False) == T.FWD_TILES[128]
        assert cfg.tma
        assert "Gluon" not in cfg.why
        cfg = choose_fwd(meta_problem(2, 1024, 1024, 8, 2, 64, **masked))
        assert cfg.kernel == FWD_TRITON and not cfg.tma
    cfg = choose_fwd(meta_problem(2, 1024, 1024, 8, 2, 128, causal=True))
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
    # The rule only changes the forward's tile.
    cfg = choose_bwd(meta_problem(1, 1024, 1024, 1, 1, 64, causal=True))
    assert cfg.kernel == BWD_TRITON and (cfg.dkdv, cfg.dq) == T.CAUSAL_TILES[64][1:]


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


def _grads_with(cfg_change, calls, causal):
    """The gradients of `calls` ((q, k, v, do, dlse, window_size, packed) each: 4-D, or packed
    with packed = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)) through
    launch.backward with the chooser's config changed by `cfg_change` (the forward: the
    chooser's), and the chosen configs. dlse is the LSE's gradient or None (rows that see no
    key get none, as through autograd)."""
    grads, chosen_configs = [], []
    for q, k, v, do, dlse, window_size, packed_args in calls:
        varlen = None if packed_args is None else Varlen(*packed_args)
        pb = problems(q, k, v, causal, window_size=window_size, varlen=varlen, do=do)[1]
        window = fa_validation.window_for(window_size, causal, pb.nq, pb.nk)
        scale = 1 / math.sqrt(q.shape[-1])
        o, lse = fa_launch.forward(q, k, v, causal, scale, window=window, varlen=varlen)
        if dlse is not None:
            dlse = torch.where(torch.isfinite(lse), dlse, 0.0)
        chosen = choose_bwd(pb)
        chosen_configs.append(chosen)
        grads += fa_launch.backward(do, q, k, v, o, lse, dlse, causal, scale, window=window,
                                    varlen=varlen, config=cfg_change(chosen))  # fmt: skip
    return grads, chosen_configs


def _varlen_args(kw):
    return kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"], kw["max_seqlen_k"]


@pytest.mark.parametrize("causal", [True, False])
def test_peel_ragged_tail_switch(causal, device):
    """The chosen config's `peel_tail` (the backward's partial last block checked on its own)
    gives the gradients of the all-checked loops (`peel_tail=False`), bitwise: packed ragged
    lengths, and a ragged dense batch whose k/v rows are misaligned (pointer loads: the dq
    loop's key checks are peeled too)."""
    q, k, v, kw = packed([70, 33, 0, 64, 5], [70, 40, 9, 64, 5], 4, 2, 32, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=5)
    q2, do2 = (make((2, 45, 2, 16), torch.float32, device, s) for s in (0, 5))
    k2, v2 = (make((2, 71, 1, 17), torch.float32, device, s)[..., 1:] for s in (1, 2))
    calls = [(q, k, v, do, None, (-1, -1), _varlen_args(kw)),
             (q2, k2, v2, do2, None, (-1, -1), None)]  # fmt: skip
    peeled, configs = _grads_with(lambda cfg: cfg, calls, causal)
    assert all(cfg.peel_tail for cfg in configs)
    checked, _ = _grads_with(lambda cfg: replace(cfg, peel_tail=False), calls, causal)
    for a, b, name in zip(peeled, checked, ("dq", "dk", "dv") * 2):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("causal", [True, False])
def test_pad_row_vectors_switch(causal, device):
    """The chosen config's `pad_rows` (the backward reads lse2 and delta from padded copies,
    without row checks) gives the gradients of the checked reads (`pad_rows=False`), bitwise:
    packed ragged lengths with an empty sequence and rows that see no key, a ragged dense batch
    read through TMA, and one through pointers (misaligned q and do) with a window; all with an
    LSE gradient."""
    q, k, v, kw = packed([70, 33, 0, 64, 5], [70, 20, 9, 64, 5], 4, 2, 32, torch.bfloat16, device)
    do, dlse = make(q.shape, q.dtype, device, seed=5), make((4, 172), torch.float32, device, 6)
    q2, k2, v2, do2 = (make((2, 45, 2, 32), torch.bfloat16, device, s) for s in range(4))
    q3, do3 = (make((2, 45, 2, 17), torch.float32, device, s)[..., 1:] for s in (0, 5))
    k3, v3 = (make((2, 71, 1, 16), torch.float32, device, s) for s in (1, 2))
    dlse2 = make((2, 2, 45), torch.float32, device, seed=7)
    calls = [(q, k, v, do, dlse, (-1, -1), _varlen_args(kw)),
             (q2, k2, v2, do2, dlse2, (-1, -1), None),
             (q3, k3, v3, do3, dlse2, (20, 0 if causal else 3), None)]  # fmt: skip
    padded, configs = _grads_with(lambda cfg: cfg, calls, causal)
    assert all(cfg.pad_rows for cfg in configs)
    assert not configs[2].dkdv_tma  # (misaligned q and do: pointer loads)
    checked, _ = _grads_with(lambda cfg: replace(cfg, pad_rows=False), calls, causal)
    for a, b, name in zip(padded, checked, ("dq", "dk", "dv") * 3):
        assert torch.equal(a, b), name


def test_pad_row_vectors_rule():
    """Padded row vectors for packed batches, ragged lengths and BLOCK_D <= 64; dense
    block-multiple d >= 128 keeps the plain ones for the portable kernels (the Gluon backward
    always reads padded ones); a config may turn them off wherever the portable kernels run."""

    def pad(nq, d, target=NO_GLUON, **kw):
        return choose_bwd(meta_problem(2, nq, nq, 4, 2, d, target=target, **kw)).pad_rows

    assert pad(256, 128, packed=True)
    assert pad(1000, 128)
    assert pad(1024, 64)
    assert not pad(1024, 128)
    assert not pad(1024, 128, causal=True)
    assert not pad(1024, 128, target=INTERPRETER)
    assert pad(1024, 128, target=H100)  # the Gluon dk/dv kernel
    p = meta_problem(2, 1000, 1000, 4, 2, 64, packed=True)
    cfg = choose_bwd(p)
    assert cfg.kernel == BWD_TRITON and cfg.pad_rows
    assert check_bwd(p, replace(cfg, pad_rows=False)) == replace(cfg, pad_rows=False)
    p = meta_problem(2, 1024, 1024, 4, 2, 128)
    with pytest.raises(ValueError, match="reads the padded row vectors"):
        check_bwd(p, replace(choose_bwd(p), pad_rows=False))


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
# Under the interpreter the target has 4 stand-in SMs and the split rule is small
# (tables.INTERPRETER_SPLIT_RULE), so a few dozen keys already take several splits; the backward
# is the dense kernels' either way.
# ------------------------------------------------------------------------------------------


def _split(b, nq, nk, h, hkv, d, dtype=torch.bfloat16, num_splits=None, tile=None, left=-1):
    """split_config of a dense call on meta tensors as an H100 sees it: None (the dense
    forward), or (tile, splits, split_len, start)."""
    p = meta_problem(b, nq, nk, h, hkv, d, dtype, window_size=(left, -1))
    cfg = split_config(p, num_splits, tile)
    if cfg is None:
        return None
    assert cfg.kernel == FWD_SPLIT and cfg.tma == cfg.tile.tma and cfg.why.startswith("split-KV")
    if num_splits is None and tile is None:  # the chooser takes it
        assert choose_fwd(p) == cfg
    return cfg.tile, cfg.split.splits, cfg.split.split_len, cfg.split.start


def test_split_config_rule():
    """The GPU rule, for an H100's 132 SMs."""
    decode = Tile(16, *T.SPLIT_TILES[128])
    # Decode, GQA 32/8: 64 query tiles; one wave: 132 // 64 = 2 splits of 128-key blocks.
    assert _split(8, 1, 4096, 32, 8, 128) == (decode, 2, 2048, 0)
    assert _split(8, 1, 32768, 32, 8, 128) == (decode, 2, 16384, 0)
    # Speculative decoding: 4 query heads x 16 queries = 64 packed rows, one tile.
    tile, splits, *_ = _split(8, 16, 8192, 32, 8, 128)
    assert tile.block_m == 64 and splits == 2
    # Training shapes fill the GPU: the dense forward.
    assert _split(8, 4096, 4096, 32, 8, 128) is None
    assert _split(1, 4096, 4096, 32, 32, 128) is None
    assert choose_fwd(meta_problem(8, 4096, 4096, 32, 8, 128)).kernel == FWD_GLUON
    # Few query rows but many batches: the split kernel, unsplit (GQA packing still pays).
    assert _split(128, 1, 4096, 32, 8, 128)[1] == 1
    # Larger Nq that still underfills: 64 rows need 16 * 64 keys per split.
    assert _split(1, 64, 65536, 1, 1, 128)[1] == 64
    # 128 packed rows take the dense forward's tile.
    tile, splits, *_ = _split(8, 32, 4096, 32, 8, 128)
    assert tile == T.FWD_TILES[128] and splits == 2
    assert _split(8, 1, 4096, 32, 8, 128, torch.float32)[0] == Tile(16, *T.SPLIT_FP32_TILES[128])
    # A forced count: runs of whole key blocks of one length (5 blocks in 4 splits: 2, 2, 1).
    assert _split(1, 1, 600, 4, 1, 64, num_splits=4)[1:3] == (3, 256)
    assert _split(1, 1, 600, 4, 1, 64, num_splits=99)[1] == 5
    # A sliding window: only the keys from the first query's window on are split.
    assert _split(8, 1, 32768, 32, 8, 128, left=4095) == (decode, 2, 2048, 28672)


def takes_split_path(q, k, v, causal=False) -> bool:
    """The chooser takes the split-KV forward. Under the interpreter (a 4-SM stand-in) these
    small shapes split the keys several ways; a real GPU gives them one split (several splits
    are forced in test_split_counts_agree_with_dense and run at large shapes on the GPU)."""
    cfg = families.probe_forward(q, k, v, causal, q.shape[-1] ** -0.5).config
    interpreted = Target.of(q.device).interpreter
    return cfg.kernel == FWD_SPLIT and (cfg.split.splits >= 2 or not interpreted)


# (B, Nq, Nk, H, Hkv, D, dtype, causal)
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
    """The chooser takes the split path; o, LSE and gradients (through the dense
    backward, from the split forward's o and LSE) against the reference."""
    *shape, dtype, causal = case
    q, k, v = qkv(*shape, dtype, device)
    assert takes_split_path(q, k, v, causal)
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
    p = problems(q, k, v, True)[0]
    o_d, lse_d = fa_launch.forward(q, k, v, True, scale, config=table_fwd(p))
    o64, lse64 = attention_reference(q.double(), k.double(), v.double(), True, return_lse=True)
    pointer = Tile(32, 16, 4, 1, tma=False)
    for n, tile in ((1, None), (2, None), (3, pointer), (5, None)):
        split = split_config(p, num_splits=n, tile=tile)
        assert split.kernel == FWD_SPLIT and (tile is None or not split.tma)
        o, lse = fa_launch.forward(q, k, v, True, scale, config=split)
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
    assert not k.is_contiguous() and takes_split_path(q, k, v, causal=True)
    check(q, k, v, causal=True)


def test_split_kv_deterministic(device):
    q, k, v = qkv(2, 1, 90, 4, 2, 32, torch.bfloat16, device)
    assert takes_split_path(q, k, v, causal=True)
    first = flash_attn(q, k, v, causal=True, return_lse=True)
    second = flash_attn(q, k, v, causal=True, return_lse=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_split_kv_opcheck(device):
    """The registered forward on a split-path shape (fake tensors, dynamic shapes)."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, 70, 4, 2, 32, torch.float32, device))
    assert takes_split_path(q, k, v, causal=True)
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_fwd, (q, k, v, True, 0.25))


def test_split_kv_torch_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(
        lambda q, k, v: flash_attn(q, k, v, causal=True, return_lse=True),
        fullgraph=True,
        backend=backend,
    )
    q, k, v = qkv(1, 2, 70, 4, 2, 32, torch.float32, device)
    assert takes_split_path(q, k, v, causal=True)
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
# The Gluon kernels on Hopper (gluon/fwd.py, gluon/bwd.py: the FWD_GLUON / BWD_GLUON configs).
# GPU-only: Gluon has no interpreter; their launches are compile-checked on CPU below, from the
# host path probed as on an H100 (`target=H100`).
# ------------------------------------------------------------------------------------------


def _check_launches(fwd, bwd, q, k, v, causal, deterministic=True):
    """launch.forward/backward with configs `fwd` and `bwd` (None: the chooser's) against the
    float64 reference and, no worse than twice its error, the reference evaluated in q's
    dtype."""
    do = make(q.shape, q.dtype, q.device, seed=9)
    scale = 1 / math.sqrt(q.shape[-1])
    o, lse = fa_launch.forward(q, k, v, causal, scale, config=fwd)
    grads = fa_launch.backward(do, q, k, v, o, lse, None, causal, scale,
                               deterministic=deterministic, config=bwd)  # fmt: skip
    o64, lse64, grads64 = _run(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    o_l, _, grads_l = _run(attention_reference, q, k, v, do, None, causal=causal)
    assert_close(o, o64, ref_lowp=o_l, name="o")
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(lse64.cpu()))
    assert_close(_finite(lse), _finite(lse64), bound=2e-5, name="lse")
    for g, g64, gl, name in zip(grads, grads64, grads_l, ("dq", "dk", "dv")):
        assert_close(g, g64, ref_lowp=gl, name=name)
    return o, lse, grads


def _need_sm90(device) -> None:
    """Skip where a test's Gluon configs cannot run (a GPU other than sm_90: check_* refuses
    them; the CPU and interpreter runs compile-check their launches instead)."""
    if not Target.of(device).gluon:
        pytest.skip("the Gluon kernels run on sm_90 only")


def _names(probe) -> list[str]:
    """The kernels a probe recorded, by name, in launch order."""
    return [kernel_name(kernel) for kernel, *_ in probe.launches]


def _probe_backward_as_on_h100(cfg, do, q, k, v, causal, deterministic=True) -> replay.Probe:
    """The backward's launches with config `cfg` for CPU tensors taken as on an H100 (TMA-aligned
    on sm_90), recorded instead of run; q stands in for the output, zeros for the LSE."""
    probe = replay.Probe()
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    fa_launch._backward(probe, do, q, k, v, q, lse, None, causal, 0.125, 0.0, (-1, -1), None,
                        deterministic, cfg, H100)  # fmt: skip
    return probe


def test_gluon_forward_launches_are_compile_checked():
    """The Gluon forward (gluon/fwd.py) runs only on an sm_90 GPU (Gluon has no interpreter):
    here its launches are probed as on an H100 (`target=H100`: CPU tensors taken as TMA-aligned
    on Hopper, softcap through tanh.approx as for half precision on a GPU) and recorded for the
    end-of-session compile check, which lowers them to TTGIR for sm_90. GQA, Nq != Nk, ragged
    ends, a padded head dim, causal (single tiles, and pairs of a long and a short query block)
    and softcap."""
    from kernelkit.shared.compile_check import record_launch

    launches = []
    cases = [(64, False, (128, 64, 3), 0.0, 300), (80, False, (128, 128, 2), 0.0, 300),
             (128, True, (128, 128, 2), 30.0, 300), (64, True, (128, 128, 2), 0.0, 256)]  # fmt: skip
    for d, causal, tile, softcap, nq in cases:
        q, k, v = qkv(2, nq, 260, 4, 2, d, torch.bfloat16, "cpu")
        p = fa_launch.forward_problem(q, k, v, causal, softcap, target=H100)
        cfg = check_fwd(p, gluon_fwd_config(p, Tile(*tile[:2], 4, tile[2], tma=True)))
        assert cfg.fast_tanh == (softcap > 0) and cfg.pairs == (causal and nq == 256)
        probe = replay.Probe()
        fa_launch._forward(probe, q, k, v, causal, 0.125, softcap, (-1, -1), None, cfg, H100)
        launches += probe.launches
    assert [kernel_name(kernel) for kernel, *_ in launches] == ["attn_fwd_gluon_kernel"] * 4
    assert launches[2][3]["SOFTCAP"] and not launches[0][3]["SOFTCAP"]
    assert [kw["PAIRS"] for *_, kw in launches] == [False, False, False, True]
    for kernel, _, args, kwargs in launches:
        record_launch(kernel, args, kwargs)


def test_gluon_backward_launches_are_compile_checked():
    """The Gluon dk/dv kernel (gluon/bwd.py, attn_bwd_gluon_kernel) runs only on an sm_90 GPU:
    its launches are probed as on an H100 and recorded for the compile check, as the forward's
    above. GQA with ragged ends and Nq != Nk (causal), a padded head dim, both ring depths; dq
    summed in the kernel in both orders."""
    from kernelkit.shared.compile_check import record_launch

    gluon = []
    cases = [(64, True, 2, (300, 260)), (80, False, 3, (300, 300)), (128, True, 2, (260, 300)),
             (128, False, 3, (256, 256))]  # fmt: skip
    for d, causal, stages, (nq, nk) in cases:
        q, k, v = qkv(2, nq, nk, 4, 2, d, torch.bfloat16, "cpu")
        do = torch.randn_like(q)
        p = fa_launch.backward_problem(do, q, k, v, causal, target=H100)
        tile = Tile(64, 128, 4, stages, tma=True)
        cfg = check_bwd(p, gluon_bwd_config(p, tile, DQ_KERNEL, T.INTERPRETER_DQ))
        assert cfg.persistent and not cfg.kv_regs and cfg.dq == T.INTERPRETER_DQ
        probe = _probe_backward_as_on_h100(cfg, do, q, k, v, causal)
        assert _names(probe) == ["attn_bwd_preprocess_kernel", "attn_bwd_gluon_kernel",
                                 "attn_bwd_dq_kernel"]  # fmt: skip
        gluon.append(probe.launches[1])
    assert [kw["CAUSAL"] for *_, kw in gluon] == [True, False, True, False]
    assert [kw["STAGES"] for *_, kw in gluon] == [2, 3, 2, 3]
    # dq summed in the Gluon kernel: its launches run only there, the portable preprocess
    # (ZERO_DQ) and dq conversion included.
    fused = []
    for deterministic in (True, False):
        q, k, v = qkv(2, 300, 260, 4, 2, 64, torch.bfloat16, "cpu")
        do = torch.randn_like(q)
        p = fa_launch.backward_problem(do, q, k, v, True, deterministic=deterministic,
                                       target=H100)  # fmt: skip
        mode = DQ_ORDERED if deterministic else DQ_ANY_ORDER
        cfg = check_bwd(p, gluon_bwd_config(p, T.FUSED_DQ_DKDV, mode))
        fused += _probe_backward_as_on_h100(cfg, do, q, k, v, True, deterministic).launches
    names = [kernel_name(kernel) for kernel, *_ in fused]
    assert names == ["attn_bwd_preprocess_kernel", "attn_bwd_gluon_kernel",
                     "attn_bwd_dq_convert_kernel"] * 2  # fmt: skip
    assert [kw["DQ_MODE"] for *_, kw in fused[1::3]] == [2, 1]
    assert [kw["KV_REGS"] for *_, kw in fused[1::3]] == [True, True]
    assert [kw["ZERO_DQ"] for *_, kw in fused[::3]] == [True, True]
    for kernel, _, args, kwargs in gluon + fused:
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
    # float32 inputs: the tables never ask for the Gluon kernels; the float32 tiles.
    cfg = choose_bwd(meta_problem(1, 100, 100, 2, 2, 128, torch.float32, causal=True))
    assert cfg.kernel == BWD_TRITON and cfg.dkdv == T.FP32_TILES[128][1] and cfg.dkdv_tma
    assert cfg.why == "the tables' tiles"
    _check_launches(fwd, bwd, q, k, v, True)
    # d64: the portable causal dk/dv tile (what a Gluon one fell back to before configs), with
    # the interpreter's forward and dq tiles, on any device.
    q, k, v = qkv(1, 70, 90, 2, 1, 64, torch.bfloat16, device)
    pf, pb = problems(q, k, v, True)
    fwd = portable_fwd_config(pf, T.INTERPRETER_FWD)
    _check_launches(
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
        _check_launches(fwd, bwd, q, k, v, True)
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
    p64 = replace(p, head_dim=64)
    fwd, bwd = choose_fwd(p), choose_bwd(p)
    fused = gluon_bwd_config(p64, T.FUSED_DQ_DKDV, DQ_ORDERED)
    portable = portable_bwd_config(p, *T.CAUSAL_TILES[128][1:])
    interp = meta_problem(1, 100, 100, 2, 1, 32, torch.float32, causal=True, softcap=5.0,
                          target=INTERPRETER)  # fmt: skip
    packed = meta_problem(2, 100, 100, 2, 1, 64, packed=True)
    split = split_config(meta_problem(2, 1, 4096, 8, 2, 64))
    return [
        # Gluon forward
        (check_fwd, replace(p, dtype=torch.float32), fwd, "float32 inputs"),
        (check_fwd, replace(p, head_dim=256), fwd, "head dim 256 (BLOCK_D 64 or 128 only)"),
        (check_fwd, replace(p, tma_q=False), fwd, "q, k, v rows not 16-byte aligned for TMA"),
        (check_fwd, replace(p, left=256), fwd, "a window edge or a packed batch"),
        (check_fwd, replace(p, packed=True), fwd, "a window edge or a packed batch"),
        (check_fwd, replace(p, right=3), fwd, "a window edge or a packed batch"),
        (check_fwd, replace(p, softcap=True), fwd, "softcap only through tanh.approx"),
        (check_fwd, p, replace(fwd, tile=Tile(64, 128, 4, 2, tma=True)), "BLOCK_M must be 128"),
        (check_fwd, replace(p, target=NO_GLUON), fwd, "not an sm_90 GPU"),
        # Gluon backward
        (check_bwd, replace(p, dtype=torch.float32), bwd, "float32 inputs"),
        (check_bwd, replace(p, tma_do=False), bwd, "q, k, v, do rows not 16-byte aligned"),
        (check_bwd, p, replace(bwd, dkdv_tma=False), "q, k, v, do rows not 16-byte aligned"),
        (check_bwd, replace(p, softcap=True), bwd, "softcap"),
        (check_bwd, replace(p, left=100), bwd, "a window edge or a packed batch"),
        (check_bwd, p, replace(bwd, dkdv=Tile(64, 64, 4, 2, tma=True)), "BLOCK_N must be 128"),
        (check_bwd, p, replace(fused, dkdv=bwd.dkdv), "dq summed in the kernel only up to BLOCK_D 64"),
        (check_bwd, p, replace(bwd, kv_regs=True), "a dq tile and K/V in shared memory"),
        (check_bwd, p, replace(bwd, dq=None), "a dq tile and K/V in shared memory"),
        (check_bwd, p64, replace(fused, persistent=True), "run one program per tile"),
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


@pytest.mark.parametrize("case", range(39))
def test_check_errors_name_the_reason(case):
    """check_fwd / check_bwd (what launch.forward / backward do with a config passed in) accept
    a config only where its kernels can run the call, else raise a ValueError naming the config
    and the reason (the backend's `can_implement`)."""
    cases = _check_error_cases()
    assert len(cases) == 39
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
    """Where the Gluon kernels ship (choose.py, tables.py; H100 A/B), as on an H100: the d128
    dk/dv kernel, causal or not, not for a window's left edge or a packed batch, nor d64 at
    these lengths or float32; the d64 forward from GLUON_FWD_MIN_N query rows on (causal: fewer)
    for a grid that fills the GPU."""
    for causal in (False, True):
        cfg = choose_bwd(meta_problem(2, 1024, 1024, 8, 2, 128, causal=causal))
        assert cfg.kernel == BWD_GLUON and cfg.dq_mode == DQ_KERNEL
        assert cfg.dkdv == T.GLUON_DKDV_TILES[128][causal] and cfg.why
        for masked in (dict(window_size=(256, -1)), dict(packed=True)):
            p = meta_problem(2, 1024, 1024, 8, 2, 128, causal=causal, **masked)
            assert choose_bwd(p).kernel == BWD_TRITON
        assert choose_bwd(meta_problem(2, 1024, 1024, 8, 2, 64, causal=causal)).kernel == BWD_TRITON
        p = meta_problem(2, 1024, 1024, 8, 2, 128, torch.float32, causal=causal)
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
    """Half-precision d64 backwards from FUSED_DQ_MIN_N query rows on sum dq in the Gluon kernel
    in a fixed order; with deterministic=False from ANY_ORDER_DQ_MIN_N rows on (fewer); shorter
    ones keep the portable kernels and d128 its Gluon dk/dv kernel with the dq kernel beside.
    As on an H100."""
    for deterministic, table, mode in ((True, T.FUSED_DQ_MIN_N, DQ_ORDERED),
                                       (False, T.ANY_ORDER_DQ_MIN_N, DQ_ANY_ORDER)):  # fmt: skip
        for causal in (False, True):
            opts = dict(causal=causal, deterministic=deterministic)
            n = table[64][causal]
            if n is None:
                long = meta_problem(1, 1 << 20, 1 << 20, 2, 1, 64, **opts)
                assert choose_bwd(long).kernel == BWD_TRITON
                continue
            p = meta_problem(1, n, n, 2, 1, 64, **opts)
            cfg = choose_bwd(p)
            assert cfg == gluon_bwd_config(p, T.FUSED_DQ_DKDV, mode)
            assert (cfg.kernel, cfg.dkdv, cfg.dq_mode, cfg.dq) == (BWD_GLUON, T.FUSED_DQ_DKDV,
                                                                   mode, None)  # fmt: skip
            assert cfg.kv_regs and not cfg.persistent and f"from {n} query rows" in cfg.why
            shorter = choose_bwd(meta_problem(1, n - 1, n - 1, 2, 1, 64, **opts))
            tables = T.CAUSAL_TILES[64][1:] if causal else (T.DKDV_TILES[64], T.DQ_TILES[64])
            assert shorter.kernel == BWD_TRITON and (shorter.dkdv, shorter.dq) == tables
            cfg128 = choose_bwd(meta_problem(1, 1 << 20, 1 << 20, 2, 1, 128, **opts))
            assert (cfg128.kernel, cfg128.dq_mode) == (BWD_GLUON, DQ_KERNEL)
            assert cfg128.dkdv == T.GLUON_DKDV_TILES[128][causal]
            # The forward does not read `deterministic`.
            assert choose_fwd(p) == choose_fwd(replace(p, deterministic=not deterministic))
    for causal in (False, True):
        assert T.ANY_ORDER_DQ_MIN_N[64][causal] < T.FUSED_DQ_MIN_N[64][causal]


def test_deterministic_option_launches():
    """As on an H100: a d64 causal backward of ANY_ORDER_DQ_MIN_N rows runs the Gluon kernel
    summing dq in any order (DQ_MODE 1, K/V in registers) and no dq kernel with
    deterministic=False, the dq kernel by default; from FUSED_DQ_MIN_N rows on the default sums
    dq in the Gluon kernel in a fixed order (DQ_MODE 2). A window's left edge keeps the dq
    kernel. Probed on meta tensors (nothing allocated or launched)."""

    def backward(n, window, deterministic):
        q = torch.empty(1, n, 2, 64, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, n, 1, 64, dtype=torch.bfloat16, device="meta")
        lse = torch.empty(1, 2, n, device="meta")
        w = fa_validation.window_for(window, True, n, n)
        probe = families.probe_backward(q, q, k, k, q, lse, None, True, 0.125, 0.0, w, None,
                                        deterministic, H100)  # fmt: skip
        gluon = [kw for kernel, _, _, kw in probe.launches
                 if kernel_name(kernel) == "attn_bwd_gluon_kernel"]  # fmt: skip
        return _names(probe), [(kw["DQ_MODE"], kw["KV_REGS"]) for kw in gluon]

    n = T.ANY_ORDER_DQ_MIN_N[64][1]
    names, modes = backward(n, (-1, -1), False)
    assert "attn_bwd_dq_kernel" not in names and "attn_bwd_dq_convert_kernel" in names
    assert modes == [(1, True)]
    names, modes = backward(n, (-1, -1), True)
    assert "attn_bwd_dq_kernel" in names and modes == []  # (d64 dk/dv: the portable kernel)
    names, modes = backward(T.FUSED_DQ_MIN_N[64][1], (-1, -1), True)
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
def test_gpu_fused_dq_by_rule(causal, deterministic, device):
    """The Gluon kernel summing dq (K/V in registers) where the chooser takes it: from
    FUSED_DQ_MIN_N / ANY_ORDER_DQ_MIN_N query rows on (probed at that length, as on an H100);
    that config (gluon_bwd_config) run at a test's size through the op's autograd path, with GQA,
    Nq != Nk and the LSE's gradient; deterministic: bitwise the same gradients on a second
    run."""
    table, mode = ((T.FUSED_DQ_MIN_N, DQ_ORDERED) if deterministic
                   else (T.ANY_ORDER_DQ_MIN_N, DQ_ANY_ORDER))  # fmt: skip
    n = table[64][causal]
    rule = meta_problem(2, n, n + 100, 8, 2, 64, causal=causal, deterministic=deterministic)
    assert choose_bwd(rule) == gluon_bwd_config(rule, T.FUSED_DQ_DKDV, mode)
    _need_sm90(device)
    q, k, v = qkv(2, 1000, 1100, 8, 2, 64, torch.bfloat16, device)
    pb = problems(q, k, v, causal, deterministic=deterministic)[1]
    cfg = check_bwd(pb, gluon_bwd_config(pb, T.FUSED_DQ_DKDV, mode))
    assert cfg.kv_regs and cfg.dq is None and choose_bwd(pb).kernel == BWD_TRITON
    _, _, grads = check_with_configs(q, k, v, causal, bwd=cfg, deterministic=deterministic)
    if deterministic:
        _, _, again = check_with_configs(q, k, v, causal, bwd=cfg, deterministic=deterministic)
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


def test_explain_shows_the_configs(device):
    """explain() returns what each direction runs as the chooser's config (forward_config,
    backward_config), each with a non-empty `why`, and its text shows them: for this device's
    tensors (target None), and as an H100 or a GPU without the Gluon kernels would run them."""
    q, k, v = qkv(2, 300, 280, 4, 2, 128, torch.bfloat16, device)
    for target in (None, H100, NO_GLUON):
        e = explain(q, k, v, causal=True, target=target)
        pf, pb = problems(q, k, v, True, target=target)
        assert isinstance(e.forward_config, FwdConfig) and isinstance(e.backward_config, BwdConfig)
        assert e.forward_config == choose_fwd(pf) and e.backward_config == choose_bwd(pb)
        assert e.forward_config.why == choose_fwd(pf).why
        text = str(e)
        assert text.startswith(f"forward: {e.forward_config}\n  why: {e.forward_config.why}\n")
        assert f"\nbackward: {e.backward_config}\n  why: {e.backward_config.why}\n" in text
        for cfg, family in ((e.forward_config, e.forward), (e.backward_config, e.backward)):
            assert cfg.why and str(cfg) and f"  family: {family}\n" in text
    e = explain(q, k, v, causal=True, target=H100)
    assert (e.forward_config.kernel, e.backward_config.kernel) == (FWD_GLUON, BWD_GLUON)
    assert e.backward_config.why == "Gluon dk/dv at d128, dq kernel beside it"
    e = explain(q, k, v, causal=True, target=NO_GLUON)
    assert e.forward_config.why.startswith("the Gluon forward cannot run: not an sm_90 GPU")
    # Decoding, from meta tensors: the split-KV forward, its splits in the text.
    q = torch.empty(2, 1, 8, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 4096, 2, 64, dtype=torch.bfloat16, device="meta")
    e = explain(q, k, k, causal=True, target=H100)
    assert e.forward_config.kernel == FWD_SPLIT and e.forward_config.why.startswith("split-KV")
    assert f"splits={e.forward_config.split.splits}x" in str(e)


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


def _concrete(cfg):
    """`cfg` with fields chosen from symbolic sizes (SymBool, SymInt) made concrete (guards)."""
    plain = {}
    for name in ("pad_rows", "pairs", "persistent", "tile_heads"):
        x = getattr(cfg, name, None)
        if isinstance(x, (torch.SymBool, torch.SymInt)):
            plain[name] = bool(x) if isinstance(x, torch.SymBool) else int(x)
    return replace(cfg, **plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dynamic_shapes_with_gpu_configs(dtype, device):
    """Dynamic-shape tracing (symbolic sizes, as opcheck's aot_dispatch_dynamic and
    torch.compile(dynamic=True) trace the ops' fakes: `families.probe_*`) through the GPU tile
    tables and rules, which the interpreter's target bypasses: as on an H100 and on a GPU without
    the Gluon kernels, the probes take the configs of the concrete call (the head dim and the
    flags concrete) and allocate outputs like its. The portable configs run here too, against
    the reference."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    for d in (32, 128):
        q, k, v = qkv(1, 19, 21, 2, 1, d, dtype, device)
        mode = FakeTensorMode(shape_env=ShapeEnv())
        dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
        fake = [mode.from_tensor(t, symbolic_context=dynamic, source=ConstantSource(name))
                for t, name in zip((q, k, v), "qkv")]  # fmt: skip
        assert isinstance(fake[0].shape[1], torch.SymInt)
        for target in (H100, NO_GLUON):
            with mode:
                fwd, bwd = families.probe_call(*fake, True, target=target)
            real_fwd, real_bwd = families.probe_call(q, k, v, True, target=target)
            assert _concrete(fwd.config) == real_fwd.config and real_fwd.config.why
            assert _concrete(bwd.config) == real_bwd.config and real_bwd.config.why
            assert families.family(fwd) == families.family(real_fwd)
            assert families.family(bwd) == families.family(real_bwd)
            for a, b in zip((*fwd.outputs, *bwd.outputs), (*real_fwd.outputs, *real_bwd.outputs)):
                assert [int(n) for n in a.shape] == list(b.shape) and a.dtype == b.dtype
            if d == 32 and target is NO_GLUON:
                assert real_fwd.config.kernel == FWD_TRITON == real_bwd.config.kernel
                check_with_configs(q, k, v, True, real_fwd.config, real_bwd.config)


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
    if not fast:
        fwd = replace(table_fwd(pf) if fwd.kernel == FWD_GLUON else fwd, fast_tanh=False)
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
    _need_sm90(device)
    q, k, v = qkv(*shape, torch.bfloat16, device)
    p = problems(q, k, v, causal)[0]
    fwd = check_fwd(p, gluon_fwd_config(p, Tile(*tile[:2], 4, tile[2], tma=True)))
    assert fwd.kernel == FWD_GLUON and fwd.persistent
    _check_launches(fwd, None, q, k, v, causal)


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
    _need_sm90(device)
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
    _need_sm90(device)
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
    assert_close(_finite(runs[0][1][:1]), _finite(lse64), bound=2e-5, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_gluon_backward_schedules_agree(causal, device):
    """The d128 Gluon dk/dv kernel persistent (one program per SM walking tiles, as the chooser
    takes it up to tables.GLUON_BWD_PERSISTENT_MAX_N query rows) and with one program per tile
    (`persistent=False`, its tile groups) give bitwise the same gradients (each tile's
    arithmetic is the same), right against the reference."""
    _need_sm90(device)
    q, k, v = qkv(4, 1000, 1100, 16, 4, 128, torch.bfloat16, device)  # 9 key blocks x 16 units
    do = make(q.shape, q.dtype, device, seed=7)
    scale = 1 / math.sqrt(128)
    p = problems(q, k, v, causal, do=do)[1]
    chosen = choose_bwd(p)
    assert chosen.kernel == BWD_GLUON and chosen.dq_mode == DQ_KERNEL and chosen.persistent
    heads = tile_heads(16, 9, p.target.sms, causal, False, False)
    per_tile = replace(chosen, persistent=False, tile_heads=heads)
    o, lse = fa_launch.forward(q, k, v, causal, scale)
    grads = [fa_launch.backward(do, q, k, v, o, lse, None, causal, scale, config=cfg)
             for cfg in (per_tile, chosen)]  # fmt: skip
    for a, b, name in zip(*grads, ("dq", "dk", "dv")):
        assert torch.equal(a, b), name
    check(q[:1], k[:1], v[:1], causal=causal)  # the default (persistent at this length)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, mode", [(128, "dkdv"), (64, "ordered"), (64, "any-order")])
def test_gpu_gluon_backward_tile_groups(d, mode, causal, device):
    """The Gluon dk/dv kernel's tiles in groups of a few (batch, kv head)s (here 2 groups of 8:
    choose.tile_heads) and in one group of all heads (`tile_heads` = all 16; negative: from
    the last key block down), one program per tile: the d128 dk/dv-only kernel, dq summed in
    the kernel in a fixed order (causal: from the last key block down either way) and in any
    order. Right against the reference; bitwise the same gradients either way where the order
    of the sums is fixed."""
    _need_sm90(device)
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
    _, _, grads64 = _run(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    _, _, grads_l = _run(attention_reference, q, k, v, do, None, causal=causal)
    grads = []
    for heads in (16 * sign, grouped):
        cfg = check_bwd(p, replace(base, persistent=False, tile_heads=heads))
        assert (cfg.dq_mode == DQ_KERNEL) == (mode == "dkdv")
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
    _need_sm90(device)
    dtype = torch.float16 if shape in GLUON_BWD_FP16_SHAPES else torch.bfloat16
    q, k, v = qkv(*shape, dtype, device)
    p = problems(q, k, v, causal)[1]
    bwd = check_bwd(p, gluon_bwd_config(p, Tile(64, 128, 4, stages, tma=True), DQ_KERNEL))
    assert bwd.kernel == BWD_GLUON and bwd.dq == choose_bwd(replace(p, target=NO_GLUON)).dq
    _check_launches(None, bwd, q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "any-order"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape", HOPPER_GPU_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}-hkv{}-d{}".format(*s)
)
def test_gpu_gluon_fused_dq(shape, causal, deterministic, device):
    """dq summed in the Gluon dk/dv kernel (DQ_ORDERED / DQ_ANY_ORDER configs; above
    tables.GLUON_FUSED_DQ_MAX_D such a config is an error, and the dq kernel runs beside the
    Gluon one instead): against the reference; in a fixed order the gradients are bitwise the
    same from run to run."""
    _need_sm90(device)
    q, k, v = qkv(*shape, torch.bfloat16, device)
    p = problems(q, k, v, causal, deterministic=deterministic)[1]
    tile = Tile(64, 128, 4, 2, tma=True)
    fused = gluon_bwd_config(p, tile, DQ_ORDERED if deterministic else DQ_ANY_ORDER)
    if block_d_for(shape[-1]) <= T.GLUON_FUSED_DQ_MAX_D:
        bwd = check_bwd(p, fused)
    else:
        with pytest.raises(ValueError, match="dq summed in the kernel only up to BLOCK_D 64"):
            check_bwd(p, fused)
        bwd = check_bwd(p, gluon_bwd_config(p, tile, DQ_KERNEL))
    o, lse, grads = _check_launches(None, bwd, q, k, v, causal, deterministic)
    if deterministic:
        do = make(q.shape, q.dtype, q.device, seed=9)  # (_check_launches')
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
        assert ("attn_fwd_gluon_kernel" in _names(fwd)) == (d == 128 and hopper)
        assert ("attn_bwd_gluon_kernel" in _names(bwd)) == (d == 128 and hopper)
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


def test_replayed_launches_match_the_full_host_path():
    """Launch sequences recorded per layout and replayed (`replay`, through prepared launches)
    pass the same compiled kernels the same arguments, tensor for tensor, as the full host path
    through Triton's own launcher."""
    from pathlib import Path

    from kernelkit.shared.testing import assert_launch_paths_agree

    assert_launch_paths_agree(Path(__file__).with_name("launch_calls.py"))
