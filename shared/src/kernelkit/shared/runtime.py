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

Kernels are launched with `launch(kernel)[grid](*args, **kwargs)`. By default eager launches
skip Triton's `kernel[grid]` too once a kernel has been compiled for a call's specialisation:
the direct launch path of `kernelkit.shared.fast_launch`, the one module that calls Triton
internals (written against Triton 3.6), caches the compiled kernel's launcher per
specialisation key and calls it directly; `launch(kernel).prepare(...)` fixes all but the
tensors for ops that plan their launches once per shape. `DIRECT_LAUNCH` says whether this
process uses it: setting `KERNELKIT_TRITON_LAUNCH=1` in the environment before kernelkit is
imported turns it off (read once, at import), and so do another Triton version or missing
internals (with a warning). Every launch then goes through Triton's own `kernel[grid](...)`
(`kernelkit.shared.triton_launch`), with the same results.

Ops follow one fallback convention: the public function decides, `if not use_triton(x):` it
returns the PyTorch reference (traced inline by torch.compile; a reference whose shapes depend
on data goes through an op of `define_opaque_op`), and otherwise calls the registered ops,
which only launch kernels.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import fast_launch
from .compile_check import record_launch
from .triton_launch import PLAIN_TENSORS, Replay, TritonLauncher, eager

__all__ = [
    "DIRECT_LAUNCH",
    "PLAIN_TENSORS",
    "KernelOp",
    "PlanCache",
    "cdiv",
    "define_op",
    "define_opaque_op",
    "function_apply",
    "inductor_compiles",
    "interpreting",
    "launch",
    "next_power_of_2",
    "num_sms",
    "plain_call",
    "traced",
    "use_triton",
]

# Whether eager launches take the direct launch path (`fast_launch`): decided once, when this
# module is first imported ($KERNELKIT_TRITON_LAUNCH, the Triton version, its internals).
# False: every launch goes through Triton's own `kernel[grid](...)`.
DIRECT_LAUNCH: bool = fast_launch.DIRECT_LAUNCH

# Triton's own launch path and the direct one's launchers, under the names tests and tools use.
_TritonLauncher, _Replay, _eager = TritonLauncher, Replay, eager
_Launcher, _Prepared = fast_launch._Launcher, fast_launch._Prepared
_T = torch.Tensor


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


class PlanCache:
    """Launch plans (grids and the non-tensor kernel arguments) per layout key, so a repeated
    call with the same shapes and strides costs a dict lookup. Traced calls (fake tensors,
    symbolic sizes) must not be cached: build their plan and use it once (`cacheable`)."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._plans: dict = {}

    def __getitem__(self, key):
        """The plan cached under `key` (KeyError if none): for tools that inspect plans."""
        return self._plans[key]

    def lookup(self, key):
        """The plan cached under `key`, or None."""
        return self._plans.get(key)

    def clear(self) -> None:
        self._plans.clear()

    def get(self, key, build: Callable, *args):
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.size:  # distinct layouts kept; then start over
                self._plans.clear()
            plan = self._plans[key] = build(*args)
        return plan

    @staticmethod
    def cacheable(*tensors) -> bool:
        """Plain tensors (or None) only: no fake, functional or symbolic-size tensors."""
        return all(t is None or t.__class__ in PLAIN_TENSORS for t in tensors)


# os.environ.get costs most of a microsecond (key and value encoding, two Python frames); the
# launch paths ask for TRITON_INTERPRET on every call, so read os.environ's own mapping (what
# os.environ[...] = / del / monkeypatch.setenv update) while os.environ is that object.
_ENVIRON = os.environ
try:
    _ENVIRON_DATA = _ENVIRON._data
    _INTERPRET_KEY = _ENVIRON.encodekey("TRITON_INTERPRET")
    _INTERPRET_OFF = (None, _ENVIRON.encodevalue(""), _ENVIRON.encodevalue("0"))
except AttributeError:  # pragma: no cover - an os.environ without CPython's internals
    _ENVIRON = None


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (decided before kernels are imported)."""
    if os.environ is _ENVIRON:
        return _ENVIRON_DATA.get(_INTERPRET_KEY) not in _INTERPRET_OFF
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Whether tensors on this device run the Triton kernels (else the PyTorch reference)."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def _as_float32_storage(t: torch.Tensor):
    """A float32 twin of bf16 tensor `t` with the same strides and offset over a float32 copy of
    its whole storage, and a callback that writes the twin's storage back (rounding in torch)."""
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
    flat32 = flat.float()
    twin = flat32.as_strided(t.size(), t.stride(), t.storage_offset())
    return twin, lambda: flat.copy_(flat32)


class _InterpretedLauncher:
    """`kernel[grid](...)` for the interpreter, through `inner`, the launcher `DIRECT_LAUNCH`
    picks (an interpreted kernel has no compiled launcher: either takes Triton's own path).

    * Does nothing on fake tensors (shape propagation only).
    * bfloat16 tensors are handed to the kernel as float32 twins: the interpreter's bf16
      arithmetic and float32 -> bf16 stores do not round like the GPU, so the kernel runs in
      float32 and torch rounds the results once, to nearest-even, as the GPU's store does.
    """

    def __init__(self, kernel, inner):
        self._kernel = kernel
        self._inner = inner

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
            result = self._inner[grid](*args, **kwargs)
            for back in write_back:
                back()
            return result

        return run

    def prepare(self, grid, *args, vary=(), **kwargs):
        return Replay(self, grid, args, kwargs, vary)


_launchers: dict[int, object] = {}


def launch(kernel):
    """Wrap a @triton.jit kernel for launching from inside an op defined with `define_op`:
    `launch(kernel)[grid](*args, **kwargs)`, or `launch(kernel).prepare(grid, *args, **kwargs)`
    for a launch replayed with new tensors. The direct launch path's launcher where
    `DIRECT_LAUNCH`, else Triton's own (`triton_launch.TritonLauncher`); under the interpreter,
    inside its shim."""
    launcher = _launchers.get(id(kernel))
    if launcher is None:
        launcher = _Launcher(kernel) if DIRECT_LAUNCH else TritonLauncher(kernel)
        if interpreting():
            launcher = _InterpretedLauncher(kernel, launcher)
        _launchers[id(kernel)] = launcher  # kernels are module globals: ids stay valid
    return launcher


# torch builds without it: always take autograd.Function.apply's own path
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)
# KernelOp.__call__'s checks as module globals: one lookup each instead of two or three
# (torch.compile recognises the function objects themselves, under any name).
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def plain_call() -> bool:
    """Whether the current call runs eagerly: no torch.compile tracing, no functorch transform
    (vmap, grad). Where a public function may take its `replay.Shortcuts`."""
    return not _is_compiling() and not _functorch_active()


def function_apply(function: type) -> Callable:
    """`function.apply` (a torch.autograd.Function) through its C implementation, without the
    Python wrapper, which only matters under functorch transforms (callers check
    `plain_call` or, as `KernelOp`, route those to `function.apply`)."""
    c_apply = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
    return c_apply.__get__(None, function) if c_apply else function.apply


# The classes of an op's non-tensor arguments (options): no tensor among them.
_OPTIONS = frozenset((bool, int, float, str, type(None), torch.dtype))


class KernelOp:
    """An op registered with torch.library plus its dispatcher-free eager path.

    Call it like the function. `.op` is the registered op (also `torch.ops.<ns>.<name>`), for
    opcheck and for code that must go through the dispatcher.
    """

    def __init__(self, fn: Callable, op):
        self.fn = fn
        self.op = op
        self.opaque = None  # the opaque twin (`define_op(fake=...)`)
        self._function = None
        self._apply = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        # One pass over the arguments: any tensor subclass (fake, functional, ...) or tracing
        # takes the registered op; plain tensors run the function, through autograd when one
        # of them requires grad.
        if _is_compiling():
            return self.op(*args)
        needs_grad = False
        for a in args:
            cls = a.__class__
            if cls is _T:  # the common case first: a plain tensor
                if a.requires_grad:
                    needs_grad = True
            elif cls in _OPTIONS:  # then an option (a set lookup: isinstance is slower)
                continue
            elif isinstance(a, _T):
                if a.__class__ not in PLAIN_TENSORS:
                    return self.op(*args)
                if a.requires_grad:
                    needs_grad = True
        if needs_grad and self._apply is not None and _grad_enabled():
            if _functorch_active():
                return self._function.apply(*args)  # functorch's path for autograd.Function
            return self._apply(*args)
        return self.fn(*args)

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
        # Function.apply's Python wrapper only matters under functorch transforms (checked in
        # __call__); outside them, its C implementation is called directly.
        self._apply = function_apply(self._function)


def define_op(
    qualname: str, *, mutates_args: Iterable[str] = (), fake: Callable | None = None
) -> Callable[[Callable], KernelOp]:
    """Decorator: register `fn` as the op `qualname` ("namespace::name"); returns a KernelOp.

    fake: the outputs of `fn` (their shapes, dtypes, devices) for fake arguments, launching
    nothing. Given, the op also gets an opaque twin, `KernelOp.opaque` ("qualname_opaque"): a
    `custom_op` whose implementation is `fn` itself, which torch.compile calls as it is instead
    of tracing into it. `fn` hands a traced call (`traced`) to the twin where Inductor must not
    look inside: kernels it cannot compile (`inductor_compiles`), or the PyTorch reference on
    CPU tensors, whose shapes may depend on data (packed sequences)."""
    mutates_args = tuple(mutates_args)

    def register(fn):
        if interpreting():
            op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
            op.register_fake(fn)
        else:
            op = torch.library.triton_op(qualname, mutates_args=mutates_args)(fn)
        kernel_op = KernelOp(fn, op)
        if fake is not None:
            twin = torch.library.custom_op(
                f"{qualname}_opaque",
                mutates_args=mutates_args,
                schema=torch.library.infer_schema(fn, mutates_args=mutates_args),
            )(fn)
            twin.register_fake(fake)
            kernel_op.opaque = twin
        return kernel_op

    return register


def define_opaque_op(
    qualname: str, *, fake: Callable, mutates_args: Iterable[str] = ()
) -> Callable[[Callable], KernelOp]:
    """Decorator: register `fn`, PyTorch code that launches no kernel, as the `custom_op`
    `qualname` ("namespace::name"), which torch.compile calls as it is instead of tracing into
    it; returns a KernelOp (eager calls run `fn` directly; `register_autograd` as for
    `define_op`). For the reference path of a public function (`if not use_triton(x):`) where
    the reference's shapes depend on data (packed sequences: it slices at cu_seqlens' values),
    which torch.compile cannot trace. fake: the outputs (shapes, dtypes, devices) for fake
    arguments."""
    mutates_args = tuple(mutates_args)

    def register(fn):
        op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
        op.register_fake(fake)
        return KernelOp(fn, op)

    return register


def traced(t: torch.Tensor) -> bool:
    """Whether `t` comes from tracing (a fake or functional tensor: torch.compile, export,
    make_fx) rather than a call on real data."""
    return t.__class__ not in PLAIN_TENSORS


def inductor_compiles(kernel) -> bool:
    """Whether Inductor can compile `kernel` as a user-defined Triton kernel (`wrap_triton`):
    not a Gluon kernel, which it handles as Triton source and fails on."""
    return type(kernel).__name__ != "GluonJITFunction"
