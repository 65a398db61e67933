"""Attention variants against plain causal and FlexAttention (issue 32): forward and backward
ms and TFLOP/s over the visible pairs, bf16, causal, plain / softcap / sliding window, ours
(the public `flash_attn`) beside `torch.compile(flex_attention)` with a block mask and a
score_mod. One JSON line per cell.

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/flash-attn/src \\
        python lab/flash-attn/ab/variants_ab.py [--quick] [--no-flex]
"""

from __future__ import annotations

import argparse
import json

import torch

from kernelkit.flash_attn import flash_attn
from kernelkit.shared.bench import bench_ms


def visible_pairs(n: int, left: int) -> int:
    """Visible (query, key) pairs of causal attention over n rows, a window of `left` keys
    before the diagonal (-1: none)."""
    if left < 0 or left >= n:
        return n * (n + 1) // 2
    return (left + 1) * (left + 2) // 2 + (n - left - 1) * (left + 1)


def flex_fns(n: int, h: int, left: int, softcap: float):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, hh, qi, ki):
        keep = qi >= ki
        if left >= 0:
            keep = keep & (qi - ki <= left)
        return keep

    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda")
    score_mod = None
    if softcap:

        def score_mod(score, b, hh, qi, ki):
            return softcap * torch.tanh(score / softcap)

    flex = torch.compile(flex_attention)

    def run(q, k, v):  # flex takes (B, H, N, D)
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    block_mask=block_mask, score_mod=score_mod).transpose(1, 2)  # fmt: skip

    return run


def cell(impl: str, b: int, n: int, h: int, d: int, left: int, softcap: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    if impl == "ours":

        def fn(q, k, v):
            return flash_attn(q, k, v, causal=True, window_size=(left, 0), softcap=softcap)
    else:
        fn = flex_fns(n, h, left, softcap)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fwd = bench_ms(lambda: fn(q, k, v))
    o = fn(qg, kg, vg)
    bwd = bench_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
    flops = 4 * d * visible_pairs(n, left) * b * h
    return dict(impl=impl, b=b, n=n, h=h, d=d, window=left, softcap=softcap,
                fwd_ms=round(fwd, 4), bwd_ms=round(bwd, 4),
                fwd_tflops=round(flops / fwd / 1e9, 1),
                bwd_tflops=round(2.5 * flops / bwd / 1e9, 1))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args()
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
