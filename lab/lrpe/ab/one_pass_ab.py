"""In-process A/B of the softmax-over-N stats read in one pass against chunks and their merge
(`Plan.stats_one_pass` 0: always chunks), at the launch level of lrpe-cosine and lrpe-rotate
(`launch.forward`, the replayed host path every public call ends in), interleaved over rounds:
host µs per call (kernelkit.shared.host_time) and GPU µs per call (a CUDA graph of 20 calls,
20 replays, best of 3). Then the public ops' host cells (forward, with x requiring grad,
backward) with the shipped plan, as the suites' host tables measure them.

    python lab/lrpe/ab/one_pass_ab.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from kernelkit.lrpe_core.op import SEQ
from kernelkit.shared.host_time import fwd_bwd_us, per_call_us

SHAPES = [(1, 256, 32, 128), (1, 512, 32, 128), (2, 512, 16, 64), (1, 1024, 8, 64), (8, 1, 32, 128)]


def gpu_us(fn, calls=20, replays=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / (calls * replays))
    return best


def launches(shape):
    """(name, {variant: launch-level forward}, public op) per op."""
    from kernelkit.lrpe_cosine import kernels as CK
    from kernelkit.lrpe_cosine import launch as CL
    from kernelkit.lrpe_cosine import lrpe_cosine
    from kernelkit.lrpe_rotate import kernels as RK
    from kernelkit.lrpe_rotate import launch as RL
    from kernelkit.lrpe_rotate import lrpe_rotate

    _, _, h, d = shape
    theta = (10000.0 ** (-torch.arange(d, device="cuda", dtype=torch.float32) / d)).expand(h, d)
    theta = theta.contiguous()
    half = theta[:, : d // 2].contiguous()
    chunked_c = dataclasses.replace(CK.PLAN, stats_one_pass=0)
    chunked_r = dataclasses.replace(RK.PLAN, stats_one_pass=0)
    yield (
        "cosine",
        {
            "chunks": lambda x: CL.forward(x, theta, 0, None, None, None, SEQ, plan=chunked_c),
            "shipped": lambda x: CL.forward(x, theta, 0, None, None, None, SEQ),
        },
        lambda x: lrpe_cosine(x, theta, act="softmax", dim=1),
    )
    yield (
        "rotate",
        {
            "chunks": lambda x: RL.forward(x, half, 0, None, None, None, SEQ, plan=chunked_r),
            "shipped": lambda x: RL.forward(x, half, 0, None, None, None, SEQ),
        },
        lambda x: lrpe_rotate(x, half, 0, "softmax", 1),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = {}
    for shape in SHAPES:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        for name, variants, op in launches(shape):
            key = f"{name} softmax N {shape}"
            assert torch.equal(variants["shipped"](x)[0], op(x))  # the op's own path
            res = {v: {"host": [], "gpu": []} for v in variants}
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for v in order:
                    f = variants[v]
                    res[v]["host"].append(per_call_us(lambda f=f, x=x: f(x)))
                    res[v]["gpu"].append(gpu_us(lambda f=f, x=x: f(x)))
            y = variants["chunks"](x)[0]
            same = torch.equal(y, variants["shipped"](x)[0])
            rows[key] = {
                "launch": res,
                "bitwise_equal": same,
                "max_abs_diff": (y.float() - variants["shipped"](x)[0].float()).abs().max().item(),
                "public_host_fwd_grad_bwd": fwd_bwd_us(op, (x,)),
            }
            med = {v: {k: statistics.median(res[v][k]) for k in ("host", "gpu")} for v in res}
            print(
                f"{key:40s} launch host {med['chunks']['host']:6.1f} -> {med['shipped']['host']:6.1f}"
                f"  gpu {med['chunks']['gpu']:6.1f} -> {med['shipped']['gpu']:6.1f}"
                f"  public fwd/grad/bwd {' / '.join(f'{t:.1f}' for t in rows[key]['public_host_fwd_grad_bwd'])}"
                f"  equal {same}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
