"""One rank of the ring tests, started by torchrun (test_ring.py): `torchrun --standalone
--nproc-per-node W ring_worker.py CASES.json OUT_DIR`.

Backend: NCCL with one GPU per rank when the machine has W GPUs, else gloo on CPU tensors (the
Triton interpreter runs the real kernels there, as in the other suites: test_ring.py sets
TRITON_INTERPRET=1 for such runs, also on a machine with fewer GPUs than ranks). Every rank builds the
case's full inputs from its seed, takes its own shard, runs `ring_attn` forward and backward
(eager, and compiled where the case says so) and saves its shard's outputs, gradients, or the
error it raised, to OUT_DIR/<case>-rank<r>.pt; rank 0 also saves single-process `flash_attn`
over the full sequence on its own device (`single`), so the test compares the ring with the
same kernels on the same backend (a machine with fewer GPUs than ranks runs the ranks on CPU).
The test process compares them with the references; nothing is checked here.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from kernelkit.flash_attn import flash_attn
from kernelkit.ring_attn import ring_attn, shard

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def inputs(case: dict, device) -> tuple[torch.Tensor, ...]:
    """(q, k, v, do, dlse) of the full sequence: the same on every rank and in the test."""
    b, n, h, hkv, d = case["shape"]
    dtype = DTYPES[case["dtype"]]
    g = torch.Generator().manual_seed(case.get("seed", 0))

    def make(shape, scale=1.0, dt=dtype):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dt).to(device)

    amp = case.get("scale_inputs", 1.0)
    q, k, v = make((b, n, h, d), amp), make((b, n, hkv, d), amp), make((b, n, hkv, d))
    do = make((b, n, h, d))
    dlse = make((b, h, n), dt=torch.float32) if case.get("dlse") else None
    return q, k, v, do, dlse


def _forward_backward(fn, q, k, v, do, dlse) -> list[torch.Tensor]:
    """(o, lse, dq, dk, dv) of `fn(q, k, v)` (o, lse) and its backward from do (and dlse), on
    the CPU."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*leaves)
    outs, grads = [o], [do]
    if dlse is not None:
        outs.append(lse)
        grads.append(dlse)
    return [t.detach().cpu() for t in (o, lse, *torch.autograd.grad(outs, leaves, grads))]


def single_process(case: dict, device) -> list[torch.Tensor]:
    """(o, lse, dq, dk, dv) of single-process `flash_attn` over the full sequence on `device`."""
    kw = dict(causal=case.get("causal", False), softmax_scale=case.get("softmax_scale"),
              softcap=case.get("softcap", 0.0))  # fmt: skip
    return _forward_backward(lambda q, k, v: flash_attn(q, k, v, return_lse=True, **kw),
                             *inputs(case, device))  # fmt: skip


def run_case(case: dict, rank: int, world: int, device, groups: dict) -> dict:
    layout = case.get("layout", "zigzag")
    q, k, v, do, dlse = inputs(case, device)
    if case.get("bad_rank") == rank:  # a rank that disagrees with the others
        bad = case["bad"]
        if bad == "length":
            q, k, v, do = (t[:, : t.shape[1] // 2] for t in (q, k, v, do))
        elif bad == "dtype":
            q, k, v = (t.float() for t in (q, k, v))
        elif bad == "causal":
            case = {**case, "causal": not case.get("causal", False)}
    q, k, v, do = (shard(t, rank, world, layout) for t in (q, k, v, do))
    if dlse is not None:
        dlse = shard(dlse, rank, world, layout, dim=2)
    group = None
    if case.get("new_group"):  # a group not used before: the first call checks the ranks
        groups[case["name"]] = group = dist.new_group(list(range(world)))
    kw = dict(causal=case.get("causal", False), softmax_scale=case.get("softmax_scale"),
              layout=layout, softcap=case.get("softcap", 0.0))  # fmt: skip

    def forward(q, k, v):
        return ring_attn(q, k, v, group, return_lse=True, **kw)

    if case.get("compile"):  # one graph (the ring's ops opaque in it), and its backward graph
        forward = torch.compile(forward, fullgraph=True)

    def step():
        return _forward_backward(forward, q, k, v, do, dlse)

    result = {"o_lse_grads": step()}
    if case.get("repeat"):  # determinism: a second run, bitwise the same
        result["again"] = step()
    if rank == 0:
        result["single"] = single_process(case, device)
    return result


def main() -> int:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    out = sys.argv[2]
    world = int(os.environ["WORLD_SIZE"])
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world
    rank = int(os.environ["RANK"])
    if use_nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_nccl else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_nccl else torch.device("cpu")
    groups: dict = {}
    for case in cases:
        if world not in case.get("worlds", (world,)):
            continue
        try:
            result = run_case(case, rank, world, device, groups)
        except Exception as e:  # the test decides whether an error was expected
            result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        result["backend"] = dist.get_backend()
        torch.save(result, os.path.join(out, f"{case['name']}-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
