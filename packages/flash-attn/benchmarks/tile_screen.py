"""Registers, spills and shared memory of flash-attn launch plans compiled for sm_90a, without a
GPU: the op's launches are captured (not run) on CPU tensors, specialised exactly as Triton's
launcher would (argument divisibility included), compiled with Triton's own toolchain for
`GPUTarget("cuda", 90, 32)` and read back with `cuobjdump --dump-resource-usage`.

    python packages/flash-attn/benchmarks/tune.py --flash-table --screen   # uses this

Run without TRITON_INTERPRET (the GPU tiles are chosen only outside the interpreter).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kernelkit.flash_attn import launchers as fa_launchers
from kernelkit.flash_attn import plans as fa_plans
from kernelkit.shared import runtime

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


_calls: list = []


class _Capture:
    """Stands in for kernelkit.shared.runtime.launch: records (kernel, args, kwargs)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _calls.append((self.kernel, args, kwargs))


def captured_launches(d, dtype, causal, plan, n=256, b=1, h=1, varlen=False):
    """The (kernel, args, kwargs) of one forward and one backward with `plan` on CPU tensors of
    shape (b, n, h, d): the strides and sizes the suite-2 shapes give (B = H = 1). varlen: the
    same b sequences packed into (b * n, h, d) (the VARLEN specialisation)."""
    launch, use_tma = runtime.launch, fa_plans.use_tma
    runtime.launch, fa_plans.use_tma = (
        _Capture,
        lambda *t: True,
    )  # TMA tiles compile as on Hopper
    _calls.clear()
    try:
        q, k, v, do = (torch.randn(b, n, h, d, dtype=dtype) for _ in range(4))
        packed = None
        if varlen:
            q, k, v, do = (t.flatten(0, 1) for t in (q, k, v, do))
            cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
            packed = fa_launchers.Varlen(cu, cu, n, n)
        scale = 1.0 / math.sqrt(d)
        o, lse = fa_launchers.forward(q, k, v, causal, scale, plan, varlen=packed)
        fa_launchers.backward(do, q, k, v, o, lse, None, causal, scale, plan, varlen=packed)
        return list(_calls)
    finally:
        runtime.launch, fa_plans.use_tma = launch, use_tma


def resource_usage(kernel, args, kwargs) -> dict:
    """{"regs", "stack" (spill bytes), "smem" (KB, dynamic + static)} of one launch for sm_90a."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    usage = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", out))
    return {
        "regs": int(usage.get("REG", -1)),
        "stack": int(usage.get("STACK", -1)),
        "smem": (int(usage.get("SHARED", 0)) + compiled.metadata.shared) / 1024,
    }


KERNEL_OF = {"fwd": "attn_fwd_kernel", "dkdv": "attn_bwd_dkdv_kernel", "dq": "attn_bwd_dq_kernel"}


def screen_plan(d, dtype, causal, plan, kinds=("fwd", "dkdv", "dq"), n=256, varlen=False) -> dict:
    """{kind: resource_usage} of the plan's kernels of the given kinds (n not a multiple of the
    tiles: the ragged-length kernels; varlen: the packed ones)."""
    launches = captured_launches(d, dtype, causal, plan, n=n, varlen=varlen)
    calls = {k.fn.__name__: (k, a, kw) for k, a, kw in launches}
    return {kind: resource_usage(*calls[KERNEL_OF[kind]]) for kind in kinds}
