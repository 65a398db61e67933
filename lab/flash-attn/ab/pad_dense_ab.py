"""A/B of `launchers.PAD_ROW_VECTORS` on dense backwards (suite-1 shapes, 48 heads of 16k,
a ragged N), interleaved in one process; also checks that the gradients are bitwise equal.
(`_pad_row_vectors` applies the switch only where it paid; set it there to A/B other shapes.)

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/flash-attn/src \\
        python lab/flash-attn/ab/pad_dense_ab.py
"""

from __future__ import annotations

import math

import torch

from kernelkit.flash_attn import launchers
from kernelkit.shared.bench import interleaved_ms


def backward_with(flag: bool, do, q, k, v, o, lse, causal: bool, scale: float):
    """The backward launches with PAD_ROW_VECTORS = flag (the replay key reads it)."""

    def run():
        launchers.PAD_ROW_VECTORS = flag
        return launchers.backward(do, q, k, v, o, lse, None, causal, scale)

    return run


def case(b: int, h: int, n: int, d: int, causal: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    scale = 1 / math.sqrt(d)
    o, lse = launchers.forward(q, k, v, causal, scale)
    on, off = (backward_with(f, do, q, k, v, o, lse, causal, scale) for f in (True, False))
    same = all(torch.equal(a, c) for a, c in zip(off(), on()))
    t = interleaved_ms({"on": on, "off": off}, rounds=5)
    ms_on, ms_off = t["on"][0], t["off"][0]
    print(
        f"B{b} H{h} N{n} d{d} causal{int(causal)}: on {ms_on:.3f} off {ms_off:.3f} ms  "
        f"on/off x{ms_on / ms_off:.3f}  bitwise {same}",
        flush=True,
    )
    launchers.PAD_ROW_VECTORS = True


def main() -> None:
    for d in (64, 128):
        for causal in (False, True):
            case(1, 2048 // d, 16384, d, causal)
            case(4, 2048 // d, 4096, d, causal)
    case(3, 16, 16384, 64, True)  # d64 causal, 48 heads of 16k
    case(1, 32, 1000, 128, True)  # a ragged N


if __name__ == "__main__":
    main()
