"""Do kernelkit's prepared launches pass the same compiled kernels the same arguments as
Triton's own `kernel[grid]` path? Run in a process without the Triton interpreter (the test
suites run under it), against kernelkit.shared's fake CUDA driver, on CPU tensors:

    python -m kernelkit.shared.launch_check path/to/calls.py:function

`function()` yields callables that run an op's forward and backward (the ops' `use_triton` is
forced on). Every launch of the first pass goes through the prepared launches that the ops'
plans build (and the launch sequences `replay` recorded, for calls that repeat a layout); the
second pass rebuilds the plans with `prepare` replaying through `launcher[grid]` and runs
every host path in full (no recorded sequences). Each launch's compiled kernel must be the same
(the fake driver's handle of Triton's specialisation: a data pointer's 16-byte alignment, say);
tensors are compared by shape, strides, dtype and which tensor of the call they are (numbered by
first use: a replay that passed one tensor for another fails), everything else by value. Prints
OK and the number of launches, or fails.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["main"]


def _calls(spec: str):
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location("_kernelkit_launch_calls", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def _ident(p, seen: dict):
    """A launch argument as compared: a tensor by shape, strides, dtype and its number."""
    import torch

    if not isinstance(p, torch.Tensor):
        return p
    return tuple(p.shape), p.stride(), p.dtype, seen.setdefault(p.data_ptr(), len(seen))


def _run(log, calls, caches) -> list[tuple]:
    for cache in caches:
        cache._plans.clear()
    out = []
    for call in calls():
        log.launches.clear()
        call()
        seen: dict[int, int] = {}  # data pointer -> number of the call's tensor, by first use
        out += [
            (function, *(_ident(p, seen) for p in params))
            for _grid, _stream, function, params in log.launches
        ]
    return out


def main(spec: str) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    from . import replay as sequences
    from . import runtime
    from .fake_driver import fake_cuda

    runtime.use_triton = lambda t: True
    calls = _calls(spec)
    with fake_cuda() as log:  # one fake driver: its compiled fakes log to it in both passes
        list(calls())  # imports the ops (their plan caches) and forces use_triton
        caches = [
            v
            for m in list(sys.modules.values())
            if m is not None and m.__name__.startswith("kernelkit.")
            for v in vars(m).values()
            if isinstance(v, runtime.PlanCache)
        ]
        prepared = _run(log, calls, caches)
        replay = runtime._Replay
        runtime._Launcher.prepare = lambda self, grid, *a, vary=(), **k: replay(
            self, grid, a, k, vary
        )
        sequences.replayed = lambda run, inputs, options, *args: run(sequences.DIRECT, *args)
        triton_path = _run(log, calls, caches)
    if not prepared or len(prepared) != len(triton_path):
        print(f"FAIL: {len(prepared)} prepared launches, {len(triton_path)} through Triton")
        return 1
    for i, (a, b) in enumerate(zip(prepared, triton_path)):
        if a != b:
            print(f"FAIL: launch {i} differs:\n  prepared {a}\n  triton   {b}")
            return 1
    print("OK", len(prepared))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
