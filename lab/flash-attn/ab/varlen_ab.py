"""A/B of a backward switch of `launchers` (`--switch`: PAD_ROW_VECTORS, the padded unchecked
row vectors, by default; PEEL_RAGGED_TAIL, the ragged last block peeled off the main loops) on
packed batches, against the dense kernel on the same tokens, in one process.

For each head dim, causal flag and document case of bench_flash_attn_varlen.py (4 rows of 16384
tokens, H = 16, bf16): the forward and the backward of
  dense     flash_attn on the padded batch (documents, longest, H, D); for equal2048 that is the
            dense (32, 2048) batch itself (switch on)
  on        flash_attn_varlen on the packed rows, the switch True
  off       the same, the switch False
timed round-robin (`interleaved_ms`: clock drift hits every variant alike), in ms and as ratios
to dense. A check first: the gradients of on and off must agree (bitwise expected).
Non-causal padded rows see their padding, so the dense column is a timing reference only there.

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/flash-attn/src:$ROOT/packages/flash-attn/benchmarks \\
        python lab/flash-attn/ab/varlen_ab.py --ds 64

(The whole default run, d64 and d128, took about a minute on an H100 with PEEL_RAGGED_TAIL;
`--ds 64` is half of its cells.)
"""

from __future__ import annotations

import argparse
import functools

import bench_flash_attn_varlen as bv
import torch
from bench_flash_attn import direction_call

from kernelkit.flash_attn import launchers
from kernelkit.shared.bench import interleaved_ms

VARIANTS = {"dense": None, "on": True, "off": False}
SWITCHES = ("PAD_ROW_VECTORS", "PEEL_RAGGED_TAIL")


def _with(switch, value, call):
    """`call` with the module switch set first (the replay key reads it: no stale launches)."""

    def run():
        setattr(launchers, switch, value)
        return call()

    return run


def _calls(switch, case, d, causal, direction):
    """{variant: timed callable} and the tensors whose grads to reset."""
    bv.D = d  # varlen_provider reads the module's head dim
    lengths = bv.case_lengths(case)
    calls, leaves = {}, []
    for name, value in VARIANTS.items():
        fn, inputs = bv.varlen_provider("triton_padded" if value is None else "triton", lengths)
        fn = functools.partial(fn, causal=causal)
        value = True if value is None else value  # dense: the shipped setting
        setattr(launchers, switch, value)
        o = fn(*inputs)
        do = bv._randn(o.shape, 7)
        calls[name] = _with(switch, value, direction_call(fn, inputs, o, do, direction))
        leaves += inputs
    return calls, leaves


def _check(switch, case, d, causal):
    """Largest |difference| of the packed gradients between the switch on and off."""
    bv.D = d
    lengths = bv.case_lengths(case)
    grads = []
    for value in (True, False):
        setattr(launchers, switch, value)
        fn, inputs = bv.varlen_provider("triton", lengths)
        o = functools.partial(fn, causal=causal)(*inputs)
        o.backward(bv._randn(o.shape, 7))
        grads.append([t.grad for t in inputs])
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(*grads))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", default=SWITCHES[0], choices=SWITCHES)
    ap.add_argument("--ds", default="64,128")
    ap.add_argument("--causal", default="1,0", help="causal flags to run (1, 0)")
    ap.add_argument("--cases", default=f"equal{bv.EQUAL},lognormal")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sw = args.switch
    print(f"{torch.cuda.get_device_name()}  rows {bv.ROWS}x{bv.ROW_TOKENS}  H {bv.H}  bf16  "
          f"switch {sw}")  # fmt: skip
    print(f"{'case':12s} {'d':>4s} {'causal':>6s} {'dir':4s} "
          f"{'dense':>8s} {'on':>8s} {'off':>8s}  {'on/dense':>8s} {'off/dense':>9s} "
          f"{'on/off':>7s}  spread")  # fmt: skip
    for case in args.cases.split(","):
        for d in (int(x) for x in args.ds.split(",")):
            for causal in (c == "1" for c in args.causal.split(",")):
                diff = _check(sw, case, d, causal)
                for direction in ("fwd", "bwd"):
                    calls, leaves = _calls(sw, case, d, causal, direction)
                    t = interleaved_ms(calls, rounds=args.rounds, grad_to_none=leaves)
                    ms = {k: v[0] for k, v in t.items()}
                    spread = max(v[1] for v in t.values())
                    print(f"{case:12s} {d:4d} {int(causal):6d} {direction:4s} {ms['dense']:8.3f} "
                          f"{ms['on']:8.3f} {ms['off']:8.3f}  "
                          f"{ms['on'] / ms['dense']:8.3f} {ms['off'] / ms['dense']:9.3f} "
                          f"{ms['on'] / ms['off']:7.3f}  {spread:.1%}"
                          + ("" if direction == "fwd" else f"  |grad on-off| {diff:.2e}"),
                          flush=True)  # fmt: skip
                    del calls, leaves
    setattr(launchers, sw, True)


if __name__ == "__main__":
    main()
