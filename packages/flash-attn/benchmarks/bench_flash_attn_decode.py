"""flash-attn decoding cells (issue 12, part 2): a few queries against a long KV cache, forward
only, bf16, GQA 32/8, d = 128, B = 8 (the Llama-style decode shape (8, 1, 32, 128)).

Tables (x = Nk, the KV cache length; µs = ms x 1000 in the rendered tables):
  flash_attn_decode-fwd-...-q1     Nq = 1, Nk in 4k..32k
  flash_attn_decode-fwd-...-q{n}   Nq in {2, 4, 8, 16} (speculative decoding), Nk in {8k, 32k}
Providers:
  triton          this package (automatic plan: the split-KV forward at these shapes)
  triton_dense    this package's dense forward forced (what 0.2.0 ran), Nq = 1 only
  triton_causal   ours with causal=True (bottom-right: query i sees keys j <= i + Nk - Nq),
                  Nq > 1 only; every other provider is non-causal (see below)
  sdpa_flash      PyTorch SDPA pinned to one backend, (B, H, N, D) inputs, `enable_gqa=True`;
  sdpa_cudnn      a backend that refuses GQA gets K/V repeated to H heads beforehand
  sdpa_efficient  (extra_info["gqa"] = "repeat_kv": it reads 4x the KV bytes);
                  extra_info["kernel"] names the autograd node that ran
Causal: at Nq = 1 causal and non-causal are the same attention, so every provider runs
non-causal. For Nq > 1, SDPA's `is_causal` is top-left aligned (wrong for decoding), so the SDPA
and `triton` cells are non-causal (the causal mask would hide at most 15 of >= 8192 keys per row:
the same bytes and nearly the same work), and `triton_causal` shows what the mask costs us.
GB/s and % of the copy bandwidth count the KV bytes only (2 * B * Nk * Hkv * d * 2 bytes), the
floor of a decode step; q, o and the partials are < 1% of them at these shapes.

`python ci/bench.py flash-attn -k decode` runs it on a GPU (about a minute); without one (CI
smoke mode) every cell runs once on a tiny shape under the Triton interpreter.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from bench_flash_attn import SDPA
from torch.nn.attention import sdpa_kernel

from kernelkit.flash_attn import flash_attn
from kernelkit.flash_attn.choose import choose_fwd, dense_fwd_config
from kernelkit.flash_attn.launch import forward, forward_problem
from kernelkit.shared.bench import record

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16
B, H, HKV, D = (8, 32, 8, 128) if GPU else (1, 4, 2, 16)
NK_DECODE = [4096, 8192, 16384, 32768] if GPU else [40]
NQ_SPEC = [2, 4, 8, 16] if GPU else [2]
NK_SPEC = [8192, 32768] if GPU else [40]
DECODE_PROVIDERS = ["triton", "triton_dense", *SDPA]
SPEC_PROVIDERS = ["triton", "triton_causal", *SDPA]


def kv_bytes(nk):
    return 2 * B * nk * HKV * D * torch.finfo(DTYPE).bits // 8


def inputs(nq, nk):
    """q (B, Nq, H, D), k, v (B, Nk, Hkv, D), in our layout."""
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def r(*shape):
        return torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=g)

    return r(B, nq, H, D), r(B, nk, HKV, D), r(B, nk, HKV, D)


def ours(provider, q, k, v):
    if provider == "triton_dense":
        config = dense_fwd_config(forward_problem(q, k, v, False))
        scale = 1.0 / math.sqrt(D)
        return lambda: forward(q, k, v, False, scale, config=config)
    return functools.partial(flash_attn, q, k, v, causal=provider == "triton_causal")


def sdpa(provider, q, k, v, info):
    """The timed SDPA call (non-causal), with GQA through enable_gqa or repeated K/V heads."""
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    backend = SDPA[provider]

    def call(kk, vv, gqa):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kk, vv, enable_gqa=gqa)

    repeated = (kt.repeat_interleave(H // HKV, 1), vt.repeat_interleave(H // HKV, 1))
    error = None
    for (kk, vv), gqa, how in (((kt, vt), True, "enable_gqa"), (repeated, False, "repeat_kv")):
        try:
            qt.requires_grad_(True)  # once, to name the kernel that ran
            info["kernel"] = type(call(kk, vv, gqa).grad_fn).__name__
            qt.requires_grad_(False)
        except RuntimeError as e:
            error = e
            qt.requires_grad_(False)
            continue
        info["gqa"] = how
        return functools.partial(call, kk, vv, gqa)
    pytest.skip(f"{provider} unavailable: {str(error).splitlines()[0]}")


def run_cell(benchmark, nq, nk, provider):
    q, k, v = inputs(nq, nk)
    info = {"nq": nq, "kv_bytes": kv_bytes(nk)}
    if provider.startswith("triton"):
        fn = ours(provider, q, k, v)
        split = choose_fwd(forward_problem(q, k, v, provider == "triton_causal")).split
        info["plan"] = f"{split.splits} splits x {split.split_len} keys" if split else "dense"
    else:
        fn = sdpa(provider, q, k, v, info)

    def call():
        with torch.no_grad():
            return fn()

    benchmark.group = f"flash_attn_decode-fwd-q{nq}"
    tag = f"batch{B}-q{nq}-head{H}-kv{HKV}-dim{D}-bf16"
    record(benchmark, call, op="flash_attn_decode", direction="fwd", tag=tag, x=nk, xname="nk",
           provider=provider, bytes_moved=kv_bytes(nk), info=info)  # fmt: skip


@pytest.mark.parametrize("provider", DECODE_PROVIDERS)
@pytest.mark.parametrize("nk", NK_DECODE)
def test_decode(benchmark, nk, provider):
    run_cell(benchmark, 1, nk, provider)


@pytest.mark.parametrize("provider", SPEC_PROVIDERS)
@pytest.mark.parametrize("nk", NK_SPEC)
@pytest.mark.parametrize("nq", NQ_SPEC)
def test_speculative_decode(benchmark, nq, nk, provider):
    run_cell(benchmark, nq, nk, provider)
