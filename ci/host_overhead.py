"""Host cost per call of each op's eager path at a tiny shape, where the GPU work is negligible.

    PYTHONPATH=shared/src:packages/act/src:packages/lrpe-rotate/src:packages/lrpe-cosine/src \
        python ci/host_overhead.py [--profile]

For forward and backward it prints microseconds per call with the host free-running (no sync
between calls: the rate at which Python can issue the op) next to torch.compile of the same
reference, and with --profile the functions that take the host time of our forward + backward
(autograd's device thread is turned off there so that cProfile sees the backward). Small-N
rows of the benchmark tables are bounded by these numbers, not by the kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kernelkit.act import act
from kernelkit.act.reference import act_reference
from kernelkit.lrpe_cosine import lrpe_cosine
from kernelkit.lrpe_cosine.reference import lrpe_cosine_reference
from kernelkit.lrpe_rotate import lrpe_rotate
from kernelkit.lrpe_rotate.reference import lrpe_rotate_reference
from kernelkit.shared.bench import torch_compile

B, N, H, D = 1, 64, 2, 64
CALLS = 400


def per_call_us(fn, calls=CALLS):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def cases():
    theta = 10000.0 ** (-torch.arange(D, device="cuda", dtype=torch.float32) / D)
    theta = theta.expand(H, D).contiguous()
    yield "act silu", lambda x: act(x, "silu"), lambda x: act_reference(x, "silu")
    yield (
        "act softmax -1",
        lambda x: act(x, "softmax", -1),
        lambda x: act_reference(x, "softmax", -1),
    )
    half = theta[:, : D // 2].contiguous()
    yield (
        "lrpe_rotate none",
        lambda x: lrpe_rotate(x, half),
        lambda x: lrpe_rotate_reference(x, half),
    )
    yield (
        "lrpe_cosine none",
        lambda x: lrpe_cosine(x, theta),
        lambda x: lrpe_cosine_reference(x, theta),
    )
    yield (
        "lrpe_cosine softmax 1",
        lambda x: lrpe_cosine(x, theta, act="softmax", dim=1),
        lambda x: lrpe_cosine_reference(x, theta, 0, "softmax", 1),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(f"{'case':24s} {'fwd us':>8s} {'compile':>8s} {'bwd us':>8s} {'compile':>8s}")
    for name, ours, ref in cases():
        row = []
        for f in (ours, torch_compile(ref)):
            x = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = f(x)
            dy = torch.randn_like(y)
            row.append(per_call_us(lambda f=f, x=x: f(x.detach())))

            def bwd(y=y, dy=dy, x=x):
                x.grad = None
                y.backward(dy, retain_graph=True)

            row.append(per_call_us(bwd))
        print(f"{name:24s} {row[0]:8.1f} {row[2]:8.1f} {row[1]:8.1f} {row[3]:8.1f}")
        if args.profile:
            x = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = ours(x)
            dy = torch.randn_like(y)
            prof = cProfile.Profile()
            with torch.autograd.set_multithreading_enabled(False):
                prof.enable()
                for _ in range(200):
                    y.backward(dy, retain_graph=True)
                    ours(x.detach())
                torch.cuda.synchronize()
                prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
