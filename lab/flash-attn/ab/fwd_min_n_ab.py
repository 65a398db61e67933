"""Where the Gluon forward starts at d64 (`tables.GLUON_FWD_MIN_N`): the table's config (the
portable forward below the threshold) against the Gluon forward's config for the same call,
with SDPA cuDNN beside them, at 16k tokens (B = 16384 / N, H = 2048 / d), bf16. On an sm_90
GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/fwd_min_n_ab.py \
        [rounds=9] [d=64]

Prints median ms, TFLOP/s and spread per case, and the largest |o| / LSE difference of the
Gluon config from the table's. Writes $OUT/fwd_min_n_ab.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelkit.flash_attn import choose as C
from kernelkit.flash_attn import launch as L
from kernelkit.shared.bench import interleaved_ms

CASES = [(n, c) for c in (False, True) for n in (512, 1024, 2048, 4096, 8192)]


def case(d: int, n: int, causal: bool, rounds: int) -> dict:
    b, h = 16384 // n, 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = d**-0.5
    p = L.forward_problem(q, k, v, causal)
    table, gluon = C.choose_fwd(p), C.gluon_fwd_config(p, why="forced")
    assert L.gluon_fwd.can_implement(p, gluon) is None
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    fns = {
        "table": lambda: L.forward(q, k, v, causal, scale, config=table),
        "gluon": lambda: L.forward(q, k, v, causal, scale, config=gluon),
        "cudnn": cudnn,
    }
    (o1, l1), (o2, l2) = fns["table"](), fns["gluon"]()
    diff = ((o1.float() - o2.float()).abs().max().item(), (l1 - l2).abs().max().item())
    res = interleaved_ms(fns, rounds=rounds)
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    cells = "  ".join(f"{name} {ms:.3f}ms {flops / ms / 1e9:.0f}TF (±{sp * 100:.0f}%)"
                      for name, (ms, sp) in res.items())  # fmt: skip
    print(f"d{d} n{n} causal={causal} table={table.kernel}: {cells}  diff o {diff[0]:.1e}"
          f" lse {diff[1]:.1e}", flush=True)  # fmt: skip
    return dict(d=d, n=n, causal=causal, table=table.kernel, diff=diff,
                ms={name: ms for name, (ms, _) in res.items()})  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    rounds = int(next((a.split("=")[1] for a in argv if a.startswith("rounds=")), "9"))
    d = int(next((a.split("=")[1] for a in argv if a.startswith("d=")), "64"))
    rows = [case(d, n, causal, rounds) for n, causal in CASES]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "fwd_min_n_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
