"""Render pytest-benchmark JSON from kernelkit suites as the seed-style tables (and a plot).

Standard library only (matplotlib is used for the PNG when it is importable), so it runs on an
offline GPU machine from a source checkout. Each benchmark's `extra_info` carries its table
coordinates, written by `kernelkit.shared.bench.record`: op, direction, tag, x (+ xname),
provider, and the measurements ms, peak_mb, gbs, pct_copy, tflops, oom.

Tables: `<op>-speed-<direction>-<tag>` (ms) and `<op>-memory-<direction>-<tag>` (MiB), one row
per x and one column per provider, like the seed documents; then the same cells as GB/s with %
of copy bandwidth (memory-bound ops) or TFLOP/s (attention).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

__all__ = ["collect", "load", "render_markdown", "render_plot"]


def load(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def collect(runs: list[dict]) -> OrderedDict:
    """{(op, direction, tag): {"xname": str, "providers": [..], "cells": {(x, provider): info}}}"""
    groups: OrderedDict = OrderedDict()
    for run in runs:
        for b in run.get("benchmarks", []):
            e = b.get("extra_info", {})
            if "op" not in e:
                continue
            key = (e["op"], e["direction"], e["tag"])
            g = groups.setdefault(key, {"xname": e.get("xname", "n"), "providers": [], "cells": {}})
            if e["provider"] not in g["providers"]:
                g["providers"].append(e["provider"])
            g["cells"][(e["x"], e["provider"])] = e
    return groups


def _fmt(v, digits):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:.{digits}f}"


def _table(title, g, value, digits) -> str:
    provs = g["providers"]
    xs = sorted({x for x, _ in g["cells"]})
    head = [g["xname"], *provs]
    rows = []
    for x in xs:
        row = [f"{x:g}" if isinstance(x, (int, float)) else str(x)]
        for p in provs:
            cell = g["cells"].get((x, p))
            if cell is None:
                row.append("-")
            elif cell.get("oom"):
                row.append("OOM")
            else:
                row.append(_fmt(value(cell), digits))
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"{title}:", "```"]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("```")
    return "\n".join(lines)


def render_markdown(runs: list[dict], title: str) -> str:
    groups = collect(runs)
    out = [f"# {title}", ""]
    mi = runs[0].get("machine_info", {}).get("kernelkit", {}) if runs else {}
    if mi:
        out.append(
            f"GPU: {mi.get('gpu')} · torch {mi.get('torch')} · triton {mi.get('triton')} · "
            f"CUDA {mi.get('cuda')} · measured copy bandwidth {mi.get('copy_gbs', 0):.0f} GB/s"
        )
        if len(mi.get("runs", [])) > 1:
            out.append(f"Cells merged from the runs of {', '.join(map(str, mi['runs']))}.")
        out.append("")
    out.append(
        "Times are the median of `triton.testing.do_bench` (L2 flushed, gradients reset), "
        "memory is peak allocated MiB of one call (inputs included)."
    )
    out.append("")
    for (op, direction, tag), g in groups.items():
        out.append(f"## {op} {direction} {tag}")
        out.append("")
        out.append(_table(f"{op}-speed-{direction}-{tag}", g, lambda c: c.get("ms"), 6))
        out.append("")
        out.append(_table(f"{op}-memory-{direction}-{tag}", g, lambda c: c.get("peak_mb"), 2))
        out.append("")
        cells = g["cells"].values()
        if any("gbs" in c for c in cells):
            out.append(
                _table(
                    f"{op}-gbs-{direction}-{tag} (GB/s, % of copy bandwidth)",
                    g,
                    lambda c: f"{c['gbs']:.0f} ({c['pct_copy']:.0f}%)" if "gbs" in c else None,
                    0,
                )
            )
            out.append("")
        if any("tflops" in c for c in cells):
            out.append(_table(f"{op}-tflops-{direction}-{tag}", g, lambda c: c.get("tflops"), 1))
            out.append("")
    return "\n".join(out)


def render_plot(runs: list[dict], path, title: str) -> bool:
    """One log-log panel of time vs x per table; returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = collect(runs)
    if not groups:
        return False
    n = len(groups)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, ((_op, direction, tag), g) in zip(axes.flat, groups.items()):
        for p in g["providers"]:
            pts = sorted(
                (x, c["ms"])
                for (x, q), c in g["cells"].items()
                if q == p and "ms" in c and isinstance(x, (int, float))
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=p)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{direction} {tag}", fontsize=7)
        ax.set_xlabel(g["xname"], fontsize=7)
        ax.set_ylabel("ms", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
