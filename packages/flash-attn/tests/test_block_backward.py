"""`flash_attn_backward`: the gradients from a given o and LSE, for a call's own statistics
(the same as autograd through flash_attn, bit for bit) and for one key block of a larger
attention whose o and LSE are given (ring attention: the blocks' dq sum to the whole dq, their
dk, dv are the whole's rows), on the kernels and on the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from fa_testing import finite, make, qkv

from kernelkit.flash_attn import flash_attn, flash_attn_backward
from kernelkit.flash_attn.reference import attention_reference, attention_reference_grads
from kernelkit.shared.testing import assert_close

# (B, Nq, Nk, H, Hkv, D), causal, window_size, softcap, softmax_scale
CASES = [
    ((1, 40, 40, 4, 2, 32), True, (-1, -1), 0.0, None),
    ((2, 17, 33, 2, 1, 64), False, (-1, -1), 4.0, -0.2),
    ((1, 24, 24, 2, 2, 16), True, (5, -1), 0.0, None),
]


def _grads(q, k, v, do, dlse, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = flash_attn(*leaves, return_lse=True, **kw)
    grads = torch.autograd.grad([o, finite(lse)], leaves, [do, dlse])
    return o.detach(), lse.detach(), grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c[0]))
def test_own_statistics_match_autograd(case, dtype, device):
    (b, nq, nk, h, hkv, d), causal, window, softcap, scale = case
    q, k, v = qkv(b, nq, nk, h, hkv, d, dtype, device)
    do = make((b, nq, h, d), dtype, device, seed=5)
    dlse = make((b, h, nq), torch.float32, device, seed=6)
    kw = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    o, lse, expected = _grads(q, k, v, do, dlse, **kw)
    got = flash_attn_backward(do, q, k, v, o, lse, dlse=dlse, **kw)
    for g, e, name in zip(got, expected, ("dq", "dk", "dv")):
        assert torch.equal(g, e), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_key_blocks_of_a_larger_attention(dtype, device):
    """Keys split in three blocks (a causal diagonal block last, as a ring's own shard): each
    block's backward with the whole's o and LSE; dq summed, dk / dv concatenated, against the
    float64 reference by FlashAttention's rule (3x the reference's error in dtype)."""
    b, n, h, hkv, d = 1, 48, 4, 2, 32
    q, k, v = qkv(b, n, 3 * n, h, hkv, d, dtype, device)
    do = make((b, n, h, d), dtype, device, seed=5)
    dlse = make((b, h, n), torch.float32, device, seed=6)
    o, lse, _ = _grads(q, k, v, do, dlse, causal=True)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    dks, dvs = [], []
    for j, causal in ((0, False), (1, False), (2, True)):
        keys = slice(j * n, (j + 1) * n)
        dq_b, dk_b, dv_b = flash_attn_backward(do, q, k[:, keys], v[:, keys], o, lse, causal,
                                               dlse=dlse)  # fmt: skip
        dq += dq_b.float()
        dks.append(dk_b)
        dvs.append(dv_b)
    got = (dq.to(dtype), torch.cat(dks, 1), torch.cat(dvs, 1))
    hi = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64, lse64 = attention_reference(*hi, True, return_lse=True)
    ref64 = torch.autograd.grad([o64, lse64], hi, [do.double(), dlse.double()])
    lowp = None
    if dtype != torch.float32:
        lo = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o_l, lse_l = attention_reference(*lo, True, return_lse=True)
        lowp = torch.autograd.grad([o_l, lse_l], lo, [do, dlse])
    for i, name in enumerate(("dq", "dk", "dv")):
        assert torch.isfinite(got[i]).all()
        assert_close(got[i], ref64[i], ref_lowp=None if lowp is None else lowp[i], factor=3.0,
                     name=name)  # fmt: skip


def test_reference_with_statistics_is_exact():
    """attention_reference_grads(o=, lse=) over key blocks sums to autograd's, in float64."""
    q, k, v = qkv(2, 9, 20, 4, 2, 16, torch.float64, "cpu")
    do = make((2, 9, 4, 16), torch.float64, "cpu", seed=5)
    dlse = make((2, 4, 9), torch.float64, "cpu", seed=6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_reference(*leaves, return_lse=True, softcap=3.0)
    expected = torch.autograd.grad([o, lse], leaves, [do, dlse])
    parts = [attention_reference_grads(do, q, k[:, s], v[:, s], dlse=dlse, softcap=3.0,
                                       o=o.detach(), lse=lse.detach())
             for s in (slice(0, 7), slice(7, 20))]  # fmt: skip
    dq = parts[0][0] + parts[1][0]
    dk = torch.cat([p[1] for p in parts], 1)
    dv = torch.cat([p[2] for p in parts], 1)
    for g, e, name in zip((dq, dk, dv), expected, ("dq", "dk", "dv")):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="o, lse: give both"):
        attention_reference_grads(do, q, k, v, o=o.detach())


def test_errors(device):
    q, k, v = qkv(1, 8, 8, 2, 1, 16, torch.bfloat16, device)
    o, lse, _ = _grads(q, k, v, torch.ones_like(q), torch.zeros(1, 2, 8, device=device))
    cases = [
        ((q[..., :8], q, k, v, o, lse), r"do: expected shape \(1, 8, 2, 16\)"),
        ((q, q, k, v, o.float(), lse), "o: expected dtype torch.bfloat16"),
        ((q, q, k, v, o, lse.transpose(1, 2)), r"lse: expected shape \(1, 2, 8\)"),
        ((q, q, k, v, o, lse.double()), "lse: expected dtype torch.float32"),
        ((q, q[:, :, 0], k, v, o, lse), r"q: expected shape \(B, Nq, H, D\)"),
        ((q, q, k, v, o, None), "lse: expected a torch.Tensor"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            flash_attn_backward(*args)
    with pytest.raises(ValueError, match="dlse: expected shape"):
        flash_attn_backward(q, q, k, v, o, lse, dlse=lse[:, :, :4])


@pytest.mark.parametrize("margin", [0, 8])
def test_sm_margin_leaves_multiprocessors(margin):
    """sm_margin takes that many multiprocessors from the persistent Gluon kernels' grids (the
    forward at 16k, the d128 backward with the dq kernel beside it at 1k), as an H100 would run
    them (meta tensors: nothing launches)."""
    from kernelkit.flash_attn import families
    from kernelkit.flash_attn.config import H100, leave_sms

    target = leave_sms(H100, torch.device("meta"), margin)
    assert target.sms == 132 - margin

    def gluon_grids(probe):
        return [grid[0] for kernel, grid, *_ in probe.launches if "gluon" in kernel.fn.__name__]

    q, k = (torch.empty(1, 16384, 16, 128, dtype=torch.bfloat16, device="meta") for _ in "qk")
    fwd = families.probe_forward(q, k, k, False, 0.1, target=target)
    assert fwd.config.persistent and gluon_grids(fwd) == [132 - margin]
    q, k = (torch.empty(1, 1024, 32, 128, dtype=torch.bfloat16, device="meta") for _ in "qk")
    o, lse = families.probe_forward(q, k, k, True, 0.1, target=target).outputs
    bwd = families.probe_backward(o, q, k, k, o, lse, None, True, 0.1, target=target)
    assert bwd.config.persistent and gluon_grids(bwd) == [132 - margin]


def test_sm_margin_errors(device):
    q, k, v = qkv(1, 8, 8, 2, 1, 16, torch.bfloat16, device)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="sm_margin: expected an int >= 0"):
            flash_attn(q, k, v, sm_margin=bad)
