"""The scaling suite's renderer (benchmarks/render.py, which runs on GPU machines) on a small
results file shaped as scaling.py writes it: one table row per length, ratios and speed-ups
from the cells, the largest sequence from two lengths' peak memory, and a failed baseline
reported instead of a number."""

from __future__ import annotations

import importlib.util
from pathlib import Path

RENDER = Path(__file__).parents[1] / "benchmarks" / "render.py"


def _render():
    spec = importlib.util.spec_from_file_location("ring_render", RENDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(provider, ms, tflops, peak):
    return {"provider": provider, "fwd_ms": ms, "fwd_bwd_ms": 4 * ms, "fwd_tflops": tflops,
            "fwd_bwd_tflops": tflops * 0.8, "peak_mb": peak, "backend": "CUDNN_ATTENTION"}  # fmt: skip


def test_render_table():
    rows = []
    for i, n_local in enumerate((32768, 65536)):
        cells = [_cell("ring", 10.0 * (i + 1), 500, 1000 * (i + 1)),
                 _cell("single", 2.0 * (i + 1), 625, 500 * (i + 1))]  # fmt: skip
        if i == 0:
            cells.append(_cell("cp-sdpa", 8.0, 600, 2000))
        row = {"world": 2, "n_local": n_local, "n": 2 * n_local, "heads": 16, "kv_heads": 16,
               "dim": 128, "causal": True, "cells": cells}  # fmt: skip
        if i == 1:
            row["cp_error"] = "CUDNN_ATTENTION: RuntimeError: no kernel"
        rows.append(row)
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 2, "gpu_memory_mb": 81559.0,
            "matmul_tflops": 800.0, "torch": "2.11", "nccl": "2.28", "date": "2026-11-27"}  # fmt: skip
    md = _render().render({"meta": meta, "rows": rows})
    lines = md.splitlines()
    assert (
        "| 32k | 64k | 10.0 | 40.0 | 500 / 400 | 625 / 500 | 80% | 50% | 32.0 (cudnn) | 0.80x | 1000 |"
        in lines
    )
    assert (
        "| 64k | 128k | 20.0 | 80.0 | 500 / 400 | 625 / 500 | 80% | 50% | - | - | 2000 |" in lines
    )
    assert "- N per GPU 65536: CUDNN_ATTENTION: RuntimeError: no kernel" in lines
    # 1000 MiB per 32k tokens on each of 2 GPUs: (0.9 * 81559) / (1000 / 32768) * 2 tokens
    assert "- 2 GPUs, ring_attn: 4.81M tokens (31 KiB per token)" in lines
    assert "- 2 GPUs, PyTorch context_parallel + SDPA: -" in lines
