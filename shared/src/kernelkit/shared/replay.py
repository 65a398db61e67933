"""Launch sequences recorded once per layout and replayed: the host fast path of ops whose
host code (plan choice, strides, grids, constexprs of several kernels) costs more than the
launches themselves.

An op writes its host path against an `ops` object: `ops.empty(shape, dtype, device)` (or
`ops.empty_like(t)`) for every tensor it allocates, `ops.launch(kernel, grid, *args,
**kwargs)` for every launch and `ops.unplannable()` before anything a replay could not repeat
(an in-place fill, say), and `ops.on_replay(fn)` for host state each replay must set up again
first (in its own thread, e.g. Triton's scratch allocator, a context variable).
`replayed(run, inputs, options, *args)` calls `run(ops, *args)`: the first call with a given
layout of `inputs` (shapes, strides, dtypes, data pointers' 16-byte alignment, which are the same
tensor, device; an int input counts by its width only, its value comes anew at every call:
`ops.launch(..., vary={"offset": i})` passes input i as the keyword `offset`, which the kernel
must not specialise on) and `options` runs it
through a `Recorder`, which launches as usual and keeps each launch prepared
(`runtime.launch(kernel).prepare`) with the places of its tensors (an input or a buffer the
sequence allocated); later calls with that layout allocate the buffers and call the prepared
launches with the new tensors, skipping the host path (and once a replay has found the compiled
kernels' launchers in the prepared launches' caches, call those directly:
`fast_launch.fused_sequence`). A sequence that launches on any other tensor (a copy made on the
way, say) is not replayed: it runs through `DIRECT` every time. With the direct launch path off
(`runtime.DIRECT_LAUNCH`), the prepared launches replay through Triton's own `kernel[grid]`.

`run` must depend on nothing but the layout and `options` (module constants included: call
`clear()` after changing them).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from . import fast_launch, runtime
from .runtime import PLAIN_TENSORS, PlanCache

__all__ = [
    "DIRECT",
    "Probe",
    "Recorder",
    "Shortcuts",
    "call_layout",
    "clear",
    "int_width",
    "recorded",
    "replayed",
]


class _Direct:
    """`ops` that allocate and launch, recording nothing."""

    @staticmethod
    def empty(shape, dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def empty_like(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t)

    @staticmethod
    def launch(kernel, grid, *args, vary=None, **kwargs):
        """`kernel[grid](*args, **kwargs)`; `vary` ({keyword: index of an int input}) names the
        arguments a replay takes from its call's inputs (the value is in `kwargs` as well)."""
        return runtime.launch(kernel)[grid](*args, **kwargs)

    @staticmethod
    def unplannable() -> None:
        return None

    @staticmethod
    def on_replay(fn: Callable[[], object]) -> None:
        return None


DIRECT = _Direct()


class Probe(_Direct):
    """`ops` that allocate as `DIRECT` does and record each launch instead of running it: what
    a host path would launch for its (fake) arguments, and the outputs' shapes. For fake
    implementations (no launch on fake tensors) and for tools and tests that ask which kernels
    a call takes. `outputs` is for the caller to keep what the host path returned."""

    def __init__(self):
        self.launches: list[tuple] = []  # (kernel, grid, args, kwargs)
        self.outputs = None

    def launch(self, kernel, grid, *args, vary=None, **kwargs):
        self.launches.append((kernel, grid, args, kwargs))

    @property
    def kernels(self) -> tuple:
        """The kernels launched, in order."""
        return tuple(kernel for kernel, *_ in self.launches)


def _gather(indices) -> Callable[[tuple], tuple]:
    """pool -> the tuple of pool[i] for i in `indices` (itemgetter, which returns a bare item for
    one index)."""
    indices = tuple(indices)
    if len(indices) == 1:
        (i,) = indices
        return lambda pool: (pool[i],)
    return operator.itemgetter(*indices) if indices else lambda pool: ()


# How a replay allocates a buffer: torch.empty, or input 0's new_empty (same device) with its
# dtype or another, or torch.empty_strided (`empty_like` of a tensor that is not contiguous), or
# torch.empty_like(input 0) (a buffer with input 0's shape, dtype and, x being keyed, the
# strides empty_like gives it: the cheapest allocation call, 0.56 against new_empty's 1.0 us).
_EMPTY, _NEW, _NEW_DTYPE, _STRIDED, _LIKE = "empty", "new", "new_dtype", "strided", "like"


def _allocator(buffers) -> Callable[[Sequence], tuple]:
    """inputs -> the pool: the inputs, then a new tensor per buffer (shape, dtype, device,
    how), allocated as `how` says. Generated code (one tuple display, the buffers' shapes and
    dtypes as default arguments): a replay allocates without looking at what it allocates."""
    items, fixed = [], {}
    for k, (shape, dtype, device, how) in enumerate(buffers):
        fixed.update({f"s{k}": shape, f"d{k}": dtype, f"v{k}": device})
        if how is _LIKE:
            items.append("empty_like(inputs[0])")
        elif how is _NEW:
            items.append(f"new(s{k})")
        elif how is _NEW_DTYPE:
            items.append(f"new(s{k}, dtype=d{k})")
        elif how is _EMPTY:
            items.append(f"empty(s{k}, dtype=d{k}, device=v{k})")
        else:  # (_STRIDED, strides)
            fixed[f"t{k}"] = how[1]
            items.append(f"empty_strided(s{k}, t{k}, dtype=d{k}, device=v{k})")
    defaults = "".join(f", {name}={name}" for name in fixed)
    src = (
        f"def alloc(inputs, empty=empty, empty_strided=empty_strided, empty_like=empty_like"
        f"{defaults}):\n"
        f"    new = inputs[0].new_empty\n"
        f"    return (*inputs, {''.join(item + ', ' for item in items)})\n"
    )
    namespace = {
        "empty": torch.empty,
        "empty_strided": torch.empty_strided,
        "empty_like": torch.empty_like,
        **fixed,
    }
    exec(src, namespace)  # source generated from indices only
    return namespace["alloc"]


class _Sequence:
    """A recorded sequence: allocate the buffers, run the prepared launches on the inputs and
    buffers, return the output buffers. The `before` callables run first (e.g. installing Triton's
    scratch allocator in the calling thread).

    The inputs and then the buffers form one `pool` that each launch picks its tensors (and
    varying ints) from. Buffers on input 0's device (part of the key) are allocated with its
    `new_empty` (fewer arguments to parse than torch.empty's), or as `torch.empty_like(input
    0)` where the host path asked for `ops.empty_like` of input 0, or for a buffer with input 0's
    shape, dtype, device and strides (fewer still).
    Where every launch is a prepared launch of the direct launch path,
    `fast_launch.fused_sequence` runs them (after a replay that found all their compiled
    kernels, with one device, stream, hook and alignment check for the whole sequence instead
    of a key per launch); otherwise they run one by one.
    """

    def __init__(self, n_inputs, buffers, launches, outputs, before, ints=()):
        # (shape, dtype, device, how: _EMPTY, _NEW, _NEW_DTYPE, _LIKE or (_STRIDED, strides))
        self._buffers = tuple(buffers)
        places = [[i if pool == 0 else n_inputs + i for pool, i in where] for _, where in launches]
        self._launches = tuple((run, _gather(p)) for (run, _), p in zip(launches, places))
        self._alloc = _allocator(self._buffers)
        self._outputs = _gather(n_inputs + i for i in outputs)
        self._before = tuple(before)
        # the tensors the fused path's alignment check covers: the buffers the launches take
        # (the inputs' alignment is part of the key, and the ints' widths)
        used = _gather(sorted({i for p in places for i in p if i >= n_inputs}))
        fused = [(run, gather, p) for (run, gather), p in zip(self._launches, places)]
        self._fused = fast_launch.fused_sequence(fused, used)

    def __call__(self, inputs):
        for fn in self._before:
            fn()
        pool = self._alloc(inputs)
        fused = self._fused
        if fused is not None:
            fused(pool)
        else:
            for run, gather in self._launches:
                run(*gather(pool))
        return self._outputs(pool)


_NOT_REPLAYED = object()


class Recorder:
    """`ops` that allocate and launch as `DIRECT` does and record the sequence."""

    def __init__(self, inputs: Sequence[torch.Tensor | int | None]):
        tensors = [(i, t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
        self._alive = [t for _, t in tensors]  # their ids stay theirs meanwhile
        self._places = {id(t): (0, i) for i, t in tensors}
        self._ints = {i: t for i, t in enumerate(inputs) if t.__class__ is int}
        self._n_inputs = len(inputs)
        self._first = inputs[0].device, inputs[0].dtype
        self._input0 = inputs[0]
        self._buffers: list = []
        self._launches: list = []
        self._ok = True
        self._before: list[Callable[[], object]] = []

    def empty(self, shape, dtype, device) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        self._alive.append(t)
        self._places[id(t)] = (1, len(self._buffers))
        # Like input 0 where that is what was asked for (the device and dtype as given: a
        # device without an index, say, is the current one at each replay, as before).
        device0, dtype0 = self._first
        if device != device0 or not isinstance(dtype, torch.dtype):
            how = _EMPTY
        elif dtype != dtype0:
            how = _NEW_DTYPE
        else:
            # input 0's shape and its exact strides (contiguous ones, as torch.empty gives):
            # torch.empty_like(input 0) gives the same at every replay (its layout is keyed)
            x = self._input0
            same = t.shape == x.shape and t.stride() == x.stride()
            how = _LIKE if same else _NEW
        self._buffers.append((tuple(shape), dtype, device, how))
        return t

    def empty_like(self, like: torch.Tensor) -> torch.Tensor:
        t = torch.empty_like(like)
        if like is self._input0:  # its layout is keyed: empty_like gives the same strides
            self._alive.append(t)
            self._places[id(t)] = (1, len(self._buffers))
            self._buffers.append((tuple(t.shape), t.dtype, t.device, _LIKE))
            return t
        if t.is_contiguous():
            return self.empty(t.shape, t.dtype, t.device)
        self._alive.append(t)
        self._places[id(t)] = (1, len(self._buffers))
        # (the layout of `like` is keyed: its empty_like's strides are the same at every replay)
        self._buffers.append((tuple(t.shape), t.dtype, t.device, (_STRIDED, t.stride())))
        return t

    def launch(self, kernel, grid, *args, vary=None, **kwargs):
        out = runtime.launch(kernel)[grid](*args, **kwargs)
        if self._ok:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            places = [self._places.get(id(t)) for t in tensors]
            vary = vary or {}
            for name, i in vary.items():
                if self._ints.get(i) != kwargs[name] or kwargs[name].__class__ is not int:
                    raise ValueError(f"vary: {name}={kwargs[name]!r} is not int input {i}")
                places.append((0, i))
            if None in places:  # a tensor made on the way (a copy): not replayable
                self._ok = False
            else:
                prepared = runtime.launch(kernel).prepare(grid, *args, vary=tuple(vary), **kwargs)
                self._launches.append((prepared, places))
        return out

    def unplannable(self) -> None:
        self._ok = False

    def on_replay(self, fn: Callable[[], object]) -> None:
        self._before.append(fn)

    def sequence(self, outputs: Sequence[torch.Tensor]):
        """The replayable sequence returning `outputs` (buffers of this recording), or a marker
        that the layout is not replayed."""
        places = [self._places.get(id(t)) for t in outputs]
        if not self._ok or any(p is None or p[0] != 1 for p in places):
            return _NOT_REPLAYED
        outputs = [i for _, i in places]
        return _Sequence(
            self._n_inputs, self._buffers, self._launches, outputs, self._before, self._ints
        )


_SEQUENCES = PlanCache()
_SHORTCUTS: list = []  # every Shortcuts made, cleared with the sequences


def clear() -> None:
    """Forget every recorded sequence (after changing a module constant that plans read), and
    every public call's shortcut to one."""
    _SEQUENCES.clear()
    for shortcuts in _SHORTCUTS:
        shortcuts.clear()


class Shortcuts(PlanCache):
    """Recorded sequences keyed by a public function's whole call: the arguments' layout and
    values, once the call has passed the function's checks and its sequence is recorded. A
    function whose checks read only what its key holds can then skip them with its op's own
    key (`recorded`): one key for the call instead of two plus the checks. The function owns
    the key and its soundness: every argument value and type the checks or the host path read,
    `runtime.launch` and whether the interpreter runs. Cleared by `clear()`."""

    def __init__(self, size: int = 4096):
        super().__init__(size)
        _SHORTCUTS.append(self)

    def remember(self, key, sequence) -> None:
        if len(self._plans) >= self.size:
            self._plans.clear()
        self._plans[key] = sequence


# The key entry of an int input: its width as Triton keys a do_not_specialize int.
_I32, _I64, _U64 = "i32", "i64", "u64"


def int_width(v: int) -> str:
    """What `replayed`'s key holds for an int input (a per-call value): its width as Triton
    keys a do_not_specialize int. Also for `Shortcuts` keys of calls with such an int."""
    return _I32 if -(2**31) <= v < 2**31 else _I64 if -(2**63) <= v < 2**63 else _U64


def replayed(run: Callable, inputs: Sequence[torch.Tensor | int | None], options, *args):
    """`run(ops, *args)` (a tuple of output tensors), replayed per layout of `inputs` (None
    allowed; inputs[0] a tensor; an int input is a per-call value, see `ops.launch`'s `vary`)
    and hashable `options`; traced calls (fake, functional tensors, symbolic ints) always run."""
    key = _key(run, inputs, options)
    if key is None:
        return run(DIRECT, *args)
    seq = _SEQUENCES._plans.get(key)  # PlanCache.lookup, without its call
    if seq is None:
        rec = Recorder(inputs)
        out = run(rec, *args)
        _SEQUENCES.get(key, rec.sequence, out)
        return out
    if seq is _NOT_REPLAYED:
        return run(DIRECT, *args)
    return seq(inputs)


def recorded(run: Callable, inputs: Sequence[torch.Tensor | int | None], options):
    """The sequence `replayed(run, inputs, options, ...)` replays for this layout of `inputs`
    (`seq(inputs)` runs it), or None where it has none (not called yet, not replayable, or a
    traced call)."""
    key = _key(run, inputs, options)
    seq = None if key is None else _SEQUENCES._plans.get(key)
    return None if seq is _NOT_REPLAYED else seq


def _key(run, inputs, options) -> tuple | None:
    """`replayed`'s key, or None for a traced call."""
    # The key: run, options, the launch function (a patched one, in tests and tools, records
    # anew), input 0's device, then per input None, or the index of the earlier input that is
    # the same tensor (flash_attn(x, x, x): which inputs are one tensor is layout too, and the
    # same tensor has the same layout), or its shape, strides, dtype and data pointer mod 16
    # (its 16-byte alignment, which Triton specialises on), or an int's width (a str).
    # Each kind of entry starts with a different type (None, int, torch.Size, str): the flat key
    # reads back one way only.
    key = [run, options, runtime.launch, inputs[0].device]
    return tuple(key) if _layout_into(key, inputs, int_width, False) else None


def call_layout(inputs: Sequence[torch.Tensor | int | None]) -> tuple | None:
    """The layout of a public call's arguments for its `Shortcuts` key: per input what
    `replayed`'s key holds, with an int's value instead of its width (an option of the call)
    and each tensor's device after its alignment (the replay key leaves devices to the checks,
    which a shortcut skips). None where an input is neither None, an int nor a plain tensor."""
    key: list = []
    return tuple(key) if _layout_into(key, inputs, _int_value, True) else None


def _int_value(v: int) -> tuple:
    """An int input's entry in `call_layout`: not a bare int, which is an earlier input's index."""
    return ("int", v)


def _layout_into(key: list, inputs, int_entry, devices: bool) -> bool:
    """Append the entries of `inputs` to key (see `_key`); False for a traced call."""
    seen: dict[int, int] = {}
    for i, t in enumerate(inputs):
        if t is None:
            key.append(None)
            continue
        if t.__class__ is int:
            key.append(int_entry(t))
            continue
        j = seen.setdefault(id(t), i)
        if j != i:
            key.append(j)
        elif t.__class__ in PLAIN_TENSORS:
            key += (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)
            if devices:
                key.append(t.device)
        else:
            return False
    return True
