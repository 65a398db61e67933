"""lrpe-cosine benchmark suite: reproduces ../shared/seeds/001_95cdd99ed94a81f9.txt on our GPU.

x = (12, N, 12, 128) bf16 in (B, N, H, D) layout (dim=1 is the sequence), theta = (12, 128)
float32, offset 0. One test per (case, N, provider); forward and backward time and peak memory,
GB/s and % of copy bandwidth. `python ci/bench.py lrpe-cosine` runs it on a GPU and renders the
seed-style tables. Without a GPU (CI smoke mode, --benchmark-disable) every test runs once on a
tiny shape.
"""

import pytest
import torch

from kernelkit.lrpe_cosine import lrpe_cosine
from kernelkit.lrpe_cosine.reference import lrpe_cosine_reference
from kernelkit.shared.bench import provider_fn, record

GPU = torch.cuda.is_available()
B, H, D = (12, 12, 128) if GPU else (1, 2, 16)
NS = [256 * 2**i for i in range(8)] if GPU else [33]
DTYPE = torch.bfloat16
CASES = [("none", None), ("silu", None), ("softmax", -1), ("softmax", 1)]
PROVIDERS = ["triton", "torch", "torch_compile"]


def fn_for(provider, a, dim):
    return provider_fn(provider, lrpe_cosine, lrpe_cosine_reference, act=a, dim=dim)


def tag_for(a, dim):
    d = "" if dim is None else f"-dim_{dim}"
    return f"batch{B}-head{H}-dim{D}-act_{a}{d}-bf16"


def make_inputs(n, requires_grad=False):
    dev = "cuda" if GPU else "cpu"
    x = torch.randn(B, n, H, D, dtype=DTYPE, device=dev, requires_grad=requires_grad)
    theta = 10000.0 ** (-torch.arange(D, device=dev, dtype=torch.float32) / D)
    return x, theta.expand(H, D).contiguous()


def case_id(c):
    return c[0] if c[1] is None else f"{c[0]}{c[1]}"


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fwd(benchmark, case, n, provider):
    a, dim = case
    x, theta = make_inputs(n)
    f = fn_for(provider, a, dim)
    benchmark.group = f"lrpe_cosine-fwd-{tag_for(a, dim)}"
    # Ideal bytes: read x once, write y (twice x's size). Softmax over the sequence needs a
    # second read of x for its statistics, which this figure does not credit.
    nbytes = 3 * x.numel() * x.element_size()
    record(
        benchmark,
        lambda: f(x, theta),
        op="lrpe_cosine",
        direction="fwd",
        tag=tag_for(a, dim),
        x=n,
        provider=provider,
        bytes_moved=nbytes,
    )


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bwd(benchmark, case, n, provider):
    a, dim = case
    x, theta = make_inputs(n, requires_grad=True)
    y = fn_for(provider, a, dim)(x, theta)
    dy = torch.randn_like(y)
    benchmark.group = f"lrpe_cosine-bwd-{tag_for(a, dim)}"
    # Ideal bytes: read dy (twice x's size), write dx, and read x back unless act is none.
    units = 3 if a == "none" else 4
    nbytes = units * x.numel() * x.element_size()
    record(
        benchmark,
        lambda: y.backward(dy, retain_graph=True),
        op="lrpe_cosine",
        direction="bwd",
        tag=tag_for(a, dim),
        x=n,
        provider=provider,
        bytes_moved=nbytes,
        grad_to_none=[x],
    )
