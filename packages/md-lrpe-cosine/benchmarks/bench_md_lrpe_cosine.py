"""md-lrpe-cosine benchmark suite: reproduces the md lrpe cosine seed table (docs/benchmarks.md) on our
GPU, plus image/video model shapes.

Seed table: x = (12, l + n^m, 12, 128) bf16, theta (12, ceil(128 / m)) float32 fixed, act none;
1-D n = 256 ... 32768, 2-D n = 16 ... 128 (n^2 tokens), 3-D n = 4 ... 32 (n^3 tokens), each with
l = 0 and l = 10 extra tokens. Providers: ours (`triton`), ours with the angle cache
(`triton_cache`), the PyTorch reference (`torch`) and torch.compile of it (`torch_compile`, at the
largest n of each grid with l = 0 only: every shape is a fresh static compile). Model table: ViT-style
image grids with class/register tokens, a DiT latent with a non-power-of-two head dim, a video
grid; theta fixed or learnable (`-dtheta`). Ideal traffic in units of x's bytes: forward read x +
write y (3); backward read dy (2) + write dx (1) (+ read x (1) for d(theta)); the cache's angle
table is extra traffic and not credited. Host table (issue 33): host µs per call
(`kernelkit.shared.host_time`) at the small shape as a 16 x 16 grid and the decode shape, forward,
forward with x requiring grad, backward. `python ci/bench.py md-lrpe-cosine` runs it on a GPU;
without one (CI smoke mode, --benchmark-disable) every cell runs once on a tiny shape.
"""

import functools
import math

import pytest
import torch

from kernelkit.md_lrpe_cosine import md_lrpe_cosine
from kernelkit.md_lrpe_cosine.reference import md_lrpe_cosine_reference
from kernelkit.shared.bench import host_cell, time_op, torch_compile

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
B, H, D = (12, 12, 128) if GPU else (1, 2, 16)
SIDES = {1: [256 * 2**i for i in range(8)], 2: [16, 32, 64, 128], 3: [4, 8, 16, 32]}
if not GPU:
    SIDES = {1: [9], 2: [3], 3: [2]}
PROVIDERS = ["triton", "triton_cache", "torch", "torch_compile"]
# (B, l, grid, H, D) of models: ViT-B/16 at 224 px (class token), ViT-L/14 at 224 px with 4
# registers, a DiT-XL/2 latent of 256 px (D = 72), a video clip of 8 x 16 x 16 patches.
MODELS = {
    "vit_b16": (32, 1, (14, 14), 12, 64),
    "vit_l14_reg": (32, 5, (16, 16), 16, 64),
    "dit_xl2": (16, 0, (16, 16), 16, 72),
    "video": (4, 0, (8, 16, 16), 16, 64),
}
if not GPU:
    MODELS = {"tiny": (2, 1, (2, 3), 2, 8)}
MODEL_CASES = [("fwd", False), ("bwd", False), ("bwd", True)]  # (direction, learnable theta)
# Host table, (B, l, grid, H, D): the small shape (1, 256, 32, 128) as a 16 x 16 image and the
# decode shape (8, 1, 32, 128) as one token per row.
HOST = {"small": (1, 0, (16, 16), 32, 128), "decode": (8, 0, (1,), 32, 128)}
if not GPU:
    HOST = {name: (2, 1, (2, 3), 2, 8) for name in HOST}


def seed_cells():
    for m, sides in SIDES.items():
        for n in sides:
            for l in (0, 10):
                for provider in PROVIDERS:
                    if provider == "torch_compile" and (n != sides[-1] or l):
                        continue
                    yield m, n, l, provider


def inputs(b, grid, l, h, d, x_grad, theta_grad):
    x = torch.randn(b, l + math.prod(grid), h, d, dtype=torch.bfloat16, device=DEVICE)
    e = -(-d // len(grid))
    theta = (10000.0 ** (-torch.arange(e, device=DEVICE, dtype=torch.float32) / e)).repeat(h, 1)
    return x.requires_grad_(x_grad), theta.requires_grad_(theta_grad)


_compiled = {}


def provider_callable(provider, grid, l):
    if provider in ("triton", "triton_cache"):
        return functools.partial(md_lrpe_cosine, shape=grid, l=l, cache=provider == "triton_cache")
    ref = functools.partial(md_lrpe_cosine_reference, shape=grid, l=l)
    if provider == "torch":
        return ref
    if (grid, l) not in _compiled:
        _compiled[grid, l] = torch_compile(ref)
    return _compiled[grid, l]


def traffic(direction, x, theta_grad):
    units = 3 if direction == "fwd" else 3 + theta_grad
    return units * x.numel() * x.element_size()


@pytest.mark.parametrize(("m", "n", "l", "provider"), list(seed_cells()))
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_seed(benchmark, direction, m, n, l, provider):
    grid = (n,) * m
    x, theta = inputs(B, grid, l, H, D, direction == "bwd", False)
    time_op(
        benchmark,
        provider_callable(provider, grid, l),
        (x, theta),
        op="md_lrpe_cosine",
        direction=direction,
        tag=f"batch{B}-head{H}-dim{D}-bf16-{m}d-l{l}",
        x=n,
        provider=provider,
        bytes_moved=traffic(direction, x, False),
        info={"tokens": x.shape[1]},
    )


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(
    ("direction", "theta_grad", "provider"),
    [(*c, p) for c in MODEL_CASES for p in PROVIDERS if p != "torch_compile" or not c[1]],
)
def test_model(benchmark, direction, theta_grad, provider, model):
    b, l, grid, h, d = MODELS[model]
    x, theta = inputs(b, grid, l, h, d, direction == "bwd", theta_grad)
    time_op(
        benchmark,
        provider_callable(provider, grid, l),
        (x, theta),
        op="md_lrpe_cosine",
        direction=direction,
        tag=f"model-act_none{'-dtheta' if theta_grad else ''}-bf16",
        x=f"{model} {b}x{x.shape[1]}x{h}x{d} grid {'x'.join(map(str, grid))}+{l}",
        xname="shape",
        provider=provider,
        bytes_moved=traffic(direction, x, theta_grad),
    )


@pytest.mark.parametrize("provider", ["triton", "torch", "torch_compile"])
@pytest.mark.parametrize("shape", list(HOST))
def test_host(benchmark, shape, provider):
    b, l, grid, h, d = HOST[shape]
    x, theta = inputs(b, grid, l, h, d, False, False)
    host_cell(
        benchmark,
        provider_callable(provider, grid, l),
        (x, theta),
        op="md_lrpe_cosine",
        case="act none",
        shape=f"{shape} {b}x{x.shape[1]}x{h}x{d} grid {'x'.join(map(str, grid))}+{l}",
        provider=provider,
        order=("act none", list(HOST).index(shape)),
    )
