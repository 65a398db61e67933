"""Host µs per call (and GPU µs of decode steps) of one source tree, for interleaved A/B runs:

    git archive <rev> shared/src packages/flash-attn/src packages/act/src | tar -x -C /tmp/old
    for i in 1 2 3; do python host_ab.py /tmp/old old; python host_ab.py . new; done > ab.jsonl

argv[1] = tree root (its shared, act and flash-attn sources go first on sys.path), argv[2] =
label. One JSON line per run (session 32: lab/flash-attn/logs/session32-H200-host-ab.jsonl)."""

import json
import os
import sys

root, label = sys.argv[1], sys.argv[2]
sys.path[:0] = [
    os.path.join(root, p) for p in ("shared/src", "packages/act/src", "packages/flash-attn/src")
]
import torch  # noqa: E402

import kernelkit.flash_attn as fa  # noqa: E402
import kernelkit.shared as sh  # noqa: E402
from kernelkit.act import act  # noqa: E402
from kernelkit.flash_attn import flash_attn  # noqa: E402
from kernelkit.shared.host_time import per_call_us  # noqa: E402

assert fa.__file__.startswith(os.path.abspath(root)), fa.__file__
res = {"label": label, "fa": fa.__version__, "shared": sh.__version__}
dev = "cuda"


def t(*s):
    return torch.randn(*s, device=dev, dtype=torch.bfloat16)


x = t(1, 256, 32, 128)
res["act silu fwd"] = per_call_us(lambda: act(x, "silu"))
q = t(1, 256, 32, 128)
res["small fwd"] = per_call_us(lambda: flash_attn(q, q, q, causal=True))
qg, kg, vg = (q.clone().requires_grad_() for _ in range(3))
res["small fwd grad"] = per_call_us(lambda: flash_attn(qg, kg, vg, causal=True))
y = flash_attn(qg, kg, vg, causal=True)
dy = torch.randn_like(y)


def bwd():
    for a in (qg, kg, vg):
        a.grad = None
    y.backward(dy, retain_graph=True)


res["small bwd"] = per_call_us(bwd)
d1 = t(8, 1, 32, 128)
res["decode nk1 fwd"] = per_call_us(lambda: flash_attn(d1, d1, d1, causal=True))
cases = {
    "decode nk512 h32": (t(8, 1, 32, 128), t(8, 512, 32, 128)),
    "decode nk4096 gqa32/8": (t(8, 1, 32, 128), t(8, 4096, 8, 128)),
    "decode b64 nk2048 gqa32/8": (t(64, 1, 32, 128), t(64, 2048, 8, 128)),
}
for name, (qd, kd) in cases.items():
    res[name + " fwd"] = per_call_us(lambda qd=qd, kd=kd: flash_attn(qd, kd, kd, causal=True))
    # GPU time: a CUDA graph of 50 calls
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            flash_attn(qd, kd, kd, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(50):
            flash_attn(qd, kd, kd, causal=True)
    g.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1000 / 50)
    res[name + " gpu"] = best
from kernelkit.flash_attn import flash_attn_with_kvcache  # noqa: E402

qd, kc, vc, kn = t(8, 1, 32, 128), t(8, 1024, 32, 128), t(8, 1024, 32, 128), t(8, 1, 32, 128)
lens = torch.full((8,), 500, dtype=torch.int32, device=dev)
with torch.no_grad():
    res["kvcache attend fwd"] = per_call_us(
        lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=True)
    )
    res["kvcache append+attend fwd"] = per_call_us(
        lambda: flash_attn_with_kvcache(qd, kc, vc, kn, kn, cache_seqlens=lens, causal=True)
    )
print(
    json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}),
    flush=True,
)
