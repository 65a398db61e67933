"""Session 36: softcap on the Gluon backward (tanh.approx; P and the cap's derivative held in 16
bits) against the portable backward it ran on before, and the plain (uncapped) backward of the
same shape, d64 / d128 at 16k tokens (B = 16384 / N, H * d = 2048), causal or not; plus GQA and
a 4k window. On an sm_90 GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/softcap_bwd_ab.py
    ... softcap_bwd_ab.py accuracy   # the accuracy part alone

First the accuracy of each variant against a float32 reference at (2, 1024, 4, d) (max error,
and the bf16 PyTorch reference's); then, per case, each variant's median ms and TFLOP/s
(2.5 x 4 x B H N^2 d, halved when causal; visible pairs for the window) over 7 interleaved
rounds; writes $OUT/softcap_ab.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from kernelkit.flash_attn import choose as C
from kernelkit.flash_attn import launch as L
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn.config import DQ_KERNEL
from kernelkit.flash_attn.reference import attention_reference
from kernelkit.shared.bench import interleaved_ms

CAP = 30.0


def variants(q, k, v, do, causal, window, d):
    """{name: callable} of the backward with softcap: the portable kernels (shipped), the
    chooser's Gluon config (fixed order; any order), the Gluon dk/dv kernel with the dq kernel
    beside it (d128); and the chooser's plain backward without softcap."""
    scale = d**-0.5
    fns = {}
    for cap in (CAP, 0.0):
        o, lse = L.forward(q, k, v, causal, scale, softcap=cap, window=window)

        def run(cfg, det, o=o, lse=lse, cap=cap):
            return lambda: L.backward(do, q, k, v, o, lse, None, causal, scale, softcap=cap,
                                      window=window, deterministic=det, config=cfg)  # fmt: skip

        for det in (True, False) if cap else (True,):
            p = L.backward_problem(do, q, k, v, causal, cap, window, deterministic=det)
            if not cap:
                fns["plain"] = run(C.choose_bwd(p), det)
                continue
            if det:
                _, dkdv, dq = C.table_tiles(p)
                fns["portable"] = run(C.portable_bwd_config(p, dkdv, dq), det)
            fns["gluon" if det else "gluon-any"] = run(C.choose_bwd(p), det)
            if det and d == 128:
                tile = T.GLUON_DKDV_TILES[d][p.causal]
                fns["gluon-dqk"] = run(C.check_bwd(p, C.gluon_bwd_config(p, tile, DQ_KERNEL)),
                                       det)  # fmt: skip
    return fns


def accuracy(d, causal, window=(-1, -1), n=1024, b=2, h=4, hk=4, dtype=torch.bfloat16):
    torch.manual_seed(1)
    q = torch.randn(b, n, h, d, device="cuda", dtype=dtype) * 2
    k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=dtype) * 2 for _ in range(2))
    do = torch.randn_like(q)

    def ref_grads(dt):
        x = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o = attention_reference(*x, causal=causal, softcap=CAP, window_size=window)
        o.backward(do.to(dt))
        return [t.grad for t in x]

    hi, lo = ref_grads(torch.float32), ref_grads(dtype)
    fns = variants(q, k, v, do, causal, window, d)
    out = {"bf16-reference": [(a.float() - r).abs().max().item() for a, r in zip(lo, hi)]}
    for name, fn in fns.items():
        if name == "plain":
            continue
        got = fn()
        assert all(torch.isfinite(t).all() for t in got), name
        out[name] = [(a.float() - r).abs().max().item() for a, r in zip(got, hi)]
    print(f"accuracy d{d} causal={causal} window={window} dtype={dtype}: "
          + "  ".join(f"{k} " + "/".join(f"{e:.2e}" for e in v) for k, v in out.items()),
          flush=True)  # fmt: skip
    return out


def main() -> None:
    rows = {"accuracy": [], "speed": []}
    for d in (64, 128):
        for causal in (True, False):
            for dtype in (torch.bfloat16, torch.float16):
                rows["accuracy"].append(dict(d=d, causal=causal, dtype=str(dtype),
                                             err=accuracy(d, causal, dtype=dtype)))  # fmt: skip
    rows["accuracy"].append(dict(d=128, window=(256, 0), err=accuracy(128, True, (256, 0))))
    if sys.argv[1:] == ["accuracy"]:
        return
    cases = [
        (d, 16384 // n, n, 2048 // d, 2048 // d, causal, (-1, -1))
        for d in (128, 64)
        for causal in (True, False)
        for n in ((1024, 2048, 4096, 8192, 16384) if d == 128 else (4096, 8192, 16384))
    ]
    cases += [
        (128, 2, 8192, 32, 8, True, (-1, -1)),
        (128, 1, 16384, 16, 16, True, (4095, 0)),
        (128, 1, 16384, 16, 16, True, (1023, 0)),
        (64, 1, 16384, 32, 32, True, (4095, 0)),
    ]
    torch.manual_seed(0)
    for d, b, n, hq, hk, causal, window in cases:
        q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        fns = variants(q, k, v, do, causal, window, d)
        pairs = n * n * (0.5 if causal else 1.0)
        if window[0] >= 0:
            w = window[0] + 1
            pairs = sum(min(i + 1, w) for i in range(n))
        flops = 2.5 * 4 * b * hq * pairs * d
        res = interleaved_ms(fns, rounds=7)
        rows["speed"].append(dict(d=d, b=b, n=n, hq=hq, hk=hk, causal=causal, window=window,
                                  ms={name: ms for name, (ms, _) in res.items()}))  # fmt: skip
        cells = "  ".join(f"{name} {ms:.3f}ms {flops / ms / 1e9:.0f}TF (±{sp * 100:.0f}%)"
                          for name, (ms, sp) in res.items())  # fmt: skip
        print(f"d{d} b{b} n{n} {hq}/{hk} causal={causal} window={window}: {cells}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "softcap_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
