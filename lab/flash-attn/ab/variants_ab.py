"""Attention variants against plain causal and FlexAttention (issue 32): forward and backward
ms and TFLOP/s over the visible pairs, bf16, causal, plain / softcap / sliding window, ours
(the public `flash_attn`) beside `torch.compile(flex_attention)` with a block mask and a
score_mod. One JSON line per cell. --ab: the chooser's configs (the Gluon kernels with a
window / softcap) against the portable kernels with the tables' tiles, forward and backward
apart, interleaved (kernelkit.shared.bench.interleaved_ms), at 16k. --walks: the Gluon
forward's tile walks for windows, interleaved: the chosen persistent static walk, causal pairs
(a config the chooser does not take with a window), one program per tile (the hardware's
dynamic block scheduler), and the dynamic walk (`FwdConfig.dynamic`: an atomic unit counter),
alone and with pairs (`lab/flash-attn/ab/persistent_balance.py` models the walks).

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/flash-attn/src \\
        python lab/flash-attn/ab/variants_ab.py [--quick] [--no-flex] [--ab] [--walks]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from kernelkit.flash_attn import flash_attn
from kernelkit.flash_attn import launch as fa_launch
from kernelkit.flash_attn.choose import (
    choose_bwd,
    choose_fwd,
    portable_bwd_config,
    portable_fwd_config,
    table_tiles,
)
from kernelkit.flash_attn.validation import window_for
from kernelkit.shared.bench import bench_ms, interleaved_ms

# The suite's own FlexAttention cell and pair count (benchmarks/bench_flash_attn_variants.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages/flash-attn/benchmarks"))
from bench_flash_attn_variants import flex_fn, visible_pairs


def fwd_bwd_ms(fn, q, k, v, do) -> tuple[float, float]:
    """(forward ms, backward ms): the backward as (forward + backward) - forward, since a
    compiled backward (FlexAttention's) may not run twice on one graph."""
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fwd = bench_ms(lambda: fn(q, k, v))
    both = bench_ms(lambda: fn(qg, kg, vg).backward(do), grad_to_none=[qg, kg, vg])
    return fwd, both - fwd


def cell(impl: str, b: int, n: int, h: int, d: int, left: int, softcap: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    if impl == "ours":

        def fn(q, k, v):
            return flash_attn(q, k, v, causal=True, window_size=(left, 0), softcap=softcap)
    else:
        fn = flex_fn(n, n if left < 0 else left, softcap)
    fwd, bwd = fwd_bwd_ms(fn, q, k, v, do)
    flops = 4 * d * visible_pairs(n, n if left < 0 else left) * b * h
    return dict(impl=impl, b=b, n=n, h=h, d=d, window=left, softcap=softcap,
                fwd_ms=round(fwd, 4), bwd_ms=round(bwd, 4),
                fwd_tflops=round(flops / fwd / 1e9, 1),
                bwd_tflops=round(2.5 * flops / bwd / 1e9, 1))  # fmt: skip


def ab(b: int, n: int, h: int, d: int, left: int, softcap: float) -> dict:
    """ms of the chosen configs and of the portable kernels, forward and backward apart."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    window = window_for((left, 0), True, n, n)
    scale = d**-0.5
    pf, pb = (fa_launch.forward_problem(q, k, v, True, softcap, window),
              fa_launch.backward_problem(do, q, k, v, True, softcap, window))  # fmt: skip
    fwd_cfgs = {"chosen": choose_fwd(pf), "portable": portable_fwd_config(pf, table_tiles(pf)[0])}
    bwd_cfgs = {"chosen": choose_bwd(pb),
                "portable": portable_bwd_config(pb, *table_tiles(pb)[1:])}  # fmt: skip
    o, lse = fa_launch.forward(q, k, v, True, scale, softcap=softcap, window=window)

    def fwd(cfg):
        return lambda: fa_launch.forward(q, k, v, True, scale, softcap=softcap, window=window,
                                         config=cfg)  # fmt: skip

    def bwd(cfg):
        return lambda: fa_launch.backward(do, q, k, v, o, lse, None, True, scale,
                                          softcap=softcap, window=window, config=cfg)  # fmt: skip

    tf = interleaved_ms({name: fwd(c) for name, c in fwd_cfgs.items()})
    tb = interleaved_ms({name: bwd(c) for name, c in bwd_cfgs.items()})
    return dict(b=b, n=n, h=h, d=d, window=left, softcap=softcap,
                fwd={name: round(t[0], 4) for name, t in tf.items()},
                bwd={name: round(t[0], 4) for name, t in tb.items()},
                kernels=[fwd_cfgs["chosen"].kernel, bwd_cfgs["chosen"].kernel])  # fmt: skip


def walks(b: int, n: int, h: int, d: int, left: int) -> dict:
    """Forward ms of the Gluon forward's walks for one windowed cell."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    window = window_for((left, 0), True, n, n)
    chosen = choose_fwd(fa_launch.forward_problem(q, k, v, True, 0.0, window))
    cfgs = {"static": chosen, "pairs": replace(chosen, pairs=True),
            "per_tile": replace(chosen, persistent=False),
            "dynamic": replace(chosen, dynamic=True),
            "dynamic_pairs": replace(chosen, dynamic=True, pairs=True)}  # fmt: skip

    def fwd(cfg):
        return lambda: fa_launch.forward(q, k, v, True, d**-0.5, window=window, config=cfg)

    t = interleaved_ms({name: fwd(c) for name, c in cfgs.items()})
    return dict(b=b, n=n, h=h, d=d, window=left, kernel=chosen.kernel,
                fwd={name: round(x[0], 4) for name, x in t.items()})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--ab", action="store_true")
    ap.add_argument("--walks", action="store_true")
    args = ap.parse_args()
    if args.walks:
        cells = [(1, n, h, d, left) for d, h in ((128, 16), (64, 32)) for n in (16384, 65536)
                 for left in (-1, 1024, 4096, 8192)]  # fmt: skip
        cells.append((16, 16384, 1, 64, -1))  # the leaderboard's forward
        for c in cells:
            print(json.dumps(walks(*c)), flush=True)
        return
    if args.ab:
        for d, h in ((128, 16), (64, 32)):
            for left, cap in ((-1, 30.0), (1024, 0.0), (4096, 0.0), (8192, 0.0), (4096, 30.0)):
                print(json.dumps(ab(1, 16384, h, d, left, cap)), flush=True)
        return
    cases = []
    for d in (128, 64):
        h = 2048 // d if d == 64 else 16
        for n in (16384,) if args.quick else (8192, 16384, 65536):
            b = max(1, 16384 // n)
            variants = [(-1, 0.0), (-1, 30.0), (1024, 0.0), (4096, 0.0)]
            if not args.quick:
                variants.append((8192, 0.0))
            for left, cap in variants:
                if left >= n:
                    continue
                cases.append((b, n, h, d, left, cap))
    for c in cases:
        for impl in ("ours",) if args.no_flex else ("ours", "flex"):
            try:
                r = cell(impl, *c)
            except Exception as e:  # flex may run out of memory at 64k
                r = dict(impl=impl, case=c, error=f"{type(e).__name__}: {str(e)[:200]}")
            print(json.dumps(r), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
