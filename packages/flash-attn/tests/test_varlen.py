"""flash-attn: packed variable-length batches (flash_attn_varlen) against the loop over
sequences of the float64 reference: ragged and empty sequences, Nq != Nk per sequence, windows
and softcap; the backward's row-vector padding and ragged-tail switches (bitwise against the
checked loops), argument errors, opcheck, torch.compile and the CPU fallback.

Runs the real Triton kernels, on the GPU or under the Triton interpreter (see
test_flash_attn.py); the helpers (`packed`, `check_varlen`, ...) are in fa_testing.py.
"""

import math
from dataclasses import replace

import pytest
import torch
from fa_testing import (
    INTERPRETER,
    NO_GLUON,
    check_varlen,
    cu_seqlens,
    finite,
    make,
    meta_problem,
    packed,
    problems,
    qkv,
    random_lengths,
    run_fwd_bwd,
)

from kernelkit.flash_attn import flash_attn, flash_attn_varlen
from kernelkit.flash_attn import launch as fa_launch
from kernelkit.flash_attn import op as fa_op
from kernelkit.flash_attn import validation as fa_validation
from kernelkit.flash_attn.choose import check_bwd, choose_bwd
from kernelkit.flash_attn.config import BWD_TRITON, H100, Varlen
from kernelkit.flash_attn.reference import attention_varlen_reference
from kernelkit.shared.testing import assert_close

# ------------------------------------------------------------------------------------------
# Packed variable-length batches (flash_attn_varlen)
# ------------------------------------------------------------------------------------------


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
    o, lse, grads = run_fwd_bwd(flash_attn, q, k, v, do, None, **kw)
    cu = cu_seqlens([n] * b, device)
    flat = [t.flatten(0, 1) for t in (q, k, v, do)]
    o_p, lse_p, grads_p = run_fwd_bwd(flash_attn_varlen, *flat[:3], flat[3], None, cu_seqlens_q=cu,
                               cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n, **kw)  # fmt: skip
    assert_close(o_p, o.flatten(0, 1), name="o")
    assert_close(lse_p, lse.transpose(0, 1).flatten(1), name="lse")
    for g_p, g, name in zip(grads_p, grads, ("dq", "dk", "dv")):
        assert_close(g_p, g.flatten(0, 1), name=name)


def test_varlen_deterministic(device):
    q, k, v, kw = packed([30, 0, 45, 7], [12, 20, 45, 1], 4, 2, 32, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=5)
    first = run_fwd_bwd(flash_attn_varlen, q, k, v, do, None, causal=True, **kw)
    second = run_fwd_bwd(flash_attn_varlen, q, k, v, do, None, causal=True, **kw)
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


@pytest.mark.parametrize("seqused", [False, True], ids=["all-keys", "seqused_k"])
def test_varlen_opcheck(seqused, device):
    q, k, v, kw = packed([5, 0, 19], [8, 3, 21], 2, 1, 32, torch.float32, device)
    cu_q, cu_k, mq, mk = kw.values()
    used = torch.tensor([6, 0, 21], dtype=torch.int32, device=device) if seqused else None
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    args = (q, k, v, cu_q, cu_k, used, mq, mk, True, 0.25)
    torch.library.opcheck(torch.ops.kernelkit_flash_attn.attn_varlen_fwd, args)
    o, lse = fa_op.attn_varlen_fwd(q.detach(), k.detach(), v.detach(), *args[3:])
    do = make(o.shape, o.dtype, device, seed=3)
    dlse = make(lse.shape, lse.dtype, device, seed=4)
    bwd = (do, q.detach(), k.detach(), v.detach(), o, lse, dlse, cu_q, cu_k, used, mq, mk, False,
           0.25, 1.5, 4, 2)  # fmt: skip
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
    assert_close(finite(lse), finite(lse64), name="compiled lse")
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
