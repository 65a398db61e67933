"""Session 36: the fused-dq Gluon backward with one program per tile against one program per SM
walking its share of the tiles (`BwdConfig.persistent`, as the dq-kernel variant does up to 4k
rows), windows, causal and not, d64 / d128 at 16k tokens. On an sm_90 GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/fused_persistent_ab.py
    ... fused_persistent_ab.py d64-windows   # the d64 window sizes (the table's threshold)

The persistent fused-dq variants are refused by `gluon.bwd.can_implement` (not shipped: the
first run's log, `lab/flash-attn/logs/session36-H200-fused-persistent-ab.log`), so this script
lifts that one check for its own configs. Per case: whether the gradients are bitwise equal
(the sums' order is fixed), each variant's median ms over 7 interleaved rounds and its spread.
The d64 sweep decided `tables.FUSED_PERSISTENT_MAX_WINDOW`
(`session36-H200-fused-persistent-d64-windows.log`).
"""

from __future__ import annotations

import dataclasses
import sys

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

CASES = [  # d, b, n, heads, causal, window, deterministic, softcap
    (128, 1, 16384, 16, True, (1023, 0), True, 0.0),
    (128, 1, 16384, 16, True, (4095, 0), True, 0.0),
    (128, 1, 16384, 16, True, (-1, -1), True, 0.0),
    (128, 1, 16384, 16, False, (-1, -1), True, 0.0),
    (128, 4, 4096, 16, True, (-1, -1), True, 0.0),
    (128, 1, 65536, 16, True, (1023, 0), True, 0.0),
    (64, 1, 16384, 32, True, (1023, 0), True, 0.0),
    (64, 1, 16384, 32, True, (-1, -1), True, 0.0),
]
D64_WINDOWS = [
    (64, 1, 16384, 32, True, (w - 1, 0), True, 0.0) for w in (512, 1024, 2048, 3072, 4096, 8192)
] + [
    (64, 1, 16384, 32, True, (1023, 0), False, 0.0),
    (64, 1, 16384, 32, True, (4095, 0), False, 0.0),
    (64, 1, 65536, 32, True, (1023, 0), True, 0.0),
    (64, 1, 16384, 32, True, (1023, 0), True, 30.0),
    (64, 4, 4096, 32, True, (1023, 0), True, 0.0),
]


def variants(q, k, v, do, causal, window, det, cap):
    """(the chooser's config, {name: callable}): the fused-dq backward with one program per tile
    and walked persistently, the chooser's config otherwise."""
    b, n, h, d = q.shape
    scale = d**-0.5
    o, lse = L.forward(q, k, v, causal, scale, softcap=cap, window=window)
    p = L.backward_problem(do, q, k, v, causal, cap, window, deterministic=det)
    chosen = C.choose_bwd(p)

    def walk(persistent):
        heads = C.tile_heads(b * h, -(-n // chosen.dkdv.block_n), p.target.sms, p.causal,
                             persistent, det)  # fmt: skip
        return dataclasses.replace(chosen, persistent=persistent, tile_heads=heads)

    def run(cfg):
        return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, softcap=cap,
                                  window=window, deterministic=det, config=cfg)  # fmt: skip

    return chosen, {"per-tile": run(walk(False)), "persistent": run(walk(True))}


def main() -> None:
    torch.manual_seed(0)
    for d, b, n, h, causal, window, det, cap in (
        D64_WINDOWS if sys.argv[1:] == ["d64-windows"] else CASES
    ):
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))  # fmt: skip
        chosen, fns = variants(q, k, v, do, causal, window, det, cap)
        same = all(torch.equal(x, y) for x, y in zip(fns["per-tile"](), fns["persistent"]()))
        res = interleaved_ms(fns, rounds=7)
        cells = "  ".join(f"{k} {ms:.3f}ms (±{sp * 100:.0f}%)" for k, (ms, sp) in res.items())
        print(
            f"d{d} b{b} n{n} h{h} causal={causal} window={window} det={det} softcap={cap} "
            f"chosen persistent={chosen.persistent}: bitwise {same}  {cells}",
            flush=True,
        )


if __name__ == "__main__":
    main()
