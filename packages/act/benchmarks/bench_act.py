"""act benchmark suite: reproduces ../shared/seeds/000_23d4463f1f0fa7d1.txt on our GPU.

x = (12, 12, N, 128) bf16 in (B, H, N, D) layout, so dim=-2 is the sequence axis. One test per
(case, N, provider); forward and backward time and peak memory, GB/s and % of copy bandwidth.
`python ci/bench.py act` runs it on a GPU and renders the seed-style tables. Without a GPU
(CI smoke mode, --benchmark-disable) every test runs once on a tiny shape.
"""

import pytest
import torch

from kernelkit.act import act
from kernelkit.act.reference import act_reference
from kernelkit.shared.bench import provider_fn, record

GPU = torch.cuda.is_available()
B, H, D = (12, 12, 128) if GPU else (1, 2, 16)
NS = [256 * 2**i for i in range(8)] if GPU else [33]
DTYPE = torch.bfloat16
CASES = [
    ("relu", None),
    ("sigmoid", None),
    ("silu", None),
    ("none", None),
    ("softmax", -1),
    ("softmax", -2),
]
PROVIDERS = ["triton", "torch", "torch_compile"]


def fn_for(provider, a, dim):
    return provider_fn(provider, act, act_reference, act=a, dim=dim)


def tag_for(a, dim):
    d = "" if dim is None else f"-dim_{dim}"
    return f"batch{B}-head{H}-dim{D}-act_{a}{d}-bf16"


def make_x(n, requires_grad=False):
    dev = "cuda" if GPU else "cpu"
    return torch.randn(B, H, n, D, dtype=DTYPE, device=dev, requires_grad=requires_grad)


def case_id(c):
    return c[0] if c[1] is None else f"{c[0]}{c[1]}"


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fwd(benchmark, case, n, provider):
    a, dim = case
    x = make_x(n)
    f = fn_for(provider, a, dim)
    benchmark.group = f"act-fwd-{tag_for(a, dim)}"
    # Ideal bytes: read x, write y (the alias of act="none" moves nothing).
    nbytes = 0 if a == "none" else 2 * x.numel() * x.element_size()
    record(
        benchmark,
        lambda: f(x),
        op="act",
        direction="fwd",
        tag=tag_for(a, dim),
        x=n,
        provider=provider,
        bytes_moved=nbytes or None,
    )


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bwd(benchmark, case, n, provider):
    a, dim = case
    x = make_x(n, requires_grad=True)
    y = fn_for(provider, a, dim)(x)
    dy = torch.randn_like(y)
    benchmark.group = f"act-bwd-{tag_for(a, dim)}"
    # Ideal bytes: read the saved tensor and dy, write dx.
    nbytes = 3 * x.numel() * x.element_size()
    record(
        benchmark,
        lambda: y.backward(dy, retain_graph=True),
        op="act",
        direction="bwd",
        tag=tag_for(a, dim),
        x=n,
        provider=provider,
        bytes_moved=nbytes,
        grad_to_none=[x],
    )
