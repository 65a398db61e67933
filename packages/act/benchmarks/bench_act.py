"""act benchmark suite: reproduces ../shared/seeds/000_23d4463f1f0fa7d1.txt on our GPU.

x = (12, 12, N, 128) bf16 in (B, H, N, D) layout, so dim=-2 is the sequence axis. One test per
(case, N, provider); forward and backward time and peak memory, GB/s and % of copy bandwidth.

Model shapes (`test_model_*`): x = (B, N, H, D) = (B, N, 32, 128) bf16 as a model feeds it,
decode (8, 1), small (1, 256) and training (8, 4096); silu, softmax over the last dim (D) and
over N (dim 1); the table rows are the tokens B·N (8, 256, 32768). Small sizes are bounded by
the host cost per call (see NOTES.md), large ones by memory bandwidth.

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


# ---------------------------------------------------------------------------------------------
# Model shapes: (B, N, H, D) as a model feeds them
# ---------------------------------------------------------------------------------------------

MODEL_SHAPES = [(8, 1, 32, 128), (1, 256, 32, 128), (8, 4096, 32, 128)] if GPU else [(2, 3, 2, 16)]
MODEL_CASES = [("silu", None), ("softmax", -1), ("softmax", 1)]


def model_tag(a, dim):
    what = a if dim is None else f"{a}-dim_{'N' if dim == 1 else dim}"
    return f"model-heads{MODEL_SHAPES[0][2]}-dim{MODEL_SHAPES[0][3]}-act_{what}-bf16"


def shape_id(shape):
    return "x".join(map(str, shape))


def model_x(shape, requires_grad=False):
    dev = "cuda" if GPU else "cpu"
    return torch.randn(*shape, dtype=DTYPE, device=dev, requires_grad=requires_grad)


def model_cells(test):
    """One test per (case, model shape, provider)."""
    test = pytest.mark.parametrize("provider", PROVIDERS)(test)
    test = pytest.mark.parametrize("shape", MODEL_SHAPES, ids=shape_id)(test)
    return pytest.mark.parametrize("case", MODEL_CASES, ids=case_id)(test)


def record_model(benchmark, fn, direction, case, shape, provider, tensors, **kwargs):
    """`record` for a model-shape cell; the ideal bytes are `tensors` tensor-sized transfers."""
    tag = model_tag(*case)
    benchmark.group = f"act-{direction}-{tag}"
    n = shape[0] * shape[1] * shape[2] * shape[3]
    record(
        benchmark,
        fn,
        op="act",
        direction=direction,
        tag=tag,
        x=shape[0] * shape[1],
        xname="tokens",
        provider=provider,
        bytes_moved=tensors * n * DTYPE.itemsize,
        info={"shape": list(shape)},
        **kwargs,
    )


@model_cells
def test_model_fwd(benchmark, case, shape, provider):
    x = model_x(shape)
    f = fn_for(provider, *case)
    record_model(benchmark, lambda: f(x), "fwd", case, shape, provider, 2)  # read x, write y


@model_cells
def test_model_bwd(benchmark, case, shape, provider):
    x = model_x(shape, requires_grad=True)
    y = fn_for(provider, *case)(x)
    dy = torch.randn_like(y)

    def bwd():
        y.backward(dy, retain_graph=True)

    # Ideal bytes: read the saved tensor and dy, write dx.
    record_model(benchmark, bwd, "bwd", case, shape, provider, 3, grad_to_none=[x])
