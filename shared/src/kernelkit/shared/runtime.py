"""How a kernelkit op is registered with torch.library and how its kernels are launched.

On a GPU an op is a `torch.library.triton_op`: torch.compile traces into it and sees the Triton
kernels (`wrap_triton`). Under the Triton interpreter (`TRITON_INTERPRET=1`, CPU-only machines)
`triton_op` cannot wrap interpreted kernels, so the same function is registered as a
`custom_op` whose fake implementation is the function itself with kernel launches skipped.
Either way one Python function is the implementation, the fake and the traced body.

Eager calls skip the dispatcher: the torch.library path costs tens of microseconds per call
(more through autograd), which dominates small launches. `define_op` therefore returns a
`KernelOp` that, on plain tensors outside torch.compile, runs the function directly (through a
`torch.autograd.Function` built from the same backward/setup_context once autograd is
registered) and otherwise calls the registered op. Both paths run the same code.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .compile_check import record_launch

__all__ = [
    "KernelOp",
    "cdiv",
    "define_op",
    "interpreting",
    "launch",
    "next_power_of_2",
    "num_sms",
    "use_triton",
]


def cdiv(a: int, b: int) -> int:
    """Ceil division for host code: `triton.cdiv` is a constexpr function whose wrapper costs
    microseconds per call on the launch path."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n, for host code (`triton.next_power_of_2` is a constexpr
    function too)."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached); a small stand-in (4) for CPU tensors, whose
    kernels run under the interpreter, so launch plans stay small there."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 4


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
            record_launch(self._kernel, args, kwargs)
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


def _eager(args) -> bool:
    """Plain tensors outside torch.compile/tracing: no dispatcher and no wrap_triton needed."""
    if torch.compiler.is_compiling():
        return False
    return all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))


class _Launcher:
    """`kernel[grid](...)`: the kernel itself on plain tensors, `wrap_triton` while tracing."""

    def __init__(self, kernel):
        self._kernel = kernel
        self._wrapped = torch.library.wrap_triton(kernel)

    def __getitem__(self, grid):
        kernel, wrapped = self._kernel, self._wrapped

        def run(*args, **kwargs):
            if _eager((*args, *kwargs.values())):  # launches pass tensors by keyword too
                return kernel[grid](*args, **kwargs)
            return wrapped[grid](*args, **kwargs)

        return run


_launchers: dict[int, object] = {}


def launch(kernel):
    """Wrap a @triton.jit kernel for launching from inside an op defined with `define_op`."""
    launcher = _launchers.get(id(kernel))
    if launcher is None:
        launcher = _InterpretedLauncher(kernel) if interpreting() else _Launcher(kernel)
        _launchers[id(kernel)] = launcher  # kernels are module globals: ids stay valid
    return launcher


class KernelOp:
    """An op registered with torch.library plus its dispatcher-free eager path.

    Call it like the function. `.op` is the registered op (also `torch.ops.<ns>.<name>`), for
    opcheck and for code that must go through the dispatcher.
    """

    def __init__(self, fn: Callable, op):
        self.fn = fn
        self.op = op
        self._function = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        if _eager(args):
            if (
                self._function is not None
                and torch.is_grad_enabled()
                and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            ):
                return self._function.apply(*args)
            return self.fn(*args)
        return self.op(*args)

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """Same contract as `torch.library.register_autograd`; also builds the eager Function."""
        self.op.register_autograd(backward, setup_context=setup_context)
        fn = self.fn

        # Classic forward(ctx, ...) form: the separate-setup_context form binds arguments with
        # inspect.signature on every call (tens of microseconds).
        def forward(ctx, *args):
            output = fn(*args)
            setup_context(ctx, args, output)
            return output

        self._function = type(
            f"{fn.__name__}_function",
            (torch.autograd.Function,),
            {"forward": staticmethod(forward), "backward": staticmethod(backward)},
        )


def define_op(qualname: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable], KernelOp]:
    """Decorator: register `fn` as the op `qualname` ("namespace::name"); returns a KernelOp."""
    mutates_args = tuple(mutates_args)

    def register(fn):
        if interpreting():
            op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
            op.register_fake(fn)
        else:
            op = torch.library.triton_op(qualname, mutates_args=mutates_args)(fn)
        return KernelOp(fn, op)

    return register
