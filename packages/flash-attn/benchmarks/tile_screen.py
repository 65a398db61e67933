"""Registers, spills and shared memory of the portable kernels' tiles compiled for sm_90a,
without a GPU: the launches of configs built from a `Plan` (one tile per kernel) are recorded,
not run, on CPU tensors as on an H100 (`config.H100`), specialised exactly as Triton's launcher
would (argument divisibility included), compiled with Triton's own toolchain for
`GPUTarget("cuda", 90, 32)` and read back with `cuobjdump --dump-resource-usage`. `Plan` and
`plan_configs` are what the tuning tools (tune.py) time.

    python packages/flash-attn/benchmarks/tune.py --flash-table --screen   # uses this

Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kernelkit.flash_attn.choose import portable_bwd_config, portable_fwd_config, table_tiles
from kernelkit.flash_attn.config import H100, Problem, Target, Tile, Varlen
from kernelkit.flash_attn.launch import _backward, _forward
from kernelkit.shared.replay import Probe

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@dataclass(frozen=True)
class Plan:
    """One tile per portable kernel (forward, dk/dv, dq): what the tables hold and the tuning
    tools compare."""

    fwd: Tile
    dkdv: Tile
    dq: Tile


def table_plan(d: int, causal: bool, dtype: torch.dtype, target: Target = H100) -> Plan:
    """The tables' portable tiles for head dim d, causal or not, dtype (dense, no window)."""
    q = torch.empty(1, 128, 1, d, dtype=dtype, device="meta")
    return Plan(*table_tiles(Problem.of(q, q, q, causal, target=target)))


def plan_configs(p: Problem, plan: Plan):
    """(FwdConfig, BwdConfig) running the portable kernels with the plan's tiles on problem p
    (a backward problem: `launch.backward_problem`)."""
    return portable_fwd_config(p, plan.fwd), portable_bwd_config(p, plan.dkdv, plan.dq)


def captured_launches(d, dtype, causal, plan, n=256, b=1, h=1, varlen=False):
    """The (kernel, args, kwargs) of one forward and one backward with `plan` on CPU tensors of
    shape (b, n, h, d), as on an H100: the strides and sizes the suite-2 shapes give (B = H = 1).
    varlen: the same b sequences packed into (b * n, h, d) (the VARLEN specialisation)."""
    q, k, v, do = (torch.randn(b, n, h, d, dtype=dtype) for _ in range(4))
    packed = None
    if varlen:
        q, k, v, do = (t.flatten(0, 1) for t in (q, k, v, do))
        cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
        packed = Varlen(cu, cu, n, n)
    scale = 1.0 / math.sqrt(d)
    p = Problem.of(q, k, v, causal, varlen=packed, do=do, target=H100)
    fwd_cfg, bwd_cfg = plan_configs(p, plan)
    fwd, bwd = Probe(), Probe()
    o, lse = _forward(fwd, q, k, v, causal, scale, 0.0, (-1, -1), packed, fwd_cfg, H100)
    _backward(bwd, do, q, k, v, o, lse, None, causal, scale, 0.0, (-1, -1), packed, True,
              bwd_cfg, H100)  # fmt: skip
    return [(kernel, args, kwargs) for kernel, _, args, kwargs in fwd.launches + bwd.launches]


def resource_usage(kernel, args, kwargs) -> dict:
    """{"regs", "stack" (spill bytes), "smem" (KB, dynamic + static)} of one launch for sm_90a."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    source = ASTSource
    if kernel.is_gluon():  # (Gluon kernels start at TTGIR)
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource
    compiled = triton.compile(
        source(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__
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
