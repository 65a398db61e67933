"""Sweep the act launch parameters at the benchmark's largest shape (GPU only).

    PYTHONPATH=packages/act/src:shared/src python packages/act/benchmarks/tune.py

Prints ms, GB/s and % of copy bandwidth per variant; the chosen defaults live in act/op.py.
"""

import torch

from kernelkit.act import act
from kernelkit.act import op as act_op
from kernelkit.shared.bench import bench_ms, copy_bandwidth_gbs


def row(label, ms, nbytes):
    gbs = nbytes / ms / 1e6
    print(f"{label:58s} {ms:8.4f} ms {gbs:7.0f} GB/s {100 * gbs / copy_bandwidth_gbs():5.1f}%")


def main():
    x = torch.randn(12, 12, 32768, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    nb = x.numel() * x.element_size()
    print(f"copy bandwidth {copy_bandwidth_gbs():.0f} GB/s; x = {nb / 2**30:.2f} GiB")
    variants = [(False, 16384, 4, 0)] + [
        (True, t, w, bi) for t in (16384, 32768) for w in (8, 16) for bi in (16, 32, 64)
    ]
    for resident, tile, warps, block_i in variants:
        act_op.RESIDENT, act_op.RESIDENT_TILE, act_op.RESIDENT_WARPS = resident, tile, warps
        act_op.RESIDENT_BLOCK_I = block_i
        label = (
            f"resident TILE={tile} warps={warps} BLOCK_I={block_i}"
            if resident
            else "split TILE=16384 warps=4"
        )
        row(f"softmax-2 fwd {label}", bench_ms(lambda: act(x, "softmax", -2)), 2 * nb)
        y = act(x, "softmax", -2)
        row(
            f"softmax-2 bwd {label}",
            bench_ms(lambda y=y: y.backward(dy, retain_graph=True), grad_to_none=[x]),
            3 * nb,
        )
    act_op.RESIDENT, act_op.RESIDENT_TILE, act_op.RESIDENT_WARPS = True, 32768, 16
    act_op.RESIDENT_BLOCK_I = 32
    act_op.SPLIT_TILE, act_op.SPLIT_WARPS, act_op.PROGRAMS_PER_SM = 16384, 4, 8
    # Per-call overhead at the smallest benchmark size (host-bound: the kernel takes ~5 us).
    xs = torch.randn(12, 12, 256, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dys = torch.randn_like(xs)
    ys = act(xs, "silu")
    row("N=256 silu fwd", bench_ms(lambda: act(xs, "silu")), 2 * xs.numel() * 2)
    row(
        "N=256 silu bwd",
        bench_ms(lambda: ys.backward(dys, retain_graph=True), grad_to_none=[xs]),
        3 * xs.numel() * 2,
    )
    row("N=256 torch silu fwd", bench_ms(lambda: torch.nn.functional.silu(xs)), 2 * xs.numel() * 2)
    comp = torch.compile(lambda t: torch.softmax(t, -2), dynamic=False)
    row("torch.compile softmax-2 fwd", bench_ms(lambda: comp(x)), 2 * nb)
    comp1 = torch.compile(lambda t: torch.nn.functional.silu(t))
    row("torch.compile silu fwd", bench_ms(lambda: comp1(x)), 2 * nb)


if __name__ == "__main__":
    main()
