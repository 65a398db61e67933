"""flash-attn benchmark suite: suites 1 and 5 of docs/benchmarks.md.

Suite 1 (`flash_attn`): bf16, d in {64, 128}, causal and not, N in 1k..32k, B = 16384 / N,
H = 2048 / d; forward, backward and forward+backward in TFLOP/s (forward FLOPs 4 B H N^2 d,
halved for causal; backward 2.5x, forward+backward 3.5x of that), one column per provider:
  triton          this package (q, k, v in (B, N, H, D))
  sdpa_flash      PyTorch SDPA pinned to each backend with torch.nn.attention.sdpa_kernel
  sdpa_cudnn      (inputs in SDPA's (B, H, N, D) layout; extra_info["kernel"] names the autograd
  sdpa_efficient   node that ran; a backend the GPU lacks is skipped)
  torch           eager attention (the package's reference: the N x N scores in memory)
  torch_compile   torch.compile of it (static shapes)
  triton_any_order this package with deterministic=False (dq's parts added in any order where
                  that measured faster: d64 from 4k rows on Hopper, tables.ANY_ORDER_DQ_MIN_N);
                  backward and forward+backward cells of d = 64 only (elsewhere it is the
                  triton column)
Eager/compiled cells whose score matrices cannot fit on the GPU are recorded as OOM without
being run (an estimate, extra_info["oom_estimated"]); the rest that run out of memory are
recorded as OOM by `record`.

Suite 5 (`flash_attn_leaderboard`): the course leaderboard shape, (16, 16384, 64) one-head 3-D
tensors, causal, bf16; forward, backward and forward+backward.

Host table (issue 33, `flash_attn-host`): host µs per call (`kernelkit.shared.host_time`: Python
issuing the calls, no sync) of causal self-attention at the small shape (1, 256, 32, 128) and
the decode shape (8, 1, 32, 128), bf16: forward, forward with q requiring grad, backward;
ours (`flash_attn(q, k, v)`, (B, N, H, D)) beside SDPA's default dispatch on (B, H, N, D)
tensors (`torch`) and torch.compile of that call (`torch_compile`). k and v do not require
grad: the backward row is dq's engine path plus our whole backward (which computes dk and dv
too), without the engine's gradient sums that q = k = v = x would add. Run it on its own,
`python ci/bench.py flash-attn -k host --name host` (results/<GPU>-host.*), so that suite 1's
file keeps its own run.

`python ci/bench.py flash-attn` runs it on a GPU. Without one (CI smoke mode,
--benchmark-disable) every test runs once on a tiny shape under the Triton interpreter.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelkit.flash_attn import FlashAttentionFunction, flash_attn
from kernelkit.flash_attn.reference import attention_reference
from kernelkit.shared.bench import host_cell, provider_fn, record, torch_compile
from kernelkit.shared.host_time import HOST_SHAPES

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16
TOKENS, HIDDEN = (16384, 2048) if GPU else (33, 32)
DS = [64, 128] if GPU else [16]
NS = [1024 * 2**i for i in range(6)] if GPU else [33]
LEADERBOARD = (16, 16384, 64) if GPU else (2, 33, 16)
DIRECTIONS = ["fwd", "bwd", "fwd_bwd"]
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
PROVIDERS = ["triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch", "torch_compile",
             "triton_any_order"]  # fmt: skip
# The leaderboard also runs our op through torch.compile(fullgraph=True), as the course
# harness calls it (`FlashAttentionFunction.apply`): the same kernels as the eager call.
LEADERBOARD_PROVIDERS = PROVIDERS + ["triton_compiled"]
SDPA = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
# Bytes per score element an eager forward+backward holds at its peak (bf16 scores, the masked
# copy, probabilities, their gradient and the scores' gradient), for the OOM estimate; twice
# that for float32 inputs.
EAGER_BYTES_PER_SCORE = 10


def shape_for(n, d):
    return max(1, TOKENS // n), HIDDEN // d


def fwd_flops(b, h, n, d, causal):
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def eager_fits(b, h, n, dtype=DTYPE):
    if not GPU:
        return True
    # what the caching allocator holds but does not use is free too (an earlier eager cell's
    # blocks would otherwise turn the next cell into a false OOM, as torch_compile fwd at 8k did)
    free = (
        torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    )
    per_score = EAGER_BYTES_PER_SCORE * dtype.itemsize / 2
    return per_score * b * h * n * n < 0.9 * free


@functools.cache
def compiled(causal):
    return torch_compile(functools.partial(attention_reference, causal=causal))


@functools.cache
def compiled_function(causal):
    """torch.compile(FlashAttentionFunction.apply) for 3-D inputs (the course harness)."""
    return torch.compile(
        lambda q, k, v: FlashAttentionFunction.apply(q, k, v, causal), fullgraph=True
    )


def sdpa(backend, causal):
    def f(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return f


def attention_fn(provider, causal):
    """(fn(q, k, v) -> o, layout) of one provider."""
    if provider == "triton":
        return functools.partial(flash_attn, causal=causal), "bnhd"
    if provider == "triton_any_order":
        return functools.partial(flash_attn, causal=causal, deterministic=False), "bnhd"
    if provider == "triton_compiled":
        return compiled_function(causal), "bnhd"
    if provider in SDPA:
        return sdpa(SDPA[provider], causal), "bhnd"
    if provider == "torch":
        return functools.partial(attention_reference, causal=causal), "bnhd"
    return compiled(causal), "bnhd"


def make_inputs(shape, layout, dtype=DTYPE):
    """q, k, v (requiring grad) and a gradient for o, shape (B, N, H, D) or (B, N, D)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def r(requires_grad=True):
        t = torch.randn(shape, dtype=dtype, device=DEVICE, generator=g)
        if layout == "bhnd" and t.dim() == 4:
            t = t.transpose(1, 2).contiguous()
        elif layout == "bhnd":  # 3-D (B, N, D): one head for SDPA
            t = t.unsqueeze(1)
        return t.requires_grad_(requires_grad)

    return r(), r(), r(), r(False)


def _raise_oom():
    raise torch.OutOfMemoryError("eager attention's score matrices do not fit (estimated)")


def direction_call(fn, inputs, o, do, direction):
    """The timed callable of one direction, given o = fn(*inputs) from an untimed call: "fwd"
    calls fn without autograd, "bwd" backpropagates do through o, "fwd_bwd" does both."""
    if direction == "bwd":
        return lambda: o.backward(do, retain_graph=True)
    if direction == "fwd":

        def call():
            with torch.no_grad():
                return fn(*inputs)

        return call
    return lambda: fn(*inputs).backward(do)


def run_case(benchmark, *, op, tag, x, shape, causal, provider, direction, flops, dtype=DTYPE):
    if provider == "triton_any_order" and (direction == "fwd" or shape[-1] != DS[0]):
        pytest.skip("deterministic=False changes only the d64 backward")
    fn, layout = attention_fn(provider, causal)
    info = {"layout": layout}
    b, n = shape[0], shape[1]
    h = shape[2] if len(shape) == 4 else 1
    if provider in ("torch", "torch_compile") and not eager_fits(b, h, n, dtype):
        info["oom_estimated"] = True
        record(benchmark, _raise_oom, op=op, direction=direction, tag=tag, x=x,
               provider=provider, flops=flops, info=info)  # fmt: skip
        return
    q, k, v, do = make_inputs(shape, layout, dtype)
    try:
        o = fn(q, k, v)
    except torch.OutOfMemoryError:
        o = None
    except RuntimeError as e:  # an SDPA backend this GPU or these inputs lack
        if provider in SDPA:
            pytest.skip(f"{provider} unavailable: {str(e).splitlines()[0]}")
        raise
    if o is not None and provider in SDPA:
        info["kernel"] = type(o.grad_fn).__name__
    call = _raise_oom if o is None else direction_call(fn, (q, k, v), o, do, direction)
    del o  # only the bwd call keeps it (and its graph)
    record(benchmark, call, op=op, direction=direction, tag=tag, x=x, provider=provider,
           flops=flops, grad_to_none=[q, k, v], info=info)  # fmt: skip


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("causal", [False, True], ids=["causal0", "causal1"])
@pytest.mark.parametrize("d", DS, ids=lambda d: f"d{d}")
def test_sweep(benchmark, d, causal, n, direction, provider):
    b, h = shape_for(n, d)
    benchmark.group = f"flash_attn-{direction}-dim{d}-causal{int(causal)}"
    flops = FLOP_FACTOR[direction] * fwd_flops(b, h, n, d, causal)
    # B = TOKENS / N changes along the table's rows, so the tag names the token count.
    tag = f"tokens{TOKENS}-head{h}-dim{d}-causal{int(causal)}-bf16"
    run_case(benchmark, op="flash_attn", tag=tag, x=n, shape=(b, n, h, d), causal=causal,
             provider=provider, direction=direction, flops=flops)  # fmt: skip


HOST_OURS = functools.partial(flash_attn, causal=True)
HOST_SDPA = functools.partial(F.scaled_dot_product_attention, is_causal=True)


@pytest.mark.parametrize("provider", ["triton", "torch", "torch_compile"])
@pytest.mark.parametrize("shape", list(HOST_SHAPES))
def test_host(benchmark, shape, provider):
    dims = HOST_SHAPES[shape] if GPU else (2, 5, 2, 16)
    q, k, v, _ = make_inputs(dims, "bnhd" if provider == "triton" else "bhnd")
    fn = provider_fn(provider, HOST_OURS, HOST_SDPA)
    host_cell(benchmark, fn, [t.detach() for t in (q, k, v)], op="flash_attn", case="causal",
              shape=f"{shape} {'x'.join(map(str, dims))}", provider=provider,
              order=(list(HOST_SHAPES).index(shape),))  # fmt: skip


@pytest.mark.parametrize("provider", LEADERBOARD_PROVIDERS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_leaderboard(benchmark, direction, provider):
    b, n, d = LEADERBOARD
    tag = f"batch{b}-head1-dim{d}-causal1-bf16"
    benchmark.group = f"flash_attn_leaderboard-{direction}"
    flops = FLOP_FACTOR[direction] * fwd_flops(b, 1, n, d, True)
    run_case(benchmark, op="flash_attn_leaderboard", tag=tag, x=n, shape=(b, n, d), causal=True,
             provider=provider, direction=direction, flops=flops)  # fmt: skip


def test_flops_convention():
    """The suite's FLOP count: 4 B H N^2 d forward, halved for causal."""
    assert fwd_flops(2, 3, 8, 16, False) == 4 * 2 * 3 * 64 * 16
    assert fwd_flops(2, 3, 8, 16, True) == 2 * 2 * 3 * 64 * 16
    assert math.isclose(FLOP_FACTOR["fwd_bwd"], FLOP_FACTOR["fwd"] + FLOP_FACTOR["bwd"])
