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

Eager launches skip Triton's `kernel[grid]` too once a kernel has been compiled for a call's
specialisation: `launch` caches the compiled kernel's launcher per specialisation key and calls
it directly (see `_Launcher`); `launch(kernel).prepare(...)` fixes all but the tensors for ops
that plan their launches once per shape.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .compile_check import record_launch

__all__ = [
    "PLAIN_TENSORS",
    "KernelOp",
    "PlanCache",
    "cdiv",
    "define_op",
    "inductor_compiles",
    "interpreting",
    "launch",
    "next_power_of_2",
    "num_sms",
    "traced",
    "use_triton",
]


# Classes the eager fast paths take as plain tensors: torch.Tensor and nn.Parameter (a learnable
# theta, say). Any other subclass (fake, functional, a user's) goes through the dispatcher.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


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

    def prepare(self, grid, *args, vary=(), **kwargs):
        return _Replay(self, grid, args, kwargs, vary)


def _eager(args, kwargs=None) -> bool:
    """Plain tensors outside torch.compile/tracing: no dispatcher and no wrap_triton needed."""
    if torch.compiler.is_compiling():
        return False
    values = args if not kwargs else (*args, *kwargs.values())
    return all(type(a) in PLAIN_TENSORS for a in values if isinstance(a, torch.Tensor))


# ---------------------------------------------------------------------------------------------
# The eager launch path. Triton's `kernel[grid](...)` (JITFunction.run) spends ~10 us of Python
# per call before its C launcher runs: it binds and specialises every argument, renders the
# options into a string key, builds launch metadata and calls two (empty) launch hooks. A
# `_Launcher` keeps, per kernel, a dict from a cheap key of everything that decides Triton's
# specialisation to the compiled kernel's launcher, and calls that launcher directly.
# ---------------------------------------------------------------------------------------------

_T = torch.Tensor
_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1
_get_device = getattr(torch._C, "_cuda_getDevice", None)  # the device Triton compiles for
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _UnkeyedArgError(Exception):
    """An argument the cached path does not key (tensor subclass, tuple, descriptor, ...)."""


def _other(a):
    """Key part of a non-constexpr argument that is neither a plain tensor nor an int."""
    if a is None:
        return None  # Triton: constexpr None
    t = type(a)
    if t is bool:
        return "u1"
    if t is float:
        return "fp32"  # Triton never specialises float arguments on their value
    raise _UnkeyedArgError


def _runtime_key(name: str, p) -> str:
    """Source of the key part of runtime (non-constexpr) parameter `name`: what Triton's
    specialisation depends on. Tensors: dtype and 16-byte alignment of the data pointer (kept
    even under do_not_specialize_on_alignment: a finer key is never wrong). Ints: the i32 / i64 /
    u64 width and, unless in do_not_specialize, equal to 1 (Triton makes it a constant) and
    divisible by 16."""
    tensor = f"({name}.dtype, not {name}.data_ptr() & 15)"
    width = f"0 if {_I32_MIN} <= {name} <= {_I32_MAX} else 1 if {name} <= {_I64_MAX} else 2"
    integer = width if p.do_not_specialize else f"({name} == 1, not {name} & 15, {width})"
    return (
        f"{tensor} if {name}.__class__ is _kk_T"
        f" else ({integer}) if {name}.__class__ is int else _kk_other({name})"
    )


_JIT_TYPES = ("JITFunction", "GluonJITFunction")


def _make_binder(kernel):
    """A function `bind(device, *args, **kwargs) -> (key, params, options)` generated for this
    kernel's signature (as Triton generates its own binder): `params` are all of the kernel's
    arguments in order, defaults filled in (what the compiled launcher takes), `options` the
    remaining keywords (num_warps, num_stages, ...). None for objects that are not plain
    JITFunctions (autotuners, heuristics): those always take Triton's own path."""
    params = getattr(kernel, "params", None)
    # Gluon kernels (GluonJITFunction) bind, specialise and launch as Triton's own do.
    if not _SUPPORTED or params is None or type(kernel).__name__ not in _JIT_TYPES:
        return None
    names = [p.name for p in params]
    if any(n.startswith("_kk_") for n in names):
        return None
    sig, key, defaults = ["_kk_device"], ["_kk_device"], {}
    for p in params:
        if p.has_default:
            defaults[f"_kk_default_{p.name}"] = p.default
            sig.append(f"{p.name}=_kk_default_{p.name}")
        else:
            sig.append(p.name)
        # A constexpr's value is its specialisation; its type too (True, 1 and 1.0 are equal).
        key.append(f"{p.name}.__class__, {p.name}" if p.is_constexpr else _runtime_key(p.name, p))
    # Every name of the generated code but the parameters starts with _kk_ (no clashes).
    src = (
        f"def bind({', '.join(sig)}, **_kk_options):\n"
        f"    _kk_key = ({', '.join(key)}, *_kk_options.items())\n"
        f"    return _kk_key, ({', '.join(names)},), _kk_options\n"
    )
    namespace = {"_kk_T": _T, "_kk_other": _other, **defaults}
    exec(src, namespace)  # source generated from the kernel's parameter names
    return namespace["bind"]


try:  # the launch conventions this module calls directly are triton 3.6's
    import triton
    from triton import knobs as _knobs
    from triton.backends.nvidia import driver as _nv_driver

    _SUPPORTED = tuple(int(v) for v in triton.__version__.split(".")[:2]) == (3, 6)
    _CudaLauncher = (
        _nv_driver.CudaLauncher if _nv_driver._BASE_ARGS_FORMAT == "iiiKKppOOOOOO" else None
    )
except (ImportError, AttributeError, ValueError):  # pragma: no cover - other triton builds
    _SUPPORTED, _CudaLauncher = False, None


def _fast_ok(kernel) -> bool:
    """Nothing asks for Triton's own path: no launch hooks (profilers), no debug or
    instrumentation mode (they change the compiled kernel), no pre-run hooks."""
    rt = _knobs.runtime
    try:
        hooks = rt.launch_enter_hook.calls or rt.launch_exit_hook.calls
    except AttributeError:  # a hook set as a plain function (or None)
        hooks = rt.launch_enter_hook or rt.launch_exit_hook
    return not (
        hooks or rt.debug or _knobs.compilation.instrumentation_mode or kernel.pre_run_hooks
    )


def _entry(compiled):
    """(launch function, the arguments it takes between the stream and the kernel's own)."""
    run = compiled.run  # the launcher (loads the module on first use)
    if (
        _CudaLauncher is not None
        and isinstance(run, _CudaLauncher)
        and not run.global_scratch_size
        and not run.profile_scratch_size
    ):
        # CudaLauncher.__call__ only allocates scratch: call its C launch function directly.
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None)
        return run.launch, (*head, compiled.packed_metadata, None, None, None)
    # No launch metadata and no hooks: _fast_ok checked there are none.
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


class _Launcher:
    """`kernel[grid](...)`: the kernel itself on plain tensors, `wrap_triton` while tracing.

    Eager launches look up the compiled kernel for this call's specialisation in `_cache`
    (key: device, per argument dtype / alignment / int class / constexpr value, options) and
    call its launcher with the current stream. A miss (or anything unusual: hooks, debug,
    a grid function, an argument the key does not cover) goes through Triton's
    `kernel[grid]`, which compiles when needed; the compiled kernel then fills the cache.
    """

    def __init__(self, kernel):
        self._kernel = kernel
        # wrap_triton returns the bare kernel when called with wrapping switched off, as it is
        # inside a triton_op's eager body; the first launch may come from there, and the wrapper
        # is kept for the fake/traced calls that need it.
        from torch._library.triton import set_wrap_triton_enabled

        with set_wrap_triton_enabled(True):
            self._wrapped = torch.library.wrap_triton(kernel)
        self._bind = _make_binder(kernel)
        self._cache: dict = {}

    def __getitem__(self, grid):
        return functools.partial(self._run, grid)

    def _run(self, grid, *args, **kwargs):
        bind = self._bind
        key = None
        if bind is not None and type(grid) is tuple and _fast_ok(self._kernel):
            try:
                device = _get_device()
                key, params, _ = bind(device, *args, **kwargs)
                entry = self._cache.get(key)
            except (_UnkeyedArgError, TypeError):  # an uncovered argument, an unhashable constexpr
                key = entry = None
            if entry is not None:  # an entry implies plain tensors: not traced
                call, head = entry
                g = (*grid, 1, 1)[:3]
                return call(*g, _get_stream(device), *head, *params)
        if not _eager(args, kwargs):
            return self._wrapped[grid](*args, **kwargs)
        compiled = self._kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if key is not None and compiled is not None:
            self._cache[key] = _entry(compiled)
        return compiled

    def prepare(self, grid, *args, vary=(), **kwargs) -> Callable[..., object]:
        """`kernel[grid](*args, **kwargs)` with everything but the tensors fixed: returns a
        function that launches it with new tensors, passed in the order the tensors appear
        here (positional ones, then keywords), followed by the values of the `vary` arguments:
        ints that change per call (an offset, say), allowed for parameters Triton does not
        specialise on (do_not_specialize; only their i32/i64 width keys the compiled kernel).
        For launches planned once per shape."""
        if self._bind is None or type(grid) is not tuple:
            return _Replay(self, grid, args, kwargs, vary)
        params_by_name = {p.name: p for p in self._kernel.params}
        if any(k not in kwargs or not params_by_name[k].do_not_specialize for k in vary):
            return _Replay(self, grid, args, kwargs, vary)
        try:
            _, params, options = self._bind(None, *args, **kwargs)
        except (_UnkeyedArgError, TypeError):
            return _Replay(self, grid, args, kwargs, vary)
        if any(isinstance(a, (tuple, list)) for a in params):  # may hold tensors: not keyed
            return _Replay(self, grid, args, kwargs, vary)
        names = self._kernel.arg_names
        slots = [i for i, a in enumerate(args) if isinstance(a, _T)]
        slots += [names.index(k) for k, v in kwargs.items() if isinstance(v, _T)]
        slots += [names.index(k) for k in vary]
        return _Prepared(self, grid, params, options, tuple(slots))


def _slot_key(t):
    """Key part of a prepared launch's per-call value: a tensor's dtype and alignment, or a
    varying (do_not_specialize) int's width."""
    if t.__class__ in PLAIN_TENSORS:
        return t.dtype, not t.data_ptr() & 15
    if t.__class__ is int:
        return 0 if _I32_MIN <= t <= _I32_MAX else 1 if t <= _I64_MAX else 2
    return _other(t)


class _Prepared:
    """A launch with fixed grid, sizes, constexprs and options; the tensors come per call.

    The fixed arguments' specialisation never changes, so the key is the device and each
    tensor's dtype and alignment; a hit calls the compiled launcher directly."""

    def __init__(self, launcher: _Launcher, grid, params, options, slots):
        self._launcher = launcher
        self._kernel = launcher._kernel
        self._grid = grid
        self._g = (*grid, 1, 1)[:3]
        self._slots = slots
        self._template = [None if i in slots else a for i, a in enumerate(params)]
        # The common layout: the tensors are the leading parameters, then `_rest`.
        self._leading = slots == tuple(range(len(slots)))
        self._rest = tuple(self._template[len(slots) :])
        self._options = options
        self._cache: dict = {}

    def _params(self, tensors):
        if self._leading:
            return (*tensors, *self._rest)
        params = list(self._template)
        for i, t in zip(self._slots, tensors):
            params[i] = t
        return params

    def direct(self, device, tensors):
        """(launch function, grid, head, rest) of the compiled kernel cached for plain `tensors`
        on `device`, called as `call(*grid, stream, *head, *tensors, *rest)` (what a cache hit
        of `__call__` does); None where the tensors are not the leading parameters or no kernel
        is cached for their key. For callers that key the tensors themselves (`replay`)."""
        if not self._leading:
            return None
        try:
            entry = self._cache.get((device, *map(_slot_key, tensors)))
        except (_UnkeyedArgError, TypeError):
            return None
        return None if entry is None else (entry[0], self._g, entry[1], self._rest)

    def __call__(self, *tensors):
        key = None
        if _fast_ok(self._kernel):
            try:
                device = _get_device()
                key = (device, *map(_slot_key, tensors))
            except (_UnkeyedArgError, TypeError):
                key = None
            entry = self._cache.get(key)
            if entry is not None:  # an entry implies plain tensors: not traced
                call, head = entry
                g = self._g
                if self._leading:
                    return call(*g, _get_stream(device), *head, *tensors, *self._rest)
                return call(*g, _get_stream(device), *head, *self._params(tensors))
        params = self._params(tensors)
        if key is None or not _eager(params):
            return self._launcher._run(self._grid, *params, **self._options)
        compiled = self._kernel.run(*params, grid=self._grid, warmup=False, **self._options)
        if compiled is not None:
            self._cache[key] = _entry(compiled)
        return compiled


class _Replay:
    """`prepare` where the cached path does not apply (interpreter, grid functions): the
    launch replayed with new tensors (and `vary` values) through `launcher[grid]`."""

    def __init__(self, launcher, grid, args, kwargs, vary=()):
        self._launcher, self._grid, self._kwargs = launcher, grid, dict(kwargs)
        self._args = [None if isinstance(a, _T) else a for a in args]
        self._pos = [i for i, a in enumerate(args) if isinstance(a, _T)]
        self._names = [k for k, v in kwargs.items() if isinstance(v, _T)] + list(vary)
        for k in self._names:
            self._kwargs[k] = None

    def __call__(self, *values):
        args, kwargs = list(self._args), dict(self._kwargs)
        for i, t in zip(self._pos, values):
            args[i] = t
        for k, t in zip(self._names, values[len(self._pos) :]):
            kwargs[k] = t
        return self._launcher[self._grid](*args, **kwargs)


_launchers: dict[int, object] = {}


def launch(kernel):
    """Wrap a @triton.jit kernel for launching from inside an op defined with `define_op`:
    `launch(kernel)[grid](*args, **kwargs)`, or `launch(kernel).prepare(grid, *args, **kwargs)`
    for a launch replayed with new tensors."""
    launcher = _launchers.get(id(kernel))
    if launcher is None:
        launcher = _InterpretedLauncher(kernel) if interpreting() else _Launcher(kernel)
        _launchers[id(kernel)] = launcher  # kernels are module globals: ids stay valid
    return launcher


# torch builds without it: always take autograd.Function.apply's own path
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


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
        if torch.compiler.is_compiling():
            return self.op(*args)
        needs_grad = False
        for a in args:
            if a.__class__ is _T:  # the common case first: a plain tensor
                if a.requires_grad:
                    needs_grad = True
            elif isinstance(a, _T):
                if a.__class__ not in PLAIN_TENSORS:
                    return self.op(*args)
                if a.requires_grad:
                    needs_grad = True
        if not (needs_grad and self._apply is not None and torch.is_grad_enabled()):
            return self.fn(*args)
        if _functorch_active():
            return self._function.apply(*args)  # functorch's path for autograd.Function
        return self._apply(*args)

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
        c_apply = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
        self._apply = c_apply.__get__(None, self._function) if c_apply else self._function.apply


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


def traced(t: torch.Tensor) -> bool:
    """Whether `t` comes from tracing (a fake or functional tensor: torch.compile, export,
    make_fx) rather than a call on real data."""
    return t.__class__ not in PLAIN_TENSORS


def inductor_compiles(kernel) -> bool:
    """Whether Inductor can compile `kernel` as a user-defined Triton kernel (`wrap_triton`):
    not a Gluon kernel, which it handles as Triton source and fails on."""
    return type(kernel).__name__ != "GluonJITFunction"
