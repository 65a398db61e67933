"""Render pytest-benchmark JSON from kernelkit suites as the seed-style tables (and a plot).

Standard library only (matplotlib is used for the PNG when it is importable), so it runs on an
offline GPU machine from a source checkout. Each benchmark's `extra_info` carries its table
coordinates, written by `kernelkit.shared.bench.record`: op, direction, tag, x (+ xname),
provider, and the measurements ms, peak_mb, gbs, pct_copy, tflops, oom.

Tables: `<op>-speed-<direction>-<tag>` (ms) and `<op>-memory-<direction>-<tag>` (MiB), one row
per x and one column per provider, like the seed documents; then the same cells as GB/s with %
of copy bandwidth (memory-bound ops) or TFLOP/s (attention).

Wide seed-format tables (optional): a cell may also carry `extra_info["seed"]`, a list of
entries `{"table": name, "row": [[key, value], ...], "values": {column: number or "OOM"},
"columns": [...], "sort": [...], "ratios": {column: [numerator, denominator]}, "digits":
{column or "*": n} (default 3), "style": "pipe" | "text", "title": str}`. Entries of one table name are merged by
row: one row per distinct `row`, sorted by `sort` (default: the row values), value columns in
the order of `columns`, then the ratio columns (numerator / denominator of that row, printed
"1.23x"; a numerator given as a list takes the smallest number among those columns; "N/A" where
one is missing). They are rendered first, in the order tables first appear. Likewise
`extra_info["plot"] = {"panel": str, "row": r, "col": c, "y": field, "ylabel": str}` places the
cell in a panel of a chosen figure: when any cell has one, the plot shows those panels (one line
per provider, `y` against x) instead of one time panel per table.
"""

from __future__ import annotations

import re
from collections import OrderedDict

__all__ = ["collect", "collect_seed", "render_markdown", "render_plot", "slug"]


def slug(name: str) -> str:
    """File-name form of a GPU name (results/<slug>.json, .benchmarks/<slug>/)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


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


def _entries(e: dict) -> list[dict]:
    seed = e.get("seed") or []
    return [seed] if isinstance(seed, dict) else list(seed)


def collect_seed(runs: list[dict]) -> OrderedDict:
    """{table: {"spec": first entry seen, "rows": {row key: {"sort", "row", "values"}}}}"""
    tables: OrderedDict = OrderedDict()
    for run in runs:
        for b in run.get("benchmarks", []):
            for entry in _entries(b.get("extra_info", {})):
                t = tables.setdefault(entry["table"], {"spec": entry, "rows": {}})
                row = tuple(tuple(kv) for kv in entry["row"])
                r = t["rows"].setdefault(
                    row, {"sort": entry.get("sort", [v for _, v in row]), "values": {}}
                )
                r["values"].update(entry.get("values", {}))
    return tables


def _ratio(values: dict, num, den):
    nums = [values.get(c) for c in ([num] if isinstance(num, str) else num)]
    nums = [v for v in nums if isinstance(v, (int, float))]
    d = values.get(den)
    if not nums or not isinstance(d, (int, float)) or d <= 0:
        return "N/A"
    return f"{min(nums) / d:.2f}x"


def _seed_table(name: str, t: dict) -> str:
    spec = t["spec"]
    keys = [k for k, _ in spec["row"]]
    ratios = spec.get("ratios", {})
    cols = list(spec.get("columns") or [])
    for r in t["rows"].values():
        cols += [c for c in r["values"] if c not in cols]
    digits = spec.get("digits", {})
    head = [*keys, *cols, *ratios]
    rows = []
    for row, r in sorted(t["rows"].items(), key=lambda kv: kv[1]["sort"]):
        cells = [str(v) for _, v in row]
        for c in cols:
            v = r["values"].get(c)
            cells.append(_fmt(v, digits.get(c, digits.get("*", 3))) if v is not None else "-")
        cells += [_ratio(r["values"], *ratios[c]) for c in ratios]
        rows.append(cells)
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = [f"### {spec.get('title', name)}", ""]
    if spec.get("style") == "text":
        lines.append("```")
        lines += ["  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in [head, *rows]]
        lines.append("```")
    else:
        lines.append("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
        lines.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
        lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(x, widths)) + " |" for x in rows]
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
    for name, t in collect_seed(runs).items():
        out += [_seed_table(name, t), ""]
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
    # Tables whose rows are labels (the model-shape tables) stay in the markdown only.
    groups = OrderedDict(
        (k, g)
        for k, g in collect(runs).items()
        if any(isinstance(x, (int, float)) for x, _ in g["cells"])
    )
    if not groups:
        return False
    panels = _plot_panels(runs)
    if panels:
        return _render_panels(plt, panels, path, title)
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


def _plot_panels(runs: list[dict]) -> dict:
    """{(row, col): {"spec": first plot entry, "series": {provider: [(x, y)]}}} of the cells
    that name a panel (extra_info["plot"]) and have a value for its `y`."""
    panels: dict = {}
    for run in runs:
        for b in run.get("benchmarks", []):
            e = b.get("extra_info", {})
            spec = e.get("plot")
            if not spec:
                continue
            p = panels.setdefault((spec["row"], spec["col"]), {"spec": spec, "series": {}})
            y = e.get(spec["y"])
            if isinstance(y, (int, float)) and isinstance(e.get("x"), (int, float)):
                p["series"].setdefault(e["provider"], []).append((e["x"], y))
    return panels


def _render_panels(plt, panels: dict, path, title: str) -> bool:
    rows = sorted({r for r, _ in panels})  # unused row / column numbers leave no gap
    cols = sorted({c for _, c in panels})
    fig, axes = plt.subplots(
        len(rows), len(cols), figsize=(4.2 * len(cols), 3.2 * len(rows)), squeeze=False
    )
    for ax in axes.flat:
        ax.axis("off")
    providers = list(dict.fromkeys(q for p in panels.values() for q in p["series"]))
    for (r, c), p in panels.items():
        ax, spec = axes[rows.index(r)][cols.index(c)], p["spec"]
        ax.axis("on")
        for provider, pts in p["series"].items():
            color = f"C{providers.index(provider) % 10}"  # one color per provider throughout
            ax.plot(*zip(*sorted(pts)), marker="o", ms=3, label=provider, color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(spec["panel"], fontsize=7)
        ax.set_xlabel(spec.get("xlabel", "n"), fontsize=7)
        ax.set_ylabel(spec.get("ylabel", spec["y"]), fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(True, which="both", alpha=0.3)
        if p["series"]:
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
