"""Run by test_launch_switch.py in a fresh process (kernelkit.shared reads the launch switch,
$KERNELKIT_TRITON_LAUNCH, once, when it is imported):

    python launch_switch_run.py MODE OUT [--triton-version V] [--break-internals]

MODE "interpret": under TRITON_INTERPRET=1, the real kernels on CPU tensors; the results are
saved to OUT (torch.save). MODE "fake": without the interpreter, against kernelkit.shared's fake
CUDA driver (the GPU launch path on CPU: nothing computes, every launch is recorded); the
launches go to OUT as JSON. Both run the same calls: `runtime.launch(kernel)[grid]`, a prepared
launch, an op of `define_op` (eager and through the dispatcher), a sequence recorded and
replayed by `replay.replayed`, and act's ops forward and backward. Prints one JSON line: the
switch as kernelkit read it, the warnings its import gave, which launcher ran (`_run` calls of
Triton's own path and of the direct one), how often Triton's `kernel.run` was called and (fake
mode) what took a launch on fake tensors (wrap_triton's wrapper, as in a traced op body).

--triton-version V: triton.__version__ is V before kernelkit is imported (another Triton).
--break-internals: a Triton internal the direct path needs is removed before kernelkit is
imported.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import triton
import triton.language as tl


@triton.jit
def axpb_kernel(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(y_ptr + offs, (x * a + 1.0).to(y_ptr.dtype.element_ty), mask=mask)


BLOCK = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["interpret", "fake"])
    parser.add_argument("out")
    parser.add_argument("--triton-version")
    parser.add_argument("--break-internals", action="store_true")
    args = parser.parse_args()
    assert (os.environ.get("TRITON_INTERPRET") == "1") == (args.mode == "interpret")
    if args.triton_version:
        triton.__version__ = args.triton_version
    if args.break_internals:
        from triton.backends.nvidia import driver

        del driver._BASE_ARGS_FORMAT
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from kernelkit.shared import fast_launch, replay, runtime
    from kernelkit.shared.triton_launch import TritonLauncher

    calls = {"triton": 0, "direct": 0, "kernel.run": 0}

    def counted(cls, name):
        run = cls._run

        def _run(self, grid, *a, **k):
            calls[name] += 1
            return run(self, grid, *a, **k)

        cls._run = _run

    counted(TritonLauncher, "triton")
    counted(fast_launch._Launcher, "direct")  # its own _run (it does not call Triton's)
    kernel_cls = type(axpb_kernel)
    kernel_run = kernel_cls.run

    def run_counted(self, *a, **k):
        if not k.get("warmup"):
            calls["kernel.run"] += 1
        return kernel_run(self, *a, **k)

    kernel_cls.run = run_counted

    if args.mode == "fake":
        from kernelkit.shared.fake_driver import fake_cuda

        runtime.use_triton = lambda t: True  # CPU tensors take the Triton path (before act)
        with fake_cuda() as log:
            run_calls(runtime, replay)
            n_launches = len(log.launches)
            traced = traced_launch(runtime)
        assert len(log.launches) == n_launches  # a traced launch launches nothing
        handles = {c.function: c.key for c in log.compiled}
        ids: dict[int, int] = {}  # data pointer -> tensor number, by first use

        def ident(p):
            if isinstance(p, torch.Tensor):
                n = ids.setdefault(p.data_ptr(), len(ids))
                return ["tensor", list(p.shape), list(p.stride()), str(p.dtype), n]
            return repr(p)

        launches = [
            [list(grid), str(handles[function]), [ident(p) for p in params]]
            for grid, _stream, function, params in log.launches
        ]
        with open(args.out, "w") as f:
            json.dump(launches, f)
    else:
        torch.save(run_calls(runtime, replay), args.out)
        n_launches = traced = None
    print(
        json.dumps(
            {
                "direct_launch": runtime.DIRECT_LAUNCH,
                "disabled_because": fast_launch.DISABLED_BECAUSE,
                "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
                "calls": calls,
                "launches": n_launches,
                "traced": traced,
            }
        )
    )


def traced_launch(runtime) -> str:
    """A launch on fake tensors (what a traced op body does): it goes through wrap_triton;
    returns the class name of what took it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(300)
        y = torch.empty_like(x)
        launcher = runtime.launch(axpb_kernel)
        launcher[(5,)](x_ptr=x, y_ptr=y, n=300, a=2.0, BLOCK=BLOCK)
    return type(launcher._wrapped).__name__


def run_calls(runtime, replay) -> dict[str, torch.Tensor]:
    """Every call, three times with the same layout (later ones take the cached paths; a
    replayed sequence runs its launches directly from its third call on)."""
    from kernelkit.act import act

    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, generator=g)
    xb = torch.randn(2, 40, 3, 16, generator=g).bfloat16()
    grid = (runtime.cdiv(x.numel(), BLOCK),)

    @runtime.define_op("kernelkit_launch_switch::axpb")
    def axpb(t: torch.Tensor, a: float) -> torch.Tensor:
        y = torch.empty_like(t)
        n = t.numel()
        runtime.launch(axpb_kernel)[(runtime.cdiv(n, BLOCK),)](
            x_ptr=t, y_ptr=y, n=n, a=a, BLOCK=BLOCK
        )
        return y

    def chain(ops, t):
        y = ops.empty(t.shape, t.dtype, t.device)
        z = ops.empty(t.shape, t.dtype, t.device)
        n = t.numel()
        ops.launch(axpb_kernel, (runtime.cdiv(n, BLOCK),), x_ptr=t, y_ptr=y, n=n, a=2.0,
                   BLOCK=BLOCK)  # fmt: skip
        ops.launch(axpb_kernel, (runtime.cdiv(n, BLOCK),), x_ptr=y, y_ptr=z, n=n, a=-0.5,
                   BLOCK=BLOCK)  # fmt: skip
        return (z,)

    for i in range(3):
        y = torch.empty_like(x)
        runtime.launch(axpb_kernel)[grid](x_ptr=x, y_ptr=y, n=x.numel(), a=3.0, BLOCK=BLOCK)
        out[f"launch {i}"] = y
        y = torch.empty_like(x)
        prepared = runtime.launch(axpb_kernel).prepare(
            grid, x_ptr=x, y_ptr=y, n=x.numel(), a=-1.5, BLOCK=BLOCK
        )
        y2 = torch.empty_like(x)
        prepared(x * 2, y2)
        out[f"prepared {i}"] = y2
        out[f"op {i}"] = axpb(x, 0.25)
        out[f"op dispatcher {i}"] = axpb.op(xb, 0.25)
        (out[f"replayed {i}"],) = replay.replayed(chain, (x,), None, x)
        (out[f"replayed bf16 {i}"],) = replay.replayed(chain, (xb,), None, xb)
        for a, dim in (("silu", None), ("softmax", 1), ("softmax", -1)):
            xg = xb.detach().requires_grad_()
            y = act(xg, a, dim)
            y.backward(torch.ones_like(y) * 0.5 + y.detach())
            out[f"act {a} {dim} {i}"] = y.detach()
            out[f"act {a} {dim} grad {i}"] = xg.grad
    return out


if __name__ == "__main__":
    main()
