"""The suites' host table (issue 33): `kernelkit.shared.bench.host_cell` measures an op's host µs
per call (`kernelkit.shared.host_time`) and `kernelkit.shared.report` renders it beside the other
tables; `ci/bench.py --merge` keys its cells by their rows. On CPU the cells run once each."""

import importlib.util
from pathlib import Path

import torch

from kernelkit.act import act
from kernelkit.act.reference import act_reference
from kernelkit.shared import host_time
from kernelkit.shared.bench import host_cell
from kernelkit.shared.report import render_markdown


class StubBenchmark:
    """The part of pytest-benchmark's fixture `host_cell` uses."""

    disabled = True

    def __init__(self):
        self.extra_info, self.group, self.ran = {}, None, 0

    def pedantic(self, fn, rounds, iterations):
        self.ran += 1
        fn()


def test_per_call_us_counts_calls():
    calls = []
    us = host_time.per_call_us(lambda: calls.append(1), calls=7, rounds=3, warmup=2)
    assert len(calls) == 2 + 7 * 3
    assert us >= 0.0
    counts = {"f": 0}

    def f(x):
        counts["f"] += 1
        return x * 2

    cells = host_time.fwd_bwd_us(f, (torch.ones(3),), calls=1, rounds=1, warmup=0)
    assert len(cells) == len(host_time.DIRECTIONS) == 3
    assert counts["f"] == 3  # the forward recording y, then one forward per forward cell


def _run(benches):
    return {"benchmarks": [{"extra_info": b.extra_info} for b in benches], "machine_info": {}}


def test_host_cells_render_as_one_table():
    x = torch.randn(2, 5, 2, 16, dtype=torch.bfloat16)
    benches = []
    for provider, fn in (("triton", act), ("torch", act_reference)):
        b = StubBenchmark()
        host_cell(b, lambda x, f=fn: f(x, "silu"), (x,), op="act", case="silu",
                  shape="small 2x5x2x16", provider=provider)  # fmt: skip
        assert b.ran == 1 and b.group == "act-host"
        assert "op" not in b.extra_info  # no speed / memory tables of its own
        benches.append(b)
    md = render_markdown([_run(benches)], "act")
    assert "### act: host µs per call" in md
    rows = [line for line in md.splitlines() if line.startswith("|") and "silu" in line]
    assert [r.split("|")[3].strip() for r in rows] == list(host_time.DIRECTIONS)
    for r in rows:  # triton, torch, torch_compile (not measured), triton / torch
        cells = [c.strip() for c in r.split("|")[4:8]]
        assert cells[2] == "-" and cells[3].endswith("x")
        assert float(cells[3][:-1]) > 0


def test_merge_keys_host_cells_by_row():
    spec = importlib.util.spec_from_file_location(
        "ci_bench", Path(__file__).parents[3] / "ci" / "bench.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x = torch.randn(2, 5, 2, 16)
    cells = {}
    for shape in ("small", "decode"):
        for provider in ("triton", "torch"):
            b = StubBenchmark()
            host_cell(b, lambda x: act(x, "silu"), (x,), op="act", case="silu", shape=shape,
                      provider=provider)  # fmt: skip
            cells[shape, provider] = {"extra_info": b.extra_info}
    old = {"benchmarks": list(cells.values()), "datetime": "old"}
    new = {"benchmarks": [cells["small", "triton"]], "datetime": "new"}
    merged = bench.merge(new, old)
    assert len(merged["benchmarks"]) == 4  # only the re-measured cell is replaced
    keys = {bench._cell_key(b) for b in merged["benchmarks"]}
    assert len(keys) == 4
    assert merged["machine_info"]["kernelkit"]["runs"] == ["old", "new"]
