"""Session 40: the forward with capped scores shifted by one fixed value (`FwdConfig.fixed_shift`,
`Scores.row_shift`) against each row's running maximum, Gluon (d64 / d128, causal, windows)
and portable (a packed batch) kernels, bf16, softcap 30 and 50 (Gemma 2). On an sm_90 GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/fixed_shift_ab.py

Per case: the largest difference of o and lse between the two (the same weights up to
rounding), each one's error against a float32 reference where the shape is small enough, and
the median ms of 7 interleaved rounds with the spread, beside the uncapped kernel's.
"""

from __future__ import annotations

import dataclasses

import torch

from kernelkit.flash_attn import choose as C
from kernelkit.flash_attn import launch as L
from kernelkit.flash_attn.config import Varlen
from kernelkit.shared.bench import interleaved_ms

CASES = [  # d, b, n, heads, causal, window, softcap
    (64, 1, 16384, 32, True, (-1, -1), 30.0),
    (128, 1, 16384, 16, True, (-1, -1), 30.0),
    (128, 1, 16384, 16, False, (-1, -1), 30.0),
    (64, 1, 16384, 32, True, (1023, 0), 30.0),
    (128, 1, 16384, 16, True, (1023, 0), 30.0),
    (128, 1, 16384, 16, True, (4095, 0), 30.0),
    (64, 1, 16384, 32, True, (4095, 0), 30.0),
    (128, 1, 16384, 16, True, (-1, -1), 50.0),
    (64, 1, 16384, 32, True, (-1, -1), 50.0),
    (128, 4, 4096, 16, True, (-1, -1), 30.0),
]


def case(d, b, n, h, causal, window, cap, packed=False):
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = d**-0.5
    varlen = None
    if packed:  # b sequences of n rows, packed
        q, k, v = (t.reshape(b * n, h, d) for t in (q, k, v))
        cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device="cuda")
        varlen = Varlen(cu, cu, n, n)
    win = window
    p = L.forward_problem(q, k, v, causal, cap, win, varlen)
    chosen = C.choose_fwd(p)
    off = dataclasses.replace(chosen, fixed_shift=False)

    def run(cfg, c=cap):
        return lambda: L.forward(q, k, v, causal, scale, softcap=c, window=win, varlen=varlen,
                                 config=cfg)  # fmt: skip

    plain = C.choose_fwd(L.forward_problem(q, k, v, causal, 0.0, win, varlen))
    o1, l1 = run(chosen)()
    o0, l0 = run(off)()
    fins = bool(torch.isfinite(o1).all() and torch.isfinite(l1).all())
    do = (o1.float() - o0.float()).abs().max().item()
    dl = (l1 - l0).abs().max().item()
    res = interleaved_ms({"fixed": run(chosen), "running-max": run(off), "uncapped": run(plain, 0.0)},
                         rounds=7)  # fmt: skip
    cells = "  ".join(f"{k} {ms:.3f}ms (±{sp * 100:.0f}%)" for k, (ms, sp) in res.items())
    print(f"d{d} b{b} n{n} h{h} causal={causal} window={window} softcap={cap} packed={packed} "
          f"[{chosen}] finite {fins} max|do| {do:.2e} max|dlse| {dl:.2e}  {cells}",
          flush=True)  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    for c in CASES:
        case(*c)
    case(128, 4, 4096, 16, True, (-1, -1), 30.0, packed=True)
    case(64, 4, 4096, 16, True, (-1, -1), 30.0, packed=True)


if __name__ == "__main__":
    main()
