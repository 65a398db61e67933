"""lrpe-cosine benchmark suite: reproduces the lrpe cosine seed table (docs/benchmarks.md) on our GPU,
plus the model shapes users run (kernelkit.shared.bench.MODEL_SHAPES).

Seed table: x = (12, N, 12, 128) bf16 in (B, N, H, D) layout, theta = (12, 128) float32,
int offset 0, theta fixed (as the seed); act none, silu, softmax over D (dim -1) and over the
sequence (dim 1). Model table: decode, small batch, training and GQA-key shapes with theta fixed
or learnable (`-dtheta`). Ideal traffic in units of x's bytes: forward read x + write y (3),
backward read dy (2) + write dx (1) + read x (1) when an act or d(theta) needs it.
Positions table: one (1, 65536, 32, 128) row, positions from an int offset, a (B, N) table or
cu_seqlens of packed log-normal documents (softmax over N per document); goal: the same % of copy
bandwidth whatever the form.
Host table (issue 33): host µs per call (`kernelkit.shared.host_time`) of act none, softmax over
D and over N at the small (1, 256, 32, 128) and decode (8, 1, 32, 128) shapes, forward, forward
with x requiring grad and backward, ours vs eager vs torch.compile.
`python ci/bench.py lrpe-cosine` runs it on a GPU and renders the seed-style tables; without a GPU
(CI smoke mode, --benchmark-disable) every cell runs once on a tiny shape.
"""

import pytest
import torch

from kernelkit.lrpe_cosine import lrpe_cosine
from kernelkit.lrpe_cosine.reference import lrpe_cosine_reference
from kernelkit.shared.bench import MODEL_SHAPES, OpSuite
from kernelkit.shared.host_time import HOST_SHAPES

GPU = torch.cuda.is_available()
B, H, D = (12, 12, 128) if GPU else (1, 2, 16)
NS = [256 * 2**i for i in range(8)] if GPU else [33]
CASES = [("none", None), ("silu", None), ("softmax", -1), ("softmax", 1)]
MODEL_CASES = [  # (direction, act, learnable theta)
    ("fwd", "none", False),
    ("fwd", "silu", False),
    ("bwd", "none", False),
    ("bwd", "none", True),
    ("bwd", "silu", False),
    ("bwd", "silu", True),
]
PROVIDERS = ["triton", "torch", "torch_compile"]
POSITION_CASES = [("none", None), ("silu", None), ("softmax", 1)]
HOST_CASES = [("none", None), ("softmax", -1), ("softmax", 1)]  # the host table's rows


def inputs(shape, x_grad, theta_grad):
    b, n, h, d = shape
    dev = "cuda" if GPU else "cpu"
    x = torch.randn(b, n, h, d, dtype=torch.bfloat16, device=dev, requires_grad=x_grad)
    e = d
    theta = (10000.0 ** (-torch.arange(e, device=dev, dtype=torch.float32) / e)).repeat(h, 1)
    return x, theta.requires_grad_(theta_grad)


def traffic(direction, act, x, theta_grad):
    units = 3 if direction == "fwd" else 2 + 1 + (act != "none" or theta_grad)
    return units * x.numel() * x.element_size()


SUITE = OpSuite(
    "lrpe_cosine", lrpe_cosine, lrpe_cosine_reference, inputs, traffic, f"batch{B}-head{H}-dim{D}"
)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_seed(benchmark, direction, case, n, provider):
    SUITE.seed_cell(benchmark, direction, case, (B, n, H, D), n, provider)


@pytest.mark.parametrize("model", list(MODEL_SHAPES))
@pytest.mark.parametrize(
    ("direction", "act", "theta_grad", "provider"),
    # torch.compile compiles every (shape, case) afresh: only the act-none cases.
    [(*c, p) for c in MODEL_CASES for p in PROVIDERS if p != "torch_compile" or c[1] == "none"],
)
def test_model(benchmark, direction, act, theta_grad, provider, model):
    SUITE.model_cell(benchmark, direction, act, theta_grad, model, provider)


@pytest.mark.parametrize("provider", ["triton", "torch"])
@pytest.mark.parametrize("form", ["offset", "table", "packed"])
@pytest.mark.parametrize("case", POSITION_CASES, ids=str)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_positions(benchmark, direction, case, form, provider):
    SUITE.positions_cell(benchmark, direction, case, form, provider)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(HOST_SHAPES))
@pytest.mark.parametrize("case", HOST_CASES, ids=str)
def test_host(benchmark, case, shape, provider):
    SUITE.host_cell(benchmark, case, shape, provider)
