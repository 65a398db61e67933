"""A/B the launch plans of the lrpe-cosine kernels (also md-lrpe-cosine's) on the GPU.

    PYTHONPATH=... python packages/lrpe-cosine/benchmarks/tune.py [--rounds 5]

Times the forward and backward launches directly (launch.forward / launch.backward with a
`Plan`), interleaved round-robin (kernelkit.shared.bench.interleaved_ms), at the seed shape
(12, 32768, 12, 128) and the training shape (8, 4096, 32, 128), bf16, for act none / silu with
theta fixed and learnable, and a 3-D grid. Prints ms, GB/s and % of the copy bandwidth against
the ideal traffic (fwd 3 units of x, bwd 3 + 1 when x is read). The shipped plan is
kernels.PLAN.
"""

import argparse
import dataclasses
import functools

import torch

from kernelkit.lrpe_cosine import kernels as K
from kernelkit.lrpe_cosine import launch
from kernelkit.shared.bench import copy_bandwidth_gbs, interleaved_ms

PLANS = {
    "shipped": K.PLAN,
    "warps8": dataclasses.replace(K.PLAN, warps=8),
    "tile2048": dataclasses.replace(K.PLAN, tile=2048),
    "tile8192_w8": dataclasses.replace(K.PLAN, tile=8192, warps=8),
}
SHAPES = {"seed": (12, 32768, 12, 128), "train": (8, 4096, 32, 128)}
SEQ = (0, None, None)


def report(label, results, nbytes):
    for name, (ms, spread) in results.items():
        gbs = nbytes / ms / 1e6
        pct = 100 * gbs / copy_bandwidth_gbs()
        print(
            f"  {label:28s} {name:12s} {ms:8.4f} ms {gbs:6.0f} GB/s {pct:5.1f}%  spread {spread:5.1%}"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"copy bandwidth {copy_bandwidth_gbs():.0f} GB/s")
    for shape_name, (b, n, h, d) in SHAPES.items():
        x = torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda")
        theta = (10000.0 ** (-torch.arange(d, device="cuda") / d)).repeat(h, 1)
        dy = torch.randn(b, n, h, 2 * d, dtype=torch.bfloat16, device="cuda")
        unit = x.numel() * x.element_size()
        grids = [None] if shape_name == "train" else [None, K.Grid((32, 32, 32), 0, 43)]
        for grid in grids:
            th = theta if grid is None else theta[:, :43].contiguous()
            where = "seq" if grid is None else "grid3d"
            for act in ("none", "silu"):
                fwd = {
                    name: functools.partial(
                        launch.forward, x, th, *SEQ, None, act, grid=grid, plan=p
                    )
                    for name, p in PLANS.items()
                }
                label = f"{shape_name} {where} fwd {act}"
                report(label, interleaved_ms(fwd, args.rounds), 3 * unit)
                for dtheta in (False, True):
                    xs = x if (act != "none" or dtheta) else None
                    bwd = {
                        name: functools.partial(
                            launch.backward,
                            dy,
                            xs,
                            th,
                            *SEQ,
                            None,
                            None,
                            act,
                            need_dtheta=dtheta,
                            grid=grid,
                            plan=p,
                        )
                        for name, p in PLANS.items()
                    }
                    label = f"{shape_name} {where} bwd {act}{' dtheta' if dtheta else ''}"
                    report(label, interleaved_ms(bwd, args.rounds), (3 + (xs is not None)) * unit)
        del x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
