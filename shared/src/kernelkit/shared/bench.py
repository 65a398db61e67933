"""Benchmark helpers: honest CUDA timing, copy-bandwidth floor, peak memory, pytest-benchmark glue.

Every benchmark of a kernelkit suite goes through `record`, which
  * warms the callable up (torch.compile and Triton compile outside the measurement),
  * times it with `triton.testing.do_bench` (median, L2 flushed between repetitions, the
    gradients in `grad_to_none` reset so a backward never includes `x.grad` accumulation),
  * measures the peak allocated memory of one call (MiB, inputs included, as the seed tables),
  * feeds pytest-benchmark a synchronising callable so its statistics are device time too,
  * stores ms, GB/s or TFLOP/s, % of the copy bandwidth measured in the same process and the
    table coordinates (op, direction, tag, x, provider) in `extra_info` for `kernelkit.shared.report`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence

import torch

from . import host_time

__all__ = [
    "MODEL_SHAPES",
    "OpSuite",
    "bench_ms",
    "copy_bandwidth_gbs",
    "cu_seqlens_of",
    "document_lengths",
    "host_cell",
    "interleaved_ms",
    "layout_row",
    "matmul_tflops",
    "peak_memory_mb",
    "position_forms",
    "provider_fn",
    "record",
    "time_op",
    "torch_compile",
]

# (B, N, H, D) of the shapes users run, beside each seed table (issue: fast at every size):
# one decoding step, a small batch, a training step, and the key/value side of 32/8 GQA.
MODEL_SHAPES = {
    "decode": (8, 1, 32, 128),
    "small": (1, 256, 32, 128),
    "train": (8, 4096, 32, 128),
    "gqa_kv": (8, 4096, 8, 128),
}


def document_lengths(
    rows: int,
    row_tokens: int,
    median: int = 2048,
    sigma: float = 1.0,
    shortest: int = 1024,
    longest: int = 16384,
    seed: int = 0,
) -> tuple[int, ...]:
    """Packed-document lengths, `rows` rows of exactly `row_tokens` tokens each: log-normal
    (median, sigma in log space) clipped to [shortest, longest], the last document of a row cut
    to fill it. Deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    for _ in range(rows):
        row: list[int] = []
        while sum(row) < row_tokens:
            x = math.exp(math.log(median) + sigma * torch.randn((), generator=g).item())
            row.append(int(min(max(x, shortest), longest)))
        row[-1] -= sum(row) - row_tokens
        lengths += row
    return tuple(lengths)


@functools.cache
def layout_row() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, document lengths) of the layout tables' single row: (1, 65536, 32, 128), 537 MB in
    bf16, holding log-normal documents of 1k-16k tokens, on a GPU; (1, 40, 2, 16) off it."""
    if torch.cuda.is_available():
        return (1, 65536, 32, 128), document_lengths(1, 65536)
    return (1, 40, 2, 16), document_lengths(1, 40, 10, 1.0, 4, 20)


def cu_seqlens_of(lengths: Sequence[int], device) -> torch.Tensor:
    """int32 prefix sums (len(lengths) + 1,) of `lengths` on `device`."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def position_forms(form: str, b: int, n: int, lengths: Sequence[int], device) -> tuple[dict, dict]:
    """(op keyword arguments, reference keyword arguments) of one way to give an LRPE op its
    token positions, for x (b, n, ...): "offset" (int 0), "starts" (a (B,) tensor of per-row
    starts), "table" (a (B, N) int64 positions table) or "packed" (B = 1, `cu_seqlens` of the
    sequences `lengths`, positions restarting in each). The references take the positions as
    `offset` (an int, the starts or a table) and the packing as `cu_seqlens`."""
    if form == "offset":
        return {"offset": 0}, {"offset": 0}
    if form == "starts":
        starts = torch.arange(b, device=device) * 7
        return {"offset": starts}, {"offset": starts}
    if form == "table":
        g = torch.Generator(device=device).manual_seed(0)
        table = torch.randint(0, 1 << 20, (b, n), device=device, generator=g)
        return {"positions": table}, {"offset": table}
    if form == "packed":
        cu = cu_seqlens_of(lengths, device)
        starts = torch.repeat_interleave(cu[:-1].long(), cu.diff().long(), output_size=n)
        table = (torch.arange(n, device=device) - starts)[None]
        return {"cu_seqlens": cu}, {"offset": table, "cu_seqlens": cu}
    raise ValueError(f"form: unknown positions form {form!r}")


def _sync() -> None:
    torch.cuda.synchronize()


@functools.cache
def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), measured once."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


@functools.cache
def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense n x n x n matrix-product rate of torch.mm in TFLOP/s on random data, measured once:
    the ceiling for compute-bound kernels (attention) as the copy bandwidth is for the rest."""
    a, b = (torch.randn(n, n, dtype=dtype, device="cuda") for _ in range(2))
    ms = bench_ms(lambda: torch.mm(a, b))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def bench_ms(
    fn: Callable[[], object], *, grad_to_none: Sequence[torch.Tensor] | None = None
) -> float:
    """Median device time of `fn` in ms (do_bench: L2 flushed, grads reset between repetitions)."""
    import triton.testing

    return float(
        triton.testing.do_bench(
            fn, warmup=10, rep=40, grad_to_none=grad_to_none, return_mode="median"
        )
    )


def interleaved_ms(
    fns: dict[str, Callable[[], object]],
    rounds: int = 5,
    *,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> dict[str, tuple[float, float]]:
    """A/B timing for decisions: each callable's `bench_ms` in round-robin passes, so drift of
    the clocks or the machine hits every variant alike; every other pass runs them in reverse
    order, so that no variant always follows the same one (a fixed order favoured the second
    of two identical configs by 1-4% on an H200). Returns {name: (median ms, spread)},
    spread = max / min - 1 over the rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # compile and warm up outside the rounds
        fn()
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(bench_ms(fns[name], grad_to_none=grad_to_none))
    return {name: (sorted(ts)[len(ts) // 2], max(ts) / min(ts) - 1.0) for name, ts in times.items()}


def peak_memory_mb(fn: Callable[[], object], setup: Callable[[], None] | None = None) -> float:
    """Peak allocated device memory (MiB) during one call of `fn`, live inputs included."""
    if setup is not None:
        setup()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    _sync()
    peak = torch.cuda.max_memory_allocated() / 2**20
    del out
    return peak


def record(
    benchmark,
    fn: Callable[[], object],
    *,
    op: str,
    direction: str,
    tag: str,
    x: float,
    provider: str,
    bytes_moved: float | None = None,
    flops: float | None = None,
    grad_to_none: Sequence[torch.Tensor] | None = None,
    xname: str = "n",
    info: dict | None = None,
) -> None:
    """Measure `fn` for one (table, x, provider) cell and hand it to pytest-benchmark."""
    extra = benchmark.extra_info
    extra.update(op=op, direction=direction, tag=tag, x=x, xname=xname, provider=provider)
    extra.update(info or {})
    grads = list(grad_to_none or [])

    def reset_grads():
        for t in grads:
            t.grad = None

    on_cuda = torch.cuda.is_available() and not getattr(benchmark, "disabled", False)
    if not on_cuda:  # smoke mode (CPU, --benchmark-disable): run the callable once
        reset_grads()
        benchmark(fn)
        return
    try:
        for _ in range(3):  # compile (Triton, torch.compile) and autotune outside the timings
            reset_grads()
            fn()
        _sync()
        ms = bench_ms(fn, grad_to_none=grads)
        mem = peak_memory_mb(fn, setup=reset_grads)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        extra.update(oom=True)
        benchmark.pedantic(lambda: None, rounds=1, iterations=1)
        return
    extra.update(ms=ms, peak_mb=mem, copy_gbs=copy_bandwidth_gbs())
    if bytes_moved is not None:
        gbs = bytes_moved / (ms * 1e-3) / 1e9
        extra.update(bytes=bytes_moved, gbs=gbs, pct_copy=100.0 * gbs / copy_bandwidth_gbs())
    if flops is not None:
        extra.update(flops=flops, tflops=flops / (ms * 1e-3) / 1e12)

    def timed():
        fn()
        _sync()

    def setup():
        reset_grads()

    rounds = max(3, min(20, int(30.0 / max(ms, 1e-3))))
    benchmark.pedantic(timed, setup=setup, rounds=rounds, warmup_rounds=1, iterations=1)


def time_op(
    benchmark,
    fn: Callable,
    inputs: Sequence,
    *,
    op: str,
    direction: str,
    tag: str,
    x,
    provider: str,
    bytes_moved: float | None = None,
    flops: float | None = None,
    xname: str = "n",
    info: dict | None = None,
) -> None:
    """One cell of a suite table: direction "fwd" times fn(*inputs); "bwd" runs it once and
    times y.backward(dy) (random dy), resetting the gradients of the inputs that require grad
    between repetitions. The pytest-benchmark group is the table, `<op>-<direction>-<tag>`."""
    benchmark.group = f"{op}-{direction}-{tag}"
    grads = None
    if direction == "fwd":

        def call():
            return fn(*inputs)

    else:
        y = fn(*inputs)
        dy = torch.randn_like(y)
        grads = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

        def call():
            y.backward(dy, retain_graph=True)

    record(
        benchmark,
        call,
        op=op,
        direction=direction,
        tag=tag,
        x=x,
        provider=provider,
        bytes_moved=bytes_moved,
        flops=flops,
        grad_to_none=grads,
        xname=xname,
        info=info,
    )


def torch_compile(fn: Callable) -> Callable:
    """The `torch_compile` benchmark provider: `torch.compile(fn)` specialised per shape.

    A suite sweeps many sizes and cases through one reference function; dynamo keys its cache
    on the code object, so the default recompile limit would silently fall back to eager
    partway through. Limits are raised and shapes are static, as for a fixed-shape model.
    """
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4096))
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(
            dynamo_config.accumulated_recompile_limit, 65536
        )
    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    return torch.compile(fn, dynamic=False, backend=backend)


def host_cell(
    benchmark,
    fn: Callable,
    inputs: Sequence,
    *,
    op: str,
    case: str,
    shape: str,
    provider: str,
    order: Sequence = (),
) -> None:
    """One provider's cells of an op's host table (`<op>-host`): host µs per call of
    `fn(*inputs)` (`host_time.fwd_bwd_us`: forward, forward with x requiring grad, backward),
    one row per (case, shape label, direction), one column per provider plus triton / torch.
    Rendered by `kernelkit.shared.report` as a wide table (`extra_info["seed"]`); pytest-benchmark
    itself times nothing here. Smoke mode (no GPU or --benchmark-disable): each of the three
    runs once. `order`: sort keys of the row before the direction (default: case, shape)."""
    benchmark.group = f"{op}-host"
    smoke = not torch.cuda.is_available() or getattr(benchmark, "disabled", False)
    once = {"calls": 1, "rounds": 1, "warmup": 0} if smoke else {}
    us = host_time.fwd_bwd_us(fn, inputs, **once)
    title = (
        f"{op}: host µs per call (Python issuing the calls, best of {host_time.ROUNDS} loops "
        f"of {host_time.CALLS}; eager PyTorch is `torch`, torch.compile is `torch_compile`)"
    )
    benchmark.extra_info["seed"] = [
        {
            "table": f"{op}-host",
            "title": title,
            "row": [["case", case], ["shape", shape], ["call", direction]],
            "sort": [*(order or (case, shape)), i],
            "values": {provider: value},
            "columns": ["triton", "torch", "torch_compile"],
            "ratios": {"triton / torch": ["triton", "torch"]},
            "digits": {"*": 1},
        }
        for i, (direction, value) in enumerate(zip(host_time.DIRECTIONS, us))
    ]
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


_compiled: dict = {}


def provider_fn(provider: str, ours: Callable, reference: Callable, **kwargs) -> Callable:
    """The callable a suite times for `provider` ("triton": our op; "torch": the PyTorch
    reference, eager; "torch_compile": the reference through `torch_compile`, one compiled
    wrapper per (reference, kwargs)), with `kwargs` bound."""
    if provider == "triton":
        return functools.partial(ours, **kwargs)
    if provider == "torch":
        return functools.partial(reference, **kwargs)
    if provider == "torch_compile":
        key = (reference, tuple(sorted(kwargs.items())))
        if key not in _compiled:
            _compiled[key] = torch_compile(functools.partial(reference, **kwargs))
        return _compiled[key]
    raise ValueError(f"provider: unknown provider {provider!r}")


class OpSuite:
    """The cells of a memory-bound op's suite: its seed table (sizes x cases) and its model table
    (MODEL_SHAPES x act x learnable parameters), ours vs PyTorch eager vs torch.compile.

    `inputs(shape, x_grad, param_grad)` makes the op's positional inputs (x first);
    `traffic(direction, act, x, param_grad)` the ideal bytes of a cell; `fn` and `reference`
    take (*inputs, act=..., dim=...). A suite file parametrizes two one-line tests over its
    cases and calls `seed_cell` / `model_cell`.
    """

    def __init__(self, op: str, fn: Callable, reference: Callable, inputs, traffic, seed_tag):
        self.op, self.fn, self.reference = op, fn, reference
        self.inputs, self.traffic, self.seed_tag = inputs, traffic, seed_tag

    def _cell(
        self, benchmark, direction, provider, shape, act, dim, param_grad, op_kw=None, ref_kw=None,
        **where,
    ):  # fmt: skip
        inputs = self.inputs(shape, direction == "bwd", param_grad)
        fn, reference = self.fn, self.reference
        if op_kw or ref_kw:  # bound per cell: no torch_compile provider for these
            fn = functools.partial(fn, **(op_kw or {}))
            reference = functools.partial(reference, **(ref_kw or {}))
        time_op(
            benchmark,
            provider_fn(provider, fn, reference, act=act, dim=dim),
            inputs,
            op=self.op,
            direction=direction,
            provider=provider,
            bytes_moved=self.traffic(direction, act, inputs[0], param_grad),
            **where,
        )

    def host_cell(self, benchmark, case, shape: str, provider) -> None:
        """A host-table cell (`kernelkit.shared.bench.host_cell`): `case` = (act, dim) at
        host_time.HOST_SHAPES[shape] (a stand-in (2, 5, 2, 16) off the GPU), x not requiring
        grad and the parameters fixed, through `provider`."""
        act, dim = case
        dims = host_time.HOST_SHAPES[shape] if torch.cuda.is_available() else (2, 5, 2, 16)
        label = act if dim is None else f"{act} dim {dim}"
        host_cell(
            benchmark,
            provider_fn(provider, self.fn, self.reference, act=act, dim=dim),
            self.inputs(dims, False, False),
            op=self.op,
            case=label,
            shape=f"{shape} {'x'.join(map(str, dims))}",
            provider=provider,
            order=(label, list(host_time.HOST_SHAPES).index(shape)),
        )

    def seed_cell(self, benchmark, direction, case, shape, x, provider) -> None:
        """A seed-table cell: `case` = (act, dim) at `shape`, row label `x`."""
        act, dim = case
        dims = "" if dim is None else f"-dim_{dim}"
        tag = f"{self.seed_tag}-act_{act}{dims}-bf16"
        self._cell(benchmark, direction, provider, shape, act, dim, False, tag=tag, x=x)

    def layout_cell(
        self, benchmark, direction, case, shape, label, provider, op_kw, ref_kw, tag
    ) -> None:
        """A cell of a layout table (how positions or packing are given): `case` = (act, dim)
        at `shape`, op and reference keyword arguments `op_kw` / `ref_kw`, row label `label`;
        providers "triton" and "torch" (eager) only."""
        act, dim = case
        dims = "" if dim is None else f"-dim_{dim}"
        tag = f"{tag}-act_{act}{dims}-bf16"
        self._cell(
            benchmark, direction, provider, shape, act, dim, False, op_kw, ref_kw, tag=tag,
            x=label, xname="layout",
        )  # fmt: skip

    def positions_cell(self, benchmark, direction, case, form, provider) -> None:
        """A cell of an LRPE op's positions table: `case` on `layout_row()`'s row with its
        positions given as `form` (see `position_forms`)."""
        shape, lengths = layout_row()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        op_kw, ref_kw = position_forms(form, shape[0], shape[1], lengths, device)
        label = form if form != "packed" else f"packed {len(lengths)} docs"
        self.layout_cell(
            benchmark, direction, case, shape, label, provider, op_kw, ref_kw, "positions"
        )

    def model_cell(self, benchmark, direction, act, param_grad, model, provider, dim=None) -> None:
        """A model-table cell: MODEL_SHAPES[model] (or a stand-in off the GPU), act (over `dim`
        for a softmax), learnable parameters (theta) when `param_grad` (tag suffix `-dtheta`)."""
        shape = MODEL_SHAPES[model] if torch.cuda.is_available() else (2, 5, 2, 16)
        dims = "" if dim is None else f"-dim_{dim}"
        tag = f"model-act_{act}{dims}{'-dtheta' if param_grad else ''}-bf16"
        label = f"{model} {'x'.join(map(str, shape))}"
        self._cell(
            benchmark,
            direction,
            provider,
            shape,
            act,
            dim,
            param_grad,
            tag=tag,
            x=label,
            xname="shape",
        )
