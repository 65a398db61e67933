"""Sweep the act launch parameters at the benchmark's largest shape (GPU only).

    PYTHONPATH=packages/act/src:shared/src python packages/act/benchmarks/tune.py

Prints ms, GB/s and % of copy bandwidth per variant; the chosen defaults live in act/launchers.py
(plans are cached per layout: each variant clears the cache, or it would time the first plan).
"""

import torch

from kernelkit.act import act
from kernelkit.act import launchers as act_launchers
from kernelkit.shared.bench import bench_ms, copy_bandwidth_gbs


def row(label, ms, nbytes):
    gbs = nbytes / ms / 1e6
    print(f"{label:58s} {ms:8.4f} ms {gbs:7.0f} GB/s {100 * gbs / copy_bandwidth_gbs():5.1f}%")


def main():
    x = torch.randn(12, 12, 32768, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    nb = x.numel() * x.element_size()
    print(f"copy bandwidth {copy_bandwidth_gbs():.0f} GB/s; x = {nb / 2**30:.2f} GiB")
    for tile, warps in ((8192, 4), (16384, 4), (32768, 8)):
        act_launchers.SPLIT_TILE, act_launchers.SPLIT_WARPS = tile, warps
        act_launchers._PLANS._plans.clear()
        row(
            f"softmax-2 fwd split TILE={tile} warps={warps}",
            bench_ms(lambda: act(x, "softmax", -2)),
            2 * nb,
        )
        y = act(x, "softmax", -2)
        row(
            f"softmax-2 bwd split TILE={tile} warps={warps}",
            bench_ms(lambda y=y: y.backward(dy, retain_graph=True), grad_to_none=[x]),
            3 * nb,
        )
    act_launchers.SPLIT_TILE, act_launchers.SPLIT_WARPS = 16384, 4
    act_launchers._PLANS._plans.clear()
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
