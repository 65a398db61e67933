"""How a kernelkit op is registered with torch.library and how its kernels are launched.

On a GPU an op is a `torch.library.triton_op`: torch.compile traces into it and sees the Triton
kernels (`wrap_triton`). Under the Triton interpreter (`TRITON_INTERPRET=1`, CPU-only machines)
`triton_op` cannot wrap interpreted kernels, so the same function is registered as a
`custom_op` whose fake implementation is the function itself with kernel launches skipped.
Either way one Python function is the implementation, the fake and the traced body.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["define_op", "interpreting", "launch", "use_triton"]


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (decided before kernels are imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Whether tensors on this device run the Triton kernels (else the PyTorch reference)."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())


def _as_float32_storage(t: torch.Tensor):
    """A float32 twin of bf16 tensor `t` with the same strides and offset over a float32 copy of
    its whole storage, and a callback that writes the twin's storage back (rounding in torch)."""
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
    flat32 = flat.float()
    twin = flat32.as_strided(t.size(), t.stride(), t.storage_offset())
    return twin, lambda: flat.copy_(flat32)


class _InterpretedLauncher:
    """`kernel[grid](...)` for the interpreter.

    * Does nothing on fake tensors (shape propagation only).
    * bfloat16 tensors are handed to the kernel as float32 twins: the interpreter's bf16
      arithmetic and float32 -> bf16 stores do not round like the GPU, so the kernel runs in
      float32 and torch rounds the results once, to nearest-even, as the GPU's store does.
    """

    def __init__(self, kernel):
        self._kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if any(isinstance(a, FakeTensor) for a in (*args, *kwargs.values())):
                return None
            write_back = []

            def shim(a):
                if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16:
                    twin, back = _as_float32_storage(a)
                    write_back.append(back)
                    return twin
                return a

            args = [shim(a) for a in args]
            kwargs = {k: shim(v) for k, v in kwargs.items()}
            result = self._kernel[grid](*args, **kwargs)
            for back in write_back:
                back()
            return result

        return run


def launch(kernel):
    """Wrap a @triton.jit kernel for launching from inside a registered op."""
    if interpreting():
        return _InterpretedLauncher(kernel)
    return torch.library.wrap_triton(kernel)


def define_op(qualname: str, *, mutates_args: Iterable[str] = ()) -> Callable:
    """Decorator: register `fn` as the op `qualname` ("namespace::name")."""
    mutates_args = tuple(mutates_args)

    def register(fn):
        if interpreting():
            op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
            op.register_fake(fn)
            return op
        return torch.library.triton_op(qualname, mutates_args=mutates_args)(fn)

    return register
