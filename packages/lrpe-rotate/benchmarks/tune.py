"""Sweep the lrpe-rotate launch parameters at the benchmark's largest shape (GPU only).

    PYTHONPATH=packages/lrpe-rotate/src:packages/act/src:shared/src \
        python packages/lrpe-rotate/benchmarks/tune.py [--quick]

x = (12, 32768, 12, 128) bf16, theta (12, 64). Prints ms, GB/s and % of copy bandwidth (ideal
traffic: fwd 2 transfers, bwd 3, bwd of act none 2) per variant, then torch.compile of the
reference for the spec's ratios. The chosen defaults live in lrpe_rotate/op.py.
"""

import functools
import sys

import torch

from kernelkit.lrpe_rotate import kernels as K
from kernelkit.lrpe_rotate import lrpe_rotate
from kernelkit.lrpe_rotate import op as rot_op
from kernelkit.lrpe_rotate.reference import lrpe_rotate_reference
from kernelkit.shared.bench import bench_ms, copy_bandwidth_gbs, torch_compile

B, N, H, D = 12, 32768, 12, 128


def row(label, ms, nbytes):
    gbs = nbytes / ms / 1e6
    print(f"{label:64s} {ms:8.4f} ms {gbs:7.0f} GB/s {100 * gbs / copy_bandwidth_gbs():5.1f}%")


def inputs():
    x = torch.randn(B, N, H, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    theta = (10000.0 ** (-torch.arange(D // 2, device="cuda") / (D // 2))).repeat(H, 1)
    return x, theta, torch.randn_like(x), x.numel() * x.element_size()


def measure(label, f, x, theta, dy, nb, act="none"):
    """Forward and backward of `f(x, theta)`."""
    row(f"fwd {label}", bench_ms(lambda: f(x, theta)), 2 * nb)
    y = f(x, theta)
    row(
        f"bwd {label}",
        bench_ms(lambda: y.backward(dy, retain_graph=True), grad_to_none=[x, theta]),
        (2 if act == "none" else 3) * nb,
    )


def main():
    quick = "--quick" in sys.argv
    x, theta, dy, nb = inputs()
    print(f"copy bandwidth {copy_bandwidth_gbs():.0f} GB/s; x = {nb / 2**30:.2f} GiB")
    cases = [("none", None), ("silu", None), ("softmax", -1)]
    variants = (
        [(2048, 4, 4)]
        if quick
        else [(2048, 4, 4), (2048, 4, 8), (2048, 8, 4), (4096, 8, 4), (8192, 8, 4)]
    )
    for tile, warps, pps in variants:
        rot_op.TILE, rot_op.NUM_WARPS, rot_op.PROGRAMS_PER_SM = tile, warps, pps
        for a, dim in cases:
            f = functools.partial(lrpe_rotate, offset=0, act=a, dim=dim)
            measure(f"{a}{dim or ''} TILE={tile} warps={warps} pps={pps}", f, x, theta, dy, nb, a)
    rot_op.TILE, rot_op.NUM_WARPS, rot_op.PROGRAMS_PER_SM = variants[0]
    seq_variants = (
        [(2048, 4, 8)]
        if quick
        else [(2048, 4, 8), (1024, 4, 8), (2048, 8, 8), (2048, 4, 16), (4096, 8, 8)]
    )
    for tile, warps, pps in seq_variants:
        rot_op.SEQ_TILE, rot_op.SEQ_WARPS, rot_op.SEQ_PROGRAMS_PER_SM = tile, warps, pps
        f = functools.partial(lrpe_rotate, offset=0, act="softmax", dim=1)
        measure(f"softmax1 SEQ_TILE={tile} warps={warps} pps={pps}", f, x, theta, dy, nb, "softmax")
    rot_op.SEQ_TILE, rot_op.SEQ_WARPS, rot_op.SEQ_PROGRAMS_PER_SM = seq_variants[0]
    # Options the seed does not time: per-batch offsets (cos/sin per row), learnable theta.
    offsets = torch.arange(B, device="cuda") * 1000
    per_batch = functools.partial(lrpe_rotate, offset=offsets, act="silu")
    measure("silu per-batch offsets", per_batch, x, theta, dy, nb, "silu")
    silu = functools.partial(lrpe_rotate, offset=0, act="silu")
    measure("silu learnable theta", silu, x, theta.clone().requires_grad_(), dy, nb, "silu")
    for a, dim in [*cases, ("softmax", 1)]:
        ref = torch_compile(functools.partial(lrpe_rotate_reference, offset=0, act=a, dim=dim))
        measure(f"torch.compile {a}{dim or ''}", ref, x, theta, dy, nb, a)
    print_registers()


def print_registers():
    """Registers / spills of every compiled variant (occupancy is what bounds bytes in flight)."""
    for name in ("rotate_fwd_kernel", "rotate_bwd_kernel", "seq_softmax_fwd_kernel",
                 "seq_softmax_bwd_sums_kernel", "seq_softmax_bwd_apply_kernel"):  # fmt: skip
        for cache in getattr(K, name).device_caches.values():
            for kernel in cache[0].values():
                names = kernel.src.fn.arg_names
                consts = {names[k[0]]: v for k, v in kernel.src.constants.items()}
                consts = {k: v for k, v in consts.items() if k.isupper()}
                regs, spills = getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?")
                print(
                    f"{name:30s} regs={regs} spills={spills} warps={kernel.metadata.num_warps} {consts}"
                )


if __name__ == "__main__":
    main()
