"""Session 36: the fused-dq Gluon backward with one program per tile against one program per SM
walking its share of the tiles (`BwdConfig.persistent`, as the dq-kernel variant does up to 4k
rows), windows, causal and not, d64 / d128 at 16k tokens. On an sm_90 GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/fused_persistent_ab.py
    ... fused_persistent_ab.py d64-windows   # the d64 window sizes (the table's threshold)
    ... fused_persistent_ab.py hold          # static / dynamic walk on 4 SMs (`hold`)
    ... fused_persistent_ab.py d64-lengths   # d64 without a window, 2k-16k (`lengths`)
    ... fused_persistent_ab.py d128-dynamic  # d128 (dq halves) per tile / from the counter
    ... fused_persistent_ab.py d128-dynamic-softcap  # the same after 0.17.0: softcap, any order
    ... fused_persistent_ab.py d64-windows-dynamic   # d64 windows per tile / from the counter
    ... fused_persistent_ab.py d64-windows-any       # the same in any order
    ... fused_persistent_ab.py short-rows            # 512 / 1k rows, d64 and d128 (`lengths`)
    ... fused_persistent_ab.py long-rows             # 16k / 32k rows per tile / from the counter
    ... fused_persistent_ab.py long-rows-rest        # the same: leaderboard, GQA, a long window
    ... fused_persistent_ab.py d64-long-rows         # d64 past 8k rows, 11 rounds
    ... fused_persistent_ab.py tile-order            # causal fixed order: shortest / longest first
    ... fused_persistent_ab.py tile-groups           # the tile groups' size (heads per group)

The persistent dq-halves variant (d128) was refused by `gluon.bwd.can_implement` until 0.17.0
(it lost: the first run's log, `lab/flash-attn/logs/session36-H200-fused-persistent-ab.log`).
This script lifts the check that keeps fused-dq programs off the walk by program id, for its
own configs. Per case: whether the gradients of the walk by program id ("persistent") and of
the walk from a counter ("dynamic", `BwdConfig.dynamic`, what ships since 0.15.0) are bitwise
those of one program per tile (the sums' order is fixed), and each variant's median ms over 7
interleaved rounds with its spread. The d64 sweeps decided `tables.FUSED_PERSISTENT_MAX_WINDOW`
(`session36-H200-fused-persistent-d64-windows.log`, `session39-H200-dynamic-walk-d64-windows*.log`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from kernelkit.flash_attn import choose as C
from kernelkit.flash_attn import launch as L
from kernelkit.flash_attn.gluon import bwd as G
from kernelkit.shared.bench import interleaved_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages/flash-attn/tests"))

_can_implement = G.can_implement


_LIFTED = "persistent fused-dq programs take their tiles from a counter (dynamic)"


def _lifted(p, cfg):
    reason = _can_implement(p, cfg)
    return None if reason == _LIFTED else reason


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

    def walk(persistent, dynamic=False):
        heads = C.tile_heads(b * h, -(-n // chosen.dkdv.block_n), p.target.sms, p.causal,
                             persistent, det)  # fmt: skip
        return dataclasses.replace(chosen, persistent=persistent, tile_heads=heads,
                                   dynamic=dynamic)  # fmt: skip

    def run(cfg):
        return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, softcap=cap,
                                  window=window, deterministic=det, config=cfg)  # fmt: skip

    return chosen, {"per-tile": run(walk(False)), "persistent": run(walk(True)),
                    "dynamic": run(walk(True, True))}  # fmt: skip


D64_LENGTHS = [  # d, b, n, heads, causal, deterministic: no window (session 40)
    (64, 8, 2048, 32, True, True),
    (64, 4, 4096, 32, True, True),
    (64, 2, 8192, 32, True, True),
    (64, 1, 16384, 32, True, True),
    (64, 4, 4096, 32, False, True),
    (64, 4, 4096, 32, True, False),
    (64, 8, 2048, 32, False, True),
    (64, 2, 8192, 32, False, True),
]


SHORT_ROWS = [  # d, b, n, heads, causal, deterministic: below FUSED_DQ_MIN_N (session 42)
    (64, 16, 1024, 32, True, True),
    (64, 16, 1024, 32, False, True),
    (64, 32, 512, 32, True, True),
    (128, 16, 1024, 16, True, True),
    (128, 16, 1024, 16, False, True),
    (128, 32, 512, 16, True, True),
]


def lengths(cases=D64_LENGTHS) -> None:
    """d64 without a window, 2k-16k rows (16k tokens): the chooser's backward (the dq kernel
    below tables.FUSED_DQ_MIN_N, fused from it) against the fused-dq kernel with one program
    per tile and walked from the counter (`BwdConfig.dynamic`); whether the walk's gradients
    are bitwise the per-tile ones' and the ms of 7 interleaved rounds (SHORT_ROWS: d64 and
    d128 below tables.FUSED_DQ_MIN_N)."""
    for case in cases:
        _length_case(*case)


def _length_case(d, b, n, h, causal, det) -> None:
    from kernelkit.flash_attn import tables as T
    from kernelkit.flash_attn.config import DQ_ANY_ORDER, DQ_ORDERED

    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))  # fmt: skip
    scale = d**-0.5
    o, lse = L.forward(q, k, v, causal, scale)
    p = L.backward_problem(do, q, k, v, causal, 0.0, (-1, -1), deterministic=det)
    chosen = C.choose_bwd(p)
    fused = C.gluon_bwd_config(p, T.FUSED_DQ_DKDV, DQ_ORDERED if det else DQ_ANY_ORDER)
    key_blocks = -(-n // fused.dkdv.block_n)

    def walk(persistent):
        heads = C.tile_heads(b * h, key_blocks, p.target.sms, causal, persistent, det)
        return dataclasses.replace(fused, persistent=persistent, dynamic=persistent,
                                   tile_heads=heads)  # fmt: skip

    def run(cfg):
        return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, deterministic=det,
                                  config=cfg)  # fmt: skip

    fns = {"chosen": run(chosen), "fused-per-tile": run(walk(False)),
           "fused-dynamic": run(walk(True))}  # fmt: skip
    same = all(torch.equal(x, y) for x, y in zip(fns["fused-per-tile"](), fns["fused-dynamic"]()))
    res = interleaved_ms(fns, rounds=7)
    cells = "  ".join(f"{k} {ms:.3f}ms (±{sp * 100:.0f}%)" for k, (ms, sp) in res.items())
    print(f"d{d} b{b} n{n} h{h} causal={causal} det={det} chosen [{chosen}]: bitwise {same}"
          f"  {cells}", flush=True)  # fmt: skip


D128_DYNAMIC = [  # d, b, n, heads, causal, window, deterministic (session 41)
    (128, 8, 2048, 16, True, (-1, -1), True),
    (128, 4, 4096, 16, True, (-1, -1), True),
    (128, 2, 8192, 16, True, (-1, -1), True),
    (128, 1, 16384, 16, True, (-1, -1), True),
    (128, 8, 2048, 16, False, (-1, -1), True),
    (128, 4, 4096, 16, False, (-1, -1), True),
    (128, 1, 16384, 16, True, (1023, 0), True),
    (128, 1, 16384, 16, True, (2047, 0), True),
    (128, 1, 16384, 16, True, (4095, 0), True),
    (128, 4, 4096, 16, True, (-1, -1), False),
    (128, 1, 16384, 16, True, (1023, 0), False),
]
D128_DYNAMIC_SOFTCAP = [  # d, b, n, heads, causal, window, deterministic, softcap (session 41,
    # after the row vectors moved into the ring): softcap, any order, d64 at 16k
    (128, 8, 2048, 16, True, (-1, -1), True, 30.0),
    (128, 4, 4096, 16, True, (-1, -1), True, 30.0),
    (128, 2, 8192, 16, True, (-1, -1), True, 30.0),
    (128, 4, 4096, 16, False, (-1, -1), True, 30.0),
    (128, 1, 16384, 16, True, (1023, 0), False, 0.0),
    (128, 1, 16384, 16, True, (4095, 0), False, 0.0),
    (128, 4, 4096, 16, True, (-1, -1), False, 0.0),
    (64, 1, 16384, 32, True, (-1, -1), True, 0.0),
    (64, 1, 16384, 32, False, (-1, -1), True, 0.0),
]

D64_WINDOWS_DYNAMIC = [  # session 42: the d64 window bound (3072) after 0.17.0's ring
    (64, 1, 16384, 32, True, (w - 1, 0), True) for w in (2048, 3072, 4096, 6144, 8192)
] + [(64, 1, 16384, 32, True, (4095, 0), False), (64, 1, 65536, 32, True, (4095, 0), True)]
D64_WINDOWS_ANY = [(64, 1, 16384, 32, True, (w - 1, 0), False) for w in (2048, 8192)]
LONG_ROWS = [  # session 44: above FUSED_PERSISTENT_MAX_N after 0.17.3's TMA stores of dk, dv
    (d, 1, n, 2048 // d, causal, (-1, -1), True)
    for d in (128, 64)
    for n, causal in ((16384, True), (16384, False), (32768, True))
]
# not yet measured (session 44's open cases): the leaderboard shape, GQA at 16k, a long window
LONG_ROWS_REST = [  # d, b, n, heads, kv heads, causal, window
    (64, 16, 16384, 1, 1, True, (-1, -1)),
    (64, 16, 16384, 1, 1, False, (-1, -1)),
    (64, 1, 16384, 32, 8, True, (-1, -1)),
    (128, 1, 16384, 32, 8, False, (-1, -1)),
    (128, 1, 16384, 16, 16, True, (12287, 0)),
]

D64_LONG_ROWS = [  # session 45: d64 past FUSED_PERSISTENT_MAX_N[64], 11 rounds; b, n, h, hkv, causal
    (16, 16384, 1, 1, True), (16, 16384, 1, 1, False), (1, 16384, 32, 8, True),
    (1, 16384, 32, 8, False), (1, 16384, 32, 32, True), (1, 16384, 32, 32, False),
    (1, 32768, 32, 32, True), (2, 12288, 16, 16, True),
]  # fmt: skip


def d128_dynamic(cases) -> None:
    """The fused-dq backward (d128: dq summed by the consumers in column halves, refused on the
    counter's walk by `can_implement` until 0.17.0) with one program per tile against the same
    config walked from the counter (`BwdConfig.dynamic`); whether the gradients are bitwise
    equal (fixed order) and the ms of 7 interleaved rounds. Session 41's first run (D128_DYNAMIC,
    the row vectors still read from global memory) and its run after 0.17.0's ring
    (D128_DYNAMIC_SOFTCAP)."""
    for d, b, n, h, causal, window, det, *cap in cases:
        _dynamic_case(d, b, n, h, causal, window, det, cap[0] if cap else 0.0)


def _dynamic_case(d, b, n, h, causal, window, det, cap, hkv=None, rounds=7) -> None:
    """One case of `d128_dynamic` (hkv kv heads: GQA; `rounds` interleaved)."""
    hkv = hkv or h
    q, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = d**-0.5
    o, lse = L.forward(q, k, v, causal, scale, softcap=cap, window=window)
    p = L.backward_problem(do, q, k, v, causal, cap, window, deterministic=det)
    chosen = C.choose_bwd(p)
    blocks = -(-n // chosen.dkdv.block_n)
    walks = {}
    for walked in (False, True):
        heads = C.tile_heads(b * hkv, blocks, p.target.sms, causal, walked, det)
        walks[walked] = dataclasses.replace(chosen, persistent=walked, dynamic=walked,
                                            tile_heads=heads)  # fmt: skip

    def run(cfg):
        return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, softcap=cap,
                                  window=window, deterministic=det, config=cfg)  # fmt: skip

    fns = {"per-tile": run(walks[False]), "dynamic": run(walks[True])}
    a, bb = fns["per-tile"](), fns["dynamic"]()
    same = all(torch.equal(x, y) for x, y in zip(a, bb))
    err = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, bb))
    res = interleaved_ms(fns, rounds=rounds)
    cells = "  ".join(f"{k} {ms:.3f}ms (±{sp * 100:.0f}%)" for k, (ms, sp) in res.items())
    print(f"d{d} b{b} n{n} h{h}/{hkv} causal={causal} window={window} det={det} softcap={cap}"
          f" [{chosen}]: "
          f"bitwise {same} (max diff {err:.2e})  {cells}", flush=True)  # fmt: skip


def hold() -> None:
    """Static and dynamic walks of the d64 short-window backward (fixed order) on 4 SMs while
    `sm_hold` programs on another stream hold the others until the walk has taken every tile
    from its counter, or 3 s: the static walk, which takes no tile from the counter, waits on
    programs that cannot start until the holders give up (the hang risk that kept it out in
    session 36); the dynamic one finishes on its 4 SMs. Prints whether the holders timed out,
    the wall time, and whether the gradients equal one program per tile's."""
    import time

    from sm_hold import HOLD_SMEM, hold_kernel
    from test_gpu_sizes import _CounterOps

    from kernelkit.flash_attn import tables as T

    n, h, hkv, d = T.FUSED_DQ_MIN_N[64][True], 8, 4, 64
    q, k, v, do = (torch.randn(1, n, hh, d, device="cuda", dtype=torch.bfloat16)
                   for hh in (h, hkv, hkv, h))  # fmt: skip
    window, scale = (1023, 0), d**-0.5
    o, lse = L.forward(q, k, v, True, scale, window=window)
    p = L.backward_problem(do, q, k, v, True, 0.0, window)
    chosen = C.choose_bwd(p)
    heads = C.tile_heads(hkv, -(-n // 128), p.target.sms, True, False, True)
    want = L.backward(do, q, k, v, o, lse, None, True, scale, window=window,
                      config=dataclasses.replace(chosen, persistent=False, dynamic=False,
                                                 tile_heads=heads))  # fmt: skip
    tiles = -(-n // 128) * hkv
    held = p.target.sms - 4
    for name, cfg in (("dynamic", chosen), ("static", dataclasses.replace(chosen, dynamic=False))):
        ctr = torch.zeros(1, dtype=torch.int32, device="cuda")
        timed_out = torch.zeros(held, dtype=torch.int32, device="cuda")
        ops = _CounterOps(ctr)

        def bwd(ops=ops, cfg=cfg):
            return L._backward(ops, do, q, k, v, o, lse, None, True, scale, 0.0, window, None,
                               True, cfg)  # fmt: skip

        bwd()
        ctr.zero_()
        torch.cuda.synchronize()
        holders, walk = torch.cuda.Stream(), torch.cuda.Stream()
        t0 = time.perf_counter()
        with torch.cuda.stream(holders):
            hold_kernel[(held,)](ctr, tiles, timed_out, 3 * 10**9, SMEM=HOLD_SMEM, num_warps=4)
        time.sleep(0.2)
        with torch.cuda.stream(walk):
            got = bwd()
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) for x, y in zip(want, got))
        print(f"hold {name}: holders timed out {int(timed_out.sum())} of {held}, "
              f"{time.perf_counter() - t0:.2f} s, bitwise {same}", flush=True)  # fmt: skip


TILE_ORDER = [  # session 45: causal, fixed order, 16k tokens; d, b, n, heads
    (128, 8, 2048, 16), (128, 4, 4096, 16), (128, 2, 8192, 16), (128, 1, 16384, 16),
    (64, 8, 2048, 32), (64, 4, 4096, 32), (64, 2, 8192, 32), (64, 1, 16384, 32),
    (64, 16, 16384, 1),
]  # fmt: skip


def tile_order() -> None:
    """Causal dq sums in the fixed order: the chooser's tile order (tile_heads < 0: each group
    of heads from its last key block down, the shortest tiles first, so the walk ends on its
    longest) against the first key block first (tile_heads > 0: the sums go key block 0, 1,
    ...; the longest tiles first, a short tail), in groups of the chooser's size, twice it and
    all heads. Gradients differ by the sums' order only: the max difference from the
    chooser's. Median ms of 7 interleaved rounds."""
    for d, b, n, h in TILE_ORDER:
        _tile_order_case(d, b, n, h)


TILE_GROUPS = [  # session 45: fixed order, 16k tokens; d, b, n, heads, causal
    (128, 4, 4096, 16, False), (128, 4, 4096, 16, True), (128, 2, 8192, 16, False),
    (128, 2, 8192, 16, True), (128, 1, 16384, 16, True), (64, 16, 16384, 1, True),
]  # fmt: skip


def tile_groups() -> None:
    """The size of the chooser's tile groups (`choose.tile_heads`: about one wave of programs
    on a group of heads), its order kept: the chooser's group against a quarter, half, twice,
    four times it and all heads. Median ms of 7 interleaved rounds."""
    for d, b, n, h, causal in TILE_GROUPS:
        _tile_order_case(d, b, n, h, causal, sizes=_group_sizes, same_order=True)


def _group_sizes(g, bhk):
    """`tile_groups`' sizes around the chooser's g of bhk (batch, kv head)s."""
    return g // 4, g // 2, 2 * g, 4 * g, bhk


def _tile_order_case(d, b, n, h, causal=True, sizes=None, same_order=False) -> None:
    """One case of `tile_order` (tile groups of `sizes(g, bhk)` heads, g the chooser's, ascending
    or with `same_order` in the chooser's order)."""
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))  # fmt: skip
    scale = d**-0.5
    o, lse = L.forward(q, k, v, causal, scale)
    chosen = C.choose_bwd(L.backward_problem(do, q, k, v, causal, 0.0, (-1, -1)))
    g = abs(chosen.tile_heads)
    sign = -1 if same_order and chosen.tile_heads < 0 else 1
    cfgs = {f"th={chosen.tile_heads}": chosen}
    for th in dict.fromkeys(sizes(g, b * h) if sizes else (g, min(2 * g, b * h), b * h)):
        if 0 < th <= b * h and (b * h) % th == 0 and sign * th != chosen.tile_heads:
            cfgs[f"th={sign * th:+d}"] = dataclasses.replace(chosen, tile_heads=sign * th)

    def run(cfg):
        return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, config=cfg)

    fns = {name: run(cfg) for name, cfg in cfgs.items()}
    ref = next(iter(fns.values()))()
    diffs = []
    for name, fn in list(fns.items())[1:]:
        got = fn()
        err = max((x.float() - y.float()).abs().max().item() for x, y in zip(ref, got))
        diffs.append(f"{name} {err:.1e}")
    res = interleaved_ms(fns, rounds=7)
    cells = "  ".join(f"{k} {ms:.3f}ms (±{sp * 100:.0f}%)" for k, (ms, sp) in res.items())
    print(f"d{d} b{b} n{n} h{h} causal={causal} [{chosen}]: max diff {', '.join(diffs)}  {cells}",
          flush=True)  # fmt: skip


MODES = {  # argv[1] -> the run (none or "d64-windows": the walks of `variants`)
    "hold": hold,
    "d128-dynamic": lambda: d128_dynamic(D128_DYNAMIC),
    "d128-dynamic-softcap": lambda: d128_dynamic(D128_DYNAMIC_SOFTCAP),
    "d64-windows-dynamic": lambda: d128_dynamic(D64_WINDOWS_DYNAMIC),
    "d64-windows-any": lambda: d128_dynamic(D64_WINDOWS_ANY),
    "short-rows": lambda: lengths(SHORT_ROWS),
    "d64-lengths": lengths,
    "long-rows": lambda: d128_dynamic(LONG_ROWS),
    "tile-order": tile_order,
    "tile-groups": tile_groups,
    "d64-long-rows": lambda: [
        _dynamic_case(64, b, n, h, c, (-1, -1), True, 0.0, hkv, rounds=11)
        for b, n, h, hkv, c in D64_LONG_ROWS
    ],
    "long-rows-rest": lambda: [
        _dynamic_case(d, b, n, h, c, w, True, 0.0, hkv) for d, b, n, h, hkv, c, w in LONG_ROWS_REST
    ],
}


def main() -> None:
    torch.manual_seed(0)
    mode = sys.argv[1] if len(sys.argv) > 1 else None
    if mode in MODES:
        MODES[mode]()
        return
    for d, b, n, h, causal, window, det, cap in D64_WINDOWS if mode == "d64-windows" else CASES:
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))  # fmt: skip
        chosen, fns = variants(q, k, v, do, causal, window, det, cap)
        ref = fns["per-tile"]()
        same = all(torch.equal(x, y) for x, y in zip(ref, fns["persistent"]()))
        same_dyn = all(torch.equal(x, y) for x, y in zip(ref, fns["dynamic"]()))
        res = interleaved_ms(fns, rounds=7)
        cells = "  ".join(f"{k} {ms:.3f}ms (±{sp * 100:.0f}%)" for k, (ms, sp) in res.items())
        print(
            f"d{d} b{b} n{n} h{h} causal={causal} window={window} det={det} softcap={cap} "
            f"chosen persistent={chosen.persistent} dynamic={chosen.dynamic}: bitwise {same}"
            f" / dynamic {same_dyn}  {cells}",
            flush=True,
        )


if __name__ == "__main__":
    main()
