"""Split-KV forward tiles x split counts at decode shapes, one compact table per shape (GPU).

    PYTHONPATH=packages/flash-attn/src:shared/src python packages/flash-attn/benchmarks/tune_decode.py
    ... tune_decode.py --quick                 # 4 tiles x 6 split counts, Nk 4k and 32k, Nq 1
    ... tune_decode.py --nq 1,4,16 --nk 8192   # other shapes (B 8, H 32, Hkv 8, d 128 unless set)

For each (Nq, Nk): the KV bytes and their copy-bandwidth floor, SDPA's flash / cuDNN / efficient
backends (enable_gqa), our dense forward (0.2.0's path), our automatic plan, then microseconds
for every split tile (rows: BLOCK_N, warps, stages, TMA; BLOCK_M follows from GROUP * Nq) and
forced split count (columns), and the best cell with its % of the copy bandwidth. Every config
is timed `--rounds` times round-robin (median), so drift hits all of them alike. The defaults
live in tables.py (SPLIT_TILES, SPLIT_WAVES, ...); NOTES.md keeps the measurements.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelkit.flash_attn import tables
from kernelkit.flash_attn.choose import choose_fwd, dense_fwd_config, split_config
from kernelkit.flash_attn.config import Tile
from kernelkit.flash_attn.launch import forward, forward_problem
from kernelkit.shared.bench import bench_ms, copy_bandwidth_gbs
from kernelkit.shared.runtime import num_sms

# (BLOCK_N, warps, stages, tma) at d = 128 bf16; the first is tables.SPLIT_TILES[128]. Shared memory
# / registers from the sm_90a screen (NOTES.md): 64 s3 70 KB / 80, 64 s4 102 KB, 32 s6 85 KB,
# 128 s2 72 KB, 128 s3 136 KB / 96.
TILES = [(64, 4, 3, True), (64, 4, 4, True), (32, 4, 4, True), (32, 4, 6, True),
         (128, 4, 2, True), (128, 4, 3, True), (64, 8, 3, True), (64, 4, 3, False)]  # fmt: skip
QUICK_TILES = TILES[:2] + TILES[4:6]
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
QUICK_SPLITS = [2, 4, 6, 8, 12, 16]
DEVICE = "cuda"
SDPA = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def tile_str(t: Tile) -> str:
    return f"{t.block_m}x{t.block_n} w{t.warps} s{t.stages} {'tma' if t.tma else 'ptr'}"


def sdpa_us(q, k, v, backend):
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    try:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            return 1e3 * bench_ms(
                lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            )
    except RuntimeError:
        return None


def run_shape(b, nq, nk, h, hkv, d, tiles, splits, rounds, causal):
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def r(*shape):
        return torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=g)

    q, k, v = r(b, nq, h, d), r(b, nk, hkv, d), r(b, nk, hkv, d)
    scale = 1.0 / math.sqrt(d)
    kv_bytes = 2 * k.numel() * k.element_size()
    copy = copy_bandwidth_gbs()

    def pct(us):
        return 100 * kv_bytes / (us * 1e-6) / 1e9 / copy

    peers = {name: sdpa_us(q, k, v, be) for name, be in SDPA.items()}
    p = forward_problem(q, k, v, causal)
    dense = dense_fwd_config(p)
    auto = choose_fwd(p)
    rows = (h // hkv) * nq
    bm = max(16, 1 << (rows - 1).bit_length())
    configs = {("dense", 0): dense}
    if auto.split is not None:
        configs[("auto", 0)] = auto
    for t in tiles:
        tile = Tile(bm, *t)
        for s in splits:
            configs[(tile, s)] = split_config(p, num_splits=s, tile=tile)
    times: dict = {key: [] for key in configs}
    for _ in range(rounds):
        for key, cfg in configs.items():
            try:
                ms = bench_ms(lambda cfg=cfg: forward(q, k, v, causal, scale, config=cfg))
            except Exception as e:  # a tile out of resources: report it and go on
                print(f"  {key}: {type(e).__name__}: {str(e)[:80]}")
                ms = math.inf
            times[key].append(1e3 * ms)
    med = {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}

    peer_str = "  ".join(f"sdpa {n} {t:.1f}" if t else f"sdpa {n} -" for n, t in peers.items())
    print(
        f"\nB{b} Nq{nq} Nk{nk} H{h}/{hkv} d{d} causal{int(causal)}: KV {kv_bytes / 1e6:.1f} MB, "
        f"copy floor {kv_bytes / copy / 1e3:.1f} us  |  {peer_str}  (us)"
    )
    line = f"  ours dense {med[('dense', 0)]:.1f}"
    if auto is not None:
        line += (
            f"   auto [{tile_str(auto.tile)}, {auto.splits} splits x {auto.split_len}] "
            f"{med[('auto', 0)]:.1f} us ({pct(med[('auto', 0)]):.0f}% copy)"
        )
    print(line)
    head = "tile \\ forced splits"
    print(f"  {head:24s}" + "".join(f"{s:>7d}" for s in splits))
    for t in tiles:
        tile = Tile(bm, *t)
        cells = "".join(
            f"{med[(tile, s)]:7.1f}" if med[(tile, s)] < 1e5 else "   fail" for s in splits
        )
        print(f"  {tile_str(tile):24s}{cells}")
    best = min((k_ for k_ in med if k_[1]), key=med.get)
    plan = configs[best]["split"]
    best_peer = min((t for t in peers.values() if t), default=None)
    vs = f", x{best_peer / med[best]:.2f} vs best SDPA" if best_peer else ""
    print(
        f"  best: {tile_str(best[0])}, {plan.splits} splits x {plan.split_len} keys: "
        f"{med[best]:.1f} us ({pct(med[best]):.0f}% copy{vs})"
    )
    spread = max(max(ts) / min(ts) - 1 for ts in times.values() if math.isfinite(max(ts)))
    print(f"  largest spread between rounds of one config: {spread:.1%}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nq", default="1")
    ap.add_argument("--nk", default="4096,8192,16384,32768")
    ap.add_argument("--bhd", default="8,32,8,128", help="B,H,Hkv,d")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--quick", action="store_true", help="4 tiles x 6 split counts, Nk 4k/32k")
    args = ap.parse_args()
    b, h, hkv, d = map(int, args.bhd.split(","))
    nks = [4096, 32768] if args.quick and args.nk == ap.get_default("nk") else args.nk
    nks = [int(n) for n in (nks.split(",") if isinstance(nks, str) else nks)]
    tiles, splits = (QUICK_TILES, QUICK_SPLITS) if args.quick else (TILES, SPLITS)
    print(
        f"GPU {torch.cuda.get_device_name()}, {num_sms(torch.device(DEVICE))} SMs, "
        f"copy {copy_bandwidth_gbs():.0f} GB/s; tables.py defaults: SPLIT_TILES[128] "
        f"{tables.SPLIT_TILES[128]}, SPLIT_WAVES {tables.SPLIT_WAVES}"
    )
    for nq in (int(n) for n in args.nq.split(",")):
        for nk in nks:
            run_shape(b, nq, nk, h, hkv, d, tiles, splits, args.rounds, args.causal)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
