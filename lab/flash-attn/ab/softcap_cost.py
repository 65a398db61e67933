"""Softcap cost at d = 64 and d = 128 (bf16, causal, H = 16, B * N = 16k): ms of the uncapped
call against softcap=50, forward and backward, through the public `flash_attn`.

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/flash-attn/src \\
        python lab/flash-attn/ab/softcap_cost.py
"""

from __future__ import annotations

import torch

from kernelkit.flash_attn import flash_attn
from kernelkit.shared.bench import bench_ms


def fwd_bwd_ms(q, k, v, do, softcap: float) -> tuple[float, float]:
    """(forward ms, backward ms) of causal attention with this softcap."""
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fwd = bench_ms(lambda: flash_attn(q, k, v, causal=True, softcap=softcap))
    o = flash_attn(qg, kg, vg, causal=True, softcap=softcap)
    bwd = bench_ms(lambda: o.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
    return fwd, bwd


def main() -> None:
    for d in (64, 128):
        for n in (8192, 32768):
            b = max(1, 16384 // n)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (
                torch.randn(b, n, 16, d, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(4)
            )
            (f0, b0), (f1, b1) = (fwd_bwd_ms(q, k, v, do, cap) for cap in (0.0, 50.0))
            print(
                f"d{d} B{b} N{n}: fwd {f0:.3f} -> {f1:.3f} ms (x{f1 / f0:.3f}), bwd {b0:.3f} -> "
                f"{b1:.3f} (x{b1 / b0:.3f}), fwd+bwd x{(f1 + b1) / (f0 + b0):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
