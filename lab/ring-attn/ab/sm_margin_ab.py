"""A/B of ring_attn's sm_margin (interleaved), W ranks, forward and fwd+bwd, plus a profile."""
import os, statistics, sys, json
import torch, torch.distributed as dist
from kernelkit.ring_attn import ring_attn, shard
from kernelkit.flash_attn import flash_attn
torch.cuda.set_device(int(os.environ["LOCAL_RANK"])); dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
margins = [0, 4, 8, 16, 32]
def timed(fn):
    dist.barrier(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record(); fn(); e.record(); torch.cuda.synchronize()
    t = torch.tensor([s.elapsed_time(e)], device="cuda"); dist.all_reduce(t, op=dist.ReduceOp.MAX); return t.item()
for n_local in map(int, sys.argv[1:]):
    n = n_local * world
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn((1, n, 16, 128), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v, do = (shard(t, rank, world) for t in (q, k, v, do))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    res = {m: {"fwd": [], "fb": []} for m in margins}
    def fwd(m):
        with torch.no_grad(): ring_attn(*leaves, causal=True, sm_margin=m)
    def fb(m):
        o = ring_attn(*leaves, causal=True, sm_margin=m); torch.autograd.grad(o, leaves, do)
    for m in margins: fwd(m); fb(m)
    for rep in range(4):
        for m in margins:
            res[m]["fwd"].append(timed(lambda: fwd(m))); res[m]["fb"].append(timed(lambda: fb(m)))
    single = [timed(lambda: flash_attn(q, k, v, True)) for _ in range(4)]
    if rank == 0:
        print(f"W={world} n_local={n_local} single fwd {statistics.median(single):.2f} ms")
        for m in margins:
            print(f"  margin {m:3d}: fwd {statistics.median(res[m]['fwd']):8.2f} ms  fwd+bwd {statistics.median(res[m]['fb']):8.2f} ms", flush=True)
dist.destroy_process_group()
