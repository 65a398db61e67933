"""Test helpers: compare against a float64 evaluation of the reference; CUDA-graph replay.

The rule every kernelkit test applies (FlashAttention's convention, generalised):
  * the relative-norm error ||out - ref64|| / ||ref64|| stays under a per-dtype bound, and
  * for low-precision outputs it is no worse than `factor` times the error of the PyTorch
    reference evaluated in that same dtype (when the test provides that evaluation).
NaN or Inf where the float64 reference is finite always fails.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from itertools import pairwise

import torch

__all__ = [
    "DTYPE_BOUND",
    "LRPE_SHORTCUT_TAKEN",
    "assert_cases_cover",
    "assert_close",
    "assert_compiled_matches",
    "assert_graph_replays",
    "assert_key_holds_the_checks",
    "assert_launch_paths_agree",
    "assert_lrpe_shortcut_gradients",
    "assert_shortcut_gradients",
    "assert_shortcuts_replay",
    "compilations",
    "entry_kernels",
    "launched_kernels",
    "lrpe_position_args",
    "lrpe_shortcut_pairs",
    "packing",
    "rel_err",
    "run_cases_without_interpreter",
    "written_arguments",
]

# Relative-norm bounds for a kernel that computes in float32 and rounds once to the output
# dtype: float32 allows a few ulps of transcendental error; low precision allows ~2-4 roundings.
DTYPE_BOUND = {
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.2e-2,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref.detach().to(torch.float64).cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}")
    den = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    if den == 0.0:
        return num
    return num / den


def assert_close(
    out: torch.Tensor,
    ref64: torch.Tensor,
    *,
    ref_lowp: torch.Tensor | None = None,
    bound: float | None = None,
    factor: float = 2.0,
    name: str = "output",
) -> float:
    """Assert `out` matches the float64 reference `ref64`; returns the relative error.

    `bound` defaults to DTYPE_BOUND[out.dtype]. `ref_lowp` is the same computation done by the
    PyTorch reference in out.dtype; when given, out's error must also be within `factor` times
    its error (plus float32-level slack so exact cases compare as equal).
    """
    if ref_lowp is not None and out.dtype != ref_lowp.dtype:
        raise AssertionError(
            f"{name}: dtype {out.dtype} != low-precision reference {ref_lowp.dtype}"
        )
    out_f = out.detach().to(torch.float64).cpu()
    ref_f = ref64.detach().to(torch.float64).cpu()
    bad = ~torch.isfinite(out_f) & torch.isfinite(ref_f)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite values, first at {idx}")
    err = rel_err(out_f, ref_f)
    limit = DTYPE_BOUND[out.dtype] if bound is None else bound
    if not err <= limit:
        raise AssertionError(f"{name}: relative error {err:.3e} > bound {limit:.1e} ({out.dtype})")
    if ref_lowp is not None:
        ref_err = rel_err(ref_lowp, ref_f)
        allowed = factor * ref_err + 1e-6
        if not err <= allowed:
            raise AssertionError(
                f"{name}: relative error {err:.3e} > {factor} x PyTorch {out.dtype} error "
                f"{ref_err:.3e}"
            )
    return err


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (tuple, list)) else []


def assert_shortcuts_replay(fn, pairs, shortcuts) -> None:
    """For a public function `fn` with `replay.Shortcuts` `shortcuts`: for each (record, call)
    pair of argument tuples, `fn(*record)` through the checked path keeps one shortcut, and
    `fn(*call)` after it (through that shortcut where the call is like `record`, else checked)
    equals, bitwise (NaN where NaN), `fn(*call)` through the checked path (the shortcuts
    cleared). Pairs of one layout test the replay; pairs of two test that the key tells them
    apart."""
    for record, call in pairs:
        shortcuts.clear()
        fn(*record)
        assert len(shortcuts._plans) == 1, "the checked call kept no shortcut"
        got = _flat(fn(*call))
        shortcuts.clear()
        want = _flat(fn(*call))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def assert_key_holds_the_checks(key, outcome, base, changes, extra=()) -> None:
    """A shortcut key is sound: `base` (a valid call's argument tuple) has a key, and the calls
    made from it by each (index, value) change of one argument, plus the `extra` calls, get one
    `outcome` (what the checks make of a call: a hashable result or the error) per key."""
    calls = [base, *extra]
    for i, value in changes:
        call = list(base)
        call[i] = value
        calls.append(tuple(call))
    outcomes: dict = {}
    for call in calls:
        k = key(*call)
        if k is not None:
            outcomes.setdefault(k, set()).add(outcome(*call))
    assert key(*base) is not None  # the valid call has a key
    for seen in outcomes.values():
        assert len(seen) == 1, seen  # one key, one outcome


def assert_shortcut_gradients(fn, pairs, shortcuts, node: str) -> list[bool]:
    """`assert_shortcuts_replay` with gradients, for a public function `fn` whose shortcuts
    replay a call that autograd records through an autograd node named `node` (the output's
    grad_fn class name starts with it). For each (record, call) pair and each choice of
    leaves requiring grad (argument 0, argument 1, both: x and theta for the LRPE ops),
    `fn(*record)` through the checked path keeps one shortcut; then `fn(*call)` and its
    gradients for a fixed dy equal, bitwise, those of the checked path (the shortcuts
    cleared). Returns, per pair and choice in that order, whether the call took the node."""
    taken = []
    for record, call in pairs:
        for leaves in ((0,), (1,), (0, 1)):

            def fresh(args, leaves=leaves):
                args = list(args)
                for i in leaves:
                    args[i] = args[i].detach().clone().requires_grad_()
                return args

            shortcuts.clear()
            fn(*fresh(record))
            assert len(shortcuts._plans) == 1, "the checked call kept no shortcut"
            results = []
            for clear in (False, True):
                if clear:
                    shortcuts.clear()
                args = fresh(call)
                y = fn(*args)
                if not clear:
                    taken.append(type(y.grad_fn).__name__.startswith(node))
                g = torch.Generator().manual_seed(3)
                dy = torch.randn(y.shape, generator=g).to(device=y.device, dtype=y.dtype)
                results.append((y, *torch.autograd.grad(y, [args[i] for i in leaves], dy)))
            got, want = results
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return taken


def assert_graph_replays(fn, inputs, new_inputs, *, warmup: int = 2, name: str = "output"):
    """Capture `fn(*inputs)` into a torch.cuda.CUDAGraph and replay it with each of
    `new_inputs` (sequences shaped like `inputs`) copied into the static inputs: every tensor
    `fn` returns must equal, bit for bit, `fn(*new)` run eagerly. `fn` may run a backward
    (e.g. `torch.autograd.grad`); inputs that require grad stay leaves that require grad.

    Warm-up calls run first on a side stream (Triton compiles, plans and caches fill there,
    as a CUDA graph needs: nothing may compile, allocate outside the pool or sync in capture).
    """
    static = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _flat(fn(*static))
    if not outs:
        raise AssertionError(f"{name}: fn returned no tensor")
    for i, new in enumerate(new_inputs):
        with torch.no_grad():
            for s, t in zip(static, new):
                s.copy_(t)
        graph.replay()
        expected = _flat(fn(*[t.detach().clone().requires_grad_(t.requires_grad) for t in new]))
        torch.cuda.synchronize()
        for j, (got, want) in enumerate(zip(outs, expected)):
            if not torch.equal(got, want):
                diff = (got.double() - want.double()).abs().max().item()
                raise AssertionError(
                    f"{name} {j}: replay {i} differs from eager (max abs diff {diff:.3e})"
                )
    return graph


@contextlib.contextmanager
def compilations():
    """Count the Triton kernels compiled inside the block, by kernel name, through Triton's
    public `knobs.runtime.jit_post_compile_hook` (the tests that check that new sizes, offsets
    or shapes reuse the compiled kernels)."""
    import triton

    counts: Counter[str] = Counter()
    knobs = triton.knobs.runtime
    previous = knobs.jit_post_compile_hook

    def hook(*, fn, **kwargs):
        counts[fn.name] += 1
        return previous(fn=fn, **kwargs) if previous is not None else None

    knobs.jit_post_compile_hook = hook
    try:
        yield counts
    finally:
        knobs.jit_post_compile_hook = previous


def written_arguments(kernel, kwargs: dict) -> set[str]:
    """The tensor arguments torch.compile's analysis of a traced launch of `kernel` with
    `kwargs` (every argument by name) finds written, for a Hopper target (no GPU needed).
    Where that analysis fails, torch assumes every tensor is written: traced graphs then copy
    every input before the launch (and some cannot be partitioned); this raises instead."""
    import logging

    import triton
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    from triton.backends.compiler import GPUTarget

    class _Target:  # what the analysis asks the driver
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    failures: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record):
            if "identify_mutated_tensors" in record.getMessage():
                error = record.exc_info[1] if record.exc_info else None
                last = str(error).strip().splitlines()[-1] if error else ""
                failures.append(f"{type(error).__name__}: {last}")

    # torch reports the failure as a warning of its dynamo logger and carries on
    handler, log = _Catch(level=logging.WARNING), logging.getLogger("torch._dynamo")
    driver = triton.runtime.driver
    previous = driver._active  # None until first used (no driver at all on a CPU machine)
    driver.set_active(_Target())
    log.addHandler(handler)
    try:
        written = wrap.identify_mutated_tensors(kernel, dict(kwargs), {})
    finally:
        log.removeHandler(handler)
        driver._active = previous
    if failures:
        raise AssertionError(f"torch could not analyse the launch: {failures[0]}")
    return set(written)


def assert_launch_paths_agree(calls_file, function: str = "launch_calls") -> None:
    """kernelkit.shared.launch_check in a process without the Triton interpreter: the ops'
    prepared launches pass the compiled kernels the same arguments as Triton's own path, for
    the forward/backward calls `function` in `calls_file` yields (a test cannot check this
    in-process: under the interpreter every launch is replayed)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kernelkit.shared.launch_check", f"{calls_file}:{function}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0 or not out.stdout.startswith("OK"):
        raise AssertionError(f"launch paths differ:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")


def run_without_interpreter(code: str, timeout: float = 600) -> str:
    """Run `code` in a fresh Python process without TRITON_INTERPRET (the ops, registered at
    import, then take the CPU fallback path that torch.compile traces as a triton_op); returns
    its stdout, and fails with its stderr's tail if it exits non-zero."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=timeout)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def run_cases_without_interpreter(path, function: str, timeout: float = 600) -> str:
    """`function()` of the file `path` (a test module, say) in a fresh process without the
    Triton interpreter (`run_without_interpreter`): the ops registered at import then take the
    PyTorch reference on CPU tensors, the path torch.compile traces there. Returns its stdout."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_kernelkit_cases', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"module.{function}()\n"
        "print('ok')\n"
    )
    out = run_without_interpreter(code, timeout=timeout)
    if not out.strip().endswith("ok"):
        raise AssertionError(f"{function} did not finish:\n{out[-2000:]}")
    return out


def entry_kernels(*modules) -> set[str]:
    """The names of the Triton kernels `modules` define to be launched: kernelkit names them
    `*_kernel`, and no device helper ends so (for tests that must cover every kernel). Jitted
    or interpreted (TRITON_INTERPRET) alike; a module without one is an error."""
    from triton.runtime.jit import KernelInterface

    names = set()
    for m in modules:
        found = {
            name
            for name, v in vars(m).items()
            if name.endswith("_kernel") and isinstance(v, KernelInterface)
        }
        if not found:
            raise ValueError(f"{m.__name__}: no Triton kernel named *_kernel")
        names |= found
    return names


def assert_cases_cover(case_kernels, kernels: set[str], family: set[str]) -> None:
    """Every kernel of `kernels` (`entry_kernels` of a package) is launched by some case
    (`case_kernels`: the kernel sets of the cases), and the cases name only kernels of `family`
    (a new plan's kernel without a case, or a stale name, fails)."""
    covered = set().union(*case_kernels)
    missing, unknown = kernels - covered, covered - family
    assert not missing, f"kernels without a GPU compile case: {sorted(missing)}"
    assert not unknown, f"cases name kernels outside the family: {sorted(unknown)}"


def launched_kernels(fn) -> set[str]:
    """The names of the CUDA kernels `fn()` launches (torch.profiler), with the `_<n>` suffix
    that Inductor gives the user-defined Triton kernels it compiles removed."""
    import re

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {re.sub(r"_\d+$", "", event.key) for event in prof.key_averages()}


def _grad_run(fn, inputs, dy=None):
    """(output, gradients of the inputs that require grad, the output gradient used)."""
    xs = [
        t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        for t in inputs
    ]
    y = fn(*xs)
    wrt = [t for t in xs if isinstance(t, torch.Tensor) and t.requires_grad]
    if dy is None:
        g = torch.Generator().manual_seed(1234)
        dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype).to(y.device)
    grads = torch.autograd.grad(y, wrt, dy) if wrt else ()
    return y.detach(), grads, dy


def assert_compiled_matches(
    fn,
    inputs,
    reference,
    *,
    backend: str = "inductor",
    kernels: set[str] | None = None,
    family: set[str] = frozenset(),
    bound: float | None = None,
    name: str = "compiled",
):
    """`torch.compile(fn, fullgraph=True, backend=backend)` against the eager `fn` and against
    `reference` (same signature) on float64 copies of the floating-point `inputs`: the output
    and the gradient of every input that requires grad (for a random output gradient), eager
    within `bound` (assert_close's default: per dtype) and compiled within 2x eager's error.

    `kernels` (GPU only): the kernels of `family` (e.g. `entry_kernels(...)`) that the call must
    launch, eager and compiled, forward and backward together; one more or one fewer fails (the
    case does not take the launch plan it is meant to cover)."""
    # A case's fn is often a closure of one lambda: a fresh start, not a recompile of the last.
    torch.compiler.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    y, grads, dy = _grad_run(fn, inputs)
    yc, grads_c, _ = _grad_run(compiled, inputs, dy)
    x64 = [
        t.detach().double().requires_grad_(t.requires_grad)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
        else t
        for t in inputs
    ]
    y64, grads64, _ = _grad_run(reference, x64, dy.double())
    if len(grads) != len(grads64):
        raise AssertionError(f"{name}: {len(grads)} gradients, the reference has {len(grads64)}")
    pairs = [(y, yc, y64, "forward")]
    pairs += [
        (g, gc, g64, f"gradient {i}") for i, (g, gc, g64) in enumerate(zip(grads, grads_c, grads64))
    ]
    for eager, comp, ref, what in pairs:
        assert_close(eager, ref, bound=bound, name=f"{name}: eager {what}")
        assert_close(comp, ref, ref_lowp=eager, bound=bound, name=f"{name}: compiled {what}")
    if kernels is None:
        return
    if not kernels <= family:
        raise AssertionError(f"{name}: {sorted(kernels - family)} are not kernels of the family")
    for what, f in (("eager", fn), ("compiled", compiled)):
        got = launched_kernels(lambda f=f: _grad_run(f, inputs, dy)) & family
        if got != kernels:
            raise AssertionError(
                f"{name}: the {what} call launched {sorted(got)}, expected {sorted(kernels)} "
                f"(missing {sorted(kernels - got)}, unexpected {sorted(got - kernels)})"
            )


def packing(lengths, device) -> torch.Tensor:
    """cu_seqlens of sequences of `lengths` packed back to back: int32 prefix sums on `device`."""
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return cu.to(torch.int32).to(device)


def lrpe_position_args(where: str, b: int, n: int, device):
    """(offset, positions, cu_seqlens) of an LRPE op's call (x of B rows of N tokens): "int" an
    int offset, "starts" per-row starts (B,), "table" a (B, N) positions table, "packed"
    sequences packed along N (B = 1): uneven lengths, the last one empty."""
    if where == "int":
        return 5, None, None
    if where == "starts":
        return torch.arange(b, device=device) * 1000 + 3, None, None
    if where == "table":
        g = torch.Generator().manual_seed(2)
        return 0, torch.randint(0, 70_000, (b, n), generator=g).to(device), None
    if where != "packed":
        raise ValueError(f"where: expected int, starts, table or packed, got {where!r}")
    cuts = sorted({0, n, *(n * k // 7 for k in (1, 3, 4, 6))})
    return 0, None, packing([hi - lo for lo, hi in pairwise(cuts)] + [0], device)


# Per pair of `lrpe_shortcut_pairs`: whether the call is like the recorded one (its shortcut).
LRPE_SHORTCUT_TAKEN = (True, False, True, True, True, False, False, True)


def assert_lrpe_shortcut_gradients(fn, shortcuts, e: int, device) -> None:
    """`assert_shortcut_gradients` of an LRPE op `fn` (its shortcuts `shortcuts`, theta of width
    `e`) over `lrpe_shortcut_pairs`: with x, theta or both requiring grad, output and gradients
    bitwise the checked call's, and exactly the calls like their recorded one
    (`LRPE_SHORTCUT_TAKEN`) replay through lrpe-core's node (`LrpeReplayedForward`)."""
    pairs = lrpe_shortcut_pairs(e, device)
    taken = assert_shortcut_gradients(fn, pairs, shortcuts, "LrpeReplayedForward")
    assert taken == [t for t in LRPE_SHORTCUT_TAKEN for _ in range(3)]  # (x, theta, both)


def lrpe_shortcut_pairs(e: int, device) -> list:
    """(record, call) argument pairs of an LRPE op (x (2, 40, 4, 32) bf16, theta (4, e)
    float32) for `assert_shortcuts_replay`: calls like the recorded one for every kind
    (element-wise, softmax over D and over N) and a decode shape, with another offset (the
    replay's per-call value) and a wider one, other x and theta values; and calls of another
    layout than the kept one (theta float64, x with other strides); last, an element-wise act
    like the recorded one (its gradient reads x). `LRPE_SHORTCUT_TAKEN` says which calls are
    like their recorded one."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g).to(dtype).to(device)

    x, xd, theta = r(2, 40, 4, 32), r(8, 1, 4, 32), r(4, e, dtype=torch.float32)
    return [
        ((x, theta, 5), (r(2, 40, 4, 32), theta, 9)),
        ((x, theta, 5, "silu"), (x, r(4, e, dtype=torch.float32), 2**40, "silu")),
        ((x, theta, 5, "softmax", -1), (x, theta, 7, "softmax", -1)),
        ((x, theta, 5, "softmax", 1), (r(2, 40, 4, 32), theta, 0, "softmax", 1)),
        ((xd, theta[:1], 100), (r(8, 1, 4, 32), theta[:1], 101)),
        ((x, theta, 5), (x, theta.double(), 5)),
        ((x, theta, 5), (x.transpose(1, 2).contiguous().transpose(1, 2), theta, 5)),
        ((x, theta, 5, "silu"), (r(2, 40, 4, 32), theta, 9, "silu")),
    ]
