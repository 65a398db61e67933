"""A/B of `launchers.PEEL_RAGGED_TAIL` (the backward's ragged last block peeled off its main
loop) on packed batches, against the dense kernel on the same tokens, in one process.

For each head dim, causal flag and document case of bench_flash_attn_varlen.py (4 rows of 16384
tokens, H = 16, bf16): the forward and the backward of
  dense     flash_attn on the padded batch (documents, longest, H, D); for equal2048 that is the
            dense (32, 2048) batch itself
  peel_on   flash_attn_varlen on the packed rows, PEEL_RAGGED_TAIL = True
  peel_off  the same, PEEL_RAGGED_TAIL = False (every ragged block checked, as before)
timed round-robin (`interleaved_ms`: clock drift hits every variant alike), in ms and as ratios
to dense. A check first: the gradients of peel_on and peel_off must agree (bitwise expected).
Non-causal padded rows see their padding, so the dense column is a timing reference only there.

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/flash-attn/src:$ROOT/packages/flash-attn/benchmarks \\
        python packages/flash-attn/benchmarks/varlen_ab.py            # ~1 minute on an H100
"""

from __future__ import annotations

import argparse
import functools

import bench_flash_attn_varlen as bv
import torch
from bench_flash_attn import direction_call

from kernelkit.flash_attn import launchers
from kernelkit.shared.bench import interleaved_ms

VARIANTS = {"dense": None, "peel_on": True, "peel_off": False}


def _with_peel(call, peel):
    """`call` with the module switch set first (the replay key reads it: no stale launches)."""
    if peel is None:
        return call

    def run():
        launchers.PEEL_RAGGED_TAIL = peel
        return call()

    return run


def _calls(case, d, causal, direction):
    """{variant: timed callable} and the tensors whose grads to reset."""
    bv.D = d  # varlen_provider reads the module's head dim
    lengths = bv.case_lengths(case)
    calls, leaves = {}, []
    for name, peel in VARIANTS.items():
        fn, inputs = bv.varlen_provider("triton_padded" if peel is None else "triton", lengths)
        fn = functools.partial(fn, causal=causal)
        launchers.PEEL_RAGGED_TAIL = True if peel is None else peel
        o = fn(*inputs)
        do = bv._randn(o.shape, 7)
        calls[name] = _with_peel(direction_call(fn, inputs, o, do, direction), peel)
        leaves += inputs
    return calls, leaves


def _check(case, d, causal):
    """Largest |difference| of the packed gradients between the switch on and off."""
    bv.D = d
    lengths = bv.case_lengths(case)
    grads = []
    for peel in (True, False):
        launchers.PEEL_RAGGED_TAIL = peel
        fn, inputs = bv.varlen_provider("triton", lengths)
        o = functools.partial(fn, causal=causal)(*inputs)
        o.backward(bv._randn(o.shape, 7))
        grads.append([t.grad for t in inputs])
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(*grads))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--causal", default="1,0", help="causal flags to run (1, 0)")
    ap.add_argument("--cases", default=f"equal{bv.EQUAL},lognormal")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  rows {bv.ROWS}x{bv.ROW_TOKENS}  H {bv.H}  bf16")
    print(f"{'case':12s} {'d':>4s} {'causal':>6s} {'dir':4s} "
          f"{'dense':>8s} {'peel_on':>8s} {'peel_off':>8s}  {'on/dense':>8s} {'off/dense':>9s} "
          f"{'on/off':>7s}  spread")  # fmt: skip
    for case in args.cases.split(","):
        for d in (int(x) for x in args.ds.split(",")):
            for causal in (c == "1" for c in args.causal.split(",")):
                diff = _check(case, d, causal)
                for direction in ("fwd", "bwd"):
                    calls, leaves = _calls(case, d, causal, direction)
                    t = interleaved_ms(calls, rounds=args.rounds, grad_to_none=leaves)
                    ms = {k: v[0] for k, v in t.items()}
                    spread = max(v[1] for v in t.values())
                    print(f"{case:12s} {d:4d} {int(causal):6d} {direction:4s} {ms['dense']:8.3f} "
                          f"{ms['peel_on']:8.3f} {ms['peel_off']:8.3f}  "
                          f"{ms['peel_on'] / ms['dense']:8.3f} {ms['peel_off'] / ms['dense']:9.3f} "
                          f"{ms['peel_on'] / ms['peel_off']:7.3f}  {spread:.1%}"
                          + ("" if direction == "fwd" else f"  |grad on-off| {diff:.2e}"),
                          flush=True)  # fmt: skip
                    del calls, leaves
    launchers.PEEL_RAGGED_TAIL = True


if __name__ == "__main__":
    main()
