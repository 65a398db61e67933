"""The d64 Gluon forward's K/V ring (issue 29: d64 forward cells behind cuDNN): the chosen tile
(GLUON_FWD_TILE, 128 x 128 keys, 2 stages: d128's, whose shared memory allows no more) against
deeper rings and 64-key blocks, interleaved forward ms beside SDPA's cuDNN backend, bf16, the
suite-1 d64 shapes (B·N = 16k tokens, H = 32) and the leaderboard's forward. Each config's max
|o - o_chosen| is printed (a deeper ring computes the same sums: 0). One JSON line per cell.

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/flash-attn/src \\
        python lab/flash-attn/ab/d64_tile_ab.py
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from kernelkit.flash_attn import launch as fa_launch
from kernelkit.flash_attn.choose import choose_fwd, gluon_fwd_config
from kernelkit.flash_attn.config import FWD_GLUON, Tile
from kernelkit.shared.bench import interleaved_ms

TILES = {"128x128s2": Tile(128, 128, 4, 2, tma=True), "128x128s3": Tile(128, 128, 4, 3, tma=True),
         "128x128s4": Tile(128, 128, 4, 4, tma=True), "128x64s4": Tile(128, 64, 4, 4, tma=True),
         "128x64s6": Tile(128, 64, 4, 6, tma=True)}  # fmt: skip


def cell(b, n, h, d, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    window = (-1, 0) if causal else (-1, -1)
    p = fa_launch.forward_problem(q, k, v, causal, 0.0, window)
    chosen = choose_fwd(p)
    base = chosen if chosen.kernel == FWD_GLUON else gluon_fwd_config(p)
    cfgs = {"chosen": chosen}
    for name, tile in TILES.items():
        cfgs[name] = replace(gluon_fwd_config(p, tile), why="")
    scale = d**-0.5

    def ours(cfg):
        return lambda: fa_launch.forward(q, k, v, causal, scale, window=window, config=cfg)

    o_ref = ours(base)()[0]
    diff = {name: (ours(c)()[0].float() - o_ref.float()).abs().max().item()
            for name, c in cfgs.items()}  # fmt: skip
    fns = {name: ours(c) for name, c in cfgs.items()}
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, is_causal=causal)

    fns["cudnn"] = cudnn
    t = interleaved_ms(fns, rounds=7)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    return dict(b=b, n=n, h=h, d=d, causal=causal, chosen=str(chosen),
                ms={k: round(x[0], 4) for k, x in t.items()},
                spread={k: round(x[1], 3) for k, x in t.items()},
                tflops={k: round(flops / x[0] / 1e9, 1) for k, x in t.items()},
                max_diff=diff)  # fmt: skip


def main() -> None:
    cells = [(16, 16384, 1, 64, True)]  # the leaderboard's forward
    for causal in (True, False):
        for n in (4096, 16384):
            cells.append((16384 // n, n, 32, 64, causal))
    for c in cells:
        print(json.dumps(cell(*c)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
