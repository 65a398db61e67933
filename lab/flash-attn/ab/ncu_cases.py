"""One call of each case below, for Nsight Compute (`ncu`) to profile the kernels it launches:
where the Gluon forward's and the d128 backward's time goes (pipe utilisation: tensor, FMA,
ALU, MUFU; issue-slot use; warp stall reasons). bf16, B·N = 16k tokens, H·d = 2048.

    ROOT=$(pwd); PYTHONPATH=$ROOT/shared/src:$ROOT/packages/flash-attn/src \\
      ncu --clock-control none -k regex:attn_ --launch-skip 0 --section SpeedOfLight \\
          --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \\
          python lab/flash-attn/ab/ncu_cases.py CASE
CASE: d64_causal, d128_causal, d128_window1k, d64_softcap, d128_causal_bwd.
"""

from __future__ import annotations

import sys

import torch

from kernelkit.flash_attn import flash_attn

CASES = {
    "d64_causal": (1, 16384, 32, 64, (-1, 0), 0.0, False),
    "d128_causal": (1, 16384, 16, 128, (-1, 0), 0.0, False),
    "d128_window1k": (1, 16384, 16, 128, (1024, 0), 0.0, False),
    "d64_softcap": (1, 16384, 32, 64, (-1, 0), 30.0, False),
    "d128_causal_bwd": (1, 16384, 16, 128, (-1, 0), 0.0, True),
}


def main(case: str) -> None:
    b, n, h, d, window, softcap, bwd = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    if bwd:
        q.requires_grad_()
        k.requires_grad_()
        v.requires_grad_()
    o = flash_attn(q, k, v, causal=True, window_size=window, softcap=softcap)
    if bwd:
        o.backward(torch.randn_like(o))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])
