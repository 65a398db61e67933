"""flash-attn: a value head dim of its own (issue 30; FlashAttention's feature for MLA-style
models, D_qk = 192, D_v = 128): q, k (..., D) and v (..., Dv), o and do (..., Dv), dq and dk
(..., D), dv (..., Dv); the LSE as ever.

o, the LSE and dq, dk, dv meet FlashAttention's rule against the float64 reference (attn_cases:
error <= 2x, gradients 3x, the reference's own error in the input dtype) and are finite, for
dense calls (padded head dims, causal with rows that see no key, windows, softcap, GQA, the
pointer path of misaligned rows), packed batches with empty sequences, decoding shapes (the
split-KV kernel), the KV cache (contiguous and paged, with the append), `flash_attn_backward`
and `FlashAttentionFunction`. The chooser, as on an H100: the Gluon kernels cannot run Dv != D
and say so in `why`; the portable kernels take the tiles of the larger head dim. Argument
errors name the argument.

Runs the real Triton kernels, on the GPU or under the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attn_cases import ATOL, RULE, Call, assert_rule
from fa_testing import INTERPRETER, cu_seqlens, finite, make, run_fwd_bwd
from torch._subclasses.fake_tensor import FakeTensorMode

from kernelkit.flash_attn import (
    FlashAttentionFunction,
    explain,
    families,
    flash_attn,
    flash_attn_backward,
    flash_attn_varlen,
    flash_attn_with_kvcache,
)
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn.choose import choose_bwd, choose_fwd, table_tiles
from kernelkit.flash_attn.config import (
    BWD_TRITON,
    FWD_SPLIT,
    FWD_TRITON,
    H100,
    KVCache,
    Problem,
    Target,
)
from kernelkit.flash_attn.kvcache import kvcache_forward
from kernelkit.flash_attn.reference import (
    attention_kvcache_reference,
    attention_reference,
    attention_varlen_reference,
    kvcache_append_reference,
)
from kernelkit.flash_attn.validation import window_for

GRADS = ("dq", "dk", "dv")


def _check(got, hi, low, dtype, name):
    """(o, lse, grads) of a call against the float64 (hi) and input-dtype (low) references."""
    (o, lse, grads), (o64, lse64, grads64), (o_l, lse_l, grads_l) = got, hi, low
    atol = ATOL[dtype]
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(o).all(), f"{name} o: non-finite values"
    assert_rule(o, o64, o_l, RULE[0], f"{name} o", atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse64)), f"{name}: LSE -inf rows"
    assert not torch.isnan(lse).any()
    assert_rule(finite(lse), finite(lse64), finite(lse_l), RULE[0], f"{name} lse", atol)
    for g, g64, g_l, gname in zip(grads, grads64, grads_l, GRADS):
        assert g.dtype == dtype and torch.isfinite(g).all(), f"{name} {gname}: non-finite"
        assert_rule(g, g64, g_l, RULE[1], f"{name} {gname}", atol)


def _against_references(fn, reference, q, k, v, lse_shape, name, **kw):
    """fn's (o, lse, (dq, dk, dv)) with an output and an LSE gradient, checked by the rule;
    returns them."""
    do = make(q.shape[:-1] + (v.shape[-1],), q.dtype, q.device, seed=7)
    dlse = make(lse_shape, torch.float32, q.device, seed=8)
    got = run_fwd_bwd(fn, q, k, v, do, dlse, **kw)
    o, lse, (dq, dk, dv) = got
    assert o.shape == q.shape[:-1] + (v.shape[-1],) and lse.shape == lse_shape
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    hi = run_fwd_bwd(reference, q.double(), k.double(), v.double(), do, dlse, **kw)
    low = run_fwd_bwd(reference, q, k, v, do, dlse, **kw)
    _check(got, hi, low, q.dtype, name)
    return got


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in rows of an odd stride: not 16-byte aligned, so read with pointer loads."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=t.device)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


# ------------------------------------------------------------------------------------------
# flash_attn
# ------------------------------------------------------------------------------------------

DENSE = [
    Call(b=1, nq=40, nk=56, h=4, hkv=2, d=32, dv=16),
    Call(b=2, nq=50, nk=70, h=2, hkv=1, d=48, dv=64, causal=True, dtype=torch.float16),
    # Nq > Nk, causal: the first rows see no key (zeros, LSE -inf)
    Call(b=1, nq=60, nk=30, h=2, hkv=2, d=64, dv=32, causal=True),
    Call(b=1, nq=45, nk=45, h=4, hkv=1, d=48, dv=64, window=(16, 8), softcap=5.0,
         dtype=torch.float16),
    Call(b=1, nq=33, nk=47, h=2, hkv=1, d=64, dv=32, causal=True, window=(12, -1)),
]  # fmt: skip


@pytest.mark.parametrize("call", DENSE, ids=str)
def test_flash_attn(call, device):
    q, k, v, _ = call.inputs(device)
    kw = dict(causal=call.causal, window_size=call.window, softcap=call.softcap)
    _against_references(flash_attn, attention_reference, q, k, v,
                        (call.b, call.h, call.nq), str(call), **kw)  # fmt: skip


def test_flash_attn_pointer_loads(device):
    """K/V rows that TMA cannot read (an odd row stride) take the pointer loads, with the
    padded value head dim masked (Dv 48 in a 64-wide block)."""
    call = Call(b=1, nq=37, nk=41, h=2, hkv=1, d=32, dv=48, causal=True)
    q, k, v, _ = call.inputs(device)
    k, v = _misaligned(k), _misaligned(v)
    window = window_for(call.window, call.causal, call.nq, call.nk)
    fwd, bwd = families.probe_call(q, k, v, call.causal, 0.0, window)
    assert not fwd.config.tma and not bwd.config.dq_tma
    _against_references(flash_attn, attention_reference, q, k, v, (call.b, call.h, call.nq),
                        str(call), causal=True)  # fmt: skip


def test_flash_attn_backward_and_function(device):
    """`flash_attn_backward` with do like o (Dv) gives the autograd gradients, bitwise (the same
    kernels); `FlashAttentionFunction` (3-D, one head) takes v of its own head dim too."""
    call = Call(b=2, nq=24, nk=40, h=2, hkv=1, d=64, dv=32, causal=True)
    q, k, v, do = call.inputs(device)
    o, lse = flash_attn(q, k, v, True, return_lse=True)
    grads = flash_attn_backward(do, q, k, v, o, lse, True)
    _, _, auto = run_fwd_bwd(flash_attn, q, k, v, do, None, causal=True)
    for g, a, name in zip(grads, auto, GRADS):
        assert torch.equal(g, a), name
    q3, k3, v3 = (t[:, :, 0] for t in (q, k, v))
    leaves = [t.detach().clone().requires_grad_() for t in (q3, k3, v3)]
    o3 = FlashAttentionFunction.apply(*leaves, True)
    assert o3.shape == (2, 24, 32)
    g3 = torch.autograd.grad(o3, leaves, do[:, :, 0])
    ref = [t.detach().double().requires_grad_() for t in (q3, k3, v3)]
    o64 = attention_reference(*ref, True)
    g64 = torch.autograd.grad(o64, ref, do[:, :, 0].double())
    low = [t.detach().clone().requires_grad_() for t in (q3, k3, v3)]
    o_l = attention_reference(*low, True)
    g_l = torch.autograd.grad(o_l, low, do[:, :, 0])
    assert_rule(o3, o64, o_l, RULE[0], "function o", ATOL[q.dtype])
    for g, r, r_l, name in zip(g3, g64, g_l, GRADS):
        assert_rule(g, r, r_l, RULE[1], f"function {name}", ATOL[q.dtype])


# ------------------------------------------------------------------------------------------
# flash_attn_varlen
# ------------------------------------------------------------------------------------------

# (name, lengths of q, lengths of k, H, Hkv, D, Dv, dtype, causal, window, softcap, seqused_k):
# empty sequences (no queries; queries and no keys: zeros, LSE -inf), Nq != Nk per sequence.
VARLEN = [
    ("causal-d48-dv64", (17, 0, 33, 5), (20, 9, 0, 5), 4, 2, 48, 64, torch.bfloat16, True,
     (-1, -1), 0.0, None),
    ("window-softcap-d64-dv32", (9, 30, 1, 0, 22), (9, 41, 3, 6, 18), 2, 1, 64, 32,
     torch.float16, False, (10, 3), 4.0, None),
    ("seqused-d32-dv16", (12, 25, 7), (30, 25, 7), 2, 2, 32, 16, torch.bfloat16, True, (-1, -1),
     0.0, (11, 25, 0)),
]  # fmt: skip


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: c[0])
def test_flash_attn_varlen(case, device):
    _, lens_q, lens_k, h, hkv, d, dv, dtype, causal, window, softcap, used = case
    q = make((sum(lens_q), h, d), dtype, device, 0)
    k = make((sum(lens_k), hkv, d), dtype, device, 1)
    v = make((sum(lens_k), hkv, dv), dtype, device, 2)
    kw = dict(cu_seqlens_q=cu_seqlens(lens_q, device), cu_seqlens_k=cu_seqlens(lens_k, device),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=causal,
              window_size=window, softcap=softcap)  # fmt: skip
    if used is not None:
        kw["seqused_k"] = torch.tensor(used, dtype=torch.int32, device=device)
    _against_references(flash_attn_varlen, attention_varlen_reference, q, k, v,
                        (h, sum(lens_q)), f"varlen d{d} dv{dv}", **kw)  # fmt: skip


# ------------------------------------------------------------------------------------------
# Decoding: the split-KV forward
# ------------------------------------------------------------------------------------------

DECODE = [
    Call(b=2, nq=1, nk=100, h=4, hkv=2, d=32, dv=16),
    Call(b=1, nq=3, nk=90, h=4, hkv=1, d=48, dv=64, causal=True, softcap=3.0,
         dtype=torch.float16),
]  # fmt: skip


@pytest.mark.parametrize("call", DECODE, ids=str)
def test_decode_takes_the_split_kernel(call, device):
    q, k, v, _ = call.inputs(device)
    window = window_for(call.window, call.causal, call.nq, call.nk)
    probe = families.probe_forward(q, k, v, call.causal, call.d**-0.5, call.softcap, window)
    # Several splits under the interpreter's 4 stand-in SMs (partials, then their merge); a GPU
    # gives these shapes one, which writes o itself (direct).
    interpreted = Target.of(q.device).interpreter
    split = probe.config.split
    assert probe.config.kernel == FWD_SPLIT and (split.splits >= 2) == interpreted
    block_dv = max(16, 1 << (call.dv - 1).bit_length())
    split_kw, *combine = (kw for _, _, _, kw in probe.launches)
    assert (split_kw["HEAD_DIM_V"], split_kw["BLOCK_DV"]) == (call.dv, block_dv)
    assert split_kw["DIRECT"] == split.direct and len(combine) == (not split.direct)
    assert split_kw["O"].shape[-1] == call.dv
    if not split.direct:
        assert split_kw["OP"].shape[-1] == block_dv
        assert (combine[0]["HEAD_DIM"], combine[0]["BLOCK_D"]) == (call.dv, block_dv)
    kw = dict(causal=call.causal, softcap=call.softcap)
    _against_references(flash_attn, attention_reference, q, k, v, (call.b, call.h, call.nq),
                        str(call), **kw)  # fmt: skip


# ------------------------------------------------------------------------------------------
# The KV cache
# ------------------------------------------------------------------------------------------


def _kv_inputs(b, cap, hkv, h, d, dv, nq, n_new, lengths, page, dtype, device, seed=0):
    """(q, k_cache, v_cache, k, v, cache_seqlens, block_table) with NaN past each sequence's
    length (never read), and the clean contiguous caches the reference reads."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    q = r(b, nq, h, d)
    clean = [r(b, cap, hkv, d), r(b, cap, hkv, dv)]
    caches = []
    for t in clean:
        for i, n in enumerate(lengths):
            t[i, n:] = 0.0
        c = t.clone()
        for i, n in enumerate(lengths):
            c[i, n:] = float("nan")
        caches.append(c)
    table = None
    if page:
        per = cap // page
        perm = torch.randperm(b * per + 2, generator=g)
        table = perm[: b * per].view(b, per).to(torch.int32)
        paged = []
        for c in caches:
            pages = torch.full((b * per + 2, page, hkv, c.shape[-1]), float("nan"), dtype=dtype)
            pages[table.flatten().long()] = c.view(b * per, page, hkv, c.shape[-1])
            paged.append(pages)
        caches, table = paged, table.to(device)
    k, v = r(b, n_new, hkv, d), r(b, n_new, hkv, dv)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    args = [t.to(device) for t in (q, *caches, k, v)]
    return (*args, seqlens, table), [t.to(device) for t in clean]


# (page size (0: contiguous), D, Dv, dtype, causal, window, softcap, pointer loads forced)
KV = [
    (0, 48, 64, torch.bfloat16, True, (-1, -1), 0.0, False),
    (16, 64, 32, torch.float16, False, (20, -1), 4.0, False),
    (16, 32, 16, torch.bfloat16, True, (-1, -1), 0.0, True),
]


@pytest.mark.parametrize("case", KV, ids=lambda c: f"page{c[0]}-d{c[1]}-dv{c[2]}" + "-ptr" * c[7])
def test_kvcache(case, device):
    """The append writes k (D) and v (Dv) rows at each sequence's length (rows past it stay
    untouched); o (Dv) and the LSE meet the rule."""
    page, d, dv, dtype, causal, window, softcap, pointer = case
    b, cap, hkv, h, nq, n_new, lengths = 2, 64, 1, 4, 2, 3, (40, 7)
    args, clean = _kv_inputs(b, cap, hkv, h, d, dv, nq, n_new, lengths, page, dtype, device)
    q, kc, vc, k, v, seqlens, table = args
    win = window_for(window, causal, nq, cap)
    if pointer:  # a page per row (PAGED = 1), pointer loads
        cache = KVCache(seqlens, 0, n_new, table, page, cap)
        p = Problem.of_cache(q, kc, vc, cache, causal, win, softcap)
        assert p.head_dim_v == dv and p.block_dv == max(16, dv)
        config = replace(choose_fwd(p), tma=False)
        o, lse = kvcache_forward(q, kc, vc, k, v, cache, causal, d**-0.5, softcap=softcap,
                                 window=win, config=config)  # fmt: skip
    else:
        o, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                         block_table=table, causal=causal, window_size=window,
                                         softcap=softcap, return_lse=True)  # fmt: skip
    assert o.shape == (b, nq, h, dv) and lse.shape == (b, h, nq)
    want = [t.clone() for t in clean]
    kvcache_append_reference(*want, k, v, seqlens)
    for name, cache, ref in (("k_cache", kc, want[0]), ("v_cache", vc, want[1])):
        have = cache[table.long()].flatten(1, 2) if page else cache
        for i, n in enumerate(lengths):
            assert torch.equal(have[i, : n + n_new], ref[i, : n + n_new]), name
            assert have[i, n + n_new :].isnan().all(), f"{name}: rows past the append"
    opts = dict(causal=causal, window_size=win, softcap=softcap, return_lse=True)
    o64, lse64 = attention_kvcache_reference(q.double(), want[0].double(), want[1].double(),
                                             seqlens + n_new, **opts)  # fmt: skip
    o_l, _ = attention_kvcache_reference(q, *want, seqlens + n_new, **opts)
    assert torch.isfinite(o).all()
    assert_rule(o, o64, o_l, RULE[0], "kvcache o", ATOL[dtype])
    torch.testing.assert_close(lse, lse64.float(), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------
# The chooser (as on an H100; nothing launched)
# ------------------------------------------------------------------------------------------


def _meta(b, nq, nk, h, hkv, d, dv, dtype=torch.bfloat16, causal=False, target=H100):
    q = torch.empty(b, nq, h, d, dtype=dtype, device="meta")
    k = torch.empty(b, nk, hkv, d, dtype=dtype, device="meta")
    v = torch.empty(b, nk, hkv, dv, dtype=dtype, device="meta")
    do = torch.empty(b, nq, h, dv, dtype=dtype, device="meta")
    return Problem.of(q, k, v, causal, do=do, target=target)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_cannot_run_it(causal):
    """d128 / dv64 would take the Gluon kernels both ways; they cannot run it, and the portable
    kernels' configs say why."""
    p = _meta(2, 4096, 4096, 8, 2, 128, 64, causal=causal)
    assert (p.head_dim, p.head_dim_v, p.block_d, p.block_dv, p.block_d_max) == (128, 64, 128, 64,
                                                                                128)  # fmt: skip
    fwd, bwd = choose_fwd(p), choose_bwd(p)
    assert fwd.kernel == FWD_TRITON and bwd.kernel == BWD_TRITON
    for cfg in (fwd, bwd):
        assert "cannot run" in cfg.why and "the value head dim must equal the query's" in cfg.why
    same = replace(p, head_dim_v=128)
    assert choose_fwd(same).kernel != FWD_TRITON and choose_bwd(same).kernel != BWD_TRITON
    assert table_tiles(p) == table_tiles(same)


def test_tiles_of_the_larger_head_dim():
    """The tables are read by max(BLOCK_D, BLOCK_DV), half precision and float32, dense and
    split-KV; the same head dims give the same configs."""
    for d, dv, big in ((64, 128, 128), (192, 128, 256), (32, 48, 64), (128, 16, 128)):
        for dtype in (torch.bfloat16, torch.float32):
            p = _meta(2, 1000, 1000, 4, 2, d, dv, dtype)
            sq = _meta(2, 1000, 1000, 4, 2, big, big, dtype)
            assert p.block_d_max == big
            assert table_tiles(p) == table_tiles(sq)
            if dtype == torch.float32:
                assert table_tiles(p) == T.FP32_TILES[big]
            bwd = choose_bwd(p)
            assert bwd.kernel == BWD_TRITON and (bwd.dkdv, bwd.dq) == table_tiles(sq)[1:]
            dec, dec_sq = (_meta(2, 1, 4096, 8, 2, *dims, dtype) for dims in ((d, dv), (big, big)))
            assert choose_fwd(dec).kernel == FWD_SPLIT
            assert choose_fwd(dec).tile == choose_fwd(dec_sq).tile


def test_equal_dims_pass_the_same_sizes():
    """Where Dv == D every portable launch gets HEAD_DIM_V = HEAD_DIM and BLOCK_DV = BLOCK_D
    (the kernels compile as before); with Dv != D they carry v's, and `explain` shows them."""
    with FakeTensorMode():
        for d, dv in ((48, 48), (128, 64)):
            q = torch.empty(2, 300, 4, d, dtype=torch.bfloat16, device="cuda")
            k = torch.empty(2, 300, 2, d, dtype=torch.bfloat16, device="cuda")
            v = torch.empty(2, 300, 2, dv, dtype=torch.bfloat16, device="cuda")
            fwd, bwd = families.probe_call(q, k, v, True, target=H100)
            assert fwd.outputs[0].shape == (2, 300, 4, dv)
            assert [t.shape[-1] for t in bwd.outputs] == [d, d, dv]
            for _, _, _, kw in (*fwd.launches, *bwd.launches):
                if "HEAD_DIM_V" in kw:
                    if "BLOCK_DV" in kw:
                        assert kw["BLOCK_DV"] == max(16, 1 << (dv - 1).bit_length())
                    assert kw["HEAD_DIM_V"] == dv and kw["HEAD_DIM"] == d
            assert all("HEAD_DIM_V" in kw for _, _, _, kw in (*fwd.launches, *bwd.launches))
            e = explain(q, k, v, True, target=H100)
            assert (e.forward, e.backward) == ("fwd(causal)", "bwd(causal)")
            assert f"HEAD_DIM={d} BLOCK_D=" in e.forward_launches[0]
            assert f"HEAD_DIM_V={dv} BLOCK_DV=" in e.forward_launches[0]


def test_problem_of_cache_reads_v_cache():
    q = torch.empty(2, 1, 4, 192, dtype=torch.bfloat16, device="meta")
    kc = torch.empty(2, 256, 1, 192, dtype=torch.bfloat16, device="meta")
    vc = torch.empty(2, 256, 1, 128, dtype=torch.bfloat16, device="meta")
    p = Problem.of_cache(q, kc, vc, KVCache(None, 256, 0, None, 0, 256), False, target=H100)
    assert (p.head_dim, p.head_dim_v, p.block_d_max) == (192, 128, 256)
    interp = Problem.of_cache(q, kc, vc, KVCache(None, 256, 0, None, 0, 256), False,
                              target=INTERPRETER)  # fmt: skip
    assert choose_fwd(interp).kernel == FWD_SPLIT


# ------------------------------------------------------------------------------------------
# Argument errors
# ------------------------------------------------------------------------------------------


def _t(*shape, device="cpu", dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype, device=device)


def test_errors(device):
    q, k = _t(2, 8, 4, 32, device=device), _t(2, 8, 2, 32, device=device)
    for v, match in ((_t(2, 9, 2, 16, device=device), "v: shape .* except the last dim"),
                     (_t(2, 8, 1, 16, device=device), "v: shape"),
                     (_t(2, 8, 2, 8, device=device), "v: value head dim Dv=8 outside 16..256"),
                     (_t(2, 8, 2, 272, device=device), "v: value head dim Dv=272")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            flash_attn(q, k, v)
    # packed
    cu = cu_seqlens([8], device)
    for v, match in ((_t(9, 2, 16, device=device), "v: shape"),
                     (_t(8, 2, 300, device=device), "v: value head dim Dv=300")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            flash_attn_varlen(q[0], k[0], v, cu, cu, 8, 8)
    # flash_attn_backward: o and do have v's head dim
    v = _t(2, 8, 2, 16, device=device)
    o, do, lse = _t(2, 8, 4, 16, device=device), _t(2, 8, 4, 16, device=device), _t(
        2, 4, 8, device=device, dtype=torch.float32)  # fmt: skip
    for bad, name in ((dict(o=q), "o"), (dict(do=q), "do")):
        args = dict(do=do, q=q, k=k, v=v, o=o, lse=lse) | bad
        with pytest.raises(ValueError, match=rf"{name}: expected shape \(2, 8, 4, 16\)"):
            flash_attn_backward(**args)
    # the KV cache
    kc = _t(2, 64, 2, 32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    new = _t(2, 3, 2, 32, device=device)
    for args, kw, match in (
        ((q[:, :1], kc, _t(2, 64, 2, 8, device=device)), {}, "v_cache: value head dim Dv=8"),
        ((q[:, :1], kc, _t(2, 64, 1, 16, device=device)), {}, "v_cache: shape"),
        ((q[:, :1], kc, _t(2, 64, 2, 16, device=device), new, new), {"cache_seqlens": lens},
         r"v: shape \(2, 3, 2, 32\), expected \(2, Nnew, 2, 16\)"),
        ((q[:, :1], kc, _t(2, 64, 2, 16, device=device), new, _t(2, 4, 2, 16, device=device)),
         {"cache_seqlens": lens}, "v: shape .* 4 new rows, k has 3"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            flash_attn_with_kvcache(*args, **kw)
