"""Session 36: the fused-dq Gluon backward with one program per tile (shipped) against one
program per SM walking its share of the tiles (`BwdConfig.persistent`, as the dq-kernel variant
does up to 4k rows), fixed order, windows, causal and not, d64 / d128 at 16k tokens. On an sm_90
GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/fused_persistent_ab.py

The persistent fused variant is refused by `gluon.bwd.can_implement` (never shipped), so this
script lifts that one check for its own configs. Per case: whether the gradients are bitwise
equal (the sums' order is fixed), each variant's median ms over 7 interleaved rounds and its
spread.
"""

from __future__ import annotations

import dataclasses

import torch

from kernelkit.flash_attn import choose as C
from kernelkit.flash_attn import launch as L
from kernelkit.flash_attn.gluon import bwd as G
from kernelkit.shared.bench import interleaved_ms

_can_implement = G.can_implement


def _lifted(p, cfg):
    reason = _can_implement(p, cfg)
    return None if reason == "the fused-dq variants run one program per tile" else reason


G.can_implement = _lifted

CASES = [  # d, b, n, heads, causal, window
    (128, 1, 16384, 16, True, (1023, 0)),
    (128, 1, 16384, 16, True, (4095, 0)),
    (128, 1, 16384, 16, True, (-1, -1)),
    (128, 1, 16384, 16, False, (-1, -1)),
    (128, 4, 4096, 16, True, (-1, -1)),
    (128, 1, 65536, 16, True, (1023, 0)),
    (64, 1, 16384, 32, True, (1023, 0)),
    (64, 1, 16384, 32, True, (-1, -1)),
]


def variants(q, k, v, do, causal, window):
    """{name: callable}: the chooser's fused-dq backward, one program per tile, and the same
    config walked persistently."""
    b, n, h, d = q.shape
    scale = d**-0.5
    o, lse = L.forward(q, k, v, causal, scale, window=window)
    p = L.backward_problem(do, q, k, v, causal, 0.0, window)
    tile = C.choose_bwd(p)
    heads = C.tile_heads(b * h, -(-n // tile.dkdv.block_n), p.target.sms, p.causal, True, True)
    pers = dataclasses.replace(tile, persistent=True, tile_heads=heads)

    def run(cfg):
        return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, window=window,
                                  config=cfg)  # fmt: skip

    return tile, {"per-tile": run(tile), "persistent": run(pers)}


def main() -> None:
    torch.manual_seed(0)
    for d, b, n, h, causal, window in CASES:
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))  # fmt: skip
        tile, fns = variants(q, k, v, do, causal, window)
        same = all(torch.equal(x, y) for x, y in zip(fns["per-tile"](), fns["persistent"]()))
        res = interleaved_ms(fns, rounds=7)
        cells = "  ".join(f"{k} {ms:.3f}ms (±{sp * 100:.0f}%)" for k, (ms, sp) in res.items())
        print(
            f"d{d} b{b} n{n} h{h} causal={causal} window={window} {tile}: bitwise {same}  {cells}",
            flush=True,
        )


if __name__ == "__main__":
    main()
