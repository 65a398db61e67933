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

__all__ = ["DIRECT", "Probe", "Recorder", "clear", "replayed"]


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


def clear() -> None:
    """Forget every recorded sequence (after changing a module constant that plans read)."""
    _SEQUENCES.clear()


# The key entry of an int input: its width as Triton keys a do_not_specialize int.
_I32, _I64, _U64 = "i32", "i64", "u64"


def _width(v: int) -> str:
    return _I32 if -(2**31) <= v < 2**31 else _I64 if -(2**63) <= v < 2**63 else _U64


def replayed(run: Callable, inputs: Sequence[torch.Tensor | int | None], options, *args):
    """`run(ops, *args)` (a tuple of output tensors), replayed per layout of `inputs` (None
    allowed; inputs[0] a tensor; an int input is a per-call value, see `ops.launch`'s `vary`)
    and hashable `options`; traced calls (fake, functional tensors, symbolic ints) always run."""
    # The key: run, options, the launch function (a patched one, in tests and tools, records
    # anew), input 0's device, then per input None, or the index of the earlier input that is
    # the same tensor (flash_attn(x, x, x): which inputs are one tensor is layout too, and the
    # same tensor has the same layout), or its shape, strides, dtype and data pointer mod 16
    # (its 16-byte alignment, which Triton specialises on), or an int's width (a str).
    # Each kind of entry starts with a different type (None, int, torch.Size, str): the flat key
    # reads back one way only.
    key = [run, options, runtime.launch, inputs[0].device]
    seen: dict[int, int] = {}
    for i, t in enumerate(inputs):
        if t is None:
            key.append(None)
            continue
        if t.__class__ is int:
            key.append(_width(t))
            continue
        j = seen.setdefault(id(t), i)
        if j != i:
            key.append(j)
        elif t.__class__ in PLAIN_TENSORS:
            key += (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)
        else:
            return run(DIRECT, *args)
    key = tuple(key)
    seq = _SEQUENCES._plans.get(key)  # PlanCache.lookup, without its call
    if seq is None:
        rec = Recorder(inputs)
        out = run(rec, *args)
        _SEQUENCES.get(key, rec.sequence, out)
        return out
    if seq is _NOT_REPLAYED:
        return run(DIRECT, *args)
    return seq(inputs)
