"""Host cost per call of each op's eager path, next to eager PyTorch and torch.compile.

    PYTHONPATH=shared/src:packages/act/src:packages/lrpe-core/src:packages/lrpe-rotate/src:\
packages/lrpe-cosine/src:packages/flash-attn/src python ci/host_overhead.py \
        [--shape tiny|small|decode] [--no-breakdown] [--profile] [--rounds 5]
    python ci/host_overhead.py --cpu [--rounds 9]     # on a machine without a GPU

Per op, microseconds of host time per call (the clock runs while Python issues the calls, not
while the GPU drains them) for ours, eager PyTorch (the reference) and torch.compile of the
reference: forward without and with autograd recording (x requires grad), and backward
(`y.backward(dy)`), at the tiny, small (1, 256, 32, 128) and decode (8, 1, 32, 128) shapes.
Where this exceeds the kernels' device time, a call costs this much.

Then (unless --no-breakdown), for the act ops, where the microseconds of our eager path go,
step by step (launch, plan lookup, allocation, KernelOp checks, autograd wrapper, validation),
measured by timing nested layers of the path and differencing; Triton's own
`kernel[grid](...)` for the same launch is printed beside the cached launch it replaces (the
"before" of that step). Then the same for lrpe_cosine (act none, softmax over N) and
lrpe_rotate (softmax over D): replayed launch sequence, replay key, KernelOp, validation; for
md_lrpe_cosine (act none, the grid of its suite's host table); and for flash_attn(x, x, x,
causal=True), forward and backward.
--cpu: on CPU, Triton's launch path runs against kernelkit.shared's fake CUDA driver (no
compile; the C launcher replaced by a counter), so every step but the driver call itself is
measured; plans are made for an H100's 132 multiprocessors. The per-op table shows ours only
(eager PyTorch on CPU tensors computes instead of launching) and the kernels each call
launches: Triton's (the fake driver's count) plus torch ops that would launch a GPU kernel.
Absolute numbers depend on the host CPU (a GPU host's Python has been 2-3.5x slower). Two
things that cost only on CPU tensors are kept out: glibc's malloc trimming and growing its heap
around megabyte buffers at every call (`steady_cpu_allocator`), and the autograd engine's sums
of gradients that meet in one tensor (flash_attn(x, x, x): dq + dk + dv, two adds that compute
on CPU, 0.8 ms at the small shape; a launch each on a GPU): flash_attn's autograd rows take
three leaves q, k, v.
--profile: the functions that take the host time of our forward + backward (cProfile), per
op (with --cpu too).
The timing (`per_call_us`, `fwd_bwd_us`, the small and decode shapes) is
`kernelkit.shared.host_time`'s, which the suites' host tables use as well.

To compare with an older checkout, run this script with that checkout's sources first on
PYTHONPATH (the per-op table uses only the public API; the breakdown needs this branch's).
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import sys

from kernelkit.shared import host_time
from kernelkit.shared.host_time import HOST_SHAPES, per_call_us, sync

SHAPES = {"tiny": (1, 64, 2, 64), **HOST_SHAPES}


def op_cases(shape, device="cuda"):
    """(name, ours, eager PyTorch) per op; the lrpe ops at their issue-33 settings (theta (H, E)
    float32, int offset 0)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from kernelkit.act import act
    from kernelkit.act.reference import act_reference
    from kernelkit.lrpe_cosine import lrpe_cosine
    from kernelkit.lrpe_cosine.reference import lrpe_cosine_reference
    from kernelkit.lrpe_rotate import lrpe_rotate
    from kernelkit.lrpe_rotate.reference import lrpe_rotate_reference

    _, _, h, d = shape
    theta = 10000.0 ** (-torch.arange(d, device=device, dtype=torch.float32) / d)
    theta = theta.expand(h, d).contiguous()
    half = theta[:, : d // 2].contiguous()
    yield "act silu", lambda x: act(x, "silu"), lambda x: act_reference(x, "silu")
    yield "act softmax -1", lambda x: act(x, "softmax", -1), lambda x: torch.softmax(x, -1)
    yield "act softmax N", lambda x: act(x, "softmax", 1), lambda x: torch.softmax(x, 1)
    yield (
        "lrpe_rotate none",
        lambda x: lrpe_rotate(x, half),
        lambda x: lrpe_rotate_reference(x, half),
    )
    yield (
        "lrpe_rotate softmax -1",
        lambda x: lrpe_rotate(x, half, 0, "softmax", -1),
        lambda x: lrpe_rotate_reference(x, half, 0, "softmax", -1),
    )
    yield (
        "lrpe_rotate softmax N",
        lambda x: lrpe_rotate(x, half, 0, "softmax", 1),
        lambda x: lrpe_rotate_reference(x, half, 0, "softmax", 1),
    )
    yield (
        "lrpe_cosine none",
        lambda x: lrpe_cosine(x, theta),
        lambda x: lrpe_cosine_reference(x, theta),
    )
    if device == "cuda":  # --cpu: flash_attn has its own breakdown (below the table)
        from kernelkit.flash_attn import flash_attn

        yield (
            "flash_attn causal",
            lambda x: flash_attn(x, x, x, causal=True),
            lambda x: sdpa(*(x.transpose(1, 2),) * 3, is_causal=True),
        )
    yield (
        "lrpe_cosine softmax N",
        lambda x: lrpe_cosine(x, theta, act="softmax", dim=1),
        lambda x: lrpe_cosine_reference(x, theta, 0, "softmax", 1),
    )
    from kernelkit.md_lrpe_cosine import md_lrpe_cosine
    from kernelkit.md_lrpe_cosine.reference import md_lrpe_cosine_reference

    grid, md_theta = md_grid_theta(shape, device)
    yield (
        "md_lrpe_cosine none",
        lambda x: md_lrpe_cosine(x, md_theta, grid),
        lambda x: md_lrpe_cosine_reference(x, md_theta, grid),
    )


def md_grid_theta(shape, device):
    """(grid, theta) of md_lrpe_cosine as in its suite's host table: N tokens as a square grid
    (small: 16 x 16), else one axis (decode: one token per row); theta (H, ceil(D / m))."""
    import torch

    _, n, h, d = shape
    side = math.isqrt(n)
    grid = (side, side) if side > 1 and side * side == n else (n,)
    e = -(-d // len(grid))
    theta = (10000.0 ** (-torch.arange(e, device=device, dtype=torch.float32) / e)).repeat(h, 1)
    return grid, theta


def fwd_bwd_us(f, shape, device="cuda"):
    """(forward, forward with x requiring grad, backward) us per call on a bf16 x of `shape`."""
    import torch

    return host_time.fwd_bwd_us(f, (torch.randn(*shape, device=device, dtype=torch.bfloat16),))


def op_table(shape, profile):
    from kernelkit.shared.bench import torch_compile

    print(f"host us per call, bf16 {shape}: ours / eager PyTorch / torch.compile")
    head = "".join(f"{h:>22s}" for h in ("fwd", "fwd, x requires grad", "bwd"))
    print(f"{'case':22s}{head}")
    for name, ours, ref in op_cases(shape):
        try:
            cols = [fwd_bwd_us(f, shape) for f in (ours, ref, torch_compile(ref))]
        except Exception as e:  # a package mid-refactor must not hide the other rows
            print(f"{name:22s} failed: {type(e).__name__}: {e}")
            continue
        cells = "".join(f"{' / '.join(f'{c[i]:.1f}' for c in cols):>22s}" for i in range(3))
        print(f"{name:22s}{cells}")
        if profile:
            profile_case(ours, shape)


def profile_case(ours, shape, device="cuda"):
    import torch

    x = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = ours(x)
    dy = torch.randn_like(y)
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(200):
            y.backward(dy, retain_graph=True)
            ours(x)
        sync()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


# ---------------------------------------------------------------------------------------------
# Breakdown of the act ops' eager path
# ---------------------------------------------------------------------------------------------


def act_breakdown(shape, device):
    """{case: {step: us}} for silu / softmax -1 / softmax over N, forward and backward."""
    import torch

    import kernelkit.act.launchers as L
    import kernelkit.act.op as O
    from kernelkit.act import act

    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)
    out = torch.empty_like(x)
    cases = [("silu", "silu", None), ("softmax -1", "softmax", 3), ("softmax N", "softmax", 1)]
    return {name: _act_case(O, L, act, a, dim, x, xg, dy, out) for name, a, dim in cases}


def _act_case(O, L, act, a, dim, x, xg, dy, out):
    """O: kernelkit.act.op (the ops), L: kernelkit.act.launchers (the plans)."""
    import torch

    y = act(xg, a, dim)
    y.backward(dy, retain_graph=True)  # builds the forward and backward plans
    yd = y.detach()
    if dim is None:
        fplan = L._PLANS[(id(L.K.act_fwd_kernel), a, x.numel())]
        bplan = L._PLANS[(id(L.K.act_bwd_kernel), a, x.numel())]
        fwd = [
            ("launch (cached)", lambda: fplan(x, out)),
            (
                "+ plan lookup, empty_like",
                lambda: L.run_elementwise(L.K.act_fwd_kernel, torch.empty_like(x), x, act=a),
            ),
            ("+ op body", lambda: O.act_fwd.fn(x, a)),
            ("+ KernelOp checks", lambda: O.act_fwd(x, a)),
        ]
        bwd = [
            ("launch (cached)", lambda: bplan(x, dy, out)),
            (
                "+ plan lookup, empty_like",
                lambda: L.run_elementwise(L.K.act_bwd_kernel, torch.empty_like(x), x, dy, act=a),
            ),
            ("+ op body", lambda: O.act_bwd.fn(x, dy, a)),
            ("+ KernelOp checks", lambda: O.act_bwd(x, dy, a)),
        ]
    else:
        dev = x.get_device()  # contiguous tensors: the plans of act's common call
        fplan = L._PLANS[("fwd dense", dim, dev, x.shape)]
        bplan = L._PLANS[("bwd dense", dim, dev, x.shape)]
        fwd = [
            ("launch (cached)", lambda: fplan(x, out)),
            ("+ plan lookup, empty_like", lambda: L.run_softmax_fwd(x, dim)),
            ("+ op body", lambda: O.softmax_fwd.fn(x, dim)),
            ("+ KernelOp checks", lambda: O.softmax_fwd(x, dim)),
        ]
        bwd = [
            ("launch (cached)", lambda: bplan(yd, dy, out)),
            ("+ plan lookup, empty_like", lambda: L.run_softmax_bwd(yd, dy, dim)),
            ("+ op body", lambda: O.softmax_bwd.fn(yd, dy, dim)),
            ("+ KernelOp checks", lambda: O.softmax_bwd(yd, dy, dim)),
        ]
    fwd.append(("+ validate, use_triton: act(x), no grad", lambda: act(x, a, dim)))
    col = {**_layers("fwd", fwd), **_layers("bwd", bwd)}
    col["fwd: act(x), x requires grad"] = per_call_us(lambda: act(xg, a, dim))

    def backward(y=y):
        xg.grad = None
        y.backward(dy, retain_graph=True)

    col["bwd: y.backward(dy) (engine + our backward)"] = per_call_us(backward)
    return col


def _layers(direction, layers):
    """us of each nested layer and of each step (its layer minus the previous one)."""
    rows, prev = {}, 0.0
    for step, fn in layers:
        if fn is None:
            continue
        total = per_call_us(fn)
        rows[f"{direction}: {step}"] = total - prev
        prev = total
    rows[f"{direction}: total without autograd"] = prev
    return rows


def triton_launch_us(shape, device):
    """Triton's own kernel[grid](...) for the silu forward launch: the launch step before."""
    import torch

    import kernelkit.act.launchers as L

    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    n = x.numel()
    grid = (L.cdiv(n, L.ELEMENTWISE_BLOCK),)
    args = (x, out, n, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1)
    kw = {"ACT": "silu", "FLAT": True, "BLOCK": L.ELEMENTWISE_BLOCK, "num_warps": 8}
    return per_call_us(lambda: L.K.act_fwd_kernel[grid](*args, **kw))


def eager_reference_us(shape, device):
    import torch

    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    y = torch.nn.functional.silu(xg)
    dy = torch.randn_like(x)

    def bwd():
        xg.grad = None
        y.backward(dy, retain_graph=True)

    return {
        "eager torch.add (no grad)": per_call_us(lambda: torch.add(x, x)),
        "eager silu fwd (x requires grad)": per_call_us(lambda: torch.nn.functional.silu(xg)),
        "eager silu bwd: y.backward(dy)": per_call_us(bwd),
    }


def flash_breakdown(shape, device):
    """{step: us} of flash_attn(x, x, x, causal=True)'s eager path, forward and backward: the
    replayed launch sequence (buffers, launches), + its replay key and lookup (launch), +
    the KernelOp, + validation (flash_attn), then the autograd forward and y.backward(dy) on
    three leaves q, k, v (and on a GPU, with q = k = v = x, which adds the engine's gradient
    sums: on CPU tensors those compute, which a GPU host does not)."""
    import torch

    import kernelkit.flash_attn.launch as L
    import kernelkit.flash_attn.op as O
    from kernelkit.flash_attn import flash_attn
    from kernelkit.shared import replay

    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    scale = 1.0 / math.sqrt(shape[-1])  # flash_attn's default
    y = flash_attn(xg, xg, xg, causal=True)
    dy = torch.randn_like(y)
    y.backward(dy, retain_graph=True)
    o, lse = L.forward(x, x, x, True, scale, window=(-1, 0))
    # The recorded sequences of these calls: key (run, options, launch, device, q's shape, ...).
    seqs = {
        key[1][0]: seq
        for key, seq in replay._SEQUENCES._plans.items()
        if key[0] in (L._forward, L._backward)
        and key[1][1:5] == (True, scale, 0.0, (-1, 0))
        and key[3:5] == (x.device, x.shape)
    }
    fwd_in, bwd_in = (x, x, x), (dy, x, x, x, o, lse, None)  # the dense inputs `launch` keys
    fwd = [
        ("buffers (empty_like x2)", lambda: (torch.empty_like(x), torch.empty_like(lse))),
        ("+ launch (replayed sequence)", lambda: seqs["fwd"](fwd_in)),
        ("+ replay key, lookup", lambda: L.forward(x, x, x, True, scale, window=(-1, 0))),
        ("+ KernelOp, attn_fwd", lambda: O.attn_fwd(x, x, x, True, scale, 0.0, -1, 0)),
        ("+ validate: flash_attn(x, x, x)", lambda: flash_attn(x, x, x, causal=True)),
    ]
    bwd_args = (dy, x, x, x, o, lse, None, True, scale)
    bwd = [
        ("replayed sequence (4 buffers, 3 launches)", lambda: seqs["bwd"](bwd_in)),
        ("+ replay key, lookup", lambda: L.backward(*bwd_args, window=(-1, 0))),
        ("+ KernelOp, attn_bwd", lambda: O.attn_bwd(*bwd_args, 0.0, -1, 0)),
    ]
    rows = {**_layers("fwd", fwd), **_layers("bwd", bwd)}
    # Autograd rows on three leaves: with q = k = v = x the engine sums dq + dk + dv into x's
    # gradient (two torch adds, a launch each on a GPU), which on CPU tensors compute 1M
    # elements each (~0.4 ms apiece): 95% of the old 876 us row. The GPU keeps the x, x, x row.
    qg, kg, vg = (x.clone().requires_grad_() for _ in range(3))
    rows["fwd: flash_attn(q, k, v), each requires grad"] = per_call_us(
        lambda: flash_attn(qg, kg, vg, causal=True)
    )
    y3 = flash_attn(qg, kg, vg, causal=True)
    rows["bwd: y.backward(dy) (engine + our backward)"] = _backward_us((qg, kg, vg), y3, dy)
    if device == "cuda":
        rows["bwd: y.backward(dy), q = k = v = x (+ 2 adds)"] = _backward_us((xg,), y, dy)
    return rows


def _backward_us(leaves, y, dy) -> float:
    """Host us per `y.backward(dy)` (the engine and our backward), the gradients of `leaves` (a
    tensor or a tuple of them) reset."""
    leaves = leaves if isinstance(leaves, tuple) else (leaves,)

    def backward():
        for t in leaves:
            t.grad = None
        y.backward(dy, retain_graph=True)

    return per_call_us(backward)


def lrpe_breakdown(shape, device):
    """{case: {step: us}} of lrpe_cosine (act none, softmax over N) and lrpe_rotate (softmax
    over D) forward: the replayed launch sequence (allocations, launches), + the replay key and
    lookup (launch.forward), + the KernelOp (fwd / fwd_seq), + validation (the public call),
    then the public call with x requiring grad and y.backward(dy)."""
    import torch

    import kernelkit.lrpe_cosine.launch as CL
    import kernelkit.lrpe_cosine.op as CO
    import kernelkit.lrpe_rotate.launch as RL
    import kernelkit.lrpe_rotate.op as RO
    from kernelkit.lrpe_cosine import lrpe_cosine
    from kernelkit.lrpe_rotate import lrpe_rotate
    from kernelkit.shared import replay

    _, _, h, d = shape
    theta = (10000.0 ** (-torch.arange(d, device=device, dtype=torch.float32) / d)).expand(h, d)
    theta = theta.contiguous()
    half = theta[:, : d // 2].contiguous()
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    cases = [
        ("cosine none", lrpe_cosine, CL, CO.fwd, theta, "none", None, "none"),
        ("cosine softmax N", lrpe_cosine, CL, CO.fwd_seq, theta, "softmax", 1, "softmax_seq"),
        ("rotate softmax -1", lrpe_rotate, RL, RO.fwd, half, "softmax", -1, "softmax"),
    ]
    cols = {}
    for name, public, L, op, th, act, dim, kind in cases:
        y = public(xg, th, 0, act, dim)
        dy = torch.randn_like(y)
        y.backward(dy, retain_graph=True)
        inputs = (x, th, 0, None, None, None)
        seq = next(  # the key: run, options (kind first), launch, device, x's layout, ...
            s
            for k, s in replay._SEQUENCES._plans.items()
            if k[0] is L._forward and k[1][0] == kind and k[4:6] == (x.shape, x.stride())
        )
        seq_kind = () if op is CO.fwd_seq or op is RO.fwd_seq else (kind,)
        fwd = [
            ("replayed sequence (allocations, launches)", lambda s=seq, i=inputs: s(i)),
            (
                "+ replay key, lookup",
                lambda L=L, th=th, k=kind: L.forward(x, th, 0, None, None, None, k),
            ),
            ("+ KernelOp", lambda op=op, th=th, k=seq_kind: op(x, th, 0, None, None, None, *k)),
            (
                "+ validate, theta: public call",
                lambda f=public, th=th, a=act, dm=dim: f(x, th, 0, a, dm),
            ),
        ]
        col = _layers("fwd", fwd)
        col["fwd: public call, x requires grad"] = per_call_us(
            lambda f=public, th=th, a=act, dm=dim: f(xg, th, 0, a, dm)
        )

        def backward(y=y, dy=dy):
            xg.grad = None
            y.backward(dy, retain_graph=True)

        col["bwd: y.backward(dy) (engine + our backward)"] = per_call_us(backward)
        cols[name] = col
    return cols


def md_breakdown(shape, device):
    """{step: us} of md_lrpe_cosine (act none, its suite's grid) forward: the replayed launch
    sequence, + the replay key and lookup (lrpe-cosine's launch.forward with the grid), + the
    op's function (fwd_plain: its Grid), + the KernelOp, + validation (the public call), then
    the public call with x requiring grad and y.backward(dy)."""
    import torch

    import kernelkit.lrpe_cosine.launch as CL
    import kernelkit.md_lrpe_cosine.op as M
    from kernelkit.md_lrpe_cosine import md_lrpe_cosine
    from kernelkit.shared import replay

    grid, theta = md_grid_theta(shape, device)
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    y = md_lrpe_cosine(xg, theta, grid)
    dy = torch.randn_like(y)
    y.backward(dy, retain_graph=True)
    g, shape_list = M._grid(theta, grid, 0), list(grid)
    seq = next(  # the key: run, options (kind, grid, ...), launch, device, x's layout, ...
        s
        for k, s in replay._SEQUENCES._plans.items()
        if k[0] is CL._forward and k[1][1] is g and k[4:6] == (x.shape, x.stride())
    )
    inputs = (x, theta, 0, None, None, None)
    fwd = [
        ("replayed sequence (allocation, launch)", lambda: seq(inputs)),
        ("+ replay key, lookup", lambda: CL.forward(x, theta, *inputs[2:], "none", grid=g)),
        ("+ op function (its Grid)", lambda: M.fwd_plain.fn(x, theta, shape_list, 0, "none")),
        ("+ KernelOp", lambda: M.fwd_plain(x, theta, shape_list, 0, "none")),
        ("+ validate: public call", lambda: md_lrpe_cosine(x, theta, grid)),
    ]
    rows = _layers("fwd", fwd)
    rows["fwd: public call, x requires grad"] = per_call_us(lambda: md_lrpe_cosine(xg, theta, grid))

    rows["bwd: y.backward(dy) (engine + our backward)"] = _backward_us(xg, y, dy)
    return rows


def print_md_breakdown(shape, device):
    grid, _ = md_grid_theta(shape, device)
    print(f"\nmd_lrpe_cosine(x, theta, {grid}) eager path, us per call, bf16 {shape} on {device}")
    for row, us in md_breakdown(shape, device).items():
        print(f"{row:46s}{us:12.2f}")


def print_lrpe_breakdown(shape, device):
    cols = lrpe_breakdown(shape, device)
    names = list(cols)
    print(f"\nlrpe eager forward, us per call, bf16 {shape} on {device} (steps are differences)")
    print(f"{'step':46s}" + "".join(f"{n:>19s}" for n in names))
    for row in cols[names[0]]:
        print(f"{row:46s}" + "".join(f"{cols[n][row]:19.2f}" for n in names))


def print_flash_breakdown(shape, device):
    print(f"\nflash_attn(x, x, x, causal=True) eager path, us per call, bf16 {shape} on {device}")
    for row, us in flash_breakdown(shape, device).items():
        print(f"{row:46s}{us:12.2f}")


def print_breakdown(shape, device):
    cols = act_breakdown(shape, device)
    names = list(cols)
    rows = list(dict.fromkeys(r for n in names for r in cols[n]))
    print(f"\nact eager path, us per call, bf16 {shape} on {device} (steps are differences)")
    print(f"{'step':46s}" + "".join(f"{n:>12s}" for n in names))
    for row in rows:
        cells = "".join(f"{cols[n][row]:12.2f}" if row in cols[n] else " " * 12 for n in names)
        print(f"{row:46s}{cells}")
    row = "Triton kernel[grid](...) for the silu launch"
    print(f"{row:46s}{triton_launch_us(shape, device):12.2f}")
    # On CPU, eager PyTorch at this size is compute: its dispatch cost shows on a tiny tensor.
    ref_shape = shape if device == "cuda" else (1, 1, 1, 8)
    for row, us in eager_reference_us(ref_shape, device).items():
        print(f"{row + ('' if ref_shape == shape else ' (tiny)'):46s}{us:12.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="breakdowns on CPU (fake driver)")
    ap.add_argument("--rounds", type=int, default=5, help="timed loops (the best counts)")
    args = ap.parse_args()
    host_time.ROUNDS = args.rounds
    if args.cpu:
        names = [args.shape] if args.shape else ["small", "decode"]
        shape = SHAPES[args.shape or "small"]
        return cpu_breakdown(shape, names, not args.no_breakdown, args.profile)
    for name in [args.shape] if args.shape else ["tiny", "small", "decode"]:
        op_table(SHAPES[name], args.profile)
        print()
    if args.no_breakdown:
        return None
    try:
        import kernelkit.act.launchers  # noqa: F401 (the plans the breakdown reads)
    except ImportError:  # an older checkout: no cached plans (or not in this module)
        print("breakdown: not available for this checkout (no cached launch plans)")
        return None
    print_breakdown(SHAPES[args.shape or "small"], "cuda")
    print_lrpe_breakdown(SHAPES[args.shape or "small"], "cuda")
    print_md_breakdown(SHAPES[args.shape or "small"], "cuda")
    return print_flash_breakdown(SHAPES[args.shape or "small"], "cuda")


def cpu_breakdown(shape, shapes, breakdown=True, profile=False):
    """Run the ops' GPU launch path on CPU tensors against the fake CUDA driver: the per-op
    table at `shapes` (ours only: eager PyTorch on CPU tensors computes), then the act and
    flash_attn breakdowns at `shape`."""
    os.environ.pop("TRITON_INTERPRET", None)
    if "kernelkit.act" in sys.modules:
        raise RuntimeError("--cpu must patch use_triton before kernelkit.act is imported")
    import torch

    import kernelkit.shared.runtime as runtime
    from kernelkit.shared.fake_driver import fake_cuda

    runtime.use_triton = lambda t: True  # CPU tensors take the Triton path
    runtime.num_sms = lambda device: CPU_SMS  # plans (chunk counts, grids) as on an H100
    # One thread: torch's CPU ops stand for GPU launches here, and intra-op threads on a small
    # tensor cost milliseconds on a shared 2-core machine (torch.exp of 8192 floats: 7 ms).
    torch.set_num_threads(1)
    # The fake launches write nothing: buffers hold whatever memory held, and denormals in it
    # make CPU arithmetic on them (a torch op between launches) slow.
    torch.set_flush_denormal(True)
    steady_cpu_allocator()
    with fake_cuda(record=False) as log:
        for name in shapes:
            cpu_op_table(SHAPES[name], log, profile)
            print()
        if breakdown:
            print_breakdown(shape, "cpu")
            print_lrpe_breakdown(shape, "cpu")
            print_md_breakdown(shape, "cpu")
            print_flash_breakdown(shape, "cpu")


CPU_SMS = 132  # --cpu: the multiprocessors plans see (an H100 SXM's)


def steady_cpu_allocator() -> None:
    """--cpu: let glibc's malloc keep what is freed, as CUDA's caching allocator does. A call
    that allocates megabyte buffers (flash_attn's backward: 3 x 2 MiB at the small shape)
    otherwise finds glibc in one of two states, depending on what ran before: served from the
    heap it grows and trims the heap every call (3 brk system calls and 2 page faults per call,
    +15-20 us), or not. Buffers up to 32 MiB then come from the heap, which is never trimmed.
    No-op where the C library has no mallopt."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 1 << 30)


# aten ops that run no kernel on a GPU (besides views, which say so themselves)
_NO_KERNEL = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}


def kernels_per_call(fn, log) -> tuple[int, list[str]]:
    """(Triton launches, torch ops that launch a GPU kernel) of one fn() on CPU tensors: the
    fake driver's count, and the aten ops that are neither views nor allocations."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
                ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    before = log.count
    with Count():
        fn()
    return log.count - before, ops


def cpu_op_table(shape, log, profile=False):
    """Host us per call of our ops on CPU (fake driver), forward, forward with x requiring
    grad, backward, and the kernels each launches: Triton's + torch ops' (aten kernels)."""
    import torch

    print(f"host us per call, ours, bf16 {shape} on cpu (fake driver, plans for {CPU_SMS} SMs)")
    cols = ("fwd", "fwd, grad", "bwd", "launches f/g/b", "us/launch f/g/b")
    print(
        f"{'case':24s}" + "".join(f"{c:>10s}" for c in cols[:3]) + f"{cols[3]:>16s}{cols[4]:>22s}"
    )
    for name, ours, _ in op_cases(shape, "cpu"):
        us = fwd_bwd_us(ours, shape, "cpu")
        x = torch.randn(*shape, dtype=torch.bfloat16)
        xg = x.clone().requires_grad_()
        y = ours(xg)
        dy = torch.randn_like(y)
        y.backward(dy, retain_graph=True)

        def bwd(y=y, dy=dy, xg=xg):
            xg.grad = None
            y.backward(dy, retain_graph=True)

        counts, extra = [], []
        for fn in (lambda f=ours, x=x: f(x), lambda f=ours, x=xg: f(x), bwd):
            launches, ops = kernels_per_call(fn, log)
            counts.append(launches + len(ops))
            extra.append(ops)
        per = "/".join(f"{t / max(c, 1):.1f}" for t, c in zip(us, counts))
        cells = "".join(f"{t:10.1f}" for t in us)
        print(f"{name:24s}{cells}{'/'.join(map(str, counts)):>16s}{per:>22s}")
        for direction, ops in zip(("fwd", "fwd, grad", "bwd"), extra):
            if ops:
                print(f"{'':26s}{direction} torch kernels: {' '.join(ops)}")
        if profile:
            profile_case(ours, shape, "cpu")


if __name__ == "__main__":
    main()
