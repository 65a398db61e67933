"""What the Gluon kernels (sm_90a) share: the Hopper language imports, constants and `aggregate`.
Gluon has no interpreter: CI compiles these kernels for sm_90a on CPU (tests) and the GPU tests
run them.

The partitions of a kernel (gl.warp_specialize) take its shared memory, barriers, descriptors
and scalars as one `@aggregate` value (as Triton's Gluon tutorials do), not as long argument
lists: a class with annotated fields and a `@gluon.constexpr_function` `__init__`, whose
methods may be `@gluon.jit`. The compiler flattens an aggregate into its fields, so passing one
costs nothing; a worker partition captures only the fields it reads (in the order they first
appear in the workers' arguments; the partition ops drop unused and duplicate captures)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Triton 3.6 has no public name for it yet (newer versions export gluon.aggregate).
from triton.language.core import _aggregate as aggregate

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)

# The annotation of an aggregate field holding a kernel argument that Triton may have turned
# into a constexpr: an integer equal to 1 (value specialization) or None (an unused pointer).
MaybeConstexpr = (gl.tensor, gl.constexpr)


@gluon.constexpr_function  # (a plain function would break the kernels' cache keys)
def maybe_constexpr(x):
    """A `MaybeConstexpr` field's value from a constexpr_function's argument (which unwraps
    constexprs)."""
    return x if isinstance(x, gl.tensor) else gl.constexpr(x)


@gluon.constexpr_function
def wgmma_layout(n):
    """The register layout of one warpgroup's (4 warps) wgmma accumulator of n columns (and of
    the m64 row blocks stacked under it)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def tanh_approx(x):
    """tanh(x) by tanh.approx.f32 (the portable kernels' SOFTCAP == 2): the capped scores."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)  # fmt: skip


@gluon.jit
def zero_counter_kernel(CTR):
    """A dynamic walk's tile counter set to 0 (one int32): launched before the Gluon forward and
    backward that take their tiles from it."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.store(CTR + gl.arange(0, 1, layout=one), gl.zeros([1], gl.int32, one))


__all__ = ["LN2", "LOG2E", "MaybeConstexpr", "aggregate", "fence_async_shared", "gl", "gluon",
           "maybe_constexpr", "mbarrier", "tanh_approx", "tma", "warpgroup_mma",
           "warpgroup_mma_wait", "wgmma_layout", "zero_counter_kernel"]  # fmt: skip
