"""A/B of the KV-cache split-KV configs on a GPU (issue 30): paged caches (a page per row vs a
page per key block through TMA, tiles, stages), contiguous caches (TMA or pointer loads), split
counts. Decode, GQA 32/8, d 128, bf16, one new row appended. Prints µs and % of copy bandwidth
(KV bytes / measured copy rate) per variant, interleaved rounds (kernelkit.shared.bench)."""

import json
import os
import sys
from dataclasses import replace

import torch

from kernelkit.flash_attn.choose import choose_fwd, split_config
from kernelkit.flash_attn.config import KVCache, Problem, Tile
from kernelkit.flash_attn.kvcache import kvcache_forward
from kernelkit.shared.bench import copy_bandwidth_gbs, interleaved_ms

H, HKV, D = 32, 8, 128
dt = torch.bfloat16


def setup(b, nk, page):
    cap = nk
    q = torch.randn(b, 1, H, D, device="cuda", dtype=dt)
    if page:
        per = cap // page
        kc = torch.randn(b * per, page, HKV, D, device="cuda", dtype=dt)
        table = torch.randperm(b * per, device="cuda").view(b, per).to(torch.int32)
    else:
        kc, table = torch.randn(b, cap, HKV, D, device="cuda", dtype=dt), None
    vc = torch.randn_like(kc)
    k = torch.randn(b, 1, HKV, D, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    seqlens = torch.full((b,), nk - 1, dtype=torch.int32, device="cuda")
    cache = KVCache(seqlens, 0, 1, table, page, cap)
    p = Problem.of_cache(q, kc, vc, cache, False)
    return (q, kc, vc, k, v, cache), p


def variants(p, page):
    base = choose_fwd(p)
    out = {"chosen": base}
    t = base.tile
    for bn, warps, stages in ((128, 8, 3), (64, 4, 4), (64, 4, 6), (32, 4, 8)):
        tile = Tile(t.block_m, bn, warps, stages, tma=True)
        cfg = split_config(p, base.split.splits, tile)
        tma = page == 0 or page % bn == 0
        out[f"bn{bn} w{warps} s{stages} {'tma' if tma else 'rows'}"] = replace(cfg, tma=tma)
        if tma:
            out[f"bn{bn} w{warps} s{stages} rows"] = replace(cfg, tma=False)
    if page == 16:
        for stages in (6, 10):
            tile = Tile(t.block_m, 16, 4, stages, tma=True)
            out[f"bn16 s{stages} tma"] = split_config(p, base.split.splits, tile)
    for mult in (2, 4):
        n = base.split.splits * mult
        out[f"splits x{mult}"] = split_config(p, n, t)
    out["chosen rows"] = replace(base, tma=False)
    return out


def main():
    bw = copy_bandwidth_gbs()
    cells = [
        (1, 65536, 0),
        (1, 131072, 0),
        (8, 16384, 0),
        (8, 65536, 0),
        (64, 16384, 0),
        (8, 16384, 16),
        (8, 65536, 16),
        (8, 16384, 64),
        (8, 65536, 64),
        (1, 65536, 64),
        (64, 16384, 64),
    ]
    if len(sys.argv) > 1:
        cells = [tuple(map(int, c.split(","))) for c in sys.argv[1:]]
    rows = []
    with torch.no_grad():
        for b, nk, page in cells:
            args, p = setup(b, nk, page)
            cfgs = variants(p, page)
            fns = {
                name: (lambda c=c, a=args: kvcache_forward(*a, False, D**-0.5, config=c))
                for name, c in cfgs.items()
            }
            res = interleaved_ms(fns, rounds=5)
            kv = 2 * b * nk * HKV * D * 2
            print(f"\n== B={b} nk={nk} page={page} (copy {bw:.0f} GB/s)", flush=True)
            for name, (ms, spread) in sorted(res.items(), key=lambda x: x[1][0]):
                pct = kv / (ms * 1e-3) / 1e9 / bw * 100
                print(
                    f"  {name:26s} {ms * 1000:9.1f} us  {pct:5.1f}%  spread {spread:.2f}  {cfgs[name]}"
                )
                rows.append(
                    dict(
                        b=b,
                        nk=nk,
                        page=page,
                        variant=name,
                        us=ms * 1000,
                        pct=pct,
                        config=str(cfgs[name]),
                    )
                )
    out = os.environ.get("OUT")
    if out:
        with open(f"{out}/kvcache_ab.json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
