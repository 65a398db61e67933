"""torch.compile(fullgraph=True) of `md_lrpe_cosine` on every path a call can take, forward and
backward (dx and d(theta)), against the eager call and the float64 reference:

  * plain CPU tensors without the Triton interpreter (the PyTorch reference), in one fresh
    process (`run_cases_without_interpreter`);
  * on the GPU with Inductor, one case per launch plan (`GPU_CASES`; the kernels are
    kernelkit-lrpe-cosine's, launched with grid positions): each case asserts the kernels it
    launches, eager and compiled, and together the cases launch every kernel of
    kernelkit.lrpe_cosine.kernels (`test_gpu_cases_cover_every_kernel`, which runs everywhere).
"""

import math
from pathlib import Path

import pytest
import torch

from kernelkit.act import kernels as act_kernels
from kernelkit.lrpe_core import kernels as core_kernels
from kernelkit.lrpe_cosine import kernels as K
from kernelkit.md_lrpe_cosine import md_lrpe_cosine
from kernelkit.md_lrpe_cosine.reference import md_lrpe_cosine_reference
from kernelkit.shared.testing import (
    assert_cases_cover,
    assert_compiled_matches,
    entry_kernels,
    run_cases_without_interpreter,
)

# softmax over N: act's chunk-stats kernel and lrpe-core's merges of chunks
FAMILY = entry_kernels(K, act_kernels, core_kernels)


def check(act, dim, grid, l, b, heads, d, device, *, backend, cache=False, x_grad=True,
          kernels=None, name=""):  # fmt: skip
    """md_lrpe_cosine(x (b, l + prod(grid), heads, d), theta (heads, ceil(d / axes)), grid, l)
    * 2; d(theta) always, dx if `x_grad`."""
    e = -(-d // len(grid))
    g = torch.Generator().manual_seed(0)
    x = torch.randn((b, l + math.prod(grid), heads, d), generator=g) * 2.0
    x = x.to(device).requires_grad_(x_grad)
    theta = 10000.0 ** (-torch.arange(e) / e) * (1.0 + 0.5 * torch.rand(heads, e, generator=g))
    theta = theta.to(device).requires_grad_()
    assert_compiled_matches(
        lambda x, theta: md_lrpe_cosine(x, theta, grid, l, act, dim, cache) * 2.0,
        [x, theta],
        lambda x, theta: md_lrpe_cosine_reference(x, theta, grid, l, act, dim) * 2.0,
        backend=backend,
        kernels=kernels,
        family=FAMILY,
        name=name,
    )


# ---------------------------------------------------------------------------------------------
# Plain CPU tensors, no interpreter (run in a fresh process)
# ---------------------------------------------------------------------------------------------

CPU_CASES = [  # (act, dim, grid, l)
    ("silu", None, (3, 5), 2),
    ("softmax", -1, (4,), 0),
    ("softmax", 1, (3, 5), 2),
    ("relu", None, (2, 3, 2, 2), 1),
]


def cpu_compile_cases():
    cpu = torch.device("cpu")
    for act, dim, grid, l in CPU_CASES:
        check(act, dim, grid, l, 2, 2, 16, cpu, backend="inductor", name=f"{act} {dim} {grid}")


def test_torch_compile_on_cpu_without_interpreter():
    run_cases_without_interpreter(Path(__file__), "cpu_compile_cases")


# ---------------------------------------------------------------------------------------------
# GPU: one case per launch plan, Inductor
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

# id -> (act, dim, grid, l, (B, H, D), angle cache, x requires grad, kernels launched)
GPU_CASES = {
    "grid1-silu": ("silu", None, (4096,), 0, (2, 8, 64), False, True, MAIN),
    "grid2-extra-tokens": ("relu", None, (64, 64), 1, (2, 8, 64), False, True, MAIN),
    "grid3-cache": ("sigmoid", None, (8, 32, 32), 4, (2, 8, 96), True, True, MAIN),
    "grid4-softmax-d": ("softmax", -1, (4, 8, 16, 16), 0, (2, 8, 64), False, True, MAIN),
    "grid2-seq": ("softmax", 1, (64, 64), 1, (2, 8, 64), False, True, SEQ),
    "grid2-seq-cache": ("softmax", 1, (48, 64), 0, (2, 8, 64), True, True, SEQ),
    "grid2-seq-one-pass": ("softmax", 1, (16, 16), 0, (2, 8, 64), False, True, SEQ_ONE_PASS),
    "grid2-dtheta-only": ("softmax", 1, (64, 64), 1, (2, 8, 64), False, False, SEQ_DTHETA_ONLY),
}


def test_gpu_cases_cover_every_kernel():
    """A kernel added to kernelkit-lrpe-cosine's kernels.py (a new plan) needs a GPU case."""
    assert_cases_cover([case[-1] for case in GPU_CASES.values()], entry_kernels(K), FAMILY)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_torch_compile_each_plan_gpu(case, device):
    act, dim, grid, l, (b, heads, d), cache, x_grad, kernels = GPU_CASES[case]
    check(act, dim, grid, l, b, heads, d, device, backend="inductor", cache=cache,
          x_grad=x_grad, kernels=kernels, name=case)  # fmt: skip
