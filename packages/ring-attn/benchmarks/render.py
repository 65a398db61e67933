"""Render the scaling suite's JSON (scaling.py) into results/<GPU>-x<W>.md and .png.

    python packages/ring-attn/benchmarks/render.py packages/ring-attn/benchmarks/results/*.json

Standard library (matplotlib for the PNG when it is importable). The largest sequence that
trains is computed, not run: memory per GPU grows linearly with N_local (no N^2 term), so two
measured lengths give the bytes per token and the constant, and 90% of the GPU's memory
divided by them gives the largest N_local (attention alone: q, k, v, do and what the forward
and backward allocate).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _cell(row, provider):
    return next((c for c in row["cells"] if c["provider"] == provider), None)


def _largest(rows, provider, gpu_mb, world) -> str:
    pts = [(r["n_local"], _cell(r, provider)["peak_mb"]) for r in rows if _cell(r, provider)]
    if len(pts) < 2:
        return "-"
    (n0, m0), (n1, m1) = pts[0], pts[-1]
    per_token = (m1 - m0) / (n1 - n0)
    const = m0 - per_token * n0
    n_local = int((0.9 * gpu_mb - const) / per_token)
    return f"{n_local * world / 1e6:.2f}M tokens ({per_token * 1024:.0f} KiB per token)"


def render(data: dict) -> str:
    meta, rows = data["meta"], data["rows"]
    w = meta["gpus"]
    lines = [
        f"# ring-attn on {w}x {meta['gpu']}",
        "",
        f"torch {meta['torch']}, NCCL {meta['nccl']}, {meta['date']}. B = 1, H = {rows[0]['heads']}"
        f" (kv heads {rows[0]['kv_heads']}), D = {rows[0]['dim']}, bf16, causal, zigzag layout. "
        f"Per-GPU TFLOP/s over the visible pairs (fwd+bwd = 3.5x fwd). Floor: the dense bf16 "
        f"matmul rate measured in the same run, {meta['matmul_tflops']:.0f} TFLOP/s.",
        "",
        "| N per GPU | N total | ring fwd ms | ring fwd+bwd ms | ring TFLOP/s fwd / fwd+bwd "
        "| single GPU TFLOP/s fwd / fwd+bwd (N per GPU) | ring / single fwd+bwd | % of matmul "
        "| PyTorch CP+SDPA fwd+bwd ms | ring speed-up vs CP | peak MiB per GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ring, single, cp = _cell(r, "ring"), _cell(r, "single"), _cell(r, "cp-sdpa")
        cp_ms = f"{cp['fwd_bwd_ms']:.1f} ({cp['backend'].split('_')[0].lower()})" if cp else "-"
        speedup = f"{cp['fwd_bwd_ms'] / ring['fwd_bwd_ms']:.2f}x" if cp else "-"
        lines.append(
            f"| {r['n_local'] // 1024}k | {r['n'] // 1024}k | {ring['fwd_ms']:.1f} "
            f"| {ring['fwd_bwd_ms']:.1f} | {ring['fwd_tflops']:.0f} / {ring['fwd_bwd_tflops']:.0f} "
            f"| {single['fwd_tflops']:.0f} / {single['fwd_bwd_tflops']:.0f} "
            f"| {ring['fwd_bwd_tflops'] / single['fwd_bwd_tflops']:.0%} "
            f"| {ring['fwd_bwd_tflops'] / meta['matmul_tflops']:.0%} | {cp_ms} | {speedup} "
            f"| {ring['peak_mb']:.0f} |"
        )
    errors = [f"- N per GPU {r['n_local']}: {r['cp_error']}" for r in rows if r.get("cp_error")]
    if errors:
        lines += ["", "PyTorch's context_parallel did not run:", *errors]
    gpu_mb = meta["gpu_memory_mb"]
    lines += [
        "",
        "Largest sequence that trains (attention alone, computed from the measured peak memory "
        "at two lengths, 90% of the GPU's memory):",
        "",
        f"- 1 GPU, flash_attn: {_largest(rows, 'single', gpu_mb, 1)}",
        f"- {w} GPUs, ring_attn: {_largest(rows, 'ring', gpu_mb, w)}",
        f"- {w} GPUs, PyTorch context_parallel + SDPA: {_largest(rows, 'cp-sdpa', gpu_mb, w)}",
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for provider, style in (("ring", "o-"), ("single", "s--"), ("cp-sdpa", "^:")):
        pts = [(r["n_local"], _cell(r, provider)) for r in rows if _cell(r, provider)]
        if pts:
            ax.plot([n for n, _ in pts], [c["fwd_bwd_tflops"] for _, c in pts], style,
                    label=provider)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per GPU")
    ax.set_ylabel("fwd+bwd TFLOP/s per GPU")
    ax.set_title(f"ring-attn, {data['meta']['gpus']}x {data['meta']['gpu']}", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(paths: list[str]) -> None:
    for p in map(Path, paths):
        data = json.loads(p.read_text())
        p.with_suffix(".md").write_text(render(data))
        plot(data, p.with_suffix(".png"))
        print(p.with_suffix(".md"))


if __name__ == "__main__":
    main(sys.argv[1:])
