"""A stand-in for Triton's CUDA driver: the eager launch paths of kernelkit.shared (the direct
one, `fast_launch`, and Triton's own) run, unchanged, on a machine without a GPU.

Inside `fake_cuda()`, Triton's `JITFunction.run` binds, specialises and keys arguments exactly as
on a GPU, but "compiles" a `FakeCompiled` per specialisation key (no code generation) whose
launcher records each launch (grid, stream, function, arguments) instead of calling the driver.
Used by the launcher's unit tests (is the compiled kernel picked for a call the one Triton would
pick?) and by `ci/host_overhead.py --cpu`, which times the host path of an op on CPU.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

__all__ = ["FakeCompiled", "FakeLaunches", "fake_cuda"]


class FakeLaunches:
    """What the fake launchers saw: `launches` holds (grid, stream, function, args) tuples and
    `scratch` the global scratch memory each of them got, `compiled` the FakeCompiled kernels in
    the order Triton asked for them, `count` the number of launches (also those of launchers
    made while `record` was off, which record nothing)."""

    def __init__(self, record: bool = True):
        self.record = record
        self.count = 0  # launches seen, recorded or not
        self.launches: list[tuple] = []
        self.compiled: list[FakeCompiled] = []
        self.device = 0
        self.stream = 0x5EED
        self.capturing = False  # what the launch path sees as "the stream is being captured"
        self.scratch_size = 0  # global scratch bytes a program of kernels compiled from now on
        self.scratch: list = []  # the global scratch each recorded launch got

    def tick(self, *args) -> None:
        """The launch function of launchers made while not recording: counts, nothing else."""
        self.count += 1


def _launcher_class():
    from triton.backends.nvidia.driver import CudaLauncher

    class FakeLauncher(CudaLauncher):
        """CudaLauncher with its C `launch` replaced: reads each tensor's data_ptr (as the C
        launcher does) and records the launch; only counts it when not recording."""

        def __init__(self, log: FakeLaunches):
            self.num_ctas = 1
            self.global_scratch_size, self.profile_scratch_size = log.scratch_size, 0
            self.global_scratch_align = 128 if log.scratch_size else 1
            self.profile_scratch_align = 1
            self.launch_cooperative_grid = self.launch_pdl = False
            self._log = log
            if not log.record:  # timing the host path: the cheapest possible stand-in
                self.launch = log.tick

        def launch(self, gx, gy, gz, stream, function, coop, pdl, gscr, pscr, *rest):
            self._log.count += 1
            _packed, meta, enter, exit_, *args = rest
            if enter is not None:
                enter(meta)
            for a in args:
                if type(a) is torch.Tensor:
                    a.data_ptr()
            if exit_ is not None:
                exit_(meta)
            if self._log.record:
                self._log.launches.append(((gx, gy, gz), stream, function, tuple(args)))
                self._log.scratch.append(gscr)

    return FakeLauncher


def _compiled_class():
    from triton.compiler.compiler import CompiledKernel

    class FakeCompiled(CompiledKernel):
        """A CompiledKernel with no binary: `key` is Triton's cache key for it and `function`
        a handle unique to that key."""

        _handles = itertools.count(0x1000)

        def __init__(self, key, signature, constexprs, options, launcher):
            self.key, self.signature, self.constexprs, self.options = (
                key,
                signature,
                constexprs,
                options,
            )
            self.module, self.name, self.src, self.metadata = object(), "fake", None, None
            self.function = next(self._handles)
            self.packed_metadata = (options.num_warps, 1, 0)
            self._run = launcher

    return FakeCompiled


FakeCompiled = None  # the class, created on first use (it needs triton's compiler module)


class _FakeDriver:
    def __init__(self, log: FakeLaunches):
        from triton.backends.compiler import GPUTarget

        self._log = log
        self._target = GPUTarget("cuda", 90, 32)

        class _Utils:
            def get_device_properties(self, device):
                return {"max_shared_mem": 232448, "multiprocessor_count": 132}

        self.utils = _Utils()

    def get_current_device(self):
        return self._log.device

    def get_current_stream(self, device):
        return self._log.stream

    def get_current_target(self):
        return self._target

    def get_device_capability(self, device=None):
        return (9, 0)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


@contextlib.contextmanager
def fake_cuda(record: bool = True) -> Iterator[FakeLaunches]:
    """Within the block, Triton launches (kernel[grid] and kernelkit's cached path) go to the
    fake driver; yields the FakeLaunches log. Set `log.device` / `log.stream` /
    `log.capturing` to change what the launch path sees as the current device and stream and
    whether that stream is being captured into a CUDA graph, `log.scratch_size` to give the
    kernels compiled next global scratch memory (Triton's device-side TMA descriptors need it).
    The kernels' and launchers' caches keep the fake kernels afterwards: use it where nothing
    launches for real."""
    global FakeCompiled
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from . import fast_launch

    if FakeCompiled is None:
        FakeCompiled = _compiled_class()
    log = FakeLaunches(record)
    launcher_cls = _launcher_class()

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = FakeCompiled(key, signature, constexprs, options, launcher_cls(log))
        self.device_caches[device][0][key] = kernel
        log.compiled.append(kernel)
        return kernel

    fl = fast_launch
    saved = (JITFunction._do_compile, fl._get_device, fl._get_stream, fl._capturing, driver._active)
    driver.set_active(_FakeDriver(log))
    JITFunction._do_compile = do_compile
    fl._get_device = lambda: log.device
    fl._get_stream = lambda device: log.stream
    fl._capturing = lambda: log.capturing
    try:
        yield log
    finally:
        (JITFunction._do_compile, fl._get_device, fl._get_stream, fl._capturing,
         driver._active) = saved  # fmt: skip
