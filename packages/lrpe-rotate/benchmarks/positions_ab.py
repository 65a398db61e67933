"""A/B of kernels.POSITIONS_TILING (how per-token positions tile the work) on the GPU.

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/act/src:\
$ROOT/packages/lrpe-core/src:$ROOT/packages/lrpe-rotate/src:$ROOT/packages/lrpe-rotate/benchmarks \
        python packages/lrpe-rotate/benchmarks/positions_ab.py [--rounds 3] [--tilings old,ahead]

Times the host paths directly (launch.forward / backward, theta fixed, bf16), interleaved
round-robin (kernelkit.shared.bench.interleaved_ms) with the switch flipped per call, at the
positions table's row (1, 65536, 32, 128) (int offset / (1, N) positions table / cu_seqlens of
the suite's log-normal documents) and the training shape (8, 4096, 32, 128) (int offset / (B, N)
table), act none and silu, forward and backward. Bytes: x read + y written forward; dy read +
dx written backward, + x read for an act (act none's backward reads no x); + the positions
table or cu_seqlens. An int offset always runs the old kernels (one row per tiling would time
the same launch). Prints ms, GB/s, % of copy bandwidth and the speedup over "old".
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_lrpe_rotate import inputs

from kernelkit.lrpe_core.op import validate_positions
from kernelkit.lrpe_rotate import kernels as K
from kernelkit.lrpe_rotate import launch
from kernelkit.shared.bench import copy_bandwidth_gbs, interleaved_ms, layout_row, position_forms

SHAPES = {
    "row": ((1, 65536, 32, 128), ("offset", "table", "packed")),
    "train": ((8, 4096, 32, 128), ("offset", "table")),
}


def with_tiling(tiling: str, fn, *args):
    """fn(*args) with kernels.POSITIONS_TILING = tiling (read by the launcher at call time)."""

    def call():
        K.POSITIONS_TILING = tiling
        return fn(*args)

    return call


def cell(shape, forms, direction, act, tilings, rounds, lengths):
    x, theta = inputs(shape, False, False)
    dy = torch.randn_like(x)
    b, n = shape[0], shape[1]
    unit = x.numel() * x.element_size()
    fns, nbytes = {}, {}
    for form in forms:
        op_kw, _ = position_forms(form, b, n, lengths, x.device)
        cu = op_kw.get("cu_seqlens")
        pos = validate_positions(x, op_kw.get("offset", 0), op_kw.get("positions"), cu)
        extra = sum(t.numel() * t.element_size() for t in (pos[1], pos[2], cu) if t is not None)
        if direction == "fwd":
            fn, args, units = launch.forward, (x, theta, *pos, cu, act), 2
        else:
            xs = x if act != "none" else None
            fn, args, units = (
                launch.backward,
                (dy, xs, theta, *pos, cu, None, act, False),
                2 + (xs is not None),
            )
        for tiling in tilings if form != "offset" else ("old",):
            name = form if form == "offset" else f"{form} {tiling}"
            fns[name] = with_tiling(tiling, fn, *args)
            nbytes[name] = units * unit + extra
    for name, fn in fns.items():  # every tiling computes what the old kernels do
        form = name.split()[0]
        if form != "offset" and f"{form} old" in fns and name != f"{form} old":
            out, ref = fn()[0], fns[f"{form} old"]()[0]  # y, or dx
            diff = (out.float() - ref.float()).abs().max().item()
            # one bf16 rounding step at the largest magnitude (FMA contraction may differ)
            tol = 2.0**-7 * max(1.0, ref.float().abs().max().item())
            assert diff <= tol, f"{name}: max |difference| to old {diff} > {tol}"
    results = interleaved_ms(fns, rounds)
    copy = copy_bandwidth_gbs()
    for name, (ms, spread) in results.items():
        gbs = nbytes[name] / ms / 1e6
        form = name.split()[0]
        base = results.get(f"{form} old", results[name])[0]
        print(
            f"  {name:16s} {ms:8.4f} ms {gbs:6.0f} GB/s {100 * gbs / copy:5.1f}% of copy"
            f"  x{base / ms:5.3f} vs old  spread {spread:5.1%}"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tilings", default=",".join(K.TILINGS))
    ap.add_argument("--acts", default="none,silu")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--directions", default="fwd,bwd")
    args = ap.parse_args()
    tilings = args.tilings.split(",")
    assert all(t in K.TILINGS for t in tilings), f"--tilings: from {K.TILINGS}"
    start = time.time()
    _, lengths = layout_row()
    dev = torch.cuda.get_device_name()
    print(f"{dev}: copy bandwidth {copy_bandwidth_gbs():.0f} GB/s; {len(lengths)} packed documents")
    for shape_name in args.shapes.split(","):
        shape, forms = SHAPES[shape_name]
        for direction in args.directions.split(","):
            for act in args.acts.split(","):
                print(f"{shape_name} {tuple(shape)} bf16 {direction} act {act}")
                cell(shape, forms, direction, act, tilings, args.rounds, lengths)
    K.POSITIONS_TILING = "old"
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    with torch.no_grad():
        main()
