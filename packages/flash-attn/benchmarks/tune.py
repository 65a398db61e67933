"""Compare flash-attn tiles and the SDPA backends on the GPU (bf16, suite-1 shapes).

    PYTHONPATH=packages/flash-attn/src:shared/src python packages/flash-attn/benchmarks/tune.py
    ... tune.py --compile-only --shard 3/8   # fill Triton's cache in parallel first
    ... tune.py --n 16384 --cases 128:0       # other sizes / a subset of (d:causal) cases

For each case (d, causal) at N (B = 16384 / N, H = 2048 / d) it prints ms and TFLOP/s of the
forward for each forward tile, of the backward for each dk/dv tile (dq tile fixed at the default)
and each dq tile (dk/dv tile fixed), next to SDPA's flash, cuDNN and memory-efficient backends,
then a summary with the best tiles and their ratios to SDPA flash and cuDNN. The chosen defaults
live in op.py (FWD_TILES, DKDV_TILES, DQ_TILES); NOTES.md keeps the measurements.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelkit.flash_attn import op as fa_op
from kernelkit.flash_attn.op import Plan, Tile
from kernelkit.shared.bench import bench_ms, copy_bandwidth_gbs, matmul_tflops

# Candidates per head dim: tiles that compile for sm_90a without (or with few) register
# spills (NOTES.md lists registers, spills and shared memory of each).
FWD = {
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
         (128, 32, 4, 4), (64, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 4)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 4),
          (64, 64, 4, 3), (128, 32, 8, 4)],
}  # fmt: skip
DKDV = {  # (query rows per step, keys per program)
    64: [(32, 128, 8, 2), (16, 128, 8, 3), (32, 64, 8, 3), (32, 128, 8, 3), (32, 64, 4, 3),
         (16, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3),
         (64, 64, 8, 3)],
    128: [(16, 128, 8, 3), (32, 64, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (16, 64, 4, 3),
          (16, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 8, 3)],
}  # fmt: skip
DQ = {  # (query rows per program, keys per step)
    64: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3),
         (128, 128, 8, 2), (64, 64, 4, 4), (64, 64, 8, 3), (64, 128, 4, 3), (64, 32, 4, 3),
         (32, 64, 4, 3), (128, 64, 8, 4)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3),
          (128, 32, 8, 4), (128, 128, 8, 2), (128, 64, 8, 4)],
}  # fmt: skip
# --ab: whole plans timed side by side, round-robin (tiles as (BM, BN, warps, stages, tma)).
AB_PLANS = {
    (64, False): {"tma, d64 fwd 128x64 w4": ((128, 64, 4, 3, True), None, None),
                  "pointer fwd": ((128, 64, 8, 3, False), None, None)},
    (64, True): {"dkdv 32x128 w8 s2": (None, (32, 128, 8, 2, True), None),
                 "dkdv 64x64 w4 s2": (None, (64, 64, 4, 2, True), None),
                 "dkdv 128x64 w4 s3": (None, (128, 64, 4, 3, True), None),
                 "dq 128x32 w4 s3": (None, None, (128, 32, 4, 3, True)),
                 "dq 64x64 w4 s3": (None, None, (64, 64, 4, 3, True)),
                 "dq 128x64 w4 s3": (None, None, (128, 64, 4, 3, True)),
                 "fwd 128x64 w4 s4": ((128, 64, 4, 4, False), None, None)},
    (128, False): {"tma, dq s4": (None, None, (128, 64, 8, 4, True))},
    (128, True): {"tma, dkdv s3, dq s4": (None, (64, 128, 8, 3, True), (128, 64, 8, 4, True))},
}  # fmt: skip
SDPA = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def fwd_flops(b, h, n, d, causal):
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def inputs(b, h, n, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r():
        return torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)

    return r(), r(), r(), r()


def time_plan(q, k, v, do, causal, plan, direction):
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, lse = fa_op.forward(q, k, v, causal, scale, plan)
    if direction == "fwd":
        return bench_ms(lambda: fa_op.forward(q, k, v, causal, scale, plan))
    return bench_ms(lambda: fa_op.backward(do, q, k, v, o, lse, None, causal, scale, plan))


def time_sdpa(q, k, v, do, causal, backend):
    qt, kt, vt, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    qt, kt, vt = (t.requires_grad_() for t in (qt, kt, vt))
    try:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            fwd = bench_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
    except RuntimeError as e:
        return None, None, f"unavailable ({str(e).splitlines()[0][:60]})"
    bwd = bench_ms(lambda: o.backward(dot, retain_graph=True), grad_to_none=[qt, kt, vt])
    return fwd, bwd, type(o.grad_fn).__name__


def candidates(d, causal, kernels=("fwd", "dkdv", "dq")):
    default = fa_op.plan_for(d, causal, torch.bfloat16)
    out = [("fwd", Plan(Tile(*t), default.dkdv, default.dq)) for t in FWD[d]]
    out += [("dkdv", Plan(default.fwd, Tile(*t), default.dq)) for t in DKDV[d]]
    out += [("dq", Plan(default.fwd, default.dkdv, Tile(*t))) for t in DQ[d]]
    return default, [(kind, plan) for kind, plan in out if kind in kernels]


def ab_plans(d, causal):
    """{name: Plan}: op.py's plan, the same tiles with all pointer / all TMA loads, AB_PLANS."""
    base = fa_op.plan_for(d, causal, torch.bfloat16)
    tiles = (base.fwd, base.dkdv, base.dq)
    plans = {
        "defaults": base,
        "defaults, pointer loads": Plan(*(replace(t, tma=False) for t in tiles)),
        "defaults, TMA loads": Plan(*(replace(t, tma=True) for t in tiles)),
    }
    for name, new in AB_PLANS.get((d, causal), {}).items():
        plans[name] = Plan(*(Tile(*t) if t else b for t, b in zip(new, tiles)))
    return plans


def run_ab(cases, n, rounds, bh=None):
    """Median over `rounds` round-robin passes of each plan's forward and backward ms; bh:
    (B, H) instead of the suite's (16384 / N, 2048 / d), e.g. (16, 1) for the leaderboard."""
    for d, causal in cases:
        b, h = bh or (max(1, 16384 // n), 2048 // d)
        q, k, v, do = inputs(b, h, n, d)
        ff = fwd_flops(b, h, n, d, causal)
        tag = f"d{d} causal{int(causal)} B{b} H{h} N{n}"
        pf, pb, _ = time_sdpa(q, k, v, do, causal, SDPA["sdpa_flash"])
        plans = ab_plans(d, causal)
        times = {name: ([], []) for name in plans}
        for _ in range(rounds):
            for name, plan in plans.items():
                times[name][0].append(time_plan(q, k, v, do, causal, plan, "fwd"))
                times[name][1].append(time_plan(q, k, v, do, causal, plan, "bwd"))
        print(f"{tag}: sdpa_flash fwd {pf:.3f} bwd {pb:.3f}")
        for name, (tf, tb) in times.items():
            mf, mb = sorted(tf)[len(tf) // 2], sorted(tb)[len(tb) // 2]
            print(
                f"  {name:40s} fwd {mf:7.3f} ({ff / mf / 1e9:4.0f} TF, x{pf / mf:4.2f})"
                f"  bwd {mb:7.3f} ({2.5 * ff / mb / 1e9:4.0f} TF, x{pb / mb:4.2f})"
                f"  fwd+bwd x{(pf + pb) / (mf + mb):4.2f}   spread fwd {max(tf) / min(tf) - 1:4.1%} bwd {max(tb) / min(tb) - 1:4.1%}"
            )
        del q, k, v, do
        torch.cuda.empty_cache()


def tile_str(t):
    return f"{t.block_m}x{t.block_n} w{t.warps} s{t.stages}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--cases", default="64:0,64:1,128:0,128:1", help="d:causal list")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--leaderboard", action="store_true", help="also the (16, 16384, 64) shape")
    ap.add_argument("--defaults-only", action="store_true", help="time only op.py's tiles")
    ap.add_argument("--kernels", default="fwd,dkdv,dq", help="which kernels' tiles to sweep")
    ap.add_argument("--ab", type=int, default=0, help="time whole plans side by side, R rounds")
    ap.add_argument("--bh", help="B,H for --ab (default: the suite's 16384/N, 2048/d)")
    args = ap.parse_args()
    kernels = tuple(args.kernels.split(","))
    cases = [(int(c.split(":")[0]), c.split(":")[1] == "1") for c in args.cases.split(",")]
    shard, nshards = (int(x) for x in args.shard.split("/"))

    if args.ab and not args.compile_only:
        print(
            f"GPU {torch.cuda.get_device_name()}  ceilings: bf16 torch.mm {matmul_tflops():.0f} "
            f"TFLOP/s, copy {copy_bandwidth_gbs():.0f} GB/s"
        )
        run_ab(cases, args.n, args.ab, tuple(map(int, args.bh.split(","))) if args.bh else None)
        return

    if args.compile_only:  # same constexprs and stride divisibility as the timed shapes, tiny N
        jobs = [
            (d, causal, plan)
            for d, causal in cases
            for _, plan in candidates(d, causal, kernels)[1]
            + [("default", candidates(d, causal)[0])]
            + ([(name, p) for name, p in ab_plans(d, causal).items()] if args.ab else [])
        ]
        for i, (d, causal, plan) in enumerate(jobs):
            if i % nshards != shard:
                continue
            q, k, v, do = inputs(1, 2048 // d, 256, d)
            scale = 1.0 / math.sqrt(d)
            o, lse = fa_op.forward(q, k, v, causal, scale, plan)
            fa_op.backward(do, q, k, v, o, lse, None, causal, scale, plan)
        torch.cuda.synchronize()
        return

    n = args.n
    summary = []
    print(f"GPU {torch.cuda.get_device_name()}  N={n}  bf16  (ms, TFLOP/s)")
    print(
        f"ceilings: bf16 8192^3 torch.mm {matmul_tflops():.0f} TFLOP/s, "
        f"device copy {copy_bandwidth_gbs():.0f} GB/s"
    )
    for d, causal in cases:
        b, h = max(1, 16384 // n), 2048 // d
        q, k, v, do = inputs(b, h, n, d)
        ff = fwd_flops(b, h, n, d, causal)
        tag = f"d{d} causal{int(causal)} B{b} H{h}"
        peers = {}
        for name, backend in SDPA.items():
            fwd, bwd, kernel = time_sdpa(q, k, v, do, causal, backend)
            peers[name] = (fwd, bwd)
            if fwd is None:
                print(f"{tag:26s} {name:16s} {kernel}")
                continue
            print(
                f"{tag:26s} {name:16s} fwd {fwd:7.3f} {ff / fwd / 1e9:6.0f}   "
                f"bwd {bwd:7.3f} {2.5 * ff / bwd / 1e9:6.0f}   [{kernel}]"
            )
        default, cands = candidates(d, causal, kernels)
        best = {"fwd": (1e9, None), "dkdv": (1e9, None), "dq": (1e9, None)}
        for kind, plan in [("default", default), *([] if args.defaults_only else cands)]:
            direction = "fwd" if kind in ("fwd", "default") else "bwd"
            try:
                ms = time_plan(q, k, v, do, causal, plan, direction)
            except Exception as e:  # out of resources for a tile: report and go on
                print(f"{tag:26s} {kind:7s} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            tile = {"fwd": plan.fwd, "dkdv": plan.dkdv, "dq": plan.dq}.get(kind, plan.fwd)
            flops = ff if direction == "fwd" else 2.5 * ff
            print(
                f"{tag:26s} {kind:7s} {tile_str(tile):18s} {direction} {ms:7.3f} {flops / ms / 1e9:6.0f}"
            )
            if kind == "default":
                ms_b = time_plan(q, k, v, do, causal, plan, "bwd")
                print(f"{tag:26s} default bwd {ms_b:7.3f} {2.5 * ff / ms_b / 1e9:6.0f}")
                for name in ("sdpa_flash", "sdpa_cudnn"):
                    pf, pb = peers.get(name, (None, None))
                    if pf:
                        print(
                            f"{tag:26s} default vs {name}: fwd x{pf / ms:4.2f} bwd x{pb / ms_b:4.2f}"
                            f" fwd+bwd x{(pf + pb) / (ms + ms_b):4.2f}"
                        )
            elif ms < best[kind][0]:
                best[kind] = (ms, tile)
        if best["dkdv"][1] and best["dq"][1]:  # the kernels are independent: both winners
            plan = Plan(default.fwd, best["dkdv"][1], best["dq"][1])
            ms_b = time_plan(q, k, v, do, causal, plan, "bwd")
            pf, pb = peers.get("sdpa_flash", (None, None))
            vs = f"  x{pb / ms_b:4.2f} flash" if pb else ""
            print(f"{tag:26s} both winners bwd {ms_b:7.3f} {2.5 * ff / ms_b / 1e9:6.0f}{vs}")
        summary.append((tag, ff, peers, best))
        del q, k, v, do
        torch.cuda.empty_cache()

    print("\nsummary: best tile per kernel; x = ratio of our time to beat (peer ms / our ms)")
    for tag, ff, peers, best in [] if args.defaults_only else summary:
        fl, cu = peers.get("sdpa_flash", (None, None)), peers.get("sdpa_cudnn", (None, None))
        ms_f = best["fwd"][0]
        line = f"{tag:26s} fwd {tile_str(best['fwd'][1]) if best['fwd'][1] else '-':18s} {ff / ms_f / 1e9:5.0f} TF"
        if fl[0]:
            line += f"  x{fl[0] / ms_f:4.2f} flash"
        if cu[0]:
            line += f"  x{cu[0] / ms_f:4.2f} cudnn"
        print(line)
        for kind in ("dkdv", "dq"):
            ms_k, t = best[kind]
            print(f"{'':26s} {kind:4s}-sweep best {tile_str(t) if t else '-':18s} bwd {ms_k:7.3f}")
        ms_b = min(best["dkdv"][0], best["dq"][0])
        line = f"{'':26s} bwd (best of sweeps) {2.5 * ff / ms_b / 1e9:5.0f} TF"
        if fl[1]:
            line += f"  x{fl[1] / ms_b:4.2f} flash"
        if cu[1]:
            line += f"  x{cu[1] / ms_b:4.2f} cudnn"
        print(line)

    if args.leaderboard:  # the course leaderboard: (16, 16384, 64), one head, causal, fwd+bwd
        q, k, v, do = (t.squeeze(2) for t in inputs(16, 1, 16384, 64))
        from kernelkit.flash_attn import flash_attn

        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))

        def ours():
            flash_attn(qs, ks, vs, causal=True).backward(do)

        print(
            f"leaderboard (16, 16384, 64) causal fwd+bwd: ours {bench_ms(ours, grad_to_none=[qs, ks, vs]):.3f} ms"
        )
        for name, backend in SDPA.items():
            qt, kt, vt = (t.unsqueeze(1).clone().requires_grad_() for t in (q, k, v))
            dot = do.unsqueeze(1)
            try:
                with sdpa_kernel(backend):

                    def peer(qt=qt, kt=kt, vt=vt, dot=dot):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(dot)

                    print(f"  {name}: {bench_ms(peer, grad_to_none=[qt, kt, vt]):.3f} ms")
            except RuntimeError as e:
                print(f"  {name}: unavailable ({str(e).splitlines()[0][:60]})")


if __name__ == "__main__":
    main()
