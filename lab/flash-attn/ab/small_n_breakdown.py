"""Where the time goes at B = H = 1 (suite 2's shapes), ours against SDPA's flash, cuDNN and
memory-efficient backends, bf16 causal: host microseconds per call (the clock stops before the
closing sync), `do_bench`'s median (what the suites report: L2 flushed between calls, so a call
whose host path outlasts the flush shows its host time) and the summed CUDA kernel time per call
from torch.profiler, forward and backward.

    PYTHONPATH=packages/flash-attn/src:shared/src python lab/flash-attn/ab/small_n_breakdown.py
"""

import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from kernelkit.flash_attn import flash_attn

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "eff": SDPBackend.EFFICIENT_ATTENTION,
}


def host_us(fn, calls=200):
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def kernel_us(fn, calls=20):
    """(summed CUDA kernel us per call, the largest kernels)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    names = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            names[e.name[:40]] = names.get(e.name[:40], 0) + e.device_time
    top = sorted(names.items(), key=lambda kv: -kv[1])[:3]
    return sum(names.values()) / calls, ", ".join(f"{n}:{t / calls:.1f}" for n, t in top)


def bench_us(fn, grads=None):
    ms = triton.testing.do_bench(fn, warmup=10, rep=40, grad_to_none=grads, return_mode="median")
    return ms * 1e3


def cases(d, n):
    """{name: (call, inputs that get gradients, output gradient)} for ours and each backend."""
    q, k, v = (
        torch.randn(1, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn_like(q)
    qt, kt, vt = (t.detach().unsqueeze(1).requires_grad_() for t in (q, k, v))
    out = {"ours": (lambda: flash_attn(q, k, v, causal=True), [q, k, v], do)}
    for name, backend in BACKENDS.items():

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        out[name] = (sdpa, [qt, kt, vt], do.unsqueeze(1))
    return out


def row(f, inputs, dout):
    with torch.no_grad():
        hf, bf, (kf, _) = host_us(f), bench_us(f), kernel_us(f)
    o = f()

    def bwd():
        for t in inputs:
            t.grad = None
        o.backward(dout, retain_graph=True)

    hb, bb, (kb, top) = host_us(bwd), bench_us(bwd, inputs), kernel_us(bwd)
    return (
        f"fwd host {hf:6.1f} us bench {bf:7.1f} kern {kf:7.1f} | "
        f"bwd host {hb:6.1f} bench {bb:7.1f} kern {kb:7.1f} [{top}]"
    )


def main():
    print(torch.cuda.get_device_name())
    for d in (16, 64, 128):
        for n in (1024, 4096, 16384):
            for name, case in cases(d, n).items():
                print(f"d{d:<3d} N{n:<6d} {name:5s} {row(*case)}", flush=True)


if __name__ == "__main__":
    main()
