"""PTX and SASS instruction counts of the Gluon backward kernel for sm_90a, built on a CPU (no
GPU): the shipped `gluon/bwd.py` and other versions of it (as in gluon_bwd_module_ab.py), for
one problem, side by side. Session 37 found with it the 16 negations per thread per step that
cost the d64 softcap backward 2%.

    PYTHONPATH=shared/src:packages/flash-attn/src:packages/flash-attn/benchmarks:lab/flash-attn/ab \
        python lab/flash-attn/ab/bwd_op_counts.py 64 30 old=/path/old_bwd.py

Arguments: head dim, softcap (0: none), then name=path modules; causal, bf16, 8k rows (d64) or
4k (d128), the chooser's config (fixed-order dq sums).
"""

from __future__ import annotations

import collections
import math
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from gluon_bwd_module_ab import modules
from tile_screen import TARGET, create_function_from_signature, make_backend
from triton.experimental.gluon._runtime import GluonASTSource

from kernelkit.flash_attn import launch as L
from kernelkit.flash_attn.config import H100
from kernelkit.shared.replay import Probe


def gluon_launch(d: int, softcap: float):
    """(kernel, args, kwargs) of the Gluon backward launch of the problem, as the current
    `launch.gluon_bwd` module makes it."""
    n = 8192 if d == 64 else 4096
    q, k, v, do = (torch.randn(1, n, 2, d, dtype=torch.bfloat16) for _ in range(4))
    o, lse = L._forward(Probe(), q, k, v, True, 1 / math.sqrt(d), softcap, (-1, -1), None, None,
                        H100)  # fmt: skip
    p = L.backward_problem(do, q, k, v, True, softcap, (-1, -1), None, True, H100)
    probe = Probe()
    L._backward(probe, do, q, k, v, o, lse, None, True, 1 / math.sqrt(d), softcap, (-1, -1), None,
                True, L.choose_bwd(p), H100)  # fmt: skip
    return next((kk, a, kw) for kk, _, a, kw in probe.launches
                if kk.fn.__name__.startswith("attn_bwd_gluon"))  # fmt: skip


def op_counts(kernel, args, kwargs) -> tuple[collections.Counter, collections.Counter]:
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    c = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                       options=options.__dict__)  # fmt: skip
    ptx = collections.Counter(re.findall(r"^\s+([a-z][a-z0-9_.]+)", c.asm["ptx"], re.M))
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return ptx, collections.Counter(ops)


def main() -> None:
    d, softcap = int(sys.argv[1]), float(sys.argv[2])
    mods = modules(sys.argv[3:])
    counts = {}
    for name, mod in mods.items():
        L.gluon_bwd = mod
        counts[name] = op_counts(*gluon_launch(d, softcap))
    L.gluon_bwd = mods["new"]
    for i, kind in enumerate(("PTX", "SASS")):
        keys = sorted(set().union(*(c[i] for c in counts.values())))
        rows = [(k, [c[i][k] for c in counts.values()]) for k in keys]
        print(f"{kind} instructions that differ ({' / '.join(counts)}):")
        for k, vals in rows:
            if len(set(vals)) > 1:
                print(f"  {k:24s} " + " / ".join(map(str, vals)))


if __name__ == "__main__":
    main()
