"""Overflow and masking: float16 and large-magnitude inputs, a few keys (1-5, 17), many more
queries than keys, packed batches with one-key and empty sequences. Every output and gradient
is finite and meets FlashAttention's accuracy rule (attn_cases.py).

Regression: a key block past the last key loads k = v = 0, whose score 0 gives
p = exp2(-lse); with few keys and large negative scores the LSE is very negative, p overflows,
the float16 dS is inf and inf * (k = 0) made dq NaN (dense and packed, non-causal)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from attn_cases import RULE, Call, check_call, fwd_bwd

from kernelkit.flash_attn import explain
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn.config import DQ_ANY_ORDER, DQ_KERNEL, DQ_ORDERED, H100

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


def _rare_key_inputs(n: int, d: int, hkv: int, softcap: float, rare: list[int], seed: int = 0):
    """(q, k, v, do) in bfloat16, (1, n, 2, d) with hkv kv heads: the keys in `rare` score
    about ln(1e-8) + ln(n) below the others for every query (after the cap), so every P of
    theirs is ~1e-8 (P (1 - tanh^2) below float16's smallest normal)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.full((d,), d**-0.5, dtype=torch.float64)  # a unit vector every query leans on
    q = torch.randn(1, n, 2, d, generator=g, dtype=torch.float64)
    q += (3.0 - q @ u)[..., None] * u  # q . u = 3 for every query
    k = torch.randn(1, n, hkv, d, generator=g, dtype=torch.float64) * 0.3
    logit = math.log(1e-8) + math.log(n)  # the rare keys' capped score
    raw = softcap * math.atanh(logit / softcap)  # its score before the cap
    k[0, rare] = u * raw / (3.0 * d**-0.5)  # q . k_rare * d^-0.5 ~ raw
    v = torch.randn(1, n, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(1, n, 2, d, generator=g, dtype=torch.float64)
    return [t.to(torch.bfloat16) for t in (q, k, v, do)]


# (n, d, kv heads, deterministic) -> {causal: the backward's (kernel, dq_mode, dq_halves) on
# Hopper (tables as of 0.14.1; asserted through explain(target=H100) everywhere)}: the portable
# kernels (run on CPU too), and on the GPU each softcap Gluon path: d64 fused dq; d128 halves in
# a fixed order, GQA causal with the dq kernel beside (row vectors scaled in the kernel), MHA
# causal halves, halves in any order.
GLUON_ORDERED_HALVES = ("gluon", DQ_ORDERED, True)
RARE_KEY_CASES = {
    (64, 64, 1, True): {False: ("triton", DQ_KERNEL, False), True: ("triton", DQ_KERNEL, False)},
    (8192, 64, 1, True): {c: ("gluon", DQ_ORDERED, False) for c in (False, True)},
    (2048, 128, 1, True): {False: GLUON_ORDERED_HALVES, True: ("gluon", DQ_KERNEL, False)},
    (2048, 128, 2, True): {True: GLUON_ORDERED_HALVES},
    (2048, 128, 1, False): {c: ("gluon", DQ_ANY_ORDER, True) for c in (False, True)},
}
RARE_KEY_PARAMS = [
    pytest.param(*case, causal, marks=() if case[0] == 64 else pytest.mark.gpu,
                 id="-".join(map(str, case)) + ("-causal" if causal else "-full"))
    for case, paths in RARE_KEY_CASES.items() for causal in paths
]  # fmt: skip


def _rare_key_path(n, d, hkv, deterministic, causal, q, k, target):
    bwd = explain(q, k, k, causal, softcap=30.0, deterministic=deterministic,
                  target=target).backward_config  # fmt: skip
    return bwd.kernel, bwd.dq_mode, bwd.dq_halves, bwd.fast_tanh


def test_rare_key_cases_take_their_paths():
    """Each GPU case of the test below takes the Hopper path it is there for (checked without
    a GPU: a table change that moves a case off its path fails here, in CI)."""
    for (n, d, hkv, det), paths in RARE_KEY_CASES.items():
        q = torch.empty(1, n, 2, d, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, n, hkv, d, dtype=torch.bfloat16, device="meta")
        for causal, path in paths.items():
            got = _rare_key_path(n, d, hkv, det, causal, q, k, H100)
            assert got == (*path, True), (n, d, hkv, det, causal, got)


@pytest.mark.parametrize("n, d, hkv, deterministic, causal", RARE_KEY_PARAMS)
def test_softcap_rarely_attended_keys(n, d, hkv, deterministic, causal, device):
    """Softcap, bfloat16: keys that every query attends with P ~1e-8 get dk rows of ~1e-8
    that the rule over the whole tensor cannot see; each such row meets the rule on its own.
    Regression: the Gluon backward held P (1 - tanh^2) in float16 unscaled, flushed it to 0
    and returned those rows as 0 (bfloat16 dS reaches 1e-38)."""
    softcap, rare = 30.0, [n // 2 + 3, n - 5, n - 1]  # causal: seen by rows of >= n / 2 keys
    q, k, v, do = (t.to(device) for t in _rare_key_inputs(n, d, hkv, softcap, rare))
    call = Call(b=1, nq=n, nk=n, h=2, hkv=hkv, d=d, causal=causal, softcap=softcap,
                deterministic=deterministic)  # fmt: skip
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        path = RARE_KEY_CASES[n, d, hkv, deterministic][causal]  # the path this GPU takes
        assert _rare_key_path(n, d, hkv, deterministic, causal, q, k, None) == (*path, True)
    got = fwd_bwd(call, q, k, v, do)
    check_call(call, got, q, k, v, do)
    hi = fwd_bwd(call, q.double(), k.double(), v.double(), do.double(), reference=True)[2]
    lowp = fwd_bwd(call, q, k, v, do, reference=True)[2]
    for j, h in itertools.product(rare, range(hkv)):  # each (key, kv head) row of dk
        ref = hi[0, j, h].abs().max().item()
        assert 0 < ref < 1e-4, f"key {j}: the case is not rare (|dk| {ref:.2e})"
        err = (got[2][0, j, h].double() - hi[0, j, h]).abs().max().item()
        base = (lowp[0, j, h].double() - hi[0, j, h]).abs().max().item()
        assert err <= RULE[1] * base, (
            f"dk of rarely attended key {j}, kv head {h}: error {err:.2e} > {RULE[1]} x "
            f"{base:.2e} (|dk| {ref:.2e})"
        )
