"""Session 36: where the small-shape backward's host time goes on a GPU host, ours against SDPA
(cuDNN) with q, k, v all requiring grad: host µs per call (no sync), wall µs per call (GPU-bound
if larger), torch.profiler CPU table and a cProfile of ours. `PYTHONPATH=shared/src:packages/flash-attn/src
python lab/flash-attn/ab/bwd_host_profile.py` on a GPU; log: lab/flash-attn/logs/session36-H200-bwd-host-profile.log."""

import cProfile
import io
import pstats

import torch
import torch.nn.functional as F

from kernelkit.flash_attn import flash_attn
from kernelkit.shared.host_time import per_call_us

torch.manual_seed(0)
q, k, v = (
    torch.randn(1, 256, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3)
)
cases = {
    "ours": lambda: flash_attn(q, k, v, causal=True),
    "sdpa": lambda: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2),
}
for name, f in cases.items():
    y = f()
    dy = torch.randn_like(y)

    def bwd(y=y, dy=dy):
        q.grad = k.grad = v.grad = None
        y.backward(dy, retain_graph=True)

    best = per_call_us(bwd, calls=200, rounds=5, warmup=50)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(200):
        bwd()
    e1.record()
    torch.cuda.synchronize()
    fwd_best = per_call_us(f, calls=200, rounds=5)
    print(
        f"{name}: bwd host {best:.1f} us/call, bwd wall (GPU-bound if larger) {e0.elapsed_time(e1) / 200 * 1e3:.1f} us/call, fwd(requires grad) host {fwd_best:.1f}",
        flush=True,
    )
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(20):
            bwd()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60
        ),
        flush=True,
    )
    if name == "ours":
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            bwd()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue()[:6000], flush=True)
