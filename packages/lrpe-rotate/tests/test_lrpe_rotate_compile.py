"""torch.compile(fullgraph=True) of `lrpe_rotate` on every path a call can take, forward and
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
from kernelkit.lrpe_rotate import kernels as K
from kernelkit.lrpe_rotate import lrpe_rotate, seq_softmax
from kernelkit.lrpe_rotate.reference import lrpe_rotate_reference
from kernelkit.shared.testing import (
    assert_cases_cover,
    assert_compiled_matches,
    entry_kernels,
    lrpe_position_args,
    run_cases_without_interpreter,
)

# softmax over N: act's chunk-stats kernel and lrpe-core's merge of its chunks
FAMILY = entry_kernels(K, seq_softmax, act_kernels, core_kernels)


def make(shape, device, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).float().to(device)


def check(act, dim, where, shape, device, *, backend, theta_grad=True, kernels=None, name=""):
    b, n, heads, d = shape
    x = make(shape, device).requires_grad_()
    theta = 0.5 + torch.rand(heads, d // 2, generator=torch.Generator().manual_seed(1))
    theta = (theta * 10000.0 ** (-torch.arange(d // 2) / (d // 2))).to(device)
    theta.requires_grad_(theta_grad)
    offset, table, cu = lrpe_position_args(where, b, n, device)

    def fn(x, theta, offset, table, cu):
        return lrpe_rotate(x, theta, offset, act, dim, positions=table, cu_seqlens=cu) * 2.0

    def reference(x, theta, offset, table, cu):
        where = table if table is not None else offset
        where = packed_positions(cu, x.shape[1]) if cu is not None else where
        return lrpe_rotate_reference(x, theta, where, act, dim, cu) * 2.0

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
    ("sigmoid", None, "table"),
    ("silu", None, "packed"),
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
# GPU: one case per launch plan (kernels.py, seq_softmax.py), Inductor
# ---------------------------------------------------------------------------------------------

ROTATE = {"rotate_fwd_kernel", "rotate_bwd_kernel"}  # int offsets: a program per tile and rows
TOKENS = {"rotate_fwd_tokens_kernel", "rotate_bwd_tokens_kernel"}  # per-token positions
SEQ = {
    "softmax_chunk_stats_kernel",  # kernelkit-act
    "merge_chunk_stats_kernel",  # kernelkit-lrpe-core (these shapes have several chunks)
    "seq_softmax_fwd_kernel",
    "seq_softmax_bwd_sums_kernel",
    "seq_softmax_bwd_apply_kernel",
}
# N <= lrpe-core's ONE_PASS_MAX_N: the stats in one chunk, no merge
SEQ_ONE_PASS = SEQ - {"merge_chunk_stats_kernel"}

# id -> (act, dim, positions, shape, theta requires grad, kernels launched)
GPU_CASES = {
    "rotate-silu": ("silu", None, "int", (2, 4096, 16, 128), True, ROTATE),
    "rotate-softmax-d": ("softmax", -1, "int", (2, 1000, 8, 64), True, ROTATE),
    "rotate-frozen-theta": ("none", None, "int", (4, 2048, 8, 128), False, ROTATE),
    "tokens-starts": ("relu", None, "starts", (3, 2048, 8, 128), True, TOKENS),
    "tokens-table": ("sigmoid", None, "table", (2, 1500, 8, 64), True, TOKENS),
    "tokens-packed": ("silu", None, "packed", (1, 4096, 8, 128), True, TOKENS),
    "seq": ("softmax", 1, "int", (2, 4096, 8, 128), True, SEQ),
    "seq-table": ("softmax", 1, "table", (2, 2000, 4, 64), True, SEQ),
    "seq-one-pass": ("softmax", 1, "int", (1, 256, 32, 128), True, SEQ_ONE_PASS),
    "seq-packed": ("softmax", 1, "packed", (1, 8192, 8, 128), True, SEQ),
}


def test_gpu_cases_cover_every_kernel():
    """A kernel added to kernels.py or seq_softmax.py (a new plan) needs a GPU case that
    launches it."""
    ours = entry_kernels(K, seq_softmax)
    assert_cases_cover([case[-1] for case in GPU_CASES.values()], ours, FAMILY)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_torch_compile_each_plan_gpu(case, device):
    act, dim, where, shape, theta_grad, kernels = GPU_CASES[case]
    check(act, dim, where, shape, device, backend="inductor", theta_grad=theta_grad,
          kernels=kernels, name=case)  # fmt: skip
