"""Suite 2 of docs/benchmarks.md: the attention seed's flash table ("flash attention
benchmark").

Batch 1, one head ((B, N, D) tensors, the seed's layout), causal; d in {16, 32, 64, 128},
N in 128 .. 65536, bfloat16 and float32; forward, backward and forward+backward ms of eager
PyTorch attention (`torch`) and of this package (`triton`), TFLOP/s and our speed-up, with
PyTorch SDPA pinned to each backend as further columns wherever the backend takes the case
(SDPA's flash and cuDNN backends refuse float32: those cells are skipped) and `torch.compile`
of the eager attention at a few N (bf16, backward and forward+backward: one compiled graph per
shape) for the plot. Eager cells whose score matrices cannot fit are recorded as OOM without
running (estimate), others that run out of memory are recorded as OOM; the suite goes on.

Rendered by `python ci/bench.py flash-attn -k flash_table --name flash-table` as the seed's
table (+ one against SDPA's backends) and a plot of TFLOP/s against N per head dim. Without a
GPU (CI smoke mode) every cell runs once on a tiny shape under the Triton interpreter.
"""

import json

import pytest
import torch
from bench_flash_attn import FLOP_FACTOR, GPU, fwd_flops, run_case
from flash_attn_tables import add_plot, add_seed, measured

DS = [16, 32, 64, 128] if GPU else [16]
NS = [128 * 2**i for i in range(10)] if GPU else [33]
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
DIRECTIONS = ["fwd", "bwd", "fwd_bwd"]
SEED_DIR = {"fwd": "ft", "bwd": "bt", "fwd_bwd": "fbt"}
SEED_SPEEDUP = {"fwd": "speedup_fwd", "bwd": "speedup_bwd", "fwd_bwd": "speedup_tot"}
SDPA_COLS = {"sdpa_flash": "flash", "sdpa_cudnn": "cudnn", "sdpa_efficient": "efficient"}
PROVIDERS = ["torch", "triton", *SDPA_COLS, "torch_compile"]
# torch.compile compiles one graph per shape (seconds each): a few N, bf16, and only the
# directions that share the training graph (a no_grad forward would compile a second one).
COMPILE_NS = {1024, 4096, 16384} if GPU else set(NS)
PLOTTED = {
    "bf16": ["triton", "torch", "torch_compile", "sdpa_flash", "sdpa_cudnn"],
    "f32": ["triton", "torch", "sdpa_efficient"],
}


def cells():
    for d in DS:
        for n in NS:
            for dt in DTYPES:
                for direction in DIRECTIONS:
                    for provider in PROVIDERS:
                        if provider == "torch_compile" and (
                            dt != "bf16" or n not in COMPILE_NS or direction == "fwd"
                        ):
                            continue
                        yield pytest.param(
                            d,
                            n,
                            dt,
                            direction,
                            provider,
                            id=f"d{d}-{n}-{dt}-{direction}-{provider}",
                        )


SEED_COLUMNS = [f"{SEED_DIR[r]}_{p}" for p in ("torch", "triton") for r in DIRECTIONS]
TFLOPS_COLUMNS = [f"tflops_{SEED_DIR[r]}_triton" for r in DIRECTIONS]
SEED_SPEC = {
    "title": "Flash table (the seed's format): batch 1, one head, causal; ms, speed-up = "
    "eager / ours",
    "columns": SEED_COLUMNS + TFLOPS_COLUMNS,
    "ratios": {
        SEED_SPEEDUP[r]: [f"{SEED_DIR[r]}_torch", f"{SEED_DIR[r]}_triton"] for r in DIRECTIONS
    },
    "digits": {"*": 4, **dict.fromkeys(TFLOPS_COLUMNS, 1)},
}
SDPA_COLUMNS = [f"{SEED_DIR[r]}_{c}" for r in DIRECTIONS for c in ("triton", *SDPA_COLS.values())]
SDPA_SPEC = {
    "title": "Flash table against SDPA's backends (ms); vs_sdpa = best SDPA backend that takes "
    "the case / ours",
    "columns": SDPA_COLUMNS,
    "digits": {"*": 4},
    "ratios": {
        f"vs_sdpa_{SEED_DIR[r]}": [
            [f"{SEED_DIR[r]}_{c}" for c in SDPA_COLS.values()],
            f"{SEED_DIR[r]}_triton",
        ]
        for r in DIRECTIONS
    },
}


@pytest.mark.parametrize(("d", "n", "dt", "direction", "provider"), list(cells()))
def test_flash_table(benchmark, d, n, dt, direction, provider):
    benchmark.group = f"flash_table-{direction}-dim{d}-{dt}"
    flops = FLOP_FACTOR[direction] * fwd_flops(1, 1, n, d, True)
    run_case(benchmark, op="flash_table", tag=f"batch1-head1-dim{d}-causal1-{dt}", x=n,
             shape=(1, n, d), causal=True, provider=provider, direction=direction, flops=flops,
             dtype=DTYPES[dt])  # fmt: skip
    row = [["seq_len", n], ["d_model", d], ["precision", dt]]
    col = SEED_DIR[direction]
    if provider in ("torch", "triton"):
        values = {f"{col}_{provider}": measured(benchmark)}
        if provider == "triton":
            values[f"tflops_{col}_triton"] = measured(benchmark, "tflops")
        add_seed(benchmark, "flash_table", row, values, **SEED_SPEC)
    if provider == "triton" or provider in SDPA_COLS:
        name = "triton" if provider == "triton" else SDPA_COLS[provider]
        add_seed(benchmark, "flash_table_sdpa", row, {f"{col}_{name}": measured(benchmark)},
                 **SDPA_SPEC)  # fmt: skip
    if provider in PLOTTED[dt] and (dt == "bf16" or direction == "fwd_bwd"):
        r = DIRECTIONS.index(direction) if dt == "bf16" else len(DIRECTIONS)
        label = direction.replace("fwd_bwd", "fwd+bwd")
        add_plot(benchmark, f"{dt} {label}, d = {d} (B 1, H 1, causal)", r, DS.index(d),
                 ylabel="TFLOP/s", xlabel="N")  # fmt: skip


def test_seed_table_rendering(tmp_path):
    """report.py renders the seed-format cells: rows sorted, OOM kept, ratios and N/A."""
    from kernelkit.shared.report import render_markdown, render_plot

    def bench(n, provider, ms, tflops):
        extra = {"op": "flash_table", "direction": "fwd", "tag": "t", "x": n, "provider": provider}
        extra.update({"oom": True} if ms == "OOM" else {"ms": ms, "tflops": tflops})

        class B:
            extra_info = extra

        row = [["seq_len", n], ["d_model", 16], ["precision", "bf16"]]
        add_seed(B, "flash_table", row, {f"ft_{provider}": measured(B)}, **SEED_SPEC)
        add_plot(B, "bf16 fwd", 0, 1, ylabel="TFLOP/s")
        return {"extra_info": B.extra_info}

    run = {"benchmarks": [bench(256, "torch", 0.04, 1.0), bench(128, "torch", "OOM", None),
                          bench(256, "triton", 0.01, 4.0), bench(128, "triton", 0.02, 2.0)]}  # fmt: skip
    md = render_markdown([json.loads(json.dumps(run))], "t")
    lines = [x for x in md.splitlines() if x.startswith("|")]
    assert lines[0].split("|")[1:4] == [" seq_len ", " d_model ", " precision "]
    r128, r256 = (x.replace(" ", "").split("|") for x in lines[2:4])
    head = lines[0].replace(" ", "").split("|")
    assert r128[head.index("ft_torch")] == "OOM" and r128[head.index("speedup_fwd")] == "N/A"
    assert r256[head.index("ft_triton")] == "0.0100" and r256[head.index("speedup_fwd")] == "4.00x"
    pytest.importorskip("matplotlib")
    assert render_plot([run], tmp_path / "p.png", "t") and (tmp_path / "p.png").stat().st_size
