"""A kernel that holds streaming multiprocessors while another kernel runs (GPU tests of the
persistent walks; imported as `sm_hold` from beside the tests, as fa_testing.py is).

`hold_kernel` programs take so much shared memory (HOLD_SMEM) that no Gluon backward program
fits beside one on its SM, and spin until an int32 in global memory (a dynamic walk's tile
counter) reaches a value, or until a time limit passes, which they report. Launched on one
stream before a persistent kernel on another, they leave that kernel only the SMs they do not
hold: its programs cannot all be resident at once."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# Shared memory per holding program: more than half of an sm_90 SM's 228 KB (one holder per
# SM), and more than 228 KB less the smallest Gluon backward program's (~137 KB).
HOLD_SMEM = 160 * 1024


@gluon.jit
def _globaltimer(x):
    """The GPU's nanosecond timer (x: any int32 scalar, unused)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=gl.int64,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _ld_volatile(ptr):
    return gl.inline_asm_elementwise("ld.volatile.global.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def hold_kernel(WATCH, until, TIMED_OUT, limit_ns, SMEM: gl.constexpr):
    """Hold this program's SM (SMEM bytes of shared memory) until the int32 at WATCH reaches
    `until` or `limit_ns` nanoseconds have passed; TIMED_OUT[program] = 1 where the limit
    passed first, else 0. Launch with num_warps=4."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    rows: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    # (two buffers: an allocation's shape is a power of 2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    buf = gl.allocate_shared_memory(gl.int32, [SMEM // 5], flat)
    more = gl.allocate_shared_memory(gl.int32, [SMEM // 20], flat)
    buf.slice(0, 128).store(gl.zeros([128], gl.int32, rows))
    more.slice(0, 128).store(gl.zeros([128], gl.int32, rows))
    t0 = _globaltimer(until)
    while (_ld_volatile(WATCH) < until) & (_globaltimer(until) - t0 < limit_ns):
        pass
    late = (_ld_volatile(WATCH) < until).to(gl.int32)
    # (reading the buffer back keeps its allocation: it adds 0)
    late = late + gl.max(buf.slice(0, 128).load(rows) + more.slice(0, 128).load(rows), axis=0)
    gl.store(
        TIMED_OUT + gl.program_id(0) + gl.arange(0, 1, layout=one),
        gl.zeros([1], gl.int32, one) + late,
    )
