"""A/B of Gluon forward modules: the shipped `kernelkit.flash_attn.gluon.fwd` against other
versions of that file (variants with module-level switches, e.g. a row sum by a second wgmma),
each loaded as a sibling module and swapped in as `launch.gluon_fwd` around its calls; the
chooser's config for each case. On an sm_90 GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/gluon_fwd_module_ab.py \
        name=/path/variant.py ... [speed|accuracy|both|warm] [cases=d64|d128|all] [rounds=5]
        [only=name]

accuracy: max error of o and the LSE against a float32 reference at (2, 2048, 4, d), causal or
not, softcap 30 or not, bf16 and fp16 (the PyTorch reference in the input dtype beside it), and
every value finite. speed: median ms and TFLOP/s over interleaved rounds. warm: one call of
each case (with only=: of that module), to fill Triton's cache from parallel processes before
a timed run. Writes $OUT/gluon_fwd_module_ab.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from gluon_bwd_module_ab import (  # (this folder is on sys.path when run as a script)
    OPTIONS,
    load,
    option,
    visible_pairs,
    warm,
)

from kernelkit.flash_attn import choose as C
from kernelkit.flash_attn import launch as L
from kernelkit.flash_attn.reference import attention_reference
from kernelkit.shared.bench import interleaved_ms


def modules(argv) -> dict:
    mods = {"shipped": L.gluon_fwd}
    for a in argv:
        if "=" in a and a.split("=")[0] not in OPTIONS:
            name, path = a.split("=", 1)
            mods[name] = load(name, path)
    return mods


def forward_fns(mods, q, k, v, causal, window, cap):
    p = L.forward_problem(q, k, v, causal, cap, window)
    cfg = C.choose_fwd(p)
    scale = q.shape[-1] ** -0.5

    def run(mod):
        def fn():
            L.gluon_fwd = mod
            try:
                return L.forward(q, k, v, causal, scale, softcap=cap, window=window, config=cfg)
            finally:
                L.gluon_fwd = mods["shipped"]

        return fn

    return {name: run(mod) for name, mod in mods.items()}, cfg


def accuracy(mods, d, causal, cap, dtype):
    torch.manual_seed(1)
    b, n, h = 2, 2048, 4
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dtype) * 2 for _ in range(3))
    ref32 = attention_reference(*(t.float() for t in (q, k, v)), causal=causal, softcap=cap)
    ref = attention_reference(q, k, v, causal=causal, softcap=cap)
    out = {"reference": [(ref.float() - ref32).abs().max().item(), 0.0]}
    fns, _ = forward_fns(mods, q, k, v, causal, (-1, -1), cap)
    lse0 = None
    for name, fn in fns.items():
        o, lse = fn()
        assert torch.isfinite(o).all() and torch.isfinite(lse).all(), name
        lse0 = lse if lse0 is None else lse0
        out[name] = [(o.float() - ref32).abs().max().item(), (lse - lse0).abs().max().item()]
    print(
        f"accuracy d{d} causal={causal} cap={cap} {dtype}: o err / lse diff to shipped: "
        + "  ".join(f"{k} {e[0]:.2e}/{e[1]:.1e}" for k, e in out.items()),
        flush=True,
    )
    return out


CASES = {  # (d, b, n, heads, causal, window, softcap)
    "d64": [(64, 16384 // n, n, 32, c, (-1, -1), 0.0) for n in (4096, 16384) for c in (True, False)]
    + [(64, 1, 16384, 32, True, (-1, -1), 30.0), (64, 1, 16384, 32, True, (1023, 0), 0.0)],
    "d128": [(128, 16384 // n, n, 16, c, (-1, -1), 0.0) for n in (4096, 16384)
             for c in (True, False)]
    + [(128, 1, 16384, 16, True, (1023, 0), 0.0)],
}  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    mods = modules(argv)
    mode = next((a for a in argv if a in ("speed", "accuracy", "both", "warm")), "both")
    which, only = option(argv, "cases", "all"), option(argv, "only", None)
    rounds = int(option(argv, "rounds", "5"))
    rows = {"accuracy": [], "speed": []}
    if mode in ("accuracy", "both"):
        for d in (64, 128):
            for causal in (True, False):
                for cap in (0.0, 30.0):
                    for dtype in (torch.bfloat16, torch.float16):
                        err = accuracy(mods, d, causal, cap, dtype)
                        rows["accuracy"].append(dict(d=d, causal=causal, cap=cap,
                                                     dtype=str(dtype), err=err))  # fmt: skip
    cases = [c for name, cs in CASES.items() if which in (name, "all") for c in cs]
    for d, b, n, h, causal, window, cap in cases if mode in ("speed", "both", "warm") else []:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fns, cfg = forward_fns(mods, q, k, v, causal, window, cap)
        if mode == "warm":
            warm(fns, only)
            continue
        flops = 4 * b * h * visible_pairs(n, causal, window) * d
        res = interleaved_ms(fns, rounds=rounds)
        rows["speed"].append(dict(d=d, b=b, n=n, h=h, causal=causal, window=window, cap=cap,
                                  cfg=str(cfg), ms={k: ms for k, (ms, _) in res.items()}))  # fmt: skip
        cells = "  ".join(f"{k} {ms:.3f}ms {flops / ms / 1e9:.0f}TF (±{sp * 100:.0f}%)"
                          for k, (ms, sp) in res.items())  # fmt: skip
        print(f"d{d} b{b} n{n} h{h} causal={causal} window={window} cap={cap}: {cells}", flush=True)
    if mode == "warm":
        return
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon_fwd_module_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
