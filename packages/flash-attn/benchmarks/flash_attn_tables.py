"""Helpers of the seed-study suites (bench_flash_table, bench_eager_table, bench_model_profile):
each benchmark cell, after `kernelkit.shared.bench.record` measured it, adds its numbers to the
wide seed-format tables and to the panels of the suite's plot that `kernelkit.shared.report`
renders (see that module for the format)."""

from __future__ import annotations


def measured(benchmark, field: str = "ms"):
    """The cell's `field` as recorded ("OOM" when it ran out of memory; None in smoke mode)."""
    e = benchmark.extra_info
    return "OOM" if e.get("oom") else e.get(field)


def add_seed(benchmark, table: str, row: list, values: dict, **spec) -> None:
    """Add `values` ({column: number | "OOM" | None}) to row `row` ([[key, value], ...]) of the
    seed-format table `table`; spec: columns, ratios, digits, sort, style, title. Smoke runs
    (nothing measured) add nothing."""
    values = {k: v for k, v in values.items() if v is not None}
    if values:
        entry = {"table": table, "row": row, "values": values, **spec}
        benchmark.extra_info.setdefault("seed", []).append(entry)


def add_plot(benchmark, panel: str, row: int, col: int, y: str = "tflops", **spec) -> None:
    """Draw this cell (its `y` against x, one line per provider) in panel (row, col) of the plot."""
    benchmark.extra_info["plot"] = {"panel": panel, "row": row, "col": col, "y": y, **spec}
