"""Test helpers: compare against a float64 evaluation of the reference; CUDA-graph replay.

The rule every kernelkit test applies (FlashAttention's convention, generalised):
  * the relative-norm error ||out - ref64|| / ||ref64|| stays under a per-dtype bound, and
  * for low-precision outputs it is no worse than `factor` times the error of the PyTorch
    reference evaluated in that same dtype (when the test provides that evaluation).
NaN or Inf where the float64 reference is finite always fails.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

__all__ = [
    "DTYPE_BOUND",
    "assert_close",
    "assert_graph_replays",
    "assert_launch_paths_agree",
    "compilations",
    "rel_err",
    "written_arguments",
]

# Relative-norm bounds for a kernel that computes in float32 and rounds once to the output
# dtype: float32 allows a few ulps of transcendental error; low precision allows ~2-4 roundings.
DTYPE_BOUND = {
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.2e-2,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}")
    den = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if den == 0.0:
        return num
    return num / den


def assert_close(
    out: torch.Tensor,
    ref64: torch.Tensor,
    *,
    ref_lowp: torch.Tensor | None = None,
    bound: float | None = None,
    factor: float = 2.0,
    name: str = "output",
) -> float:
    """Assert `out` matches the float64 reference `ref64`; returns the relative error.

    `bound` defaults to DTYPE_BOUND[out.dtype]. `ref_lowp` is the same computation done by the
    PyTorch reference in out.dtype; when given, out's error must also be within `factor` times
    its error (plus float32-level slack so exact cases compare as equal).
    """
    if ref_lowp is not None and out.dtype != ref_lowp.dtype:
        raise AssertionError(
            f"{name}: dtype {out.dtype} != low-precision reference {ref_lowp.dtype}"
        )
    out_f = out.detach().to(torch.float64).cpu()
    ref_f = ref64.detach().to(torch.float64).cpu()
    bad = ~torch.isfinite(out_f) & torch.isfinite(ref_f)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite values, first at {idx}")
    err = rel_err(out_f, ref_f)
    limit = DTYPE_BOUND[out.dtype] if bound is None else bound
    if not err <= limit:
        raise AssertionError(f"{name}: relative error {err:.3e} > bound {limit:.1e} ({out.dtype})")
    if ref_lowp is not None:
        ref_err = rel_err(ref_lowp, ref_f)
        allowed = factor * ref_err + 1e-6
        if not err <= allowed:
            raise AssertionError(
                f"{name}: relative error {err:.3e} > {factor} x PyTorch {out.dtype} error "
                f"{ref_err:.3e}"
            )
    return err


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (tuple, list)) else []


def assert_graph_replays(fn, inputs, new_inputs, *, warmup: int = 2, name: str = "output"):
    """Capture `fn(*inputs)` into a torch.cuda.CUDAGraph and replay it with each of
    `new_inputs` (sequences shaped like `inputs`) copied into the static inputs: every tensor
    `fn` returns must equal, bit for bit, `fn(*new)` run eagerly. `fn` may run a backward
    (e.g. `torch.autograd.grad`); inputs that require grad stay leaves that require grad.

    Warm-up calls run first on a side stream (Triton compiles, plans and caches fill there,
    as a CUDA graph needs: nothing may compile, allocate outside the pool or sync in capture).
    """
    static = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _flat(fn(*static))
    if not outs:
        raise AssertionError(f"{name}: fn returned no tensor")
    for i, new in enumerate(new_inputs):
        with torch.no_grad():
            for s, t in zip(static, new):
                s.copy_(t)
        graph.replay()
        expected = _flat(fn(*[t.detach().clone().requires_grad_(t.requires_grad) for t in new]))
        torch.cuda.synchronize()
        for j, (got, want) in enumerate(zip(outs, expected)):
            if not torch.equal(got, want):
                diff = (got.double() - want.double()).abs().max().item()
                raise AssertionError(
                    f"{name} {j}: replay {i} differs from eager (max abs diff {diff:.3e})"
                )
    return graph


@contextlib.contextmanager
def compilations():
    """Count the Triton kernels compiled inside the block, by kernel name, through Triton's
    public `knobs.runtime.jit_post_compile_hook` (the tests that check that new sizes, offsets
    or shapes reuse the compiled kernels)."""
    import triton

    counts: Counter[str] = Counter()
    knobs = triton.knobs.runtime
    previous = knobs.jit_post_compile_hook

    def hook(*, fn, **kwargs):
        counts[fn.name] += 1
        return previous(fn=fn, **kwargs) if previous is not None else None

    knobs.jit_post_compile_hook = hook
    try:
        yield counts
    finally:
        knobs.jit_post_compile_hook = previous


def written_arguments(kernel, kwargs: dict) -> set[str]:
    """The tensor arguments torch.compile's analysis of a traced launch of `kernel` with
    `kwargs` (every argument by name) finds written, for a Hopper target (no GPU needed).
    Where that analysis fails, torch assumes every tensor is written: traced graphs then copy
    every input before the launch (and some cannot be partitioned); this raises instead."""
    import logging

    import triton
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    from triton.backends.compiler import GPUTarget

    class _Target:  # what the analysis asks the driver
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    failures: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record):
            if "identify_mutated_tensors" in record.getMessage():
                error = record.exc_info[1] if record.exc_info else None
                last = str(error).strip().splitlines()[-1] if error else ""
                failures.append(f"{type(error).__name__}: {last}")

    # torch reports the failure as a warning of its dynamo logger and carries on
    handler, log = _Catch(level=logging.WARNING), logging.getLogger("torch._dynamo")
    driver = triton.runtime.driver
    previous = driver._active  # None until first used (no driver at all on a CPU machine)
    driver.set_active(_Target())
    log.addHandler(handler)
    try:
        written = wrap.identify_mutated_tensors(kernel, dict(kwargs), {})
    finally:
        log.removeHandler(handler)
        driver._active = previous
    if failures:
        raise AssertionError(f"torch could not analyse the launch: {failures[0]}")
    return set(written)


def assert_launch_paths_agree(calls_file, function: str = "launch_calls") -> None:
    """kernelkit.shared.launch_check in a process without the Triton interpreter: the ops'
    prepared launches pass the compiled kernels the same arguments as Triton's own path, for
    the forward/backward calls `function` in `calls_file` yields (a test cannot check this
    in-process: under the interpreter every launch is replayed)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kernelkit.shared.launch_check", f"{calls_file}:{function}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0 or not out.stdout.startswith("OK"):
        raise AssertionError(f"launch paths differ:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")


def run_without_interpreter(code: str, timeout: float = 600) -> str:
    """Run `code` in a fresh Python process without TRITON_INTERPRET (the ops, registered at
    import, then take the CPU fallback path that torch.compile traces as a triton_op); returns
    its stdout, and fails with its stderr's tail if it exits non-zero."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
