"""Ring attention's scaling suite, one process per GPU:

    torchrun --standalone --nproc-per-node 4 packages/ring-attn/benchmarks/scaling.py \
        --lengths 32768 65536 131072 --out results/NVIDIA-H100-80GB-HBM3-x4.json

At each per-GPU length N_local (B = 1, H = 16, D = 128, bf16, causal, zigzag) and in the same
process, side by side:
* "ring": `ring_attn` on W GPUs (N = W * N_local tokens), forward and forward + backward;
* "single": `flash_attn` on one GPU at N_local (every GPU runs it at once, no communication):
  the throughput a ring step should keep;
* "cp-sdpa": PyTorch's `context_parallel` with SDPA (cuDNN, else the flash backend) at the same
  N, its load-balanced causal sharding.
Times are the median of `--reps` runs after a warm-up, each run started together on every
rank (a barrier) and taken as the slowest rank's (a step waits for the slowest). TFLOP/s count
the causal pairs once (fwd 2 matmuls of N^2/2, bwd 2.5x the forward) per GPU. The floors:
the dense bf16 matmul rate measured here, and the peak memory per GPU, from which the largest
sequence that fits is computed. Rank 0 writes the JSON; `render.py` makes the tables and plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from kernelkit.flash_attn import flash_attn
from kernelkit.ring_attn import ring_attn, shard
from kernelkit.shared.bench import matmul_tflops


def _events(fn, reps: int, warmup: int = 1) -> list[float]:
    """ms of each of `reps` runs of fn (after `warmup`), the slowest rank's, started together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return times


def _peak_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    t = torch.tensor([(torch.cuda.max_memory_allocated() - base) / 2**20], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _fwd_bwd(attn, q, k, v, do):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            attn(*leaves)

    def fwd_bwd():
        o = attn(*leaves)
        torch.autograd.grad(o, leaves, do)

    return fwd, fwd_bwd


def _cell(provider, fwd, fwd_bwd, reps, flops_fwd, inputs_mb):
    f = _events(fwd, reps)
    fb = _events(fwd_bwd, reps)
    ms_f, ms_fb = statistics.median(f), statistics.median(fb)
    return {
        "provider": provider,
        "fwd_ms": ms_f,
        "fwd_bwd_ms": ms_fb,
        "fwd_tflops": flops_fwd / (ms_f * 1e-3) / 1e12,
        "fwd_bwd_tflops": 3.5 * flops_fwd / (ms_fb * 1e-3) / 1e12,
        # training memory: the inputs (q, k, v, do) plus the peak above them during fwd + bwd
        "peak_mb": inputs_mb + _peak_mb(fwd_bwd),
        "runs_fwd_ms": f,
        "runs_fwd_bwd_ms": fb,
    }


def _profile(fn, rank: int) -> None:
    """Rank 0's kernels of one run of fn: the time each kind took and the GPU's idle time."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type.name == "CUDA")  # fmt: skip
        for start, end, name in kernels:
            if end - start > 200:  # us
                print(f"  {start:12.0f} {end - start:9.0f} us {name[:70]}", flush=True)


def _cp_sdpa(full, world, causal, reps, flops, inputs_mb):
    """PyTorch's context parallelism: SDPA under `context_parallel` on the full (B, N, H, D)
    tensors `full` (q, k, v, do), which it shards in place (its own load-balanced layout), timed
    inside the context. Returns (cell, None), or (None, the error) when no backend ran."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn import functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world,))
    errors = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        bufs = [t.transpose(1, 2).contiguous() for t in full]  # (B, H, N, D)
        try:
            with (
                context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4),
                sdpa_kernel(backend),
            ):
                qs, ks, vs, dos = bufs
                # looked up at each call: the context replaces F.scaled_dot_product_attention
                fwd, fwd_bwd = _fwd_bwd(
                    lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal),
                    qs, ks, vs, dos,
                )  # fmt: skip
                cell = _cell("cp-sdpa", fwd, fwd_bwd, reps, flops, inputs_mb)
                cell["backend"] = backend.name
                return cell, None
        except Exception as e:  # recorded in the results
            errors.append(f"{backend.name}: {type(e).__name__}: {str(e)[:300]}")
        finally:
            del bufs
            torch.cuda.empty_cache()
    return None, "; ".join(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-cp", action="store_true", help="skip PyTorch's context_parallel")
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", action="store_true",
                    help="print rank 0's CUDA kernel times of one ring forward (first length)")  # fmt: skip
    args = ap.parse_args()

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    h, hkv, d, causal = args.heads, args.kv_heads, args.dim, True
    rows = []
    matmul = matmul_tflops()
    for n_local in args.lengths:
        n = n_local * world
        g = torch.Generator(device="cuda").manual_seed(0)

        def make(heads, g=g, n=n):
            return torch.randn((1, n, heads, d), generator=g, device="cuda", dtype=torch.bfloat16)

        q, k, v, do = make(h), make(hkv), make(hkv), make(h)
        local_t = [shard(t, rank, world, "zigzag") for t in (q, k, v, do)]
        inputs_mb = sum(t.numel() * t.element_size() for t in local_t) / 2**20
        flops_ring = 4 * h * d * n * n / 2 / world  # per GPU
        flops_single = 4 * h * d * n_local * n_local / 2
        row = {"world": world, "n_local": n_local, "n": n, "heads": h, "kv_heads": hkv,
               "dim": d, "causal": causal, "cells": []}  # fmt: skip
        fwd, fwd_bwd = _fwd_bwd(lambda a, b, c: ring_attn(a, b, c, causal=causal), *local_t)
        row["cells"].append(_cell("ring", fwd, fwd_bwd, args.reps, flops_ring, inputs_mb))
        if args.profile and n_local == args.lengths[0]:
            _profile(fwd, rank)
        single = [t[:, :n_local].contiguous() for t in local_t]
        fwd, fwd_bwd = _fwd_bwd(lambda a, b, c: flash_attn(a, b, c, causal), *single)
        row["cells"].append(_cell("single", fwd, fwd_bwd, args.reps, flops_single, inputs_mb))
        del single
        del local_t
        if not args.no_cp and world > 1:
            cell, error = _cp_sdpa([q, k, v, do], world, causal, args.reps, flops_ring,
                                   inputs_mb)  # fmt: skip
            if cell is not None:
                row["cells"].append(cell)
            else:
                row["cp_error"] = error
        del q, k, v, do
        torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "cells"}), flush=True)
            for c in row["cells"]:
                print(f"  {c['provider']:8s} fwd {c['fwd_ms']:9.2f} ms {c['fwd_tflops']:6.1f} TF"
                      f"  fwd+bwd {c['fwd_bwd_ms']:9.2f} ms {c['fwd_bwd_tflops']:6.1f} TF"
                      f"  peak {c['peak_mb']:8.0f} MiB", flush=True)  # fmt: skip
    if rank == 0:
        meta = {
            "gpu": torch.cuda.get_device_name(),
            "gpus": world,
            "gpu_memory_mb": torch.cuda.get_device_properties(0).total_memory / 2**20,
            "matmul_tflops": matmul,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "date": time.strftime("%Y-%m-%d"),
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
