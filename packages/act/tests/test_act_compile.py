"""torch.compile(fullgraph=True) of `act` on every path a call can take, forward and backward,
against the eager call and the float64 reference:

  * plain CPU tensors without the Triton interpreter (`act` itself takes the PyTorch reference,
    traced inline; a softmax over packed sequences reads cu_seqlens' values and goes through
    the opaque reference ops), in one fresh process (`run_cases_without_interpreter`);
  * on the GPU with Inductor, one case per launch plan (`GPU_CASES`): each case asserts the
    kernels it launches, eager and compiled, and together the cases launch every kernel of
    kernels.py (`test_gpu_cases_cover_every_kernel`, which runs everywhere).
"""

from pathlib import Path

import pytest
import torch

from kernelkit.act import act
from kernelkit.act import kernels as K
from kernelkit.act.launchers import COLS_MAX_L, ROWS_MAX_L
from kernelkit.act.reference import act_reference
from kernelkit.shared.testing import (
    assert_cases_cover,
    assert_compiled_matches,
    entry_kernels,
    packing,
    run_cases_without_interpreter,
)


def make(shape, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def check(a, dim, x, cu=None, *, backend, kernels=None, name=""):
    """act(x, a, dim, cu_seqlens=cu) * 2 compiled vs eager vs the float64 reference."""
    x = x.requires_grad_()
    if cu is None:
        assert_compiled_matches(
            lambda t: act(t, a, dim) * 2.0,
            [x],
            lambda t: act_reference(t, a, dim) * 2.0,
            backend=backend,
            kernels=kernels,
            family=entry_kernels(K),
            name=name,
        )
        return
    assert_compiled_matches(
        lambda t, c: act(t, a, dim, cu_seqlens=c) * 2.0,
        [x, cu],
        lambda t, c: act_reference(t, a, dim, c) * 2.0,
        backend=backend,
        kernels=kernels,
        family=entry_kernels(K),
        name=name,
    )


# ---------------------------------------------------------------------------------------------
# Plain CPU tensors, no interpreter (run in a fresh process)
# ---------------------------------------------------------------------------------------------

CPU_BACKEND = "inductor"


def cpu_compile_cases():
    """Every compiled case on plain CPU tensors: the element-wise acts, softmax over the last, a
    middle and the first dim, and softmax over packed sequences (the opaque reference ops)."""
    cpu = torch.device("cpu")
    x = make((2, 33, 3, 16), torch.float32, cpu)
    for a in ("relu", "sigmoid", "silu"):
        check(a, None, x, backend=CPU_BACKEND, name=a)
    for dim in (-1, 1, 0):
        check("softmax", dim, x, backend=CPU_BACKEND, name=f"softmax dim {dim}")
    packed = make((1, 37, 3, 16), torch.float32, cpu)
    cu = packing([10, 23, 0, 4], cpu)
    check("softmax", 1, packed, cu, backend=CPU_BACKEND, name="packed softmax dim 1")
    check("softmax", -1, make((2, 3, 37), torch.float32, cpu), cu, backend=CPU_BACKEND,
          name="packed softmax dim -1")  # fmt: skip


def test_torch_compile_on_cpu_without_interpreter():
    run_cases_without_interpreter(Path(__file__), "cpu_compile_cases")


# ---------------------------------------------------------------------------------------------
# GPU: one case per launch plan (launchers.py), Inductor
# ---------------------------------------------------------------------------------------------

ELEMENTWISE = {"act_fwd_kernel", "act_bwd_kernel"}
ROWS = {"softmax_fwd_rows_kernel", "softmax_bwd_rows_kernel"}
COLS = {"softmax_fwd_cols_kernel", "softmax_bwd_cols_kernel"}
SPLIT = {
    "softmax_chunk_stats_kernel",
    "softmax_fwd_apply_kernel",
    "softmax_bwd_chunk_sums_kernel",
    "softmax_bwd_apply_kernel",
}


def _sliced(t):
    """Strided, not dense: the element-wise kernels walk a collapsed 4-D layout."""
    return t[:, 1:, ::2]


def _collapse_fails(t):
    """A layout SoftmaxView cannot collapse around dim 2: the plans run on a compact copy."""
    return t.permute(0, 2, 4, 1, 3)[:, ::2, :, :, ::3]


# id -> (act, dim, shape, view of the input, packed lengths or None, kernels launched)
GPU_CASES = {
    "elementwise-flat": ("silu", None, (2, 300, 3, 40), None, None, ELEMENTWISE),
    "elementwise-strided": ("sigmoid", None, (4, 170, 30), _sliced, None, ELEMENTWISE),
    "softmax-rows": ("softmax", -1, (2, 300, 3, 40), None, None, ROWS),
    "softmax-cols": ("softmax", 1, (2, COLS_MAX_L, 4, 64), None, None, COLS),
    "softmax-split-seq": ("softmax", 1, (2, 4096, 4, 64), None, None, SPLIT),
    "softmax-split-long-row": ("softmax", -1, (3, ROWS_MAX_L + 1000), None, None, SPLIT),
    "softmax-packed": ("softmax", 1, (1, 8192, 4, 64), None, [3000, 1, 0, 4000, 1191], SPLIT),
    "softmax-packed-last-dim": ("softmax", -1, (3, 2, 9000), None, [4000, 1, 4999], SPLIT),
    "softmax-copy": ("softmax", 2, (3, 4, 5, 6, 7), _collapse_fails, None, COLS),
}


def test_gpu_cases_cover_every_kernel():
    """A kernel added to kernels.py (a new plan) needs a GPU case that launches it."""
    assert_cases_cover(
        [case[-1] for case in GPU_CASES.values()], entry_kernels(K), entry_kernels(K)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_torch_compile_each_plan_gpu(case, dtype, device):
    a, dim, shape, view, lengths, kernels = GPU_CASES[case]
    x = make(shape, dtype, device)
    x = view(x) if view is not None else x
    cu = packing(lengths, device) if lengths is not None else None
    check(a, dim, x, cu, backend="inductor", kernels=kernels, name=case)


def test_packed_reference_ops_opcheck(device):
    """The packed softmax's reference ops (what `act` runs on CPU tensors without the
    interpreter; torch.compile calls them as they are) agree with their fakes and autograd."""
    from kernelkit.act.op import softmax_packed_grad_reference, softmax_packed_reference

    x = make((1, 37, 3, 16), torch.float32, device).requires_grad_()
    cu = packing([10, 23, 0, 4], device)
    torch.library.opcheck(softmax_packed_reference.op, (x, 1, cu))
    y = softmax_packed_reference(x.detach(), 1, cu)
    dy = make(x.shape, x.dtype, device, seed=3)
    torch.library.opcheck(softmax_packed_grad_reference.op, (y, dy, 1, cu))
