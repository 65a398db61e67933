"""flash-attn: `seqused_k` of flash_attn_varlen (FlashAttention's): sequence b attends to only
the first seqused_k[b] of its keys, causal and windows bottom-right aligned to that count.

Against the loop over sequences of the float64 reference by FlashAttention's accuracy rule
(attn_cases.py): used counts below, at and between block boundaries, equal to the sequence's
keys, and 0; key blocks wholly past the used keys (the dk/dv kernel writes their rows as zeros);
GQA, causal, a window, softcap, float16 and bfloat16. Then: seqused_k = every sequence's length
is bitwise the call without it, argument errors, torch.compile and the CPU fallback (the ops'
opcheck with seqused_k: test_varlen.py).

Runs the real Triton kernels, on the GPU or under the Triton interpreter (see
test_flash_attn.py), where the `poison_empty` fixture fills fresh outputs with NaN: an element
no kernel wrote fails the finiteness checks.
"""

import pytest
import torch
from attn_cases import ATOL, RULE, assert_rule
from fa_testing import finite, make, packed, run_fwd_bwd

from kernelkit.flash_attn import flash_attn_varlen
from kernelkit.flash_attn.reference import (
    attention_varlen_reference,
    attention_varlen_reference_grads,
)
from kernelkit.shared.testing import assert_close

# (name, lengths of q, lengths of k, seqused_k, H, Hkv, D, dtype, causal, window_size, softcap).
# The interpreter's tiles are 16 / 32 keys (forward, dq / dk-dv): 70 keys with 20 used leave
# whole dk/dv blocks past the used keys; 32 of 40 ends on a block boundary; 0 used with queries
# gives rows that see nothing; a sequence without queries has used and unused keys.
CASES = [
    ("gqa-bf16", [5, 17, 9, 33, 0, 1], [70, 17, 6, 40, 3, 9], [20, 17, 0, 32, 2, 9], 4, 2, 32,
     torch.bfloat16, False, (-1, -1), 0.0),
    ("causal-fp16", [40, 3, 12, 0, 21], [70, 5, 12, 4, 50], [17, 0, 12, 1, 33], 2, 1, 24,
     torch.float16, True, (-1, -1), 0.0),
    ("window-bf16", [30, 7, 18], [64, 7, 40], [45, 3, 0], 2, 2, 16, torch.bfloat16, False,
     (6, 3), 0.0),
    ("causal-window-softcap-fp16", [25, 9, 0, 14], [66, 9, 5, 30], [38, 9, 5, 0], 4, 1, 16,
     torch.float16, True, (9, -1), 3.0),
]  # fmt: skip


def _inputs(lens_q, lens_k, used, h, hkv, d, dtype, device):
    q, k, v, kw = packed(lens_q, lens_k, h, hkv, d, dtype, device)
    return q, k, v, kw, torch.tensor(used, dtype=torch.int32, device=device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_seqused_k(case, device):
    _, lens_q, lens_k, used, h, hkv, d, dtype, causal, window, softcap = case
    q, k, v, kw, seqused = _inputs(lens_q, lens_k, used, h, hkv, d, dtype, device)
    kw.update(causal=causal, window_size=window, softcap=softcap, seqused_k=seqused)
    do = make(q.shape, dtype, device, seed=7)
    dlse = make((h, q.shape[0]), torch.float32, device, seed=8)
    o, lse, grads = run_fwd_bwd(flash_attn_varlen, q, k, v, do, dlse, **kw)
    o64, lse64, grads64 = run_fwd_bwd(attention_varlen_reference, q.double(), k.double(),
                                      v.double(), do, dlse, **kw)  # fmt: skip
    o_l, _, grads_l = run_fwd_bwd(attention_varlen_reference, q, k, v, do, dlse, **kw)

    for name, t in zip(("o", "dq", "dk", "dv"), (o, *grads)):
        assert t.dtype == dtype and torch.isfinite(t).all(), f"{name}: non-finite values"
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(lse64.cpu())), "LSE -inf rows"
    assert_close(finite(lse), finite(lse64), bound=2e-5, name="lse")
    assert_rule(o, o64, o_l, RULE[0], "o", ATOL[dtype])
    for name, g, g64, gl in zip(("dq", "dk", "dv"), grads, grads64, grads_l):
        assert_rule(g, g64, gl, RULE[1], name, ATOL[dtype])

    dq, dk, dv = grads
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    for b, n in enumerate(used):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        assert (dk[k0 + n : k1] == 0).all() and (dv[k0 + n : k1] == 0).all(), f"seq {b}"
        if n == 0:  # rows that see no key: zeros, LSE -inf, no gradient
            assert (o[q0:q1] == 0).all() and torch.isneginf(lse[:, q0:q1]).all()
            assert (dq[q0:q1] == 0).all()


def test_seqused_k_full_lengths_is_bitwise_the_call_without(device):
    """seqused_k = every sequence's key count (the SEQUSED kernels) gives the outputs and
    gradients of the call without it, bitwise."""
    lens_q, lens_k = [21, 0, 40, 3], [37, 6, 70, 0]
    q, k, v, kw = packed(lens_q, lens_k, 4, 2, 32, torch.bfloat16, device)
    do = make(q.shape, q.dtype, device, seed=5)
    dlse = make((4, q.shape[0]), torch.float32, device, seed=6)
    full = torch.tensor(lens_k, dtype=torch.int32, device=device)
    for opts in (dict(causal=True, window_size=(11, -1)), dict(softcap=2.0)):
        a = run_fwd_bwd(flash_attn_varlen, q, k, v, do, dlse, **opts, **kw)
        b = run_fwd_bwd(flash_attn_varlen, q, k, v, do, dlse, seqused_k=full, **opts, **kw)
        for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), (a[0], a[1], *a[2]),
                              (b[0], b[1], *b[2])):  # fmt: skip
            assert torch.equal(x, y), f"{opts} {name}"


def _errors(device):
    q, k, v, kw = packed([4, 6], [5, 7], 2, 1, 16, torch.float32, device)
    i32 = dict(dtype=torch.int32, device=device)
    cases = [
        ([5, 7], "seqused_k: expected a torch.Tensor or None, got list"),
        (torch.tensor([5, 7], dtype=torch.int64, device=device), "seqused_k: dtype must be"),
        (torch.tensor([5, 7, 1], **i32), r"seqused_k: expected shape \(num_seqs,\) = \(2,\)"),
        (torch.tensor([[5, 7]], **i32), r"seqused_k: expected shape \(num_seqs,\)"),
        (torch.tensor([5, 0, 7, 0], **i32)[::2], "seqused_k: must be contiguous"),
        (torch.tensor([5, 7], dtype=torch.int32, device="meta"), "seqused_k: on device meta"),
    ]
    if device.type == "cpu":  # values are checked only where they are free to read
        cases += [
            (torch.tensor([5, 8], **i32), r"seqused_k: entry 1 is 8, outside 0\.\.7"),
            (torch.tensor([-1, 7], **i32), r"seqused_k: entry 0 is -1, outside 0\.\.5"),
        ]
    return q, k, v, kw, cases


@pytest.mark.parametrize("case", range(8))
def test_seqused_k_errors(case, device):
    q, k, v, kw, cases = _errors(device)
    if case >= len(cases):
        pytest.skip("seqused_k values are the caller's contract on the GPU (no sync)")
    seqused, match = cases[case]
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen(q, k, v, seqused_k=seqused, **kw)


def test_seqused_k_torch_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    q, k, v, kw = packed([5, 0, 30, 1], [8, 3, 30, 1], 4, 2, 32, torch.float32, device)
    used = torch.tensor([3, 2, 17, 0], dtype=torch.int32, device=device)

    def f(q, k, v, cu_q, cu_k, used):
        o = flash_attn_varlen(q, k, v, cu_q, cu_k, 30, 30, causal=True, seqused_k=used)
        return o * 2.0

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves, kw["cu_seqlens_q"], kw["cu_seqlens_k"], used).sum().backward()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64 = attention_varlen_reference(*ref, kw["cu_seqlens_q"], kw["cu_seqlens_k"], causal=True,
                                     seqused_k=used)  # fmt: skip
    (o64 * 2.0).sum().backward()
    for a, r, name in zip(leaves, ref, ("dq", "dk", "dv")):
        assert_close(a.grad, r.grad, name=f"compiled {name}")


def test_seqused_k_cpu_tensors_without_interpreter_use_the_reference(monkeypatch):
    """The CPU fallback (the opaque reference ops) takes seqused_k forward and backward."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, kw = packed([4, 0, 9, 3], [6, 2, 9, 5], 2, 1, 16, torch.float32, "cpu")
    used = torch.tensor([2, 1, 9, 0], dtype=torch.int32)
    do = make(q.shape, q.dtype, "cpu", seed=5)
    dlse = make((2, q.shape[0]), torch.float32, "cpu", seed=6)
    opts = dict(causal=True, softcap=2.0, seqused_k=used, **kw)
    o, lse, grads = run_fwd_bwd(flash_attn_varlen, q, k, v, do, dlse, **opts)
    o_r, lse_r, _ = run_fwd_bwd(attention_varlen_reference, q, k, v, do, dlse, **opts)
    assert torch.equal(o, o_r) and torch.equal(lse, lse_r.float())
    _, _, grads64 = run_fwd_bwd(attention_varlen_reference, q.double(), k.double(), v.double(),
                                do, dlse, **opts)  # fmt: skip
    for g, g64, name in zip(grads, grads64, ("dq", "dk", "dv")):
        assert_close(g, g64, name=name)
    assert (grads[1][2:6] == 0).all() and (grads[1][-5:] == 0).all()


def test_seqused_k_reference_grads_closed_form():
    """`attention_varlen_reference_grads` with seqused_k (the fallback's backward) is the
    reference's autograd gradient."""
    q, k, v, kw = packed([4, 0, 9, 5, 3], [6, 2, 9, 7, 4], 4, 2, 16, torch.float64, "cpu")
    used = torch.tensor([3, 2, 9, 0, 4], dtype=torch.int32)
    do = make(q.shape, torch.float64, "cpu", seed=5)
    dlse = make((4, q.shape[0]), torch.float64, "cpu", seed=6)
    opts = dict(causal=True, softcap=2.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_varlen_reference(*leaves, return_lse=True, seqused_k=used, **opts, **kw)
    expected = torch.autograd.grad([o, finite(lse)], leaves, [do, dlse])
    cu = (kw["cu_seqlens_q"], kw["cu_seqlens_k"])
    got = attention_varlen_reference_grads(do, q, k, v, *cu, dlse=dlse, seqused_k=used, **opts)
    for g, e, name in zip(got, expected, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=name)
