"""torch.compile(fullgraph=True) of `lrpe_cosine` on every path a call can take, forward and
backward (dx and d(theta)), against the eager call and the float64 reference:

  * plain CPU tensors without the Triton interpreter (the PyTorch reference; a softmax over
    packed sequences runs through kernelkit-act's op, opaque to torch.compile there), in one
    fresh process (`run_cases_without_interpreter`);
  * on the GPU with Inductor, one case per launch plan (`GPU_CASES`): each case asserts the
    kernels it launches, eager and compiled, and together the cases launch every kernel of
    kernels.py (`test_gpu_cases_cover_every_kernel`, which runs everywhere).
"""

from pathlib import Path

import pytest
import torch

from kernelkit.act import kernels as act_kernels
from kernelkit.lrpe_core import kernels as core_kernels
from kernelkit.lrpe_core.reference import packed_positions
from kernelkit.lrpe_cosine import kernels as K
from kernelkit.lrpe_cosine import lrpe_cosine
from kernelkit.lrpe_cosine.reference import lrpe_cosine_reference
from kernelkit.shared.testing import (
    assert_cases_cover,
    assert_compiled_matches,
    entry_kernels,
    lrpe_position_args,
    run_cases_without_interpreter,
)

# softmax over N: act's chunk-stats kernel and lrpe-core's merges of chunks
FAMILY = entry_kernels(K, act_kernels, core_kernels)


def check(act, dim, where, shape, device, *, backend, x_grad=True, kernels=None, name=""):
    """lrpe_cosine(x, theta (H, D), positions `where`) * 2, d(theta) always, dx if `x_grad`."""
    b, n, heads, d = shape
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 2.0).to(device).requires_grad_(x_grad)
    theta = 10000.0 ** (-torch.arange(d) / d) * (1.0 + 0.5 * torch.rand(heads, d, generator=g))
    theta = theta.to(device).requires_grad_()
    offset, table, cu = lrpe_position_args(where, b, n, device)

    def fn(x, theta, offset, table, cu):
        return lrpe_cosine(x, theta, offset, act, dim, positions=table, cu_seqlens=cu) * 2.0

    def reference(x, theta, offset, table, cu):
        where = table if table is not None else offset
        where = packed_positions(cu, x.shape[1]) if cu is not None else where
        return lrpe_cosine_reference(x, theta, where, act, dim, cu) * 2.0

    assert_compiled_matches(
        fn, [x, theta, offset, table, cu], reference, backend=backend, kernels=kernels,
        family=FAMILY, name=name,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Plain CPU tensors, no interpreter (run in a fresh process)
# ---------------------------------------------------------------------------------------------

CPU_CASES = [  # (act, dim, positions)
    ("silu", None, "int"),
    ("softmax", -1, "int"),
    ("softmax", 1, "int"),
    ("relu", None, "starts"),
    ("none", None, "table"),
    ("sigmoid", None, "packed"),
    ("softmax", 1, "packed"),  # kernelkit-act's softmax over packed sequences: opaque
]


def cpu_compile_cases():
    cpu = torch.device("cpu")
    for act, dim, where in CPU_CASES:
        shape = (1 if where == "packed" else 2, 33, 3, 16)
        check(act, dim, where, shape, cpu, backend="inductor", name=f"{act} {dim} {where}")


def test_torch_compile_on_cpu_without_interpreter():
    run_cases_without_interpreter(Path(__file__), "cpu_compile_cases")


# ---------------------------------------------------------------------------------------------
# GPU: one case per launch plan (kernels.py), Inductor
# ---------------------------------------------------------------------------------------------

MAIN = {"cosine_fwd_kernel", "cosine_bwd_kernel"}  # element-wise acts, softmax over D
SEQ = {
    "softmax_chunk_stats_kernel",  # kernelkit-act
    "merge_chunk_stats_kernel",  # kernelkit-lrpe-core (these shapes have several chunks)
    "cosine_fwd_kernel",
    "cosine_bwd_seq_sums_kernel",
    "merge_chunk_sums_kernel",  # kernelkit-lrpe-core
    "cosine_bwd_kernel",
}
# x frozen: the sums kernel alone (its sums are not merged: no main kernel reads them)
SEQ_DTHETA_ONLY = SEQ - {"cosine_bwd_kernel", "merge_chunk_sums_kernel"}
# N <= lrpe-core's ONE_PASS_MAX_N: the stats in one chunk, no merge (the backward's sums still
# come in chunks and are merged)
SEQ_ONE_PASS = SEQ - {"merge_chunk_stats_kernel"}

# id -> (act, dim, positions, shape, x requires grad, kernels launched)
GPU_CASES = {
    "tile-silu": ("silu", None, "int", (2, 4096, 16, 64), True, MAIN),
    "tile-softmax-d": ("softmax", -1, "int", (8, 1000, 8, 64), True, MAIN),
    "tile-frozen-x": ("relu", None, "int", (2, 2048, 8, 128), False, MAIN),
    "small-tile-starts": ("sigmoid", None, "starts", (3, 2048, 8, 64), True, MAIN),
    "small-tile-table": ("none", None, "table", (2, 1500, 8, 64), True, MAIN),
    "small-tile-packed": ("silu", None, "packed", (1, 4096, 8, 64), True, MAIN),
    "seq": ("softmax", 1, "int", (2, 4096, 8, 64), True, SEQ),
    "seq-dtheta-only": ("softmax", 1, "int", (2, 4096, 8, 64), False, SEQ_DTHETA_ONLY),
    "seq-one-pass": ("softmax", 1, "int", (1, 256, 32, 128), True, SEQ_ONE_PASS),
    "seq-packed": ("softmax", 1, "packed", (1, 8192, 8, 64), True, SEQ),
}


def test_gpu_cases_cover_every_kernel():
    """A kernel added to kernels.py (a new plan) needs a GPU case that launches it."""
    assert_cases_cover([case[-1] for case in GPU_CASES.values()], entry_kernels(K), FAMILY)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_torch_compile_each_plan_gpu(case, device):
    act, dim, where, shape, x_grad, kernels = GPU_CASES[case]
    check(act, dim, where, shape, device, backend="inductor", x_grad=x_grad, kernels=kernels,
          name=case)  # fmt: skip
