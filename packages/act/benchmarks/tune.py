"""Sweep the act launch parameters at the benchmark's largest shape (GPU only).

    PYTHONPATH=packages/act/src:shared/src python packages/act/benchmarks/tune.py

Prints ms, GB/s and % of copy bandwidth per variant; the chosen defaults live in act/op.py.
"""

import itertools

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
    for block, warps in itertools.product([1024, 2048, 4096, 8192], [4, 8]):
        act_op.ELEMENTWISE_BLOCK, act_op.ELEMENTWISE_WARPS = block, warps
        row(f"silu fwd BLOCK={block} warps={warps}", bench_ms(lambda: act(x, "silu")), 2 * nb)
        y = act(x, "silu")
        row(
            f"silu bwd BLOCK={block} warps={warps}",
            bench_ms(lambda y=y: y.backward(dy, retain_graph=True), grad_to_none=[x]),
            3 * nb,
        )
    act_op.ELEMENTWISE_BLOCK, act_op.ELEMENTWISE_WARPS = 4096, 8
    for tile in [2048, 4096, 8192, 16384]:
        act_op.TILE = tile
        row(f"softmax-1 fwd TILE={tile}", bench_ms(lambda: act(x, "softmax", -1)), 2 * nb)
        y = act(x, "softmax", -1)
        row(
            f"softmax-1 bwd TILE={tile}",
            bench_ms(lambda y=y: y.backward(dy, retain_graph=True), grad_to_none=[x]),
            3 * nb,
        )
    for tile, warps, pps in itertools.product([4096, 8192, 16384], [4, 8], [4, 8, 16]):
        act_op.TILE, act_op.SPLIT_WARPS, act_op.PROGRAMS_PER_SM = tile, warps, pps
        row(
            f"softmax-2 fwd TILE={tile} warps={warps} pps={pps}",
            bench_ms(lambda: act(x, "softmax", -2)),
            2 * nb,
        )
        y = act(x, "softmax", -2)
        row(
            f"softmax-2 bwd TILE={tile} warps={warps} pps={pps}",
            bench_ms(lambda y=y: y.backward(dy, retain_graph=True), grad_to_none=[x]),
            3 * nb,
        )
    comp = torch.compile(lambda t: torch.softmax(t, -2))
    row("torch.compile softmax-2 fwd", bench_ms(lambda: comp(x)), 2 * nb)
    comp1 = torch.compile(lambda t: torch.nn.functional.silu(t))
    row("torch.compile silu fwd", bench_ms(lambda: comp1(x)), 2 * nb)


if __name__ == "__main__":
    main()
