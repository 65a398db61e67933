"""Where the backward's time goes, kernel by kernel (torch.profiler), beside SDPA cuDNN and SDPA
flash (FA2) on the same inputs: suite 1's training shapes (B = 16384 / N, H = 2048 / d) and the
leaderboard's. Per kernel: mean GPU ms per backward; per provider: the sum and its TFLOP/s in
the FlashAttention convention (2.5x the forward's 4 B H N^2 d, halved for causal).

    PYTHONPATH=packages/flash-attn/src:shared/src python lab/flash-attn/ab/bwd_breakdown.py
    ... bwd_breakdown.py --any-order      # flash_attn(deterministic=False)

Dividing a kernel's time by its block products gives its rate per product (NOTES.md, session
21: the floor analysis of the 7-product backward against cuDNN's 5).
"""

import argparse
import collections
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from kernelkit.flash_attn import flash_attn

CASES = [  # (B, H, N, d, causal)
    (1, 16, 16384, 128, True),
    (4, 16, 4096, 128, True),
    (1, 16, 16384, 128, False),
    (4, 16, 4096, 128, False),
    (1, 32, 16384, 64, True),
    (4, 32, 4096, 64, True),
    (1, 32, 16384, 64, False),
    (16, 1, 16384, 64, True),  # the leaderboard's
]


def kernel_ms(fn, iters=5):
    """{kernel name: mean GPU ms per call} of fn() (after two warm-up calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:60]] += e.device_time / iters / 1e3
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--any-order", action="store_true", help="flash_attn(deterministic=False)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    for b, h, n, d, causal in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(4)
        )
        qkv = [t.requires_grad_() for t in (q, k, v)]
        o = flash_attn(*qkv, causal=causal, deterministic=not args.any_order)
        runs = {
            "ours": kernel_ms(
                lambda o=o, qkv=qkv, do=do: torch.autograd.grad(o, qkv, do, retain_graph=True)
            )
        }
        qkv_t = [t.detach().transpose(1, 2).requires_grad_() for t in qkv]
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
            with sdpa_kernel(backend):
                o_t = F.scaled_dot_product_attention(*qkv_t, is_causal=causal)
            do_t = do.transpose(1, 2)
            runs[name] = kernel_ms(
                lambda o_t=o_t, qkv_t=qkv_t, do_t=do_t: torch.autograd.grad(
                    o_t, qkv_t, do_t, retain_graph=True
                )
            )
        flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
        print(f"== d{d} {'causal' if causal else 'full'} B{b} H{h} N{n}")
        for name, ms in runs.items():
            total = sum(ms.values())
            print(f"  {name:6s} {total:7.3f} ms  {flops / total / 1e9:5.0f} TFLOP/s")
            for kernel, t in sorted(ms.items(), key=lambda kv: -kv[1]):
                if t > 0.01 * total:
                    print(f"      {t:7.3f} ms  {kernel}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
