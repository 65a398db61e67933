"""Overflow and masking: float16 and large-magnitude inputs, a few keys (1-5, 17), many more
queries than keys, packed batches with one-key and empty sequences. Every output and gradient
is finite and meets FlashAttention's accuracy rule (attn_cases.py).

Regression: a key block past the last key loads k = v = 0, whose score 0 gives
p = exp2(-lse); with few keys and large negative scores the LSE is very negative, p overflows,
the float16 dS is inf and inf * (k = 0) made dq NaN (dense and packed, non-causal)."""

from __future__ import annotations

import pytest
import torch
from attn_cases import Call, check_call, fwd_bwd

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
