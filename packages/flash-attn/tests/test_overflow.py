"""Overflow and masking: float16 and large-magnitude inputs, a few keys (1-5, 17), many more
queries than keys, packed batches with one-key and empty sequences. Every output and gradient
is finite and meets FlashAttention's accuracy rule (attn_cases.py).

Regression: a key block past the last key loads k = v = 0, whose score 0 gives
p = exp2(-lse); with few keys and large negative scores the LSE is very negative, p overflows,
the float16 dS is inf and inf * (k = 0) made dq NaN (dense and packed, non-causal)."""

from __future__ import annotations

import math

import pytest
import torch
from attn_cases import RULE, Call, check_call, fwd_bwd

from kernelkit.flash_attn import explain
from kernelkit.flash_attn import tables as T

# (Nq, Nk): one key, Nq >> Nk, a few keys, a ragged block
FEW_KEYS = [(1, 1), (5, 1), (128, 3), (2, 5), (300, 17)]
LARGE = (5.0, 3.0)  # q x 5, k and v x 3: scores of +-100 and more


def _check(call: Call, device) -> None:
    q, k, v, do = call.inputs(device)
    check_call(call, fwd_bwd(call, q, k, v, do), q, k, v, do)


@pytest.mark.parametrize("scale", [(1.0, 1.0), LARGE], ids=["randn", "large"])
@pytest.mark.parametrize("d", [16, 128])
@pytest.mark.parametrize("nq, nk", FEW_KEYS, ids=lambda n: str(n))
def test_few_keys_float16(nq, nk, d, scale, device):
    _check(Call(b=2, nq=nq, nk=nk, h=5, hkv=5, d=d, dtype=torch.float16, scale_q=scale[0],
                scale_kv=scale[1]), device)  # fmt: skip


@pytest.mark.parametrize("nq, nk", [(5, 1), (300, 17)], ids=lambda n: str(n))
def test_few_keys_causal_gqa_float16(nq, nk, device):
    _check(Call(b=1, nq=nq, nk=nk, h=4, hkv=2, d=32, causal=True, dtype=torch.float16,
                scale_q=LARGE[0], scale_kv=LARGE[1]), device)  # fmt: skip


# cu_seqlens_q = [0, 76, 110, 256] against keys of one each, 1 / 2 / 3, 3 each, and none / 5 / 1.
PACKED_KEYS = [(1, 1, 1), (1, 2, 3), (3, 3, 3), (0, 5, 1)]


@pytest.mark.parametrize("d", [16, 128])
@pytest.mark.parametrize("keys", PACKED_KEYS, ids=lambda k: "k" + "-".join(map(str, k)))
def test_packed_few_and_no_keys_float16(keys, d, device):
    lengths = tuple(zip((76, 34, 146), keys))
    _check(Call(h=5, hkv=5, d=d, lengths=lengths, dtype=torch.float16, scale_q=LARGE[0],
                scale_kv=LARGE[1]), device)  # fmt: skip


@pytest.mark.parametrize("window", [(2, -1), (-1, 1)], ids=["left2", "right1"])
def test_window_edges_with_few_keys_float16(window, device):
    """Window edges that leave a block partly past the last key (the masked loops)."""
    _check(Call(b=1, nq=40, nk=17, h=2, hkv=1, d=32, window=window, dtype=torch.float16,
                scale_q=LARGE[0], scale_kv=LARGE[1]), device)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scale", [(1.0, 1.0), LARGE, (20.0, 20.0)], ids=["randn", "large", "x20"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("nq, nk", FEW_KEYS + [(4096, 2), (1, 4099)], ids=lambda n: str(n))
def test_gpu_few_keys(nq, nk, d, causal, scale, dtype, device):
    _check(Call(b=2, nq=nq, nk=nk, h=4, hkv=2, d=d, causal=causal, dtype=dtype,
                scale_q=scale[0], scale_kv=scale[1]), device)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("keys", PACKED_KEYS, ids=lambda k: "k" + "-".join(map(str, k)))
def test_gpu_packed_few_and_no_keys(keys, d, causal, device):
    lengths = tuple(zip((76, 34, 146), keys)) + ((0, 0), (1, 0))
    _check(Call(h=4, hkv=2, d=d, causal=causal, lengths=lengths, dtype=torch.float16,
                scale_q=LARGE[0], scale_kv=LARGE[1]), device)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq, nk", [(5, 1), (300, 17), (2176, 3), (8192, 5)], ids=lambda n: str(n))
def test_gpu_few_keys_softcap(nq, nk, d, causal, dtype, device):
    """Softcap on the Gluon backward (tanh.approx, P in 16 bits; d128 at every length, d64 from
    tables.FUSED_DQ_MIN_N rows) with large inputs and a few keys: the keys past the last one in
    a ragged block score exp2(-lse) before their mask, which overflows 16 bits there."""
    call = Call(b=1, nq=nq, nk=nk, h=4, hkv=2, d=d, causal=causal, softcap=5.0, dtype=dtype,
                scale_q=LARGE[0], scale_kv=LARGE[1])  # fmt: skip
    q, k, v, _ = call.inputs(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        kernel = "gluon" if d == 128 or nq >= T.FUSED_DQ_MIN_N[64][True] else "triton"
        e = explain(q, k, v, causal, softcap=call.softcap)
        assert (e.backward_config.kernel, e.backward_config.fast_tanh) == (kernel, True)
    _check(call, device)


def _rare_key_inputs(n: int, d: int, softcap: float, rare: list[int], seed: int = 0):
    """(q, k, v, do) in bfloat16, (1, n, 2, d) with one kv head: the keys in `rare` score
    about ln(1e-8) + ln(n) below the others for every query (after the cap), so every P of
    theirs is ~1e-8 (P (1 - tanh^2) below float16's smallest normal)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.full((d,), d**-0.5, dtype=torch.float64)  # a unit vector every query leans on
    q = torch.randn(1, n, 2, d, generator=g, dtype=torch.float64)
    q += (3.0 - q @ u)[..., None] * u  # q . u = 3 for every query
    k = torch.randn(1, n, 1, d, generator=g, dtype=torch.float64) * 0.3
    logit = math.log(1e-8) + math.log(n)  # the rare keys' capped score
    raw = softcap * math.atanh(logit / softcap)  # its score before the cap
    k[0, rare, 0] = u * raw / (3.0 * d**-0.5)  # q . k_rare * d^-0.5 ~ raw
    v = torch.randn(1, n, 1, d, generator=g, dtype=torch.float64)
    do = torch.randn(1, n, 2, d, generator=g, dtype=torch.float64)
    return [t.to(torch.bfloat16) for t in (q, k, v, do)]


# (64, 64) on the portable kernels anywhere; the others on the Gluon backward (d64 from
# tables.FUSED_DQ_MIN_N rows).
RARE_KEY_SHAPES = [(64, 64), pytest.param(8192, 64, marks=pytest.mark.gpu),
                   pytest.param(2048, 128, marks=pytest.mark.gpu)]  # fmt: skip


@pytest.mark.parametrize("n, d", RARE_KEY_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_rarely_attended_keys(n, d, causal, device):
    """Softcap, bfloat16: keys that every query attends with P ~1e-8 get dk rows of ~1e-8
    that the rule over the whole tensor cannot see; each such row meets the rule on its own.
    Regression: the Gluon backward held P (1 - tanh^2) in float16 unscaled, flushed it to 0
    and returned those rows as 0 (bfloat16 dS reaches 1e-38)."""
    softcap, rare = 30.0, [n // 2 + 3, n - 5, n - 1]  # (causal: seen by >= n / 2 keys' rows)
    q, k, v, do = (t.to(device) for t in _rare_key_inputs(n, d, softcap, rare))
    call = Call(b=1, nq=n, nk=n, h=2, hkv=1, d=d, causal=causal, softcap=softcap)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0) and n > 64:
        e = explain(q, k, v, causal, softcap=softcap)
        assert (e.backward_config.kernel, e.backward_config.fast_tanh) == ("gluon", True)
    got = fwd_bwd(call, q, k, v, do)
    check_call(call, got, q, k, v, do)
    hi = fwd_bwd(call, q.double(), k.double(), v.double(), do.double(), reference=True)[2]
    lowp = fwd_bwd(call, q, k, v, do, reference=True)[2]
    for j in rare:
        ref = hi[0, j].abs().max().item()
        assert 0 < ref < 1e-4, f"key {j}: the case is not rare (|dk| {ref:.2e})"
        err = (got[2][0, j].double() - hi[0, j]).abs().max().item()
        base = (lowp[0, j].double() - hi[0, j]).abs().max().item()
        assert err <= RULE[1] * base, (
            f"dk of rarely attended key {j}: error {err:.2e} > {RULE[1]} x {base:.2e} (|dk| {ref:.2e})"
        )
