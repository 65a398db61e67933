"""Host time per call: how long Python takes to issue an op's calls, not how long the GPU takes
to run them. Used by `ci/host_overhead.py` (per-op tables, breakdowns) and by the suites' host
tables (`kernelkit.shared.bench.host_cell`), so both measure the same way.

`per_call_us(fn)` calls `fn` `calls` times back to back without synchronising and stops the
clock before the closing `torch.cuda.synchronize()`: fewer calls than the GPU's launch queue
holds (1024), so issuing never waits for the device. The best of `rounds` loops counts (the
least disturbed by the machine). Where this exceeds the kernels' device time, a call costs this
much. `fwd_bwd_us` measures the three cells of an op: forward, forward with x requiring grad
(autograd recording), and backward (`y.backward(dy)`, engine included, gradient of x reset).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["CALLS", "DIRECTIONS", "HOST_SHAPES", "ROUNDS", "WARMUP", "fwd_bwd_us", "per_call_us"]

# (B, N, H, D) of the host tables: a small prompt and one decoding step of a 32-head model.
HOST_SHAPES = {"small": (1, 256, 32, 128), "decode": (8, 1, 32, 128)}
# The three cells `fwd_bwd_us` measures, in its order.
DIRECTIONS = ("fwd", "fwd, x requires grad", "bwd")
CALLS = 200  # calls per timed loop: below the GPU's launch queue depth (1024)
ROUNDS = 5  # timed loops per measurement; the best counts
WARMUP = 20  # untimed calls first (compiles, caches)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(
    fn: Callable[[], object],
    calls: int | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
) -> float:
    """Host µs per call of `fn`: the best of `rounds` loops of `calls` back-to-back calls, the
    clock stopped before the closing sync. Defaults: the module's CALLS, ROUNDS, WARMUP (read at
    call time, so a script may set them)."""
    calls = CALLS if calls is None else calls
    for _ in range(WARMUP if warmup is None else warmup):
        fn()
    best = float("inf")
    for _ in range(ROUNDS if rounds is None else rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    sync()
    return best


def fwd_bwd_us(
    f: Callable,
    inputs: Sequence,
    calls: int | None = None,
    rounds: int | None = None,
    warmup: int | None = None,
) -> tuple[float, float, float]:
    """(forward, forward with x requiring grad, backward) host µs per call of `f(*inputs)`;
    inputs[0] is x (not requiring grad: a copy that does is made). The backward is
    `y.backward(dy)` of one recorded forward (random dy, graph retained), x.grad reset before
    each call. With calls = rounds = 1 and warmup = 0, each of the three runs once (after the
    one forward that records y)."""
    x, rest = inputs[0], tuple(inputs[1:])
    xg = x.detach().clone().requires_grad_()
    y = f(xg, *rest)
    dy = torch.randn_like(y)

    def bwd():
        xg.grad = None
        y.backward(dy, retain_graph=True)

    timing = {"calls": calls, "rounds": rounds, "warmup": warmup}
    return (
        per_call_us(lambda: f(x, *rest), **timing),
        per_call_us(lambda: f(xg, *rest), **timing),
        per_call_us(bwd, **timing),
    )
