"""Compare flash-attn tiles and the SDPA backends on the GPU (bf16, suite-1 shapes; --flash-table:
suite 2's B = H = 1 causal shapes, d = 16/32 and float32).

    PYTHONPATH=packages/flash-attn/src:shared/src python packages/flash-attn/benchmarks/tune.py
    ... tune.py --compile-only --shard 3/8   # fill Triton's cache in parallel first
    ... tune.py --n 16384 --cases 128:0       # other sizes / a subset of (d:causal) cases
    ... tune.py --flash-table --screen --shard 0/2   # CPU only: sm_90a registers / spills
    ... tune.py --flash-table --compile-only --shard 3/16 ; tune.py --flash-table  # GPU

For each case (d, causal) at N (B = 16384 / N, H = 2048 / d) it prints ms and TFLOP/s of the
forward for each forward tile, of the backward for each dk/dv tile (dq tile fixed at the default)
and each dq tile (dk/dv tile fixed), next to SDPA's flash, cuDNN and memory-efficient backends,
then a summary with the best tiles and their ratios to SDPA flash and cuDNN. The chosen defaults
live in tables.py (FWD_TILES, DKDV_TILES, DQ_TILES); NOTES.md keeps the measurements. The
"default" of each case is the tables' portable tiles (`tile_screen.table_plan`); "auto" rows
time what the chooser runs (Gluon kernels included).
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from tile_screen import Plan, plan_configs, table_plan
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelkit.flash_attn.config import H100, Target, Tile
from kernelkit.flash_attn.launch import backward, backward_problem, forward
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
# --flash-table: suite 2's shapes (B = 1, H = 1, causal), head dims and dtypes whose tiles were
# never timed. Candidates per kernel as (BM, BN, warps, stages[, tma]); the tables' tile is always
# timed too. Screened for sm_90a on CPU (--screen): candidates that spill more than the tables' own
# tile were dropped (NOTES.md, "Seed study"), except d = 128 float32, whose spill-free tiles run
# at a third of eager PyTorch's float32 speed (suite 3): larger TMA tiles that spill a little.
_BF16_SMALL_D = {
    "fwd": [
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 3),
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (128, 64, 4, 3, True),
    ],
    "dkdv": [
        (64, 128, 4, 3),
        (32, 128, 4, 3),
        (64, 64, 4, 3),
        (32, 64, 4, 3),
        (128, 64, 8, 3),
        (64, 64, 4, 3, True),
        (64, 128, 8, 2, True),
    ],
    "dq": [
        (128, 64, 4, 3),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 3),
        (128, 32, 4, 3),
        (128, 64, 8, 3, True),
        (128, 64, 8, 4, True),
    ],
}
_FP32_SMALL_D = {
    "fwd": [
        (64, 64, 4, 2),
        (128, 32, 4, 2),
        (128, 64, 8, 2),
        (64, 32, 4, 3),
        (32, 32, 4, 2),
        (64, 32, 4, 2, True),
    ],
    "dkdv": [
        (32, 64, 4, 2),
        (32, 32, 4, 2),
        (32, 128, 8, 1),
        (32, 32, 4, 1, True),
        (32, 64, 4, 2, True),
    ],
    "dq": [
        (64, 32, 4, 2),
        (64, 64, 4, 2),
        (128, 32, 8, 2),
        (64, 32, 4, 1),
        (32, 32, 4, 1, True),
        (64, 32, 4, 2, True),
    ],
}
# d64/d128 bf16 at one head: 64-row forward tiles (twice the programs of the suite-1 tiles) for
# a small-grid rule; the backward keeps the tables' tiles.
_BF16_SMALL_GRID = {"fwd": [(64, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (64, 64, 4, 4)]}
FLASH_TABLE = {
    (64, "bf16"): _BF16_SMALL_GRID,
    (128, "bf16"): _BF16_SMALL_GRID,
    (16, "bf16"): _BF16_SMALL_D,
    (32, "bf16"): _BF16_SMALL_D,
    (16, "fp32"): _FP32_SMALL_D,
    (32, "fp32"): _FP32_SMALL_D,
    (64, "fp32"): {
        "fwd": [(64, 32, 4, 3), (64, 64, 4, 2), (128, 32, 8, 2), (32, 32, 4, 2), (64, 16, 4, 3),
                (32, 64, 4, 2), (64, 32, 4, 2, True), (64, 32, 4, 3, True)],
        "dkdv": [(32, 32, 4, 2), (16, 32, 4, 2), (32, 64, 8, 2), (16, 64, 4, 2),
                 (32, 32, 4, 1, True), (16, 32, 4, 2, True), (32, 32, 4, 2, True)],
        "dq": [(32, 32, 4, 2), (64, 32, 4, 2), (64, 32, 8, 2), (32, 64, 4, 2), (16, 32, 4, 2),
               (32, 32, 4, 1, True), (32, 32, 4, 2, True)],
    },
    (128, "fp32"): {
        "fwd": [(32, 32, 8, 2), (32, 64, 8, 1), (32, 32, 8, 1, True), (32, 32, 8, 2, True),
                (32, 64, 8, 1, True), (64, 32, 8, 2, True), (64, 64, 8, 1, True),
                (64, 32, 4, 1, True), (128, 32, 8, 1, True)],
        "dkdv": [(16, 32, 8, 2), (32, 32, 8, 1), (16, 16, 4, 2), (16, 32, 8, 1, True),
                 (16, 32, 8, 2, True), (16, 16, 4, 2, True), (32, 32, 4, 1, True),
                 (32, 64, 8, 1, True), (64, 32, 8, 1, True)],
        "dq": [(32, 32, 8, 2), (16, 32, 4, 2), (32, 32, 8, 1, True), (16, 32, 4, 2, True),
               (16, 32, 8, 1), (16, 32, 8, 1, True), (64, 32, 8, 1, True),
               (64, 32, 4, 1, True), (64, 64, 8, 1, True)],
    },
}  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SDPA = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def fwd_flops(b, h, n, d, causal):
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def inputs(b, h, n, d, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r():
        return torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=g)

    return r(), r(), r(), r()


def run_plan(q, k, v, do, causal, plan):
    """(forward, backward) callables running `plan`'s tiles (None: the chooser's configs)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    fwd_cfg = bwd_cfg = None
    if plan is not None:
        fwd_cfg, bwd_cfg = plan_configs(backward_problem(do, q, k, v, causal), plan)
    o, lse = forward(q, k, v, causal, scale, config=fwd_cfg)
    return (functools.partial(forward, q, k, v, causal, scale, config=fwd_cfg),
            functools.partial(backward, do, q, k, v, o, lse, None, causal, scale, config=bwd_cfg))  # fmt: skip


def time_plan(q, k, v, do, causal, plan, direction):
    fwd, bwd = run_plan(q, k, v, do, causal, plan)
    return bench_ms(fwd if direction == "fwd" else bwd)


def default_plan(d, causal, dtype=torch.bfloat16):
    """The tables' portable tiles for this case on this GPU (an H100's without one: --screen)."""
    target = Target.of(torch.device("cuda")) if torch.cuda.is_available() else H100
    return table_plan(d, causal, dtype, target)


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
    default = default_plan(d, causal)
    out = [("fwd", Plan(Tile(*t), default.dkdv, default.dq)) for t in FWD[d]]
    out += [("dkdv", Plan(default.fwd, Tile(*t), default.dq)) for t in DKDV[d]]
    out += [("dq", Plan(default.fwd, default.dkdv, Tile(*t))) for t in DQ[d]]
    return default, [(kind, plan) for kind, plan in out if kind in kernels]


def ab_plans(d, causal):
    """{name: Plan}: the chooser's configs ("auto"), the tables' tiles, the same tiles with all
    pointer / all TMA loads, AB_PLANS."""
    base = default_plan(d, causal)
    tiles = (base.fwd, base.dkdv, base.dq)
    plans = {
        "auto": None,
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


# --small-grid: the forward's table tile against 64-row tiles (tables.SMALL_GRID_FWD) at grids of a
# few waves or less: (B, H) pairs timed at each N, causal and not.
SMALL_GRID_TILES = [(64, 128, 4, 3), (64, 64, 4, 3)]
SMALL_GRID_BH = [(1, 1), (1, 4), (2, 8), (1, 16), (4, 16), (8, 16)]


def run_small_grid(cases, ns, bhs, rounds):
    """Forward ms (median of `rounds` round-robin passes) of the tables' table tile, each 64-row
    candidate and the automatic choice (the small-grid rule), with the table tile's programs
    per SM: where the rule's thresholds (SMALL_GRID_FWD) come from."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for d, causal in cases:
        table = default_plan(d, causal)
        plans = {"table " + tile_str(table.fwd): table}
        for t in SMALL_GRID_TILES:
            plans[tile_str(Tile(*t))] = replace(table, fwd=Tile(*t))
        plans["auto (rule)"] = None
        for b, h in bhs:
            for n in ns:
                q, k, v, do = inputs(b, h, n, d)
                times = {name: [] for name in plans}
                for _ in range(rounds):
                    for name, plan in plans.items():
                        f = run_plan(q, k, v, do, causal, plan)[0]
                        f()
                        times[name].append(bench_ms(f))
                ms = {name: _median(t) for name, t in times.items()}
                base = next(iter(ms.values()))
                waves = b * h * math.ceil(n / table.fwd.block_m) / sms
                cells = "  ".join(f"{name} {m:.4f} x{base / m:4.2f}" for name, m in ms.items())
                ff = fwd_flops(b, h, n, d, causal)
                print(f"d{d} causal{int(causal)} B{b} H{h} N{n} waves {waves:5.2f} "
                      f"({ff / base / 1e9:.0f} TF): {cells}", flush=True)  # fmt: skip
                del q, k, v, do
        torch.cuda.empty_cache()


def tile_str(t):
    return f"{t.block_m}x{t.block_n} w{t.warps} s{t.stages}" + (" tma" if t.tma else "")


def table_plans(d, dt):
    """[(kind, tile, plan)]: the tables' causal plan for (d, dtype) first (kind "default"), then each
    FLASH_TABLE candidate of one kernel with the other two kernels at the tables' tiles."""
    base = default_plan(d, True, DTYPES[dt])
    out = [("default", None, base)]
    for kind, tiles in FLASH_TABLE.get((d, dt), {}).items():  # none: the tables' tiles only
        for t in map(lambda t: Tile(*t), tiles):
            if t != getattr(base, kind):
                out.append((kind, t, replace(base, **{kind: t})))
    return out


def screen_flash_table(cases):
    """CPU: registers / spill bytes / shared KB for sm_90a of every candidate (tile_screen.py)."""
    from tile_screen import screen_plan

    for d, dt in cases:
        for kind, tile, plan in table_plans(d, dt):
            kinds = ("fwd", "dkdv", "dq") if kind == "default" else (kind,)
            try:
                usage = screen_plan(d, DTYPES[dt], True, plan, kinds)
            except Exception as e:  # e.g. out of shared memory: report and go on
                print(f"d{d} {dt} {kind:7s} {tile_str(tile) if tile else '':18s} failed: {e!s:.80}")
                continue
            for k, u in usage.items():
                t = getattr(plan, k)
                flag = "  SPILLS" if u["stack"] > 0 else ""
                print(f"d{d} {dt} {kind:7s} {k:4s} {tile_str(t):18s} regs {u['regs']:3d} "
                      f"stack {u['stack']:5d} B smem {u['smem']:6.1f} KB{flag}", flush=True)  # fmt: skip


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def _best_sdpa(q, k, v, do):
    """((fwd ms, backend), (bwd ms, backend)) of the fastest SDPA backend that takes the case."""
    times = {}
    for name, backend in SDPA.items():
        fwd, bwd, _ = time_sdpa(q, k, v, do, True, backend)
        if fwd is not None:
            times[name] = (fwd, bwd)
    return tuple(min(((t[j], n) for n, t in times.items()), default=(None, "-")) for j in (0, 1))


def _vs(peer, ms):
    return f"x{peer[0] / ms:4.2f} {peer[1]}" if peer[0] else "(no SDPA backend)"


def run_flash_table(cases, ns, rounds, defaults_only=False):
    """Suite-2 shapes (B = H = 1, causal): the tables' tiles and each candidate, forward or backward
    ms (median of `rounds` round-robin passes), beside the best SDPA backend that takes the case;
    per kernel the candidate with the best geometric-mean speed-up over the tables' tile across N;
    then the plan of the winners against SDPA."""
    summary = []
    for d, dt in cases:
        plans = table_plans(d, dt)[: 1 if defaults_only else None]
        ratios = {}  # (kind, tile) -> [the tables' ms / candidate ms, per N]
        peers = {}
        for n in ns:
            q, k, v, do = inputs(1, 1, n, d, dtype=DTYPES[dt])
            peers[n] = _best_sdpa(q, k, v, do)
            times = {i: [] for i in range(len(plans))}
            for _ in range(rounds):
                for i, (kind, _, plan) in enumerate(plans):
                    dirs = {"default": ("fwd", "bwd"), "fwd": ("fwd",)}.get(kind, ("bwd",))
                    times[i].append([time_plan(q, k, v, do, True, plan, r) for r in dirs])
            f0, b0 = (_median([t[j] for t in times[0]]) for j in (0, 1))
            ff = fwd_flops(1, 1, n, d, True)
            print(f"d{d} {dt} N{n}: tables.py tiles fwd {f0:.4f} ms ({ff / f0 / 1e9:.1f} TF, "
                  f"{_vs(peers[n][0], f0)}), bwd {b0:.4f} ms ({_vs(peers[n][1], b0)})", flush=True)  # fmt: skip
            for i, (kind, tile, _) in enumerate(plans[1:], start=1):
                ms, ref = _median([t[0] for t in times[i]]), f0 if kind == "fwd" else b0
                ratios.setdefault((kind, tile), []).append(ref / ms)
                print(
                    f"  {kind:4s} {tile_str(tile):18s} {ms:8.4f} ms  x{ref / ms:5.2f} vs tables.py"
                )
            del q, k, v, do
            torch.cuda.empty_cache()
        print(
            f"d{d} {dt}: best candidate per kernel (geomean speed-up over the tables' tile; per N)"
        )
        win = {}
        for kind in ("fwd", "dkdv", "dq"):
            cands = [(math.prod(r) ** (1 / len(r)), t, r) for (k, t), r in ratios.items() if k == kind]  # fmt: skip
            if cands:
                g, t, r = max(cands, key=lambda c: c[0])
                if g >= 1.03:  # beyond the noise between passes
                    win[kind] = t
                print(f"  {kind:4s} {tile_str(t):18s} x{g:4.2f} ({' '.join(f'{x:.2f}' for x in r)})"
                      f"{'  <- wins' if kind in win else '  (keep tables.py)'}")  # fmt: skip
        plan = replace(plans[0][2], **win)
        for n in ns:  # the chosen plan (the tables' tiles if nothing won) against SDPA
            q, k, v, do = inputs(1, 1, n, d, dtype=DTYPES[dt])
            f, b = (time_plan(q, k, v, do, True, plan, r) for r in ("fwd", "bwd"))
            summary.append((f"d{d} {dt} N{n}", plan, f, b, *peers[n]))
            del q, k, v, do
        print(flush=True)
    print("chosen plans against the best SDPA backend (x > 1: we are faster; goal >= 1 at N >= 1k)")
    for tag, plan, f, b, pf, pb in summary:
        tiles = " / ".join(tile_str(getattr(plan, k)) for k in ("fwd", "dkdv", "dq"))
        print(f"  {tag:18s} fwd {f:8.4f} {_vs(pf, f):22s} bwd {b:8.4f} {_vs(pb, b):22s} [{tiles}]")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--cases", default="64:0,64:1,128:0,128:1", help="d:causal list")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--leaderboard", action="store_true", help="also the (16, 16384, 64) shape")
    ap.add_argument("--defaults-only", action="store_true", help="time only the tables' tiles")
    ap.add_argument("--kernels", default="fwd,dkdv,dq", help="which kernels' tiles to sweep")
    ap.add_argument("--ab", type=int, default=0, help="time whole plans side by side, R rounds")
    ap.add_argument("--bh", help="B,H for --ab (default: the suite's 16384/N, 2048/d)")
    ap.add_argument("--flash-table", action="store_true", help="suite-2 shapes: B = H = 1, causal")
    ap.add_argument("--table-cases", default="16:bf16,32:bf16,16:fp32,32:fp32,64:fp32,128:fp32")
    ap.add_argument("--ns", default="1024,4096,16384", help="N list for --flash-table")
    ap.add_argument("--rounds", type=int, default=2, help="round-robin passes for --flash-table")
    ap.add_argument("--screen", action="store_true", help="CPU: sm_90a registers/spills only")
    ap.add_argument("--small-grid", action="store_true", help="64-row forward tiles, few heads")
    args = ap.parse_args()
    kernels = tuple(args.kernels.split(","))
    if args.small_grid:
        cases = [(int(c.split(":")[0]), c.split(":")[1] == "1") for c in args.cases.split(",")]
        bhs = [tuple(map(int, x.split(","))) for x in args.bh.split(";")] if args.bh else None
        print(f"GPU {torch.cuda.get_device_name()}  small grids: forward ms, bf16")
        run_small_grid(cases, [int(n) for n in args.ns.split(",")], bhs or SMALL_GRID_BH, 3)
        return
    if args.flash_table:
        cases = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.table_cases.split(",")]
        shard, nshards = (int(x) for x in args.shard.split("/"))
        if args.screen:
            screen_flash_table(cases[shard::nshards])
        elif args.compile_only:  # the timed shapes' specialisation (B = H = 1), tiny N
            jobs = [
                (d, dt, plan)
                for d, dt in cases
                for kind, _, plan in table_plans(d, dt)
                if kind == "default" or not args.defaults_only
            ]
            for d, dt, plan in jobs[shard::nshards]:
                q, k, v, do = inputs(1, 1, 256, d, dtype=DTYPES[dt])
                fwd, bwd = run_plan(q, k, v, do, True, plan)
                bwd()
            torch.cuda.synchronize()
        else:
            print(f"GPU {torch.cuda.get_device_name()}  flash table: B 1, H 1, causal")
            ns = [int(n) for n in args.ns.split(",")]
            run_flash_table(cases, ns, args.rounds, args.defaults_only)
        return
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
            run_plan(q, k, v, do, causal, plan)[1]()
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
