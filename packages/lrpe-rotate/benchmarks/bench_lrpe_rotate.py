"""lrpe-rotate benchmark suite: reproduces ../shared/seeds/002_a9066e483d9abb9d.txt on our GPU.

x = (12, N, 12, 128) bf16 in (B, N, H, D) layout, theta = (12, 64) float32 (one frequency per
pair), int offset 0, theta not learnable (as the seed). Cases: act none, silu, softmax over D
(dim -1) and over the sequence (dim 1). One test per (case, N, provider); forward and backward
time and peak memory, GB/s and % of copy bandwidth against the ideal traffic (fwd: read x +
write y; bwd: read x (not for act none) + dy, write dx). `python ci/bench.py lrpe-rotate` runs
it on a GPU and renders the seed-style tables. Without a GPU (CI smoke mode,
--benchmark-disable) every test runs once on a tiny shape.
"""

import pytest
import torch

from kernelkit.lrpe_rotate import lrpe_rotate
from kernelkit.lrpe_rotate.reference import lrpe_rotate_reference
from kernelkit.shared.bench import provider_fn, record

GPU = torch.cuda.is_available()
B, H, D = (12, 12, 128) if GPU else (1, 2, 16)
NS = [256 * 2**i for i in range(8)] if GPU else [33]
DTYPE = torch.bfloat16
CASES = [("none", None), ("silu", None), ("softmax", -1), ("softmax", 1)]
PROVIDERS = ["triton", "torch", "torch_compile"]


def fn_for(provider, a, dim):
    return provider_fn(provider, lrpe_rotate, lrpe_rotate_reference, act=a, dim=dim)


def tag_for(a, dim):
    d = "" if dim is None else f"-dim_{dim}"
    return f"batch{B}-head{H}-dim{D}-act_{a}{d}-bf16"


def device():
    return "cuda" if GPU else "cpu"


def make_inputs(n, requires_grad=False):
    x = torch.randn(B, n, H, D, dtype=DTYPE, device=device(), requires_grad=requires_grad)
    half = D // 2
    theta = (10000.0 ** (-torch.arange(half, device=device()) / half)).repeat(H, 1)
    return x, theta


def case_id(c):
    return c[0] if c[1] is None else f"{c[0]}{c[1]}"


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fwd(benchmark, case, n, provider):
    a, dim = case
    x, theta = make_inputs(n)
    f = fn_for(provider, a, dim)
    benchmark.group = f"lrpe_rotate-fwd-{tag_for(a, dim)}"
    record(
        benchmark,
        lambda: f(x, theta),
        op="lrpe_rotate",
        direction="fwd",
        tag=tag_for(a, dim),
        x=n,
        provider=provider,
        bytes_moved=2 * x.numel() * x.element_size(),
    )


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bwd(benchmark, case, n, provider):
    a, dim = case
    x, theta = make_inputs(n, requires_grad=True)
    y = fn_for(provider, a, dim)(x, theta)
    dy = torch.randn_like(y)
    benchmark.group = f"lrpe_rotate-bwd-{tag_for(a, dim)}"
    transfers = 2 if a == "none" else 3
    record(
        benchmark,
        lambda: y.backward(dy, retain_graph=True),
        op="lrpe_rotate",
        direction="bwd",
        tag=tag_for(a, dim),
        x=n,
        provider=provider,
        bytes_moved=transfers * x.numel() * x.element_size(),
        grad_to_none=[x],
    )
