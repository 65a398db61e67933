"""Where a small launch's host µs go on a GPU host: torch allocations and launches, Triton's
`kernel[grid]`, its C launcher with tensors or ints, kernelkit's launcher, a TMA kernel's
scratch (allocator per launch vs kept), and act / flash_attn / SDPA calls, then cProfile of
three ops. Run from the repository root with PYTHONPATH as ci/gpu_run.sh sets it; writes
$OUT/launch_micro.json (session 32: lab/flash-attn/logs/session32-H200-launch-micro-*.log)."""

import json
import os

import torch
import triton
import triton.language as tl

from kernelkit.shared.host_time import per_call_us

out = {}


def rec(name, fn, **kw):
    us = per_call_us(fn, **kw)
    out[name] = round(us, 2)
    print(f"{name:60s} {us:7.2f}", flush=True)


@triton.jit
def copy2(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


@triton.jit
def copy8(a, b, c, d, e, f, g, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = (
        tl.load(a + i, mask=i < n)
        + tl.load(b + i, mask=i < n)
        + tl.load(c + i, mask=i < n)
        + tl.load(d + i, mask=i < n)
    )
    v += tl.load(e + i, mask=i < n) + tl.load(f + i, mask=i < n) + tl.load(g + i, mask=i < n)
    tl.store(y_ptr + i, v, mask=i < n)


x = torch.randn(1, 256, 32, 128, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
n = x.numel()
grid = (triton.cdiv(n, 1024),)
dev = torch.cuda.current_device()
rec("torch.empty_like(x)", lambda: torch.empty_like(x))
rec("torch.empty(4096, int8)", lambda: torch.empty(4096, dtype=torch.int8, device="cuda"))
rec("F.silu(x)", lambda: torch.nn.functional.silu(x))
rec("torch.add(x, x)", lambda: torch.add(x, x))
rec("x.add_(0) in place", lambda: x.add_(0))
rec("torch.ops.aten.silu.out(x, out=y)", lambda: torch.ops.aten.silu.out(x, out=y))
rec("_cuda_getDevice()", lambda: torch._C._cuda_getDevice())
rec("_cuda_getCurrentRawStream(dev)", lambda: torch._C._cuda_getCurrentRawStream(dev))
rec("x.data_ptr()", lambda: x.data_ptr())
rec("triton copy2[grid](x, y, n)", lambda: copy2[grid](x, y, n, BLOCK=1024))
c2 = copy2[grid](x, y, n, BLOCK=1024)
run = c2.run
print(
    "launcher",
    type(run),
    run.global_scratch_size,
    run.profile_scratch_size,
    c2.packed_metadata,
    flush=True,
)
L = run.launch
head = (
    c2.function,
    run.launch_cooperative_grid,
    run.launch_pdl,
    None,
    None,
    c2.packed_metadata,
    None,
    None,
    None,
)
s = torch._C._cuda_getCurrentRawStream(dev)
g = (grid[0], 1, 1)
rec("C launch copy2 tensors", lambda: L(*g, s, *head, x, y, n, 1024))
px, py = x.data_ptr(), y.data_ptr()
rec("C launch copy2 ints (precomputed)", lambda: L(*g, s, *head, px, py, n, 1024))
rec(
    "C launch copy2 ints (data_ptr per call)",
    lambda: L(*g, s, *head, x.data_ptr(), y.data_ptr(), n, 1024),
)
rec(
    "C launch copy2 + stream lookup, tensors",
    lambda: L(*g, torch._C._cuda_getCurrentRawStream(dev), *head, x, y, n, 1024),
)
xs = [torch.randn_like(x) for _ in range(7)]
c8 = copy8[grid](*xs, y, n, BLOCK=1024)
r8 = c8.run
h8 = (
    c8.function,
    r8.launch_cooperative_grid,
    r8.launch_pdl,
    None,
    None,
    c8.packed_metadata,
    None,
    None,
    None,
)
L8 = r8.launch
rec("C launch copy8 tensors (8 ptrs)", lambda: L8(*g, s, *h8, *xs, y, n, 1024))
p8 = [t.data_ptr() for t in xs]
rec("C launch copy8 ints (precomputed)", lambda: L8(*g, s, *h8, *p8, py, n, 1024))
rec("C launch copy2 grid 0 (no cuLaunch), tensors", lambda: L(0, 1, 1, s, *head, x, y, n, 1024))
rec("C launch copy2 grid 0, ints", lambda: L(0, 1, 1, s, *head, px, py, n, 1024))
# the kernelkit launcher
from kernelkit.shared import runtime  # noqa: E402

kl = runtime.launch(copy2) if hasattr(runtime, "launch") else None
if kl is not None:
    rec("kernelkit launch(copy2)[grid](x, y, n)", lambda: kl[grid](x, y, n, BLOCK=1024))


@triton.jit
def copy_tma(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    d = tl.make_tensor_descriptor(x_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
    i = tl.program_id(0) * BLOCK
    tl.store(y_ptr + i + tl.arange(0, BLOCK), d.load([i]))


try:
    gt = (triton.cdiv(n, 256),)
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    ct = copy_tma[gt](x, y, n, BLOCK=256)
    rt = ct.run
    print("tma launcher scratch", rt.global_scratch_size, rt.global_scratch_align, flush=True)
    if kl is not None:
        kt = runtime.launch(copy_tma)
        rec(
            "kernelkit launch(copy_tma)[grid] (scratch via allocator)",
            lambda: kt[gt](x, y, n, BLOCK=256),
        )
    ht = (ct.function, rt.launch_cooperative_grid, rt.launch_pdl)
    scratch = torch.empty(gt[0] * rt.global_scratch_size, dtype=torch.int8, device="cuda")
    rec(
        "CudaLauncher.__call__ copy_tma (allocator)",
        lambda: rt(gt[0], 1, 1, s, ct.function, ct.packed_metadata, None, None, None, x, y, n, 256),
    )
    rec(
        "C launch copy_tma, cached scratch tensor",
        lambda: rt.launch(
            gt[0], 1, 1, s, *ht, scratch, None, ct.packed_metadata, None, None, None, x, y, n, 256
        ),
    )
    rec(
        "torch._C._cuda_isCurrentStreamCapturing()",
        lambda: torch._C._cuda_isCurrentStreamCapturing(),
    )
except Exception as e:
    print("TMA part failed", repr(e), flush=True)
# ops
from kernelkit.act import act  # noqa: E402

rec("act(x, silu)", lambda: act(x, "silu"))
xg = x.clone().requires_grad_()
rec("act(xg, silu)", lambda: act(xg, "silu"))
rec("F.silu(xg)", lambda: torch.nn.functional.silu(xg))
from kernelkit.flash_attn import flash_attn  # noqa: E402

q = torch.randn(1, 256, 32, 128, device="cuda", dtype=torch.bfloat16)
rec("flash_attn(q,q,q,causal)", lambda: flash_attn(q, q, q, causal=True))
qt = q.transpose(1, 2)
rec(
    "sdpa(qt,qt,qt,causal)",
    lambda: torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, is_causal=True),
)
qd = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
kd = torch.randn(8, 512, 32, 128, device="cuda", dtype=torch.bfloat16)
rec("flash_attn decode (8,1|512,32,128)", lambda: flash_attn(qd, kd, kd, causal=True))
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402

for name, fn in [
    ("flash small", lambda: flash_attn(q, q, q, causal=True)),
    ("act silu", lambda: act(x, "silu")),
    ("flash decode", lambda: flash_attn(qd, kd, kd, causal=True)),
]:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(25)
    print(name)
    print(sio.getvalue()[:6000])
with open(os.path.join(os.environ.get("OUT", "/tmp"), "launch_micro.json"), "w") as f:
    json.dump(out, f, indent=1)
