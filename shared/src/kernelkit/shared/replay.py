"""Launch sequences recorded once per layout and replayed: the host fast path of ops whose
host code (plan choice, strides, grids, constexprs of several kernels) costs more than the
launches themselves.

An op writes its host path against an `ops` object: `ops.empty(shape, dtype, device)` for
every tensor it allocates, `ops.launch(kernel, grid, *args, **kwargs)` for every launch and
`ops.unplannable()` before anything a replay could not repeat (an in-place fill, say), and
`ops.on_replay(fn)` for host state each replay must set up again first (in its own thread,
e.g. Triton's scratch allocator, a context variable).
`replayed(run, inputs, options, *args)` calls `run(ops, *args)`: the first call with a given
layout of `inputs` (shapes, strides, dtypes, 16-byte alignment, which of them are the same
tensor, device) and `options` runs it
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
    def launch(kernel, grid, *args, **kwargs):
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

    def launch(self, kernel, grid, *args, **kwargs):
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
# dtype or another.
_EMPTY, _NEW, _NEW_DTYPE = "empty", "new", "new_dtype"


class _Sequence:
    """A recorded sequence: allocate the buffers, run the prepared launches on the inputs and
    buffers, return the output buffers. The `before` callables run first (e.g. installing Triton's
    scratch allocator in the calling thread).

    The inputs and then the buffers form one `pool` that each launch picks its tensors from.
    Buffers on input 0's device (part of the key) are allocated with its `new_empty` (fewer
    arguments to parse than torch.empty's).
    Where every launch is a prepared launch of the direct launch path taking its tensors as
    leading parameters, `fast_launch.fused_sequence` runs them (after a replay that found all
    their compiled kernels, with one device, stream, hook and alignment check for the whole
    sequence instead of a key per launch); otherwise they run one by one.
    """

    def __init__(self, n_inputs, buffers, launches, outputs, before):
        self._buffers = tuple(buffers)  # (shape, dtype, device, how: _EMPTY, _NEW or _NEW_DTYPE)
        places = [[i if pool == 0 else n_inputs + i for pool, i in where] for _, where in launches]
        self._launches = tuple((run, _gather(p)) for (run, _), p in zip(launches, places))
        self._outputs = _gather(n_inputs + i for i in outputs)
        self._before = tuple(before)
        # the tensors the launches take (what the fused path's alignment check covers)
        used = _gather(sorted({i for p in places for i in p}))
        self._fused = fast_launch.fused_sequence(self._launches, used)

    def __call__(self, inputs):
        for fn in self._before:
            fn()
        first = inputs[0]
        pool = (
            *inputs,
            *[
                first.new_empty(shape)
                if how is _NEW
                else first.new_empty(shape, dtype=dtype)
                if how is _NEW_DTYPE
                else torch.empty(shape, dtype=dtype, device=device)
                for shape, dtype, device, how in self._buffers
            ],
        )
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

    def __init__(self, inputs: Sequence[torch.Tensor | None]):
        self._alive = [t for t in inputs if t is not None]  # their ids stay theirs meanwhile
        self._places = {id(t): (0, i) for i, t in enumerate(inputs) if t is not None}
        self._n_inputs = len(inputs)
        self._first = inputs[0].device, inputs[0].dtype
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
        else:
            how = _NEW if dtype == dtype0 else _NEW_DTYPE
        self._buffers.append((tuple(shape), dtype, device, how))
        return t

    def launch(self, kernel, grid, *args, **kwargs):
        out = runtime.launch(kernel)[grid](*args, **kwargs)
        if self._ok:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            places = [self._places.get(id(t)) for t in tensors]
            if None in places:  # a tensor made on the way (a copy): not replayable
                self._ok = False
            else:
                prepared = runtime.launch(kernel).prepare(grid, *args, **kwargs)
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
        return _Sequence(self._n_inputs, self._buffers, self._launches, outputs, self._before)


_SEQUENCES = PlanCache()


def clear() -> None:
    """Forget every recorded sequence (after changing a module constant that plans read)."""
    _SEQUENCES.clear()


def replayed(run: Callable, inputs: Sequence[torch.Tensor | None], options, *args):
    """`run(ops, *args)` (a tuple of output tensors), replayed per layout of `inputs` (None
    allowed; inputs[0] a tensor) and hashable `options`; traced calls (fake, functional tensors)
    always run."""
    # The key: run, options, the launch function (a patched one, in tests and tools, records
    # anew), input 0's device, then per input None, or the index of the earlier input that is
    # the same tensor (flash_attn(x, x, x): which inputs are one tensor is layout too, and the
    # same tensor has the same layout), or its shape, strides, dtype and storage offset mod 16
    # (with the dtype, this decides the offset's 16-byte alignment). Each kind of entry starts
    # with a different type (None, int, torch.Size): the flat key reads back one way only.
    key = [run, options, runtime.launch, inputs[0].device]
    seen: dict[int, int] = {}
    for i, t in enumerate(inputs):
        if t is None:
            key.append(None)
            continue
        j = seen.setdefault(id(t), i)
        if j != i:
            key.append(j)
        elif t.__class__ in PLAIN_TENSORS:
            key += (t.shape, t.stride(), t.dtype, t.storage_offset() & 15)
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
