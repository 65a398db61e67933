"""A/B the launch plans of the lrpe-rotate kernels on the GPU.

    PYTHONPATH=... python packages/lrpe-rotate/benchmarks/tune.py [--rounds 5]

Times the launches directly (launch.forward / launch.backward with a `Plan`),
interleaved round-robin (kernelkit.shared.bench.interleaved_ms), at the seed shape
(12, 32768, 12, 128) and the training shape (8, 4096, 32, 128), bf16, theta (H, D/2); backward
with theta fixed and learnable. Prints ms, GB/s and % of copy bandwidth against the ideal
traffic (fwd 2 units of x; bwd 2, + 1 when x is read). The shipped plan is kernels.PLAN.
"""

import argparse
import dataclasses
import functools

import torch

from kernelkit.lrpe_rotate import kernels as K
from kernelkit.lrpe_rotate import launch
from kernelkit.shared.bench import copy_bandwidth_gbs, interleaved_ms

PLANS = {
    "shipped": K.PLAN,
    "warps4": dataclasses.replace(K.PLAN, warps=4),
    "tile4096": dataclasses.replace(K.PLAN, tile=4096),
    "pps8": dataclasses.replace(K.PLAN, programs_per_sm=8),
}
SHAPES = {"seed": (12, 32768, 12, 128), "train": (8, 4096, 32, 128)}
SEQ = (0, None, None)


def report(label, results, nbytes):
    for name, (ms, spread) in results.items():
        gbs = nbytes / ms / 1e6
        pct = 100 * gbs / copy_bandwidth_gbs()
        print(
            f"  {label:26s} {name:10s} {ms:8.4f} ms {gbs:6.0f} GB/s {pct:5.1f}%  spread {spread:5.1%}"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"copy bandwidth {copy_bandwidth_gbs():.0f} GB/s")
    for shape_name, (b, n, h, d) in SHAPES.items():
        x = torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda")
        theta = (10000.0 ** (-torch.arange(d // 2, device="cuda") / (d // 2))).repeat(h, 1)
        dy = torch.randn_like(x)
        unit = x.numel() * x.element_size()
        for kind in ("none", "silu", "softmax"):
            fwd = {
                name: functools.partial(launch.forward, x, theta, *SEQ, None, kind, plan=p)
                for name, p in PLANS.items()
            }
            report(f"{shape_name} fwd {kind}", interleaved_ms(fwd, args.rounds), 2 * unit)
            for dtheta in (False, True):
                xs = x if (kind != "none" or dtheta) else None
                bwd = {
                    name: functools.partial(
                        launch.backward, dy, xs, theta, *SEQ, None, None, kind, dtheta, plan=p
                    )
                    for name, p in PLANS.items()
                }
                label = f"{shape_name} bwd {kind}{' dtheta' if dtheta else ''}"
                report(label, interleaved_ms(bwd, args.rounds), (2 + (xs is not None)) * unit)
        seq = {
            name: functools.partial(launch.forward, x, theta, *SEQ, None, "softmax_seq", plan=p)
            for name, p in PLANS.items()
        }
        report(f"{shape_name} fwd softmax_seq", interleaved_ms(seq, args.rounds), 3 * unit)
        del x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
