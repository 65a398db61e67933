"""What the Gluon kernels (sm_90a) share: the Hopper language imports and constants. Gluon has
no interpreter: CI compiles these kernels for sm_90a on CPU (tests) and the GPU tests run them."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)

__all__ = ["LN2", "LOG2E", "fence_async_shared", "gl", "gluon", "mbarrier", "tma",
           "warpgroup_mma", "warpgroup_mma_wait"]  # fmt: skip
