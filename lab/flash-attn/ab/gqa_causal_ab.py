"""Session 35: the d128 backward, dq summed by the consumers in column halves (0.13.0) against the
dq kernel beside the Gluon dk/dv kernel, fixed order and any order, GQA causal / non-causal and
MHA causal at 16k tokens (B = 16384 / N). On an sm_90 GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/gqa_causal_ab.py
    ... gqa_causal_ab.py ring   # session 42: GQA causal only, after 0.17.0's ring and walk

    ... gqa_causal_ab.py heads-inner  # session 42: `BwdConfig.heads_inner` (GQA walk order;
                                      # a session build's field, gone since it lost)

`ring` adds the halves in the fixed order ("halves-fixed": what the chooser would take without
`tables.ORDERED_GQA_CAUSAL_DQ_KERNEL_D`, walked from the counter up to 8k rows since 0.17.0).

Prints, per case, each variant's median ms and TFLOP/s (2.5 x 4 x B H N^2 d, halved when causal)
over 7 interleaved rounds and its spread; writes $OUT/gqa_ab.json. The result decided
`tables.ORDERED_GQA_CAUSAL_DQ_KERNEL_D` (lab/flash-attn/logs/session35-H200-gqa-causal-ab.log).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from kernelkit.flash_attn import choose as C
from kernelkit.flash_attn import launch as L
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn.config import DQ_KERNEL, DQ_ORDERED
from kernelkit.shared.bench import interleaved_ms

D = 128
CASES = [
    (16384 // n, n, hq, hk, causal)
    for n in (2048, 4096, 8192, 16384)
    for hq, hk in ((32, 8), (32, 4), (16, 16))
    for causal in (True, False)
    if causal or hk != hq
]
RING_CASES = [
    (16384 // n, n, hq, hk, True)
    for n in (2048, 4096, 8192, 16384)
    for hq, hk in ((32, 8), (32, 4))
]


def variants(q, k, v, o, lse, do, causal, halves=False):
    """{name: callable} of the backward: the chooser's config (halves, fixed / any order) and
    the dq-kernel path it replaced from 2k rows."""
    scale = D**-0.5

    def run(cfg, det):
        return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, deterministic=det,
                                  config=cfg)  # fmt: skip

    fns = {}
    for det in (True, False):
        p = L.backward_problem(do, q, k, v, causal, deterministic=det)
        fns[f"chosen-{'fixed' if det else 'any'}"] = run(C.choose_bwd(p), det)
        if det:
            tile = T.GLUON_DKDV_TILES[D][causal]
            fns["dq-kernel"] = run(C.check_bwd(p, C.gluon_bwd_config(p, tile, DQ_KERNEL)), det)
            if halves:
                cfg = C.gluon_bwd_config(p, T.FUSED_DQ_DKDV, DQ_ORDERED)
                fns["halves-fixed"] = run(C.check_bwd(p, cfg), det)
    return fns


HEADS_INNER_CASES = [  # d, b, n, hq, hk, causal (16k tokens)
    (d, 16384 // n, n, hq, hk, causal)
    for d, n, hq, hk, causal in [
        (128, 2048, 32, 8, True),
        (128, 4096, 32, 8, True),
        (128, 8192, 32, 8, True),
        (128, 16384, 32, 8, True),
        (128, 4096, 32, 4, True),
        (128, 16384, 32, 4, True),
        (128, 4096, 32, 8, False),
        (128, 16384, 32, 8, False),
        (128, 16384, 32, 4, False),
        (64, 4096, 32, 8, True),
        (64, 16384, 32, 8, True),
        (64, 16384, 32, 8, False),
    ]
]


def heads_inner() -> None:
    """GQA, fixed order: the chooser's backward, the fused-dq one (d128: dq halves) walking
    each query head's blocks in turn (what ships) and each query block's heads in turn
    (`BwdConfig.heads_inner`; the chooser's too where it differs); max |difference| of the gradients from the head-major walk and
    the ms / TFLOP/s of 7 interleaved rounds."""
    for d, b, n, hq, hk, causal in HEADS_INNER_CASES:
        q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        scale = d**-0.5
        o, lse = L.forward(q, k, v, causal, scale)
        p = L.backward_problem(do, q, k, v, causal, deterministic=True)
        fused = C.check_bwd(p, C.gluon_bwd_config(p, T.FUSED_DQ_DKDV, DQ_ORDERED))

        def run(cfg, do=do, q=q, k=k, v=v, o=o, lse=lse, causal=causal, scale=scale):
            return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, config=cfg)

        chosen = C.choose_bwd(p)
        fns = {
            "chosen": run(chosen),
            "head-major": run(fused),
            "heads-inner": run(dataclasses.replace(fused, heads_inner=True)),
        }
        if chosen != fused:  # (the dq-kernel variant: its walk order too)
            fns["chosen-heads-inner"] = run(dataclasses.replace(chosen, heads_inner=True))
        ref = fns["head-major"]()
        err = [max((a.float() - r.float()).abs().max().item() for a, r in zip(fns[x](), ref))
               for x in ("chosen", "heads-inner")]  # fmt: skip
        flops = 2.5 * 4 * b * hq * n * n * d * (0.5 if causal else 1.0)
        res = interleaved_ms(fns, rounds=7)
        cells = "  ".join(f"{name} {ms:.3f}ms {flops / ms / 1e9:.0f}TF (±{sp * 100:.0f}%)"
                          for name, (ms, sp) in res.items())  # fmt: skip
        print(f"d{d} b{b} n{n} {hq}/{hk} causal={causal} [{fused}] max diff chosen {err[0]:.3g}"
              f" heads-inner {err[1]:.3g}: {cells}", flush=True)  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    if sys.argv[1:] == ["heads-inner"]:
        heads_inner()
        return
    rows = []
    ring = sys.argv[1:] == ["ring"]
    for b, n, hq, hk, causal in RING_CASES if ring else CASES:
        q = torch.randn(b, n, hq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, n, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        o, lse = L.forward(q, k, v, causal, D**-0.5)
        fns = variants(q, k, v, o, lse, do, causal, halves=ring)
        ref = next(iter(fns.values()))()
        for name, fn in fns.items():
            err = max((a.float() - r.float()).abs().max().item() for a, r in zip(fn(), ref))
            print(f"  {name}: max |grad - first variant's| {err:.3g}", flush=True)
        flops = 2.5 * 4 * b * hq * n * n * D * (0.5 if causal else 1.0)
        res = interleaved_ms(fns, rounds=7)
        rows.append(dict(b=b, n=n, hq=hq, hk=hk, causal=causal,
                         ms={name: ms for name, (ms, _) in res.items()}))  # fmt: skip
        cells = "  ".join(f"{name} {ms:.3f}ms {flops / ms / 1e9:.0f}TF (±{sp * 100:.0f}%)"
                          for name, (ms, sp) in res.items())  # fmt: skip
        print(f"b{b} n{n} {hq}/{hk} causal={causal}: {cells}", flush=True)
    with open(
        os.path.join(os.environ.get("OUT", "/tmp"), "gqa_ab_ring.json" if ring else "gqa_ab.json"),
        "w",
    ) as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
