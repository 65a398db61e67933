"""A/B of ring_attn's sm_margin, interleaved: forward and forward + backward at W ranks.

torchrun --standalone --nproc-per-node 4 lab/ring-attn/ab/sm_margin_ab.py 32768 65536
"""

import os
import statistics
import sys

import torch
import torch.distributed as dist

from kernelkit.flash_attn import flash_attn
from kernelkit.ring_attn import ring_attn, shard

MARGINS = [0, 4, 8, 16, 32]


def timed(fn) -> float:
    """ms of one run of fn, the slowest rank's, started together."""
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def one_length(n_local: int, rank: int, world: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn((1, n_local * world, 16, 128), generator=g, device="cuda",
                        dtype=torch.bfloat16) for _ in range(4)]  # fmt: skip
    q, k, v, do = (shard(t, rank, world) for t in full)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd(m):
        with torch.no_grad():
            ring_attn(*leaves, causal=True, sm_margin=m)

    def fwd_bwd(m):
        o = ring_attn(*leaves, causal=True, sm_margin=m)
        torch.autograd.grad(o, leaves, do)

    for m in MARGINS:  # warm-up
        fwd(m)
        fwd_bwd(m)
    res = {m: ([], []) for m in MARGINS}
    for _ in range(4):
        for m in MARGINS:
            res[m][0].append(timed(lambda m=m: fwd(m)))
            res[m][1].append(timed(lambda m=m: fwd_bwd(m)))
    single = [timed(lambda: flash_attn(q, k, v, True)) for _ in range(4)]
    if rank == 0:
        print(f"W={world} n_local={n_local} single fwd {statistics.median(single):.2f} ms")
        for m in MARGINS:
            f, fb = (statistics.median(x) for x in res[m])
            print(f"  margin {m:3d}: fwd {f:8.2f} ms  fwd+bwd {fb:8.2f} ms", flush=True)


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    for n_local in map(int, sys.argv[1:]):
        one_length(n_local, dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
