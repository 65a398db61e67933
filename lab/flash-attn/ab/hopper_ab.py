"""Issue 14 (flash-attn on Hopper at cuDNN speed): the candidates side by side in one GPU call.

    PYTHONPATH=packages/flash-attn/src:shared/src python lab/flash-attn/ab/hopper_ab.py
    ... hopper_ab.py --screen          # on CPU, no GPU: compile every launch below for sm_90a
    TRITON_INTERPRET=1 ... hopper_ab.py --dry-run --workers 2   # on CPU: the script's own logic

The GPU run (about 3 minutes on an H100; --budget caps the timing part):
1. compile + correctness (--workers processes, killed after --warm-timeout s): every candidate
   against the current plan on the timed layout at N = 1024 and on a ragged GQA shape with
   Nq != Nk: max abs differences of o, lse, dq, dk, dv, beside the current plan's own difference
   from a float32 evaluation of the reference; PASS when each is within 3x that noise (+1e-3).
   A candidate that fails or does not finish (a hang) is excluded from the timing. Their
   compiles land in Triton's on-disk cache, which then serves the timing process.
2. timing: forward and backward apart, ms medians of round-robin passes
   (kernelkit.shared.bench.interleaved_ms, as tune.py --ab) of the current plan, every candidate
   that changes that direction's kernels, SDPA flash and SDPA cuDNN, at N = 16k, the leaderboard
   shape (B = 16, H = 1, N = 16k, d = 64, causal), then N = 4k (B = 16384 / N, H = 2048 / d) for
   d64/d128 causal/non-causal; a compact TFLOP/s table and the leaderboard fwd+bwd sums at the end.

Candidates (`CANDIDATES`): G1 the Gluon forward (kernels_gluon.py, Tile.gluon) with the current
backward tiles; P the portable dk/dv kernel, B* Gluon dk/dv tiles, with the current forward and
dq. (The Triton warp-specialised candidates of the first run were removed: wrong results on the
H100; so were the Gluon backward's fused-dq variants, 1.4-2x slower: NOTES.md.)
`--screen` compiles each launch of the run in a child process (Triton's Hopper
warp-specialisation pass aborts the process on loops it cannot handle) and prints registers,
spill stack, shared memory, warps, whether the kernel was warp-specialised and its setmaxnreg
counts: every launch of the GPU run compiles there first (NOTES.md).
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from kernelkit.flash_attn import launchers as fa_launchers
from kernelkit.flash_attn import plans as fa_plans
from kernelkit.flash_attn.plans import Plan, Tile
from kernelkit.shared import runtime

CASES = [(64, False), (64, True), (128, False), (128, True)]  # (d, causal)
NS = (16384, 4096)
TOKENS, HIDDEN = 16384, 2048  # B * N and H * d of the timed shapes
LEADERBOARD = (16, 1, 16384, 64)  # B, H, N, d; causal
CHECK_N, RAGGED = 1024, ((1000, 1100), (1100, 1000))  # correctness shapes (Nq, Nk: full, causal)
DEVICE = "cuda"


def gluon(bm, bn, stages):
    """A tile of the Gluon forward (kernels_gluon.py): 2 x 64 rows, a `stages`-deep K/V ring."""
    return Tile(bm, bn, 4, stages, tma=True, gluon=True)


def gluon_bwd(bm, stages):
    """A tile of the Gluon backward (kernels_gluon.py): 2 x 64 keys, `bm` query rows per step,
    a `stages`-deep q/do ring."""
    return Tile(bm, 128, 4, stages, tma=True, gluon=True)


# name -> {d: (fwd, dk/dv, dq)}, None = the current plan's tile; "portable": the portable dk/dv
# tile of that case (plans.portable_dkdv). Screened for sm_90a (--screen): shared memory
# <= 227 KB. G1's tile is the shipped Gluon forward tile, B2 / B4's d = 128 tiles the shipped
# Gluon dk/dv tiles (causal / not).
FUSED = fa_plans.GLUON_FUSED_DQ  # dq summed in the Gluon dk/dv kernel
CANDIDATES = {
    "G1": {64: (gluon(128, 128, 2), None, None), 128: (gluon(128, 128, 2), None, None)},
    "P": {64: (None, "portable", None), 128: (None, "portable", None)},
    "B2": {64: (None, gluon_bwd(64, 2), None), 128: (None, gluon_bwd(64, 2), None)},
    "B4": {64: (None, gluon_bwd(128, 2), None), 128: (None, gluon_bwd(64, 3), None)},
    "F": {64: (None, gluon_bwd(64, 2), FUSED), 128: (None, gluon_bwd(64, 2), FUSED)},
    "Fa": {64: (None, gluon_bwd(64, 2), FUSED), 128: (None, gluon_bwd(64, 2), FUSED)},
}
# Candidates timed with deterministic=False (dq's parts added in any order).
NONDETERMINISTIC = {"Fa"}
PEERS = ("sdpa flash", "sdpa cudnn")


def plans_for(d, causal):
    """{name: Plan}: "current" (plans.py's plan) and the candidates for head dim d."""
    base = fa_plans.plan_for(d, causal, torch.bfloat16)
    tiles = (base.fwd, base.dkdv, base.dq)
    out = {"current": base}
    for name, by_d in CANDIDATES.items():
        if d in by_d:
            fwd, dkdv, dq = (t or b for t, b in zip(by_d[d], tiles))
            if dkdv == "portable":
                dkdv = fa_plans.portable_dkdv(d, causal)
            out[name] = Plan(fwd, dkdv, dq)
    return out


def tile_str(t):
    if t == fa_plans.GLUON_FUSED_DQ:
        return "fused"
    kind = " Gluon" if t.gluon else ""
    return f"{t.block_m}x{t.block_n} w{t.warps} s{t.stages}{' tma' if t.tma else ''}{kind}"


def fwd_flops(b, h, nq, nk, d, causal):
    """FlashAttention convention; the backward counts 2.5x (as tune.py and the suite do)."""
    return 4.0 * b * h * nq * nk * d / (2 if causal else 1)


def shapes(d, causal):
    """(label, B, Nq, Nk, H, Hkv) of the correctness shapes of a case: the timed layout at
    N = 1024 (same kernel specialisation as N = 4k/16k), and ragged ends + GQA + Nq != Nk."""
    h = HIDDEN // d
    nq, nk = RAGGED[causal]
    return [(f"N={CHECK_N}", 1, CHECK_N, CHECK_N, h, h), ("ragged GQA", 2, nq, nk, 4, 2)]


# ---------------------------------------------------------------------------------------------
# --screen: compile for sm_90a on CPU
# ---------------------------------------------------------------------------------------------

KINDS = {
    "attn_fwd": "fwd",
    "attn_bwd_dkdv": "dkdv",
    "attn_bwd_dq": "dq",
    "attn_bwd": "dkdv",
}  # by kernel name stem


class _Capture:
    """Stands in for the op's `launch`: records (kernel, args, kwargs) instead of running."""

    calls: list = []  # noqa: RUF012 (one list, reset per capture)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _Capture.calls.append((self.kernel, args, kwargs))


def captured_launches(plan, causal, b, nq, nk, h, hkv, d):
    """(kernel, args, kwargs) of one forward and one backward with `plan` on CPU tensors of these
    shapes, taken as on a Hopper GPU (TMA-aligned, the Gluon forward allowed): what
    Triton's launcher would specialise on."""
    saved = runtime.launch, fa_plans.use_tma, fa_plans._gluon_device
    runtime.launch, fa_plans.use_tma = _Capture, lambda *t: True
    fa_plans._gluon_device = lambda device: True
    _Capture.calls = []
    try:
        q, do = (torch.randn(b, nq, h, d, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, nk, hkv, d, dtype=torch.bfloat16) for _ in range(2))
        o, lse = fa_launchers.forward(q, k, v, causal, 1 / math.sqrt(d), plan)
        fa_launchers.backward(do, q, k, v, o, lse, None, causal, 1 / math.sqrt(d), plan)
        return list(_Capture.calls)
    finally:
        runtime.launch, fa_plans.use_tma, fa_plans._gluon_device = saved


def _compile_sm90(kernel, args, kwargs, out, log):
    """Child process: compile one launch for sm_90a (its output into `log`); put its resource
    usage on `out`."""
    fd = os.open(log, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    if kernel.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True)
    usage = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", res.stdout.decode()))
    maxnreg = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])
    out.put(
        {
            "regs": int(usage.get("REG", -1)),
            "stack": int(usage.get("STACK", -1)),
            "smem_kb": round((int(usage.get("SHARED", 0)) + compiled.metadata.shared) / 1024),
            "warps": compiled.metadata.num_warps,
            "ws": "ttg.warp_specialize" in compiled.asm["ttgir"],
            "setmaxnreg": " ".join(sorted({f"{a}{n}" for a, n in maxnreg})),
        }
    )


def screen_one(kernel, args, kwargs, timeout=600):
    """Resource usage of one launch compiled in a child process, or how the compiler failed."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with tempfile.NamedTemporaryFile(mode="r", suffix=".log") as log:
        p = ctx.Process(target=_compile_sm90, args=(kernel, args, kwargs, out, log.name))
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            return {"failed": "timeout"}
        if p.exitcode == 0:
            return out.get()
        text = log.read()
    why = re.search(r"([\w/]+\.cpp:\d+).*(Assertion .*)", text)
    why = " ".join(why.groups()) if why else next(iter(re.findall(r"\w+Error: .*", text)), "?")
    return {"failed": f"exit {p.exitcode}: {why[-200:]}"}


def screen(cases, names=None):
    """Compile each distinct launch of the GPU run (every plan on the correctness shapes, the
    timed layout and the leaderboard's) for sm_90a; returns the number of failures."""
    os.environ.pop("TRITON_INTERPRET", None)
    done, failures = set(), 0
    for d, causal in cases:
        layouts = [s[1:] for s in shapes(d, causal)]
        if (d, causal) == (LEADERBOARD[3], True):
            b, h, _, _ = LEADERBOARD
            layouts.append((b, CHECK_N, CHECK_N, h, h))
        for name, plan in plans_for(d, causal).items():
            if names and name != "current" and not re.fullmatch(names, name):
                continue
            for b, nq, nk, h, hkv in layouts:
                for kernel, args, kwargs in captured_launches(plan, causal, b, nq, nk, h, hkv, d):
                    stem = re.sub(r"(_ws|_gluon)?_kernel$", "", kernel.fn.__name__)
                    kind = KINDS.get(stem)
                    if kind is None:
                        continue
                    # Launches that specialise alike compile alike: key on what differs.
                    flags = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num")}
                    key = (kernel.fn.__name__, h == 1, hkv != h, tuple(sorted(flags.items())))
                    if key in done:
                        continue
                    done.add(key)
                    t0 = time.time()
                    res = screen_one(kernel, args, kwargs)
                    failures += "failed" in res
                    print(
                        f"d{d} causal{int(causal)} {name:7s} {kind:4s} {tile_str(getattr(plan, kind)):24s}"
                        f" B{b} Nq{nq} Nk{nk} H{h} Hkv{hkv}: {res}  ({time.time() - t0:.0f} s)",
                        flush=True,
                    )
    print(f"{len(done)} launches compiled for sm_90a, {failures} failed")
    return failures


# ---------------------------------------------------------------------------------------------
# GPU run
# ---------------------------------------------------------------------------------------------


def _rand(*shape, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=g)


def _run(plan, q, k, v, do, causal, deterministic=True):
    scale = 1 / math.sqrt(q.shape[-1])
    o, lse = fa_launchers.forward(q, k, v, causal, scale, plan)
    grads = fa_launchers.backward(do, q, k, v, o, lse, None, causal, scale, plan,
                                  deterministic=deterministic)  # fmt: skip
    return (o, lse, *grads)


def _maxdiff(a, b):
    """[(name, max abs difference, same non-finite pattern)] of o, lse, dq, dk, dv."""
    out = []
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), a, b):
        x, y = x.float(), y.float()
        fin = torch.isfinite(x) & torch.isfinite(y)
        err = (x[fin] - y[fin]).abs().max().item() if fin.any() else 0.0
        out.append((name, err, torch.equal(torch.isfinite(x), torch.isfinite(y))))
    return out


def _fmt(diffs):
    return "  ".join(
        f"{n} {e:.1e}" + ("" if same else " NONFINITE-DIFFERS") for n, e, same in diffs
    )


def check(d, causal, name):
    """Printable lines: on each of `shapes(d, causal)` the max abs differences of o, lse, dq, dk,
    dv between plan `name` and the current plan, and between the current plan and a float32
    evaluation of the reference (the rounding noise). PASS when every difference of the
    candidate is within 3x that noise (+1e-3) and non-finite values sit alike."""
    from kernelkit.flash_attn.reference import attention_reference

    plans = plans_for(d, causal)
    lines = []
    for label, b, nq, nk, h, hkv in shapes(d, causal):
        q, do = _rand(b, nq, h, d, seed=1), _rand(b, nq, h, d, seed=4)
        k, v = _rand(b, nk, hkv, d, seed=2), _rand(b, nk, hkv, d, seed=3)
        cur = _run(plans["current"], q, k, v, do, causal)
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        o32, lse32 = attention_reference(*leaves, causal=causal, return_lse=True)
        noise = _maxdiff(cur, (o32, lse32, *torch.autograd.grad(o32, leaves, do.float())))
        tag = f"d{d} causal{int(causal)} {name:7s} {label:10s}"
        if name == "current":
            lines.append(f"{tag} vs fp32 ref: {_fmt(noise)}")
            continue
        det = name not in NONDETERMINISTIC
        out = _run(plans[name], q, k, v, do, causal, det)
        diff = _maxdiff(out, cur)
        if det:  # bitwise reproducible: a second run
            again = _maxdiff(_run(plans[name], q, k, v, do, causal, det), out)
            diff.append(("repeat", max(e for _, e, _ in again), True))
        ok = all(s and e <= 3 * en + 1e-3 for (_, e, s), (_, en, _) in zip(diff, noise))
        ok = ok and all(e == 0 for n, e, _ in diff if n == "repeat")
        lines.append(f"{tag} vs current: {_fmt(diff)}  {'PASS' if ok else 'FAIL'}")
    return lines


def _gluon(plan) -> bool:
    """Whether a plan runs a Gluon kernel (checked last: a hang there stops nothing else)."""
    return plan.fwd.gluon or plan.dkdv.gluon


def warm(shard, nshards):
    """Worker process: the correctness checks of its share of (case, plan), which also fills
    Triton's on-disk cache for the timing process, then the leaderboard layout (H = 1). The
    Gluon candidates come last: a hang there (a barrier protocol bug) stops nothing else."""
    jobs = [(d, c, name) for d, c in CASES for name in plans_for(d, c)]
    jobs.sort(key=lambda job: _gluon(plans_for(job[0], job[1])[job[2]]))
    jobs = ([("leaderboard",)] if shard == nshards - 1 else []) + jobs[shard::nshards]
    for job in jobs:
        if job == ("leaderboard",):  # compiles only (the Gluon plans' are left to the timing)
            b, h, _, d = LEADERBOARD
            q, k, v, do = (_rand(b, CHECK_N, h, d, seed=s) for s in range(4))
            for plan in plans_for(d, True).values():
                if not _gluon(plan):
                    _run(plan, q, k, v, do, True)
        else:
            for line in check(*job):
                print(line, flush=True)
        print("DONE", *job, flush=True)


def warm_all(workers, timeout, extra=()):
    """`warm` in `workers` processes at once, killed after `timeout` seconds. Returns the check
    lines (sorted) and the (d, causal, name) jobs that passed."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--warm", f"{i}/{workers}", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        for i in range(workers)
    ]
    deadline = time.time() + timeout
    lines, done = [], set()
    for p in procs:
        try:
            out = p.communicate(timeout=max(1.0, deadline - time.time()))[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0] + "\nWORKER KILLED (timeout)"
        out = out.splitlines()
        for x in out:
            if x.startswith("DONE "):
                done.add(x)
            elif " vs " in x:
                lines.append(x)
        if p.returncode:
            lines.append(f"WORKER rc={p.returncode}: " + " | ".join(out[-8:]))
    failed = {tuple(x.split()[:3]) for x in lines if x.endswith("FAIL")}
    passed = {
        (d, c, name)
        for d, c in CASES
        for name in plans_for(d, c)
        if f"DONE {d} {c} {name}" in done and (f"d{d}", f"causal{int(c)}", name) not in failed
    }
    return sorted(lines), passed


def _sdpa(q, k, v, do, causal, backend):
    """(forward, backward, leaves) of SDPA pinned to one backend, on (B, H, N, D) copies."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2).contiguous()

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    o = fwd()
    return fwd, lambda: o.backward(dot, retain_graph=True), [qt, kt, vt]


def time_cell(b, h, n, d, causal, rounds, passed=None):
    """{(direction, provider): ms}: the current plan, every candidate that changes that
    direction's kernels (and passed the checks, when `passed` is given), SDPA flash and cuDNN,
    timed in round-robin passes."""
    from torch.nn.attention import SDPBackend

    from kernelkit.shared.bench import interleaved_ms

    q, k, v, do = (_rand(b, n, h, d, seed=s) for s in range(4))
    scale = 1 / math.sqrt(d)
    plans = plans_for(d, causal)
    if passed is not None:
        plans = {k: p for k, p in plans.items() if k == "current" or (d, causal, k) in passed}
    cur = plans["current"]
    peers = {}
    for name, backend in zip(PEERS, (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)):
        try:
            peers[name] = _sdpa(q, k, v, do, causal, backend)
        except RuntimeError as e:
            print(f"  {name} unavailable: {str(e).splitlines()[0][:80]}")
    res = {}
    for direction in ("fwd", "bwd"):
        fns = {}
        for name, plan in plans.items():
            if direction == "fwd" and (name == "current" or plan.fwd != cur.fwd):
                fns[name] = functools.partial(fa_launchers.forward, q, k, v, causal, scale, plan)
            elif direction == "bwd" and (name == "current" or plan.fwd == cur.fwd):
                o, lse = fa_launchers.forward(q, k, v, causal, scale, cur)
                args = (do, q, k, v, o, lse, None, causal, scale, plan)
                det = name not in NONDETERMINISTIC
                fns[name] = functools.partial(fa_launchers.backward, *args, deterministic=det)
        leaves = []
        for name, (fwd, bwd, ls) in peers.items():
            fns[name] = fwd if direction == "fwd" else bwd
            leaves += ls
        for name, (ms, spread) in interleaved_ms(fns, rounds, grad_to_none=leaves).items():
            res[direction, name] = ms
            print(f"  {direction} {name:10s} {ms:8.3f} ms  (spread {spread:4.1%})", flush=True)
    del q, k, v, do, peers
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return res


def table(results):
    """The compact table: TFLOP/s per (cell, direction) and provider; x = best of ours /
    cuDNN (time ratio, > 1: faster than cuDNN)."""
    names = ["current", *CANDIDATES, *PEERS]
    print("\nTFLOP/s (FlashAttention convention; bwd counts 2.5x the forward's FLOPs)")
    print(
        f"{'cell':32s} {'dir':3s} "
        + " ".join(f"{n.removeprefix('sdpa '):>7s}" for n in names)
        + "   best/cuDNN"
    )
    for (tag, flops), res in results.items():
        for direction in ("fwd", "bwd"):
            fl = flops * (2.5 if direction == "bwd" else 1.0)
            row = [res.get((direction, n)) for n in names]
            cells = " ".join(f"{fl / ms / 1e9:7.0f}" if ms else f"{'-':>7s}" for ms in row)
            ours = min(ms for n, ms in zip(names, row) if ms and n not in PEERS)
            cudnn = res.get((direction, "sdpa cudnn"))
            best = min((ms, n) for n, ms in zip(names, row) if ms and n not in PEERS)[1]
            vs = f"x{cudnn / ours:5.3f} ({best})" if cudnn else ""
            print(f"{tag:32s} {direction:3s} {cells}   {vs}")
    print("\nlegend (fwd, dk/dv, dq tiles; '.' = current):")
    for name, by_d in CANDIDATES.items():
        desc = "; ".join(
            f"d{d}: " + ", ".join(tile_str(t) if isinstance(t, Tile) else t or "." for t in tiles)
            for d, tiles in by_d.items()
        )
        print(f"  {name:4s} {desc}")


def run_gpu(args):
    t_start = time.time()
    import triton

    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "none (dry run)"
    print(
        f"GPU {gpu}  torch {torch.__version__}  triton {triton.__version__}"
        f"  cuDNN {torch.backends.cudnn.version()}",
        flush=True,
    )
    for d, causal in args.cases:
        for name, plan in plans_for(d, causal).items():
            print(
                f"  d{d} causal{int(causal)} {name:7s} "
                + " | ".join(map(tile_str, (plan.fwd, plan.dkdv, plan.dq)))
            )
    if args.workers:
        print(
            f"\n== compile + correctness (max abs differences; {args.workers} workers)", flush=True
        )
        extra = (["--dry-run"] if args.dry_run else []) + (
            ["--plans", args.plans] if args.plans else []
        )
        lines, passed = warm_all(args.workers, args.warm_timeout, extra)
        for line in lines:
            print(line)
        every = {(d, c, n) for d, c in args.cases for n in plans_for(d, c)}
        for d, c, name in sorted(every - passed):
            print(f"EXCLUDED from timing: d{d} causal{int(c)} {name} (failed or did not finish)")
        print(f"({time.time() - t_start:.0f} s)", flush=True)
    else:
        passed = None
    print("\n== timing: ms medians of round-robin passes", flush=True)
    b_lb, h_lb, n_lb, d_lb = LEADERBOARD
    cells = [(max(1, TOKENS // n), HIDDEN // d, n, d, c) for n in args.n for d, c in args.cases]
    cells.insert(len(args.cases), (b_lb, h_lb, n_lb, d_lb, True))  # after the first N's cases
    results = {}
    for b, h, n, d, causal in cells:
        tag = f"d{d} causal{int(causal)} N{n} B{b} H{h}"
        if time.time() - t_start > args.budget:
            print(f"{tag}: skipped (--budget {args.budget:.0f} s spent)")
            continue
        print(tag, flush=True)
        res = time_cell(b, h, n, d, causal, args.rounds, passed)
        results[tag, fwd_flops(b, h, n, n, d, causal)] = res
    table(results)
    lb = next((r for (tag, _), r in results.items() if tag.endswith(f"B{b_lb} H{h_lb}")), None)
    if lb:
        print(
            "\nleaderboard shape fwd+bwd ms (a candidate changes one direction; the other is the current plan's):"
        )
        for name in ["current", *CANDIDATES, *PEERS]:
            f, bw = (
                lb.get(("fwd", name), lb[("fwd", "current")]),
                lb.get(("bwd", name), lb[("bwd", "current")]),
            )
            if ("fwd", name) in lb or ("bwd", name) in lb:
                print(f"  {name:10s} {f + bw:7.3f}")
    print(f"\ntotal {time.time() - t_start:.0f} s")


def _dry_run_sizes():
    """--dry-run: CPU tensors under the interpreter, tiny shapes, a wall-clock `bench_ms`."""
    global DEVICE, TOKENS, HIDDEN, LEADERBOARD, CHECK_N, RAGGED
    import kernelkit.shared.bench as bench

    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run runs under TRITON_INTERPRET=1")
    DEVICE, TOKENS, HIDDEN, LEADERBOARD = "cpu", 64, 256, (2, 1, 64, 64)
    CHECK_N, RAGGED = 64, ((40, 44), (44, 40))

    def wall_ms(fn, *, grad_to_none=None):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    bench.bench_ms = wall_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--screen", action="store_true", help="compile for sm_90a on CPU only")
    ap.add_argument("--plans", help="only the candidates whose name matches (regex)")
    ap.add_argument("--cases", default=",".join(f"{d}:{int(c)}" for d, c in CASES))
    ap.add_argument("--n", default=",".join(map(str, NS)), help="sequence lengths to time")
    ap.add_argument("--rounds", type=int, default=5, help="round-robin passes per cell")
    ap.add_argument("--workers", type=int, default=12, help="compile/check processes (0: none)")
    ap.add_argument("--budget", type=float, default=210, help="seconds; later cells are skipped")
    ap.add_argument("--warm-timeout", type=float, default=120, help="seconds for the checks")
    ap.add_argument("--warm", help=argparse.SUPPRESS)
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="on CPU under TRITON_INTERPRET=1, tiny shapes, wall-clock timer: checks the script",
    )
    args = ap.parse_args()
    if args.dry_run:
        _dry_run_sizes()
    args.cases = [(int(c.split(":")[0]), c.split(":")[1] == "1") for c in args.cases.split(",")]
    args.n = [int(x) for x in args.n.split(",")] if not args.dry_run else [64]
    if args.plans:  # (the --warm children get the same flag)
        for name in [n for n in CANDIDATES if not re.fullmatch(args.plans, n)]:
            del CANDIDATES[name]
    if args.screen:
        sys.exit(1 if screen(args.cases, args.plans) else 0)
    elif args.warm:
        warm(*map(int, args.warm.split("/")))
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()
