"""The cached launch path of kernelkit.shared.runtime (used by every op's eager calls).

On CPU, `fake_cuda` stands in for Triton's CUDA driver: Triton's own `JITFunction.run` binds,
specialises and keys arguments as on a GPU, and "compiles" one fake kernel per specialisation.
Every launch through the cached path must use the kernel Triton itself picks for the same
arguments (a misaligned pointer or an int that stops being divisible by 16 must not reuse a
kernel specialised for the other case), on the current stream, with all arguments in order.
The GPU tests at the end run real launches.
"""

import random

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from kernelkit.act import act
from kernelkit.act.reference import act_reference
from kernelkit.shared import runtime
from kernelkit.shared.fake_driver import fake_cuda
from kernelkit.shared.testing import assert_close


def _probe(x_ptr, y_ptr, n, key, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = "a"):
    pass  # never compiled: the fake driver stands in for the compiler (`key`: a name the
    # generated binder must not confuse with its own)


def make_kernel():
    # A real JITFunction even under the interpreter (triton.jit would return an interpreted one).
    return JITFunction(_probe, do_not_specialize=["key"])


@pytest.fixture
def fake():
    with fake_cuda() as log:
        yield log


def triton_choice(kernel, grid, args, kwargs):
    """The compiled kernel Triton's own path picks for these arguments (without launching)."""
    return kernel.run(*args, grid=grid, warmup=True, **kwargs)


def check_last_launch(log, kernel, grid, args, kwargs):
    expected = triton_choice(kernel, grid, args, kwargs)
    got_grid, stream, function, params = log.launches[-1]
    assert function == expected.function, (args, kwargs)
    assert stream == log.stream
    assert got_grid == (*grid, 1, 1)[:3]
    names = kernel.arg_names
    bound = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
    bound.setdefault("MODE", "a")
    assert len(params) == len(names)
    for name, value in zip(names, params):
        assert value is bound[name], name


def buffers():
    base = {dt: torch.zeros(64, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32)}
    # offsets in elements: 0 and 8 (bf16: 16 bytes) aligned, 1 misaligned (for every dtype here)
    return [b[off:] for b in base.values() for off in (0, 1, 8)]


def test_random_calls_use_tritons_specialisation(fake):
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    slow_calls = []
    real_run = kernel.run

    def counting_run(*args, **kwargs):
        if not kwargs.get("warmup"):
            slow_calls.append(1)
        return real_run(*args, **kwargs)

    kernel.run = counting_run
    rng = random.Random(0)
    tensors = buffers()
    ints = [0, 1, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**40, 2**63 + 16]

    def config():
        x, y = rng.choice(tensors), rng.choice([*tensors, None])
        n, m = rng.choice(ints), rng.choice(ints)
        flag = rng.choice([True, False, 1.5, 7])
        consts = {"BLOCK": rng.choice([64, 128]), "MODE": rng.choice(["a", "b", 1, True])}
        if rng.random() < 0.3:
            del consts["MODE"]  # the default
        options = rng.choice([{}, {"num_warps": 4}, {"num_warps": 8}])
        if rng.random() < 0.5:
            return (x, y, n, m, flag), {**consts, **options}
        kwargs = {"x_ptr": x, "y_ptr": y, "n": n, "key": m, "flag": flag}
        return (), {**kwargs, **consts, **options}

    configs = [(config(), rng.choice([0, 1])) for _ in range(40)]
    calls = 300
    for _ in range(calls):
        (args, kwargs), fake.device = rng.choice(configs)
        fake.stream = rng.randrange(1, 1 << 40)
        grid = rng.choice([(3,), (2, 5), (1, 2, 3)])
        launcher[grid](*args, **kwargs)
        check_last_launch(fake, kernel, grid, args, kwargs)
    # The cache is used: only a call whose key was not seen before takes Triton's path.
    assert 0 < len(slow_calls) <= len(configs)
    assert len(launcher._cache) == len(slow_calls)


def test_alignment_and_divisibility_never_reuse_a_specialisation(fake):
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    x = torch.zeros(64, dtype=torch.bfloat16)
    cases = [
        (x, x, 64),  # aligned, n % 16 == 0
        (x, x, 64),  # the same: a hit
        (x[1:], x, 64),  # x misaligned
        (x, x[1:], 64),  # y misaligned
        (x, x, 63),  # n no longer divisible by 16
        (x, x, 1),  # n == 1: a constant for Triton
        (x, None, 64),  # y None
        (x.float(), x, 64),  # dtype
    ]
    functions = []
    for a, b, n in cases:
        launcher[(1,)](a, b, n, 5, True, BLOCK=64)
        check_last_launch(fake, kernel, (1,), (a, b, n, 5, True), {"BLOCK": 64})
        functions.append(fake.launches[-1][2])
    assert len(set(functions)) == len(cases) - 1 and functions[0] == functions[1]
    assert len(launcher._cache) == len(cases) - 1


def test_do_not_specialize_int_shares_a_kernel(fake):
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    x = torch.zeros(64)
    for m in (16, 17, 1):  # `key` is in do_not_specialize: one kernel for all three
        launcher[(1,)](x, x, 16, m, True, BLOCK=64)
        check_last_launch(fake, kernel, (1,), (x, x, 16, m, True), {"BLOCK": 64})
    assert len(fake.compiled) == 1


def test_prepared_launch(fake):
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    x = torch.zeros(64, dtype=torch.float16)
    y = torch.zeros(64, dtype=torch.float16)
    # Tensors given by keyword, y before x: the prepared launch takes them in that order.
    p = launcher.prepare((4, 2), n=32, y_ptr=y, x_ptr=x, key=3, flag=False, BLOCK=128, MODE=7)
    compiled_before = len(fake.compiled)
    for a, b in [(x, y), (x[1:], y), (x, y[8:]), (x.float(), y), (x, y), (x[1:], y)]:
        p(b, a)
        args = (a, b)
        kwargs = {"n": 32, "key": 3, "flag": False, "BLOCK": 128, "MODE": 7}
        check_last_launch(fake, kernel, (4, 2), args, kwargs)
    # Three specialisations: aligned (y at +8 elements is 16-byte aligned too), x misaligned,
    # x float32.
    assert len(p._cache) == 3
    assert len(fake.compiled) - compiled_before == 3


def test_prepared_launch_with_a_varying_int(fake):
    """`vary`: a do_not_specialize int passed per call after the tensors; only its width keys
    the kernel. A specialised int cannot vary (replayed through launcher[grid] instead)."""
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    x = torch.zeros(64, dtype=torch.float16)
    p = launcher.prepare((2,), x_ptr=x, y_ptr=x, n=32, key=0, flag=True, BLOCK=64, vary=("key",))
    assert isinstance(p, runtime._Prepared)
    for key in (5, 16, 1, 2**40, 7, -3):
        p(x, x, key)
        check_last_launch(fake, kernel, (2,), (x, x, 32, key, True), {"BLOCK": 64})
    assert len(p._cache) == 2  # i32 and i64
    replayed = launcher.prepare((2,), x_ptr=x, y_ptr=x, n=32, key=0, flag=True, BLOCK=64,
                                vary=("n",))  # fmt: skip
    assert isinstance(replayed, runtime._Replay)
    replayed(x, x, 48)
    check_last_launch(fake, kernel, (2,), (x, x, 48, 0, True), {"BLOCK": 64})


def test_prepare_falls_back_to_replay(fake):
    """A grid function or a tuple argument: `prepare` replays through launcher[grid]."""
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    x = torch.zeros(64)
    p = launcher.prepare((1,), x, y_ptr=x, n=16, key=3, flag=(1, 2), BLOCK=64)
    assert isinstance(p, runtime._Replay)
    z = torch.zeros(64)[1:]
    p(z, x)
    check_last_launch(fake, kernel, (1,), (z, x, 16, 3, (1, 2)), {"BLOCK": 64})
    p = launcher.prepare(lambda meta: (2,), x, x, 16, 3, True, BLOCK=64)
    p(z, x)
    assert fake.launches[-1][0] == (2, 1, 1) and fake.launches[-1][3][0] is z


def test_hooks_and_debug_take_tritons_path(fake):
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    x = torch.zeros(64)
    launcher[(1,)](x, x, 16, 3, True, BLOCK=64)
    assert len(launcher._cache) == 1
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        launcher[(1,)](x, x, 16, 3, True, BLOCK=64)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert len(seen) == 1  # the profiler hook saw the launch
    launcher[(1,)](x, x, 16, 3, True, BLOCK=64)
    assert len(seen) == 1
    # TRITON_DEBUG compiles other kernels: the cached (non-debug) one must not be used.
    debug = knobs.runtime.debug
    knobs.runtime.debug = True
    try:
        launcher[(1,)](x, x, 16, 3, True, BLOCK=64)
        check_last_launch(fake, kernel, (1,), (x, x, 16, 3, True), {"BLOCK": 64})
    finally:
        knobs.runtime.debug = debug
    assert fake.launches[-1][2] != fake.launches[0][2]


def test_grid_function_and_unkeyed_arguments_take_tritons_path(fake):
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    x = torch.zeros(64)
    launcher[lambda meta: (meta["n"] // 16,)](x, x, 32, 3, True, BLOCK=64)
    assert fake.launches[-1][0] == (2, 1, 1)
    launcher[(1,)](x, x, 32, 3, (1, 2), BLOCK=64)  # a tuple argument: not keyed
    assert not launcher._cache


def test_replayed_sequence_with_a_varying_int(fake, monkeypatch):
    """`replay`: an int input is a per-call value (`vary`), keyed by its width only. Launches
    whose tensors are not the leading parameters (given by keyword, the int between them) run
    one by one on the first replay, then fused (the kept launchers), each call with its own
    tensors and value; a new width records a new sequence."""
    from kernelkit.shared import replay

    kernel = make_kernel()
    launchers = {}
    monkeypatch.setattr(
        runtime, "launch", lambda k: launchers.setdefault(id(k), runtime._Launcher(k))
    )

    def run(ops, x, key):
        y = ops.empty(x.shape, x.dtype, x.device)
        ops.launch(kernel, (2,), n=32, y_ptr=y, x_ptr=x, key=key, flag=True, BLOCK=64,
                   vary={"key": 1})  # fmt: skip
        ops.launch(kernel, (3,), x_ptr=y, y_ptr=x, n=16, key=key, flag=False, BLOCK=32,
                   vary={"key": 1})  # fmt: skip
        return (y,)

    for key in (5, 7, 0, 2**40, 9, -3):
        x = torch.zeros(64, dtype=torch.float16)
        (y,) = replay.replayed(run, (x, key), "test", x, key)
        assert fake.launches[-2][3][:4] == (x, y, 32, key)
        assert fake.launches[-1][3][:4] == (y, x, 16, key)
        check_last_launch(fake, kernel, (3,), (y, x, 16, key, False), {"BLOCK": 32})
    sequences = [s for k, s in replay._SEQUENCES._plans.items() if k[0] is run]
    assert len(sequences) == 2  # i32 and i64 keys
    assert all(s._fused is not None and s._fused._direct for s in sequences[:1])
    x = torch.zeros(64, dtype=torch.float16)
    with pytest.raises(ValueError, match="vary"):  # the value must be the int input it names
        replay.replayed(lambda ops, x: run(ops, x, 4), (x, 5), "bad", x)


@pytest.fixture
def scratch_allocator(monkeypatch):
    """triton.set_allocator's allocator for the test (restored after it): CPU buffers, each
    request recorded as (bytes, alignment, stream); the kept scratch starts empty."""
    from triton.runtime import _allocation

    from kernelkit.shared import fast_launch

    monkeypatch.setattr(fast_launch, "_scratch", {})
    asked = []

    def alloc(size, align, stream):
        asked.append((size, align, stream))
        return torch.empty(size, dtype=torch.int8)

    before = _allocation._allocator.get()
    triton.set_allocator(alloc)
    yield alloc, asked
    triton.set_allocator(before)


def test_scratch_is_kept_per_stream(fake, scratch_allocator):
    """Kernels that need global scratch memory (device-side TMA descriptors): Triton's launcher
    asks the allocator at every launch; the direct path keeps the memory per (device, stream)
    and reuses it, grows it for a larger grid, starts afresh on another stream or device or
    with a new allocator, and asks per launch while the stream is being captured (a CUDA graph
    keeps the address it captured)."""
    alloc, asked = scratch_allocator
    fake.scratch_size = 128
    kernel = make_kernel()
    launcher = runtime._Launcher(kernel)
    x = torch.zeros(64)

    def run(grid):
        launcher[grid](x, x, 16, 3, True, BLOCK=64)
        check_last_launch(fake, kernel, grid, (x, x, 16, 3, True), {"BLOCK": 64})
        return fake.scratch[-1]

    first = run((2,))  # Triton's path (compiles): the allocator's memory for this launch
    assert asked == [(256, 128, fake.stream)] and first.numel() == 256
    kept = run((2,))  # cached: asked once more, then kept
    assert kept is not first and len(asked) == 2
    assert run((1,)) is kept and run((2,)) is kept and len(asked) == 2
    grown = run((4,))
    assert asked[-1] == (512, 128, fake.stream) and grown is not kept
    assert run((3,)) is grown and run((1,)) is grown and len(asked) == 3

    stream = fake.stream
    fake.stream = 0xACE  # another stream: its own memory
    side = run((1,))
    assert asked[-1] == (128, 128, 0xACE) and side is not grown
    fake.stream = stream
    assert run((2,)) is grown
    fake.device = 1  # another device, same stream handle (the legacy default stream)
    assert run((2,)) is not grown and len(asked) == 5
    fake.device = 0

    fake.capturing = True  # CUDA-graph capture: new memory at every launch
    captured = [run((2,)) for _ in range(3)]
    assert len(asked) == 8 and len({id(t) for t in captured} | {id(grown)}) == 4
    fake.capturing = False
    assert run((2,)) is grown and len(asked) == 8

    triton.set_allocator(lambda size, align, s: alloc(size, align, s))  # a new allocator
    fresh = run((2,))
    assert fresh is not grown and len(asked) == 9
    assert run((4,)) is not fresh and run((4,)) is fake.scratch[-2] and len(asked) == 10


def test_tensor_subclass_in_keywords_is_not_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.empty(4)
    assert not runtime._eager((), {"x": t})
    assert runtime._eager((), {"x": torch.empty(4)})


# ---------------------------------------------------------------------------------------------
# GPU: real launches
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("a", "dim"), [("silu", None), ("softmax", -1), ("softmax", 1)])
def test_misaligned_after_aligned_gpu(a, dim):
    """The same shape at an aligned then a misaligned address: the cached path must not reuse
    the kernel compiled for 16-byte-aligned pointers."""
    base = torch.randn(2 * 33 * 3 * 40 + 8, device="cuda", dtype=torch.bfloat16)
    for off in (0, 1, 8, 1):
        x = base[off : off + 2 * 33 * 3 * 40].view(2, 33, 3, 40).detach().requires_grad_()
        y = act(x, a, dim)
        dy = torch.randn_like(y)
        y.backward(dy)
        x64 = x.detach().double().requires_grad_()
        y64 = act_reference(x64, a, dim)
        y64.backward(dy.double())
        assert_close(y, y64, name=f"{a} forward at offset {off}")
        assert_close(x.grad, x64.grad, name=f"{a} backward at offset {off}")


@pytest.mark.gpu
@pytest.mark.parametrize(("a", "dim"), [("silu", None), ("softmax", -1), ("softmax", 1)])
def test_side_stream_gpu(a, dim):
    """Cached launches go to the current stream: on a side stream, the kernels must wait for
    data that stream writes only after a long sleep (on any other stream they would read it
    before it is there)."""
    x = torch.randn(4, 512, 4, 64, device="cuda")
    act(x, a, dim)  # compile and cache
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        late = torch.empty_like(x)
        torch.cuda._sleep(50_000_000)  # tens of ms
        late.copy_(x)
        y = act(late, a, dim)
    torch.cuda.current_stream().wait_stream(s)
    assert_close(y, act_reference(x.double(), a, dim))
