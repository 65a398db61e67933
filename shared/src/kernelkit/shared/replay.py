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
launches with the new tensors, skipping the host path. A sequence that launches on any other
tensor (a copy made on the way, say) is not replayed: it runs through `DIRECT` every time.

`run` must depend on nothing but the layout and `options` (module constants included: call
`clear()` after changing them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import runtime
from .runtime import PLAIN_TENSORS, PlanCache

__all__ = ["DIRECT", "Recorder", "clear", "replayed"]


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


class _Sequence:
    """A recorded sequence: allocate the buffers, run the prepared launches on the inputs and
    buffers, return the output buffers. The `before` callables run first (e.g. installing Triton's
    scratch allocator in the calling thread)."""

    def __init__(self, buffers, launches, outputs, before):
        self._buffers = buffers
        self._launches = launches
        self._outputs = outputs
        self._before = tuple(before)

    def __call__(self, inputs):
        for fn in self._before:
            fn()
        bufs = [
            torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in self._buffers
        ]
        pools = (inputs, bufs)
        for run, places in self._launches:
            run(*[pools[pool][i] for pool, i in places])
        return tuple(bufs[i] for i in self._outputs)


_NOT_REPLAYED = object()


class Recorder:
    """`ops` that allocate and launch as `DIRECT` does and record the sequence."""

    def __init__(self, inputs: Sequence[torch.Tensor | None]):
        self._alive = [t for t in inputs if t is not None]  # their ids stay theirs meanwhile
        self._places = {id(t): (0, i) for i, t in enumerate(inputs) if t is not None}
        self._buffers: list = []
        self._launches: list = []
        self._ok = True
        self._before: list[Callable[[], object]] = []

    def empty(self, shape, dtype, device) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        self._alive.append(t)
        self._places[id(t)] = (1, len(self._buffers))
        self._buffers.append((tuple(shape), dtype, device))
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
        return _Sequence(self._buffers, self._launches, [i for _, i in places], self._before)


_SEQUENCES = PlanCache()


def clear() -> None:
    """Forget every recorded sequence (after changing a module constant that plans read)."""
    _SEQUENCES.clear()


def replayed(run: Callable, inputs: Sequence[torch.Tensor | None], options, *args):
    """`run(ops, *args)` (a tuple of output tensors), replayed per layout of `inputs` (None
    allowed) and hashable `options`; traced calls (fake, functional tensors) always run."""
    key = [run, options, runtime.launch]  # a patched launch (tests, tools) records anew
    first: dict[int, int] = {}  # which inputs are one tensor (flash_attn(x, x, x)) is layout too
    for i, t in enumerate(inputs):
        if t is None:
            key.append(None)
        elif t.__class__ in PLAIN_TENSORS:
            key += (t.shape, t.stride(), t.dtype, (t.storage_offset() * t.element_size()) & 15)
            key.append(first.setdefault(id(t), i))
        else:
            return run(DIRECT, *args)
    key.append(inputs[0].get_device())
    key = tuple(key)
    seq = _SEQUENCES.lookup(key)
    if seq is None:
        rec = Recorder(inputs)
        out = run(rec, *args)
        _SEQUENCES.get(key, rec.sequence, out)
        return out
    if seq is _NOT_REPLAYED:
        return run(DIRECT, *args)
    return seq(inputs)
