"""A/B of Gluon backward modules: the shipped `kernelkit.flash_attn.gluon.bwd` against other
versions of that file (e.g. `git show <commit>:.../gluon/bwd.py > old.py`), each loaded as a
sibling module and swapped in as `launch.gluon_bwd` around its calls; the chooser's config for
each case (forced, so nothing is replayed). On an sm_90 GPU:

    PYTHONPATH=shared/src:packages/flash-attn/src python lab/flash-attn/ab/gluon_bwd_module_ab.py \
        old=/path/old_bwd.py [speed|accuracy|both|warm] [cases=softcap|plain|short|all]
        [rounds=7] [only=name] [d=64|128]

accuracy: max error of dq / dk / dv against a float32 reference at (2, 1024, 4, d) and the
worst relative error of the dk rows of rarely attended keys (softcap 30, bf16; the bf16
PyTorch reference's beside it). speed: median ms and TFLOP/s over interleaved rounds. warm: one
call of each case (only=: of that module) to fill Triton's cache from parallel processes before
a timed run.
Writes $OUT/gluon_bwd_module_ab.json. Logs: `lab/flash-attn/logs/session37-H200-*-ab.log`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

from kernelkit.flash_attn import choose as C
from kernelkit.flash_attn import launch as L
from kernelkit.flash_attn.reference import attention_reference
from kernelkit.shared.bench import interleaved_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages/flash-attn/tests"))
from test_overflow import _rare_key_inputs

CAP = 30.0


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"kernelkit.flash_attn.gluon.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class Before37:
    """A module from before 0.14.1 (no `scaled_rows`; its `launch` takes no such argument)."""

    def __init__(self, mod):
        self.mod = mod

    def scaled_rows(self, cfg, s):
        return None

    def launch(self, *args):
        assert args[-1] is False
        return self.mod.launch(*args[:-1])


class Commit37:
    """Commit d4af508's module: `rows_scaled` (a bool) with lse2 - 15 and +delta 2^-15."""

    def __init__(self, mod):
        self.mod = mod

    def scaled_rows(self, cfg, s):
        return (15.0, 2.0**-15) if self.mod.rows_scaled(cfg, s) else None

    def launch(self, *args):
        return self.mod.launch(*args)


OPTIONS = ("cases", "rounds", "only", "d")  # key=value arguments that are not modules


def option(argv, key: str, default: str | None) -> str | None:
    """The value of `key=value` in argv, or `default`."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"{key}=")), default)


def warm(fns, only: str | None) -> None:
    """One call of `only`'s function (of each without `only`), to compile it."""
    for name, fn in fns.items():
        if only in (None, name):
            fn()
    torch.cuda.synchronize()


def visible_pairs(n: int, causal: bool, window) -> float:
    """(query, key) pairs a causal / windowed / full n x n attention computes."""
    if window[0] >= 0:
        return sum(min(i + 1, window[0] + 1) for i in range(n))
    return n * n * (0.5 if causal else 1.0)


def modules(argv) -> dict:
    mods = {"new": L.gluon_bwd}
    for a in argv:
        if "=" in a and a.split("=")[0] not in OPTIONS:
            name, path = a.split("=", 1)
            mod = load(name, path)
            if hasattr(mod, "rows_scaled"):
                mod = Commit37(mod)
            elif not hasattr(mod, "scaled_rows"):
                mod = Before37(mod)
            mods[name] = mod
    return mods


def backward_fns(mods, q, k, v, do, causal, window, cap, deterministic=True):
    d = q.shape[-1]
    scale = d**-0.5
    o, lse = L.forward(q, k, v, causal, scale, softcap=cap, window=window)
    p = L.backward_problem(do, q, k, v, causal, cap, window, deterministic=deterministic)
    cfg = C.choose_bwd(p)
    assert cfg.kernel == "gluon", cfg

    def run(mod):
        def fn():
            L.gluon_bwd = mod
            try:
                return L.backward(do, q, k, v, o, lse, None, causal, scale, softcap=cap,
                                  window=window, deterministic=deterministic, config=cfg)  # fmt: skip
            finally:
                L.gluon_bwd = mods["new"]

        return fn

    return {name: run(mod) for name, mod in mods.items()}, cfg


def grads(q, k, v, do, causal, cap, dt):
    x = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
    o = attention_reference(*x, causal=causal, softcap=cap)
    o.backward(do.to(dt))
    return [t.grad for t in x]


def accuracy(mods, d, causal, cap, dtype):
    torch.manual_seed(1)
    b, n, h = 2, 2048 if d == 128 else 8192, 4
    q = torch.randn(b, n, h, d, device="cuda", dtype=dtype) * 2
    k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dtype) * 2 for _ in range(2))
    do = torch.randn_like(q)
    hi, lo = grads(q, k, v, do, causal, cap, torch.float32), grads(q, k, v, do, causal, cap, dtype)
    fns, _ = backward_fns(mods, q, k, v, do, causal, (-1, -1), cap)
    out = {"reference": [(a.float() - r).abs().max().item() for a, r in zip(lo, hi)]}
    for name, fn in fns.items():
        got = fn()
        assert all(torch.isfinite(t).all() for t in got), name
        out[name] = [(a.float() - r).abs().max().item() for a, r in zip(got, hi)]
    print(f"accuracy d{d} n{n} causal={causal} cap={cap} {dtype}: "
          + "  ".join(f"{k} " + "/".join(f"{e:.2e}" for e in v) for k, v in out.items()),
          flush=True)  # fmt: skip
    return out


def rare_keys(mods, d, causal):
    """Keys every query attends with P ~1e-8 (softcap, bf16): worst relative dk-row error."""
    n = 2048 if d == 128 else 8192
    rare = [n // 2 + 3, n - 5, n - 1]
    q, k, v, do = _rare_key_inputs(n, d, 1, CAP, rare)  # the test's inputs, one kv head
    q, k, v, do = (t.cuda() for t in (q, k, v, do))
    hi = grads(q, k, v, do, causal, CAP, torch.float64)[1][0, rare]
    lo = grads(q, k, v, do, causal, CAP, torch.bfloat16)[1][0, rare]

    def rel(dk):
        return ((dk.double() - hi).abs().amax(-1) / hi.abs().amax(-1)).max().item()

    fns, _ = backward_fns(mods, q, k, v, do, causal, (-1, -1), CAP)
    out = {"reference": rel(lo)} | {name: rel(fn()[1][0, rare]) for name, fn in fns.items()}
    print(f"rare keys d{d} causal={causal}: "
          + "  ".join(f"{k} {e:.2e}" for k, e in out.items()), flush=True)  # fmt: skip
    return out


CASES = {  # (d, b, n, heads, kv heads, causal, window, softcap, deterministic)
    "softcap": [(d, 16384 // n, n, 2048 // d, 2048 // d, c, (-1, -1), CAP, True)
                for d, n in ((128, 2048), (128, 16384), (64, 16384)) for c in (True, False)],
    "plain": [(d, 16384 // n, n, 2048 // d, 2048 // d, c, (-1, -1), 0.0, True)
              for d, n in ((128, 2048), (128, 4096), (128, 16384), (64, 16384))
              for c in (True, False)]
    + [(128, 2, 8192, 32, 8, True, (-1, -1), 0.0, True),
       (128, 1, 16384, 16, 16, True, (4095, 0), 0.0, True)]
    + [(128, 16384 // n, n, 16, 16, c, (-1, -1), 0.0, False)
       for n in (4096, 16384) for c in (True, False)],
    # short tiles: 1k windows, 2k-4k rows, and 16k causal beside them
    "short": [(d, 1, 16384, 2048 // d, 2048 // d, True, (1023, 0), 0.0, True) for d in (128, 64)]
    + [(d, 16384 // n, n, 2048 // d, 2048 // d, c, (-1, -1), 0.0, True)
       for d in (128, 64) for n in (2048, 4096) for c in (True, False)]
    + [(d, 16384 // n, n, 2048 // d, 2048 // d, True, (-1, -1), 0.0, True)
       for d in (128, 64) for n in (8192, 16384)]
    + [(128, 1, 16384, 16, 16, True, (1023, 0), CAP, True),
       (128, 2, 8192, 32, 8, True, (-1, -1), 0.0, True),
       (128, 2, 8192, 32, 8, False, (-1, -1), 0.0, True)],
}  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    mods = modules(argv)
    mode = next((a for a in argv if a in ("speed", "accuracy", "both", "warm")), "both")
    which, only = option(argv, "cases", "all"), option(argv, "only", None)
    rounds, head_d = int(option(argv, "rounds", "7")), int(option(argv, "d", "0"))
    rows = {"accuracy": [], "rare": [], "speed": []}
    if mode in ("accuracy", "both"):
        for d in (128, 64):
            for causal in (True, False):
                rows["rare"].append(dict(d=d, causal=causal, err=rare_keys(mods, d, causal)))
                for cap in (CAP, 0.0):
                    for dtype in (torch.bfloat16, torch.float16):
                        err = accuracy(mods, d, causal, cap, dtype)
                        rows["accuracy"].append(dict(d=d, causal=causal, cap=cap,
                                                     dtype=str(dtype), err=err))  # fmt: skip
    cases = [
        c for name, cs in CASES.items() if which in (name, "all") for c in cs if head_d in (0, c[0])
    ]
    for d, b, n, hq, hk, causal, window, cap, det in cases if mode != "accuracy" else []:
        torch.manual_seed(0)
        q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        fns, cfg = backward_fns(mods, q, k, v, do, causal, window, cap, det)
        if mode == "warm":
            warm(fns, only)
            continue
        flops = 2.5 * 4 * b * hq * visible_pairs(n, causal, window) * d
        base = fns["new"]()
        diff = {name: max((a.float() - r.float()).abs().max().item()
                          for a, r in zip(fn(), base)) for name, fn in fns.items()}  # fmt: skip
        res = interleaved_ms(fns, rounds=rounds)
        rows["speed"].append(dict(d=d, b=b, n=n, hq=hq, hk=hk, causal=causal, window=window,
                                  cap=cap, deterministic=det, cfg=str(cfg),
                                  ms={name: ms for name, (ms, _) in res.items()}, diff=diff))  # fmt: skip
        cells = "  ".join(f"{name} {ms:.3f}ms {flops / ms / 1e9:.0f}TF (±{sp * 100:.0f}%"
                          f"{'' if name == 'new' else f', diff {diff[name]:.1e}'})"
                          for name, (ms, sp) in res.items())  # fmt: skip
        print(f"d{d} b{b} n{n} {hq}/{hk} causal={causal} window={window} cap={cap} "
              f"{'fixed' if det else 'any'} order: {cells}",
              flush=True)  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon_bwd_module_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
