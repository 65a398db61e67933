"""Triton's own launch path, which every kernelkit launch can take: `kernel[grid](...)` on plain
tensors, `torch.library.wrap_triton(kernel)[grid](...)` while tracing (torch.compile, export,
make_fx: the launch becomes a node of the graph). Public Triton and torch APIs only.

With the direct launch path off (`kernelkit.shared.fast_launch`, `KERNELKIT_TRITON_LAUNCH=1`)
`runtime.launch(kernel)` is a `TritonLauncher`; with it on, the direct launcher falls back to
this path for everything its cache does not cover.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PLAIN_TENSORS", "Replay", "TritonLauncher", "eager"]

# Classes the eager fast paths take as plain tensors: torch.Tensor and nn.Parameter (a learnable
# theta, say). Any other subclass (fake, functional, a user's) goes through the dispatcher.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def eager(args, kwargs=None) -> bool:
    """Plain tensors outside torch.compile/tracing: no dispatcher and no wrap_triton needed."""
    if torch.compiler.is_compiling():
        return False
    values = args if not kwargs else (*args, *kwargs.values())
    return all(type(a) in PLAIN_TENSORS for a in values if isinstance(a, torch.Tensor))


class TritonLauncher:
    """`launcher[grid](*args, **kwargs)`: `kernel[grid](*args, **kwargs)` on plain tensors,
    `wrap_triton(kernel)[grid](...)` otherwise; `prepare` replays through `launcher[grid]`."""

    def __init__(self, kernel):
        self._kernel = kernel

    @functools.cached_property
    def _wrapped(self):
        # wrap_triton returns the bare kernel when called with wrapping switched off, as it is
        # inside a triton_op's eager body; the wrapper is made with it on, for the traced calls.
        from torch._library.triton import set_wrap_triton_enabled

        with set_wrap_triton_enabled(True):
            return torch.library.wrap_triton(self._kernel)

    def __getitem__(self, grid):
        return functools.partial(self._run, grid)

    def _run(self, grid, *args, **kwargs):
        if not eager(args, kwargs):
            return self._wrapped[grid](*args, **kwargs)
        return self._kernel[grid](*args, **kwargs)

    def prepare(self, grid, *args, vary=(), **kwargs):
        """`launcher[grid](*args, **kwargs)` as a function of the tensors (in the order they
        appear here: positional ones, then keywords) followed by the values of the `vary`
        keyword arguments: the interface of `fast_launch`'s prepared launches."""
        return Replay(self, grid, args, kwargs, vary)


class Replay:
    """A prepared launch replayed with new tensors (and `vary` values) through
    `launcher[grid]`: what `prepare` returns where no cached launch applies (Triton's own path,
    the interpreter, grid functions)."""

    def __init__(self, launcher, grid, args, kwargs, vary=()):
        self._launcher, self._grid, self._kwargs = launcher, grid, dict(kwargs)
        self._args = [None if isinstance(a, torch.Tensor) else a for a in args]
        self._pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self._names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)] + list(vary)
        for k in self._names:
            self._kwargs[k] = None

    def __call__(self, *values):
        args, kwargs = list(self._args), dict(self._kwargs)
        for i, t in zip(self._pos, values):
            args[i] = t
        for k, t in zip(self._names, values[len(self._pos) :]):
            kwargs[k] = t
        return self._launcher[self._grid](*args, **kwargs)
