"""The direct launch path: eager launches call a compiled kernel's launcher without Triton's
`kernel[grid](...)`. The only kernelkit module that depends on Triton internals.

Triton's `kernel[grid](...)` (`JITFunction.run`) spends ~10 us of Python per call before its C
launcher runs: it binds and specialises every argument, renders the options into a string key,
builds launch metadata and calls two (empty) launch hooks. A `_Launcher` keeps, per kernel, a
dict from a cheap key of everything that decides Triton's specialisation to the compiled
kernel's launcher, and calls that launcher directly; `_Prepared` launches (everything but the
tensors fixed) and `fused_sequence` (replay's recorded launch sequences) build on it. Misses,
launch hooks, debug mode, grid functions and tracing take Triton's own path
(`triton_launch.TritonLauncher`).

Written against Triton 3.6 (checked: `triton.__version__` major.minor must be 3.6). The Triton
internals it uses:

* `JITFunction`: `params` (each with `name`, `is_constexpr`, `do_not_specialize`,
  `has_default`, `default`), `arg_names`, `pre_run_hooks`, and `run(*args, grid=, warmup=False,
  **kwargs)` returning the `CompiledKernel` (the type names `JITFunction` and
  `GluonJITFunction` select the kernels it handles); what Triton 3.6 specialises on (a tensor's
  dtype and 16-byte alignment; an int's width, == 1 and % 16 unless in `do_not_specialize`;
  constexpr values; floats never), which the key mirrors.
* `CompiledKernel`: `run` (the launcher), `function`, `packed_metadata`; the launcher's call
  convention `run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
  enter_hook, exit_hook, *params)`.
* `triton.backends.nvidia.driver`: `CudaLauncher` (`launch`, `launch_cooperative_grid`,
  `launch_pdl`, `num_ctas`, `global_scratch_size`, `global_scratch_align`,
  `profile_scratch_size`) and `_BASE_ARGS_FORMAT == "iiiKKppOOOOOO"` (the C `launch` function's
  arguments), to call `CudaLauncher.launch` directly; `triton.runtime._allocation._allocator`
  (the context variable holding `triton.set_allocator`'s allocator) for kernels that need
  global scratch memory (device-side TMA descriptors), which `_ScratchLaunch` keeps per stream.
* `triton.knobs`: `runtime.launch_enter_hook` / `launch_exit_hook` (`.calls`), `runtime.debug`,
  `compilation.instrumentation_mode` (any of them set: Triton's own path).
* torch's `torch._C._cuda_getDevice` and `torch._C._cuda_getCurrentRawStream`.

The switch: `KERNELKIT_TRITON_LAUNCH=1` (any value but "" and "0") in the environment when this
module is first imported turns the direct path off; every launch then goes through Triton's own
`kernel[grid](...)`. It is read once: `DIRECT_LAUNCH` (also `runtime.DIRECT_LAUNCH`) says which
path this process uses and `DISABLED_BECAUSE` why it is off. Another Triton version, or internals
that are not there (ImportError / AttributeError while setting up), turn it off too, with one
`RuntimeWarning` saying why.
"""

from __future__ import annotations

import functools
import operator
import os
import warnings

import torch

from .triton_launch import PLAIN_TENSORS, TritonLauncher, eager

__all__ = ["DIRECT_LAUNCH", "DISABLED_BECAUSE", "ENV", "TRITON_VERSION", "fused_sequence"]

ENV = "KERNELKIT_TRITON_LAUNCH"  # set (not "" or "0"): every launch takes Triton's own path
TRITON_VERSION = (3, 6)  # the Triton (major, minor) whose internals this module calls


def _configure(switch: str | None, version: str, setup=None) -> tuple[bool, str | None]:
    """(direct path on, why not) for the value of $KERNELKIT_TRITON_LAUNCH, Triton's
    `__version__` and `setup()`, which imports the internals (ImportError / AttributeError:
    missing). Warns (RuntimeWarning) when the version or the internals turn the path off."""
    if switch not in (None, "", "0"):
        return False, f"{ENV}={switch}"
    try:
        found = tuple(int(v) for v in version.split(".")[:2])
    except ValueError:
        found = None
    if found != TRITON_VERSION:
        why = (
            f"Triton {version}: kernelkit's direct launch path is written against Triton "
            f"{'.'.join(map(str, TRITON_VERSION))} internals, so kernels launch through "
            "Triton's own kernel[grid](...) (slower host path, same results)"
        )
        warnings.warn(why, RuntimeWarning, stacklevel=2)
        return False, why
    if setup is not None:
        try:
            setup()
        except (ImportError, AttributeError) as e:
            why = (
                f"Triton {version}: an internal the direct launch path needs is missing "
                f"({type(e).__name__}: {e}), so kernels launch through Triton's own "
                "kernel[grid](...) (slower host path, same results)"
            )
            warnings.warn(why, RuntimeWarning, stacklevel=2)
            return False, why
    return True, None


_knobs = _CudaLauncher = _allocator = None


def _setup() -> None:
    """Import the Triton internals this module calls (see the module docstring)."""
    global _knobs, _CudaLauncher, _allocator
    from triton import knobs
    from triton.backends.nvidia import driver
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime import _allocation
    from triton.runtime.jit import JITFunction

    # Class-level names (a kernel's own, `params` and the like, are checked per kernel by
    # `_make_binder`); a missing one raises AttributeError here.
    JITFunction.run, CompiledKernel.run  # noqa: B018
    knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, knobs.runtime.debug  # noqa: B018
    knobs.compilation.instrumentation_mode  # noqa: B018
    launcher = driver.CudaLauncher
    # The C launch function's arguments; another layout: call the launcher object instead.
    _CudaLauncher = launcher if driver._BASE_ARGS_FORMAT == "iiiKKppOOOOOO" else None
    _allocator = _allocation._allocator
    _allocator.get  # noqa: B018
    _knobs = knobs


def _triton_version() -> str:
    try:
        import triton
    except ImportError as e:  # pragma: no cover - torch without triton
        return f"(not importable: {e})"
    return str(getattr(triton, "__version__", "(unknown)"))


DIRECT_LAUNCH, DISABLED_BECAUSE = _configure(os.environ.get(ENV), _triton_version(), _setup)

# ---------------------------------------------------------------------------------------------
# Keys and binders
# ---------------------------------------------------------------------------------------------

_T = torch.Tensor
_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1
_get_device = getattr(torch._C, "_cuda_getDevice", None)  # the device Triton compiles for
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


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
    JITFunctions (autotuners, heuristics, interpreted kernels) and with the direct path off:
    those always take Triton's own path."""
    params = getattr(kernel, "params", None)
    # Gluon kernels (GluonJITFunction) bind, specialise and launch as Triton's own do.
    if not DIRECT_LAUNCH or params is None or type(kernel).__name__ not in _JIT_TYPES:
        return None
    if not (hasattr(kernel, "arg_names") and hasattr(kernel, "pre_run_hooks")):
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
        and not run.profile_scratch_size
    ):
        if not run.global_scratch_size:
            # CudaLauncher.__call__ only allocates scratch: call its C launch function directly.
            head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None)
            return run.launch, (*head, compiled.packed_metadata, None, None, None)
        if not run.launch_pdl:
            return _ScratchLaunch(compiled, run), ()
    # No launch metadata and no hooks: _fast_ok checked there are none.
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


# Global scratch memory kept for the next launch on the same stream:
# (device, stream) -> (bytes, the allocator that gave it, its buffer). At most SCRATCH_STREAMS
# entries (torch's streams come from a pool, but an external stream's handle may be anything):
# past that the dict is emptied and refilled.
_scratch: dict = {}
SCRATCH_STREAMS = 64


class _ScratchLaunch:
    """The launch of a kernel that needs global scratch memory (Triton's device-side TMA
    descriptors: `global_scratch_size` bytes a program), called as the C launch function is but
    without the scratch: `call(gx, gy, gz, stream, *params)`.

    `CudaLauncher.__call__` asks `triton.set_allocator`'s allocator for new memory at every
    launch (a `torch.empty`: ~4 us of host time a launch on an H200 host). Here the memory is
    kept per (device, stream), the largest asked for so far from the allocator in force (a new
    allocator starts afresh), and reused by the next launch on that stream: launches on one
    stream run one after another, so the previous one is done with it (kernels launched with
    programmatic dependent launch, which may overlap, take `CudaLauncher.__call__`). Memory
    given up (grown, or a new allocator) goes back to its allocator while launches may still
    use it, as after Triton's own launches: torch's allocator reuses it in that stream's order.
    While the stream is being captured into a CUDA graph the allocator is asked per launch, as
    Triton does: the graph keeps the address it captured, which later launches must not
    share."""

    __slots__ = ("_align", "_bytes", "_head", "_launch", "_meta", "_run")

    def __init__(self, compiled, run):
        self._run = run
        self._launch = run.launch
        self._head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl)
        self._meta = compiled.packed_metadata
        self._bytes = run.global_scratch_size * run.num_ctas
        self._align = run.global_scratch_align

    def __call__(self, gx, gy, gz, stream, *params):
        if _capturing():
            return self._run(gx, gy, gz, stream, self._head[0], self._meta, None, None, None,
                             *params)  # fmt: skip
        size = gx * gy * gz * self._bytes
        alloc = _allocator.get()
        key = (_get_device(), stream)
        kept = _scratch.get(key)
        if kept is None or kept[0] < size or kept[1] is not alloc:
            if kept is None and len(_scratch) >= SCRATCH_STREAMS:
                _scratch.clear()
            kept = _scratch[key] = (size, alloc, alloc(size, self._align, stream))
        return self._launch(gx, gy, gz, stream, *self._head, kept[2], None, self._meta, None,
                            None, None, *params)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


class _Launcher(TritonLauncher):
    """`kernel[grid](...)`: the kernel itself on plain tensors, `wrap_triton` while tracing.

    Eager launches look up the compiled kernel for this call's specialisation in `_cache`
    (key: device, per argument dtype / alignment / int class / constexpr value, options) and
    call its launcher with the current stream. A miss (or anything unusual: hooks, debug,
    a grid function, an argument the key does not cover) goes through Triton's
    `kernel[grid]`, which compiles when needed; the compiled kernel then fills the cache.
    """

    def __init__(self, kernel):
        super().__init__(kernel)
        self._bind = _make_binder(kernel)
        self._cache: dict = {}

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
        if not eager(args, kwargs):
            return self._wrapped[grid](*args, **kwargs)
        compiled = self._kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if key is not None and compiled is not None:
            self._cache[key] = _entry(compiled)
        return compiled

    def prepare(self, grid, *args, vary=(), **kwargs):
        """`kernel[grid](*args, **kwargs)` with everything but the tensors fixed: returns a
        function that launches it with new tensors, passed in the order the tensors appear
        here (positional ones, then keywords), followed by the values of the `vary` arguments:
        ints that change per call (an offset, say), allowed for parameters Triton does not
        specialise on (do_not_specialize; only their i32/i64 width keys the compiled kernel).
        For launches planned once per shape."""
        if self._bind is None or type(grid) is not tuple:
            return super().prepare(grid, *args, vary=vary, **kwargs)
        params_by_name = {p.name: p for p in self._kernel.params}
        if any(k not in kwargs or not params_by_name[k].do_not_specialize for k in vary):
            return super().prepare(grid, *args, vary=vary, **kwargs)
        try:
            _, params, options = self._bind(None, *args, **kwargs)
        except (_UnkeyedArgError, TypeError):
            return super().prepare(grid, *args, vary=vary, **kwargs)
        if any(isinstance(a, (tuple, list)) for a in params):  # may hold tensors: not keyed
            return super().prepare(grid, *args, vary=vary, **kwargs)
        names = self._kernel.arg_names
        slots = [i for i, a in enumerate(args) if isinstance(a, _T)]
        slots += [names.index(k) for k, v in kwargs.items() if isinstance(v, _T)]
        slots += [names.index(k) for k in vary]
        return _Prepared(self, grid, params, options, tuple(slots), len(vary))


def _key_function(n_tensors: int, n_ints: int):
    """`key(device, *values)` of a prepared launch taking `n_tensors` tensors then `n_ints`
    varying (do_not_specialize) ints: the device, each tensor's dtype and 16-byte alignment,
    each int's width (what Triton specialises on), or None where a value is not a plain tensor
    (fake, functional: traced) or an int. Generated code: one condition, one tuple display."""
    tensors = [f"v{i}" for i in range(n_tensors)]
    ints = [f"v{i}" for i in range(n_tensors, n_tensors + n_ints)]
    checks = [f"{v}.__class__ in _kk_plain" for v in tensors]
    checks += [f"{v}.__class__ is int" for v in ints]
    parts = [f"{v}.dtype, not {v}.data_ptr() & 15" for v in tensors]
    parts += [
        f"0 if {_I32_MIN} <= {v} <= {_I32_MAX} else 1 if {v} <= {_I64_MAX} else 2" for v in ints
    ]
    src = (
        f"def key(_kk_device, {', '.join(tensors + ints)}):\n"
        f"    if {' and '.join(checks) or 'True'}:\n"
        f"        return (_kk_device, {''.join(p + ', ' for p in parts)})\n"
        f"    return None\n"
    )
    namespace = {"_kk_plain": PLAIN_TENSORS}
    exec(src, namespace)  # source generated from counts only
    return namespace["key"]


class _Prepared:
    """A launch with fixed grid, sizes, constexprs and options; the tensors come per call.

    The fixed arguments' specialisation never changes, so the key is the device and each
    tensor's dtype and alignment; a hit calls the compiled launcher directly."""

    def __init__(self, launcher: _Launcher, grid, params, options, slots, n_vary=0):
        self._launcher = launcher
        self._key = _key_function(len(slots) - n_vary, n_vary)
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

    def direct(self, device, values):
        """(launch function, grid, head) of the compiled kernel cached for the per-call `values`
        (plain tensors, varying ints) on `device`, called as `call(*grid, stream, *head,
        *params)` with `params` all of the kernel's parameters (`param_maker`), as a cache hit
        of `__call__` does; None where no kernel is cached for their key. For callers that key
        the values themselves (`fused_sequence`)."""
        try:
            entry = self._cache.get(self._key(device, *values))
        except TypeError:  # not as many values as the launch takes
            return None
        return None if entry is None else (entry[0], self._g, entry[1])

    def param_maker(self, places):
        """A function of a pool (a sequence) returning this launch's parameters, its per-call
        values taken from `pool[places[k]]` (in the order `__call__` takes them), the fixed
        ones filled in: generated code, one tuple display."""
        where = dict(zip(self._slots, places))
        items, fixed = [], {}
        for i, a in enumerate(self._template):
            if i in where:
                items.append(f"pool[{where[i]}]")
            else:
                fixed[f"_kk_{i}"] = a
                items.append(f"_kk_{i}")
        # fixed values as defaults: local lookups, and no name of the kernel's in the source
        defaults = "".join(f", {name}={name}" for name in fixed)
        src = f"def make(pool{defaults}):\n    return ({', '.join(items)},)\n"
        namespace = dict(fixed)
        exec(src, namespace)  # source generated from indices and fixed names only
        return namespace["make"]

    def __call__(self, *tensors):
        key = None
        if _fast_ok(self._kernel):
            try:
                device = _get_device()
                key = self._key(device, *tensors)
            except TypeError:  # no CUDA in this torch build, or not as many values
                key = None
            entry = self._cache.get(key)
            if entry is not None:  # an entry implies plain tensors: not traced
                call, head = entry
                g = self._g
                if self._leading:
                    return call(*g, _get_stream(device), *head, *tensors, *self._rest)
                return call(*g, _get_stream(device), *head, *self._params(tensors))
        params = self._params(tensors)
        if key is None or not eager(params):
            return self._launcher._run(self._grid, *params, **self._options)
        compiled = self._kernel.run(*params, grid=self._grid, warmup=False, **self._options)
        if compiled is not None:
            self._cache[key] = _entry(compiled)
        return compiled


# ---------------------------------------------------------------------------------------------
# Recorded launch sequences (kernelkit.shared.replay)
# ---------------------------------------------------------------------------------------------

_data_ptr = torch.Tensor.data_ptr
_pre_run_hooks = operator.attrgetter("pre_run_hooks")


class _FusedSequence:
    """Runs a recorded sequence of `_Prepared` launches on a pool of tensors (and varying ints,
    whose widths the caller's key fixes). The caller's key also fixes the dtypes and the 16-byte
    alignment of the tensors it takes in; the others (`used`: buffers the sequence allocates)
    must be aligned. The launch functions the prepared launches' caches hold for these tensors
    are kept per current device (`_direct`) after a run that found them all; later runs with
    the `used` tensors aligned and no launch hooks call them directly, as each prepared
    launch's cache hit would, with one device, stream, hook and alignment check for the whole
    sequence instead of a key per launch. Otherwise the prepared launches run one by one."""

    def __init__(self, launches, used):
        # (prepared launch, pool -> its per-call values, pool -> all its parameters)
        self._launches = tuple((run, gather) for run, gather, _ in launches)
        self._makers = tuple(make for _, _, make in launches)
        self._used = used  # pool -> the tensors whose alignment is checked per run
        kernels = list(dict.fromkeys(run._kernel for run, _ in self._launches))
        self._kernel, self._more_kernels = kernels[0], tuple(kernels[1:])
        self._direct: dict = {}

    def __call__(self, pool) -> None:
        try:
            device = _get_device()
        except TypeError:  # no CUDA in this torch build: the prepared launches say so too
            device = None
        direct = self._direct.get(device)
        aligned = not functools.reduce(operator.or_, map(_data_ptr, self._used(pool)), 0) & 15
        if (
            direct is not None
            and aligned
            and _fast_ok(self._kernel)
            and not any(map(_pre_run_hooks, self._more_kernels))
        ):
            stream = _get_stream(device)
            for call, grid, head, make in direct:
                call(*grid, stream, *head, *make(pool))
            return
        for run, gather in self._launches:
            run(*gather(pool))
        if direct is None and aligned and device is not None:
            self._keep_direct(device, pool)

    def _keep_direct(self, device, pool) -> None:
        """Keep the launch functions of the aligned run on `device` that just ran (the
        prepared launches' caches hold them now), where it found all of them."""
        direct = []
        for (run, gather), make in zip(self._launches, self._makers):
            entry = run.direct(device, gather(pool))
            if entry is None:  # not cached (a launch hook, say, sent it down Triton's path)
                return
            call, grid, head = entry
            direct.append((call, grid, head, make))
        self._direct[device] = tuple(direct)


def fused_sequence(launches, used):
    """A function of the pool that runs `launches` ((launch, pool -> its per-call values, their
    places in the pool) triples, in order) through `_FusedSequence`, where every launch is a
    `_Prepared` one; else None (the caller runs the launches one by one). `used`: pool -> the
    tensors the launches take whose 16-byte alignment the caller's key does not fix (checked
    at every run; the key must fix the others' alignment and every tensor's dtype)."""
    if not launches or not all(isinstance(run, _Prepared) for run, _, _ in launches):
        return None
    made = [(run, gather, run.param_maker(places)) for run, gather, places in launches]
    return _FusedSequence(made, used)
