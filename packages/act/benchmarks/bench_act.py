"""act benchmark suite: reproduces the act seed table (docs/benchmarks.md) on our GPU, plus the
model shapes users run (kernelkit.shared.bench.MODEL_SHAPES).

Seed table: x = (12, 12, N, 128) bf16 in (B, H, N, D) layout, so dim=-2 is the sequence axis;
one cell per (case, N, provider), forward and backward. Model table: x = (B, N, H, D) as a model
feeds it, decode (8, 1, 32, 128), small (1, 256, 32, 128) and training (8, 4096, 32, 128); silu,
softmax over the last dim (D) and over N (dim 1). Small sizes are bounded by the host cost per
call (NOTES.md), large ones by memory bandwidth. Ideal traffic in units of x's bytes: forward
read x + write y (2; none is an alias: 0), backward read the saved tensor and dy, write dx (3).
Packed table: softmax over N of (1, 65536, 32, 128) as one sequence ("dense") and as log-normal
documents packed back to back ("packed", cu_seqlens: a softmax per document); goal: the same %
of copy bandwidth.
Host table (issue 33): host µs per call (`kernelkit.shared.host_time`: Python issuing the calls,
no sync) of the model cases at the small (1, 256, 32, 128) and decode (8, 1, 32, 128) shapes,
forward, forward with x requiring grad and backward, ours vs eager vs torch.compile.
`python ci/bench.py act` runs it on a GPU and renders the seed-style tables; without a GPU (CI
smoke mode, --benchmark-disable) every cell runs once on a tiny shape.
"""

import pytest
import torch

from kernelkit.act import act
from kernelkit.act.reference import act_reference
from kernelkit.shared.bench import OpSuite, cu_seqlens_of, layout_row
from kernelkit.shared.host_time import HOST_SHAPES

GPU = torch.cuda.is_available()
B, H, D = (12, 12, 128) if GPU else (1, 2, 16)
NS = [256 * 2**i for i in range(8)] if GPU else [33]
CASES = [
    ("relu", None),
    ("sigmoid", None),
    ("silu", None),
    ("none", None),
    ("softmax", -1),
    ("softmax", -2),
]
MODEL_CASES = [("silu", None), ("softmax", -1), ("softmax", 1)]
MODELS = ["decode", "small", "train"]
PROVIDERS = ["triton", "torch", "torch_compile"]


def inputs(shape, x_grad, _param_grad):
    dev = "cuda" if GPU else "cpu"
    return (torch.randn(*shape, dtype=torch.bfloat16, device=dev, requires_grad=x_grad),)


def traffic(direction, a, x, _param_grad):
    units = (0 if a == "none" else 2) if direction == "fwd" else 3
    return units * x.numel() * x.element_size() or None


SUITE = OpSuite("act", act, act_reference, inputs, traffic, f"batch{B}-head{H}-dim{D}")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_seed(benchmark, direction, case, n, provider):
    SUITE.seed_cell(benchmark, direction, case, (B, H, n, D), n, provider)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_model(benchmark, direction, case, model, provider):
    a, dim = case
    SUITE.model_cell(benchmark, direction, a, False, model, provider, dim=dim)


@pytest.mark.parametrize("provider", ["triton", "torch"])
@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_packed(benchmark, direction, layout, provider):
    shape, lengths = layout_row()
    kw = {}
    if layout == "packed":
        kw = {"cu_seqlens": cu_seqlens_of(lengths, "cuda" if GPU else "cpu")}
    label = "dense" if not kw else f"packed {len(lengths)} docs"
    SUITE.layout_cell(
        benchmark, direction, ("softmax", 1), shape, label, provider, kw, kw, "packed"
    )


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", list(HOST_SHAPES))
@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
def test_host(benchmark, case, shape, provider):
    SUITE.host_cell(benchmark, case, shape, provider)
