"""Suite 3 of docs/benchmarks.md: the attention seed's eager-attention table
("benchmark_attn").

As the seed's experiment: batch 8, one head ((B, N, D) tensors), no mask, float32;
d in {16, 32, 64, 128}, N in {256, 1024, 4096, 8192, 16384}. Per cell: forward ms (a forward
that records the graph for a backward, as the seed's loop of forward passes did), backward ms
and the memory allocated before the backward (inputs, output gradient, what autograd saved),
for eager PyTorch attention (`torch`), `torch.compile` of it (`torch_compile`; its forward and
backward share one compiled graph per shape) and this package (`triton`), side by side. Cells
that run out of memory (or whose eager score matrices cannot fit: an estimate, not run) read
OOM. float32 here means full float32 products: PyTorch's default matmul precision for eager and
compiled attention, three tf32 products per product for ours (README).

Rendered by `python ci/bench.py flash-attn -k eager_table --name eager-table`.
"""

import pytest
import torch
from bench_flash_attn import GPU, _raise_oom, attention_fn, eager_fits, make_inputs
from flash_attn_tables import add_plot, add_seed, measured

from kernelkit.shared.bench import record

BATCH = 8 if GPU else 2
DS = [16, 32, 64, 128] if GPU else [16]
NS = [256, 1024, 4096, 8192, 16384] if GPU else [33]
DTYPE = torch.float32
PROVIDERS = {"torch": "torch", "torch_compile": "compile", "triton": "triton"}
PLOT_ROW = 10  # below the flash table's panels when both suites are rendered together
COLUMNS = [f"{m}_{p}" for p in PROVIDERS.values() for m in ("fwd", "bwd", "mem")]
SPEC = {
    "title": "Eager-attention table (the seed's format): batch 8, one head, no mask, float32; "
    "fwd and bwd in ms, mem = MiB allocated before the backward",
    "columns": COLUMNS,
    "digits": {"*": 3, **{c: 0 for c in COLUMNS if c.startswith("mem")}},
    "ratios": {
        "fwd_x_torch": ["fwd_torch", "fwd_triton"],
        "bwd_x_torch": ["bwd_torch", "bwd_triton"],
        "bwd_x_compile": ["bwd_compile", "bwd_triton"],
    },
    "style": "text",
}


def fwd_flops(n, d):
    return 4.0 * BATCH * n * n * d


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("d", DS, ids=lambda d: f"d{d}")
def test_eager_table(benchmark, d, n, provider, direction):
    benchmark.group = f"eager_table-{direction}-dim{d}"
    fn, layout = attention_fn(provider, False)
    flops = (1.0 if direction == "fwd" else 2.5) * fwd_flops(n, d)
    cell = {"op": "eager_table", "direction": direction, "tag": f"batch{BATCH}-head1-dim{d}-f32",
            "x": n, "provider": provider, "flops": flops}  # fmt: skip
    mem_before = None
    if provider != "triton" and not eager_fits(BATCH, 1, n, DTYPE):
        record(benchmark, _raise_oom, **cell, info={"layout": layout, "oom_estimated": True})
        mem_before = "OOM"
    else:
        q, k, v, do = make_inputs((BATCH, n, d), layout, DTYPE)
        try:
            o = fn(q, k, v)
            if GPU:
                torch.cuda.synchronize()
                mem_before = torch.cuda.memory_allocated() / 2**20
        except torch.OutOfMemoryError:
            o, mem_before = None, "OOM"
        if o is None:
            call = _raise_oom
        elif direction == "fwd":
            del o

            def call():  # records the graph (and frees it), like the seed's forward passes
                return fn(q, k, v)

        else:

            def call():
                o.backward(do, retain_graph=True)

        record(benchmark, call, **cell, grad_to_none=[q, k, v], info={"layout": layout})
    row = [["d_model", d], ["seq_len", n]]
    name = PROVIDERS[provider]
    values = {f"{direction}_{name}": measured(benchmark)}
    if direction == "bwd":
        values[f"mem_{name}"] = benchmark.extra_info["mem_before_mb"] = mem_before
    add_seed(benchmark, "eager_table", row, values, **SPEC)
    add_plot(benchmark, f"{direction}, d = {d} (B {BATCH}, H 1, f32)",
             PLOT_ROW + ["fwd", "bwd"].index(direction), DS.index(d), y="ms", ylabel="ms",
             xlabel="N")  # fmt: skip
