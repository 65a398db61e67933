"""A/B of lrpe-rotate's wave rule for grids of few heads, with lrpe-cosine beside it, on a GPU.

    ROOT=$(pwd)  # the repository root
    PYTHONPATH=$ROOT/shared/src:$ROOT/packages/lrpe-core/src:$ROOT/packages/lrpe-rotate/src:\
$ROOT/packages/lrpe-cosine/src:$ROOT/packages/act/src:$ROOT/packages/lrpe-rotate/benchmarks \
    python packages/lrpe-rotate/benchmarks/gqa_ab.py [--rounds 3] [--extra 8,24]

The rule: lrpe-rotate splits batch rows into groups until about `Plan.programs_per_sm` programs
per SM, 16 now ("wave"), 4 before ("former"). At GQA keys/values (8, 4096, 8, 128) the former
rule ran 1024 programs of 8 batch rows (1.55 waves of the 660 that fit at 5 a SM), the wave
rule runs 3072 of 3 rows; the training shape (8, 4096, 32, 128) has 4096 programs either way
(a control: its rows must not move). lrpe-cosine has no rule change (4096 programs at GQA
already): its two columns run the same plan and show the A/B's noise.

Per (op, shape, act, direction): the public op as the suite times it (forward: op(x, theta,
act); backward: y.backward(dy) with x, and theta for "+dtheta", requiring grad, gradients reset
between repetitions), the rules interleaved (kernelkit.shared.bench.interleaved_ms, median of
`--rounds`), in ms, GB/s and % of copy bandwidth with the suite's traffic (rotate: fwd 2 units
of x, bwd 2 + 1 when x is read; cosine: fwd 3, bwd 3 + 1). "device": the kernels' own time per
call from torch.profiler (L2 flushed between calls; no host in it). Where ms is well above
device, the call waits on the host (autograd, the op's Python, d(theta)'s reduction ops) and
no launch plan changes it. `--extra 8,24` adds rotate variants with those programs per SM.
Without a GPU: one tiny call per cell under the Triton interpreter, checking that the rules
give the same outputs (no timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch

from kernelkit.lrpe_cosine import lrpe_cosine
from kernelkit.lrpe_rotate import kernels as RK
from kernelkit.lrpe_rotate import lrpe_rotate

SHAPES = {"gqa_kv": (8, 4096, 8, 128), "train": (8, 4096, 32, 128)}
CASES = [  # (direction, act, theta requires grad)
    ("fwd", "none", False),
    ("fwd", "silu", False),
    ("bwd", "none", False),
    ("bwd", "none", True),
    ("bwd", "silu", False),
    ("bwd", "silu", True),
]
WAVE = RK.PLAN
DEVICE = "cuda"
FORMER = dataclasses.replace(RK.PLAN, programs_per_sm=4)


def theta_of(op, h, d, device, grad):
    """theta as the suites build it: (H, D/2) for rotate, (H, D) for cosine, float32."""
    e = d // 2 if op == "rotate" else d
    theta = (10000.0 ** (-torch.arange(e, device=device, dtype=torch.float32) / e)).repeat(h, 1)
    return theta.requires_grad_(grad)


def traffic(op, direction, act, x, theta_grad) -> int:
    base = 2 if op == "rotate" else 3
    units = base if direction == "fwd" else base + (act != "none" or theta_grad)
    return units * x.numel() * x.element_size()


def with_plan(plan, fn):
    """fn with lrpe-rotate's module PLAN set first (read per call; the plan keys the cache)."""

    def call():
        RK.PLAN = plan
        return fn()

    return call


def plan_label(shape, plan) -> str:
    """Grid and batch rows per program of the rotate plan for `shape` on this device."""
    x = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
    theta = torch.empty(shape[2], shape[3] // 2, device=DEVICE)
    grid, kw = RK._rotate_layout(x, theta, None, None, None, "none", plan)
    return f"grid {grid[0]}x{grid[1]} = {grid[0] * grid[1]} programs, {kw['rows_per_program']} rows"


def device_ms(fn, grads, calls=10) -> tuple[float, int] | None:
    """(kernel time per call in ms, kernels per call) from torch.profiler, L2 flushed between
    calls (the flush's fill or memset not counted); None if the profiler gives nothing."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device=DEVICE)
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                flush.zero_()
                for g in grads:
                    g.grad = None
                fn()
            torch.cuda.synchronize()
        total_us, kernels = 0.0, 0
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0.0)
            if t <= 0 or "fill" in e.key.lower() or "memset" in e.key.lower():
                continue
            total_us += t
            kernels += e.count
        return (total_us / calls / 1e3, round(kernels / calls)) if total_us > 0 else None
    except Exception as err:  # the timing columns still stand without it
        print(f"    (profiler: {type(err).__name__}: {err})")
        return None


def cell_fns(op, shape, direction, act, theta_grad, variants):
    """({name: callable}, grads to reset, x) of one cell; the same inputs for every variant."""
    fn = lrpe_rotate if op == "rotate" else lrpe_cosine
    h, d = shape[2], shape[3]
    x = torch.randn(shape, dtype=torch.bfloat16, device=DEVICE, requires_grad=direction == "bwd")
    theta = theta_of(op, h, d, DEVICE, theta_grad)
    grads = []
    if direction == "fwd":
        base = functools.partial(fn, x, theta, act=act)
    else:
        y = fn(x, theta, act=act)
        dy = torch.randn_like(y)
        grads = [x, theta] if theta_grad else [x]

        def base():
            y.backward(dy, retain_graph=True)

    if op == "rotate":
        fns = {name: with_plan(plan, base) for name, plan in variants.items()}
    else:  # no rule change in lrpe-cosine: the same plan twice (the A/B's noise)
        fns = {name: base for name in variants}
    return fns, grads, x


def run_gpu(rounds: int, extra: list[int]) -> None:
    from kernelkit.shared.bench import copy_bandwidth_gbs, interleaved_ms

    copy = copy_bandwidth_gbs()
    variants = {"former": FORMER, "wave": WAVE}
    for pps in extra:
        variants[f"pps{pps}"] = dataclasses.replace(RK.PLAN, programs_per_sm=pps)
    print(f"{torch.cuda.get_device_name()} · copy bandwidth {copy:.0f} GB/s · rounds {rounds}")
    for shape_name, shape in SHAPES.items():
        for name, plan in variants.items():
            print(f"rotate {shape_name} {name:7s}: {plan_label(shape, plan)}")
    print("cell | per variant: ms (spread) GB/s % of copy [device ms, % of copy, kernels] | gain")
    for op in ("rotate", "cosine"):
        names = list(variants) if op == "rotate" else ["former", "wave"]
        for shape_name, shape in SHAPES.items():
            for direction, act, theta_grad in CASES:
                chosen = {k: variants[k] for k in names}
                fns, grads, x = cell_fns(op, shape, direction, act, theta_grad, chosen)
                nbytes = traffic(op, direction, act, x, theta_grad)
                times = interleaved_ms(fns, rounds, grad_to_none=grads)
                label = f"{op} {shape_name} {direction} {act}{' +dtheta' if theta_grad else ''}"
                parts = []
                for name, (ms, spread) in times.items():
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    dev = device_ms(fns[name], grads)
                    where = "device n/a"
                    if dev is not None:
                        dms, kernels = dev
                        dpct = 100 * nbytes / (dms * 1e-3) / 1e9 / copy
                        where = f"device {dms:.4f} {dpct:3.0f}% k{kernels}"
                    parts.append(
                        f"{name} {ms:.4f} ({spread:4.1%}) {gbs:5.0f} {100 * gbs / copy:3.0f}% "
                        f"[{where}]"
                    )
                gain = times["former"][0] / times["wave"][0]
                print(f"{label:34s} | " + " | ".join(parts) + f" | x{gain:.3f}", flush=True)
                del fns, grads, x
                torch.cuda.empty_cache()
    RK.PLAN = WAVE


def run_cpu() -> None:
    """No GPU: each cell once at a tiny shape under the interpreter, rules compared."""
    shape = (4, 40, 2, 16)
    for op, fn in (("rotate", lrpe_rotate), ("cosine", lrpe_cosine)):
        for direction, act, theta_grad in CASES:
            out = {}
            for name, plan in (("former", FORMER), ("wave", WAVE)):
                RK.PLAN = plan
                g = torch.Generator().manual_seed(0)
                x = torch.randn(shape, generator=g).requires_grad_(direction == "bwd")
                theta = theta_of(op, shape[2], shape[3], "cpu", theta_grad)
                y = fn(x, theta, act=act)
                if direction == "bwd":
                    y.backward(torch.ones_like(y))
                    out[name] = (x.grad, theta.grad)
                else:
                    out[name] = (y.detach(), None)
            same = torch.equal(out["former"][0], out["wave"][0])
            print(f"{op} {direction} {act}{' +dtheta' if theta_grad else ''}: same output {same}")
    RK.PLAN = WAVE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--extra", default="", help="more rotate programs_per_sm values, e.g. 8,24")
    args = ap.parse_args()
    extra = [int(v) for v in args.extra.split(",") if v]
    if torch.cuda.is_available():
        run_gpu(args.rounds, extra)
    else:
        print("no GPU: smoke run under the interpreter (no timing)")
        run_cpu()


if __name__ == "__main__":
    main()
