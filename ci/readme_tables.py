#!/usr/bin/env python3
"""Generate the root README's two tables from the files they describe. Standard library only.

    python ci/readme_tables.py           # rewrite the tables in README.md
    python ci/readme_tables.py --check   # exit 1 (and show the difference) if README.md is stale

* The package table (between `<!-- generated: packages -->` and `<!-- end generated -->`):
  one row per distribution, name, import, description and version read from its pyproject.toml.
* The results table (between `<!-- generated: results -->` and `<!-- end generated -->`): one
  row per entry of RESULT_ROWS below, its numbers read from the committed pytest-benchmark JSON
  in packages/<pkg>/benchmarks/results/, with the GPU and date of that run (machine_info and
  datetime) and the first package version that shipped the measured code (from git history:
  see `results_version`).

To add a row, add an entry to RESULT_ROWS; to change a number, commit a new results file and run
this script (`test_readme.py` in ci/tests fails while the README disagrees).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
END = "<!-- end generated -->"


@dataclass(frozen=True)
class Project:
    path: Path  # the folder holding pyproject.toml
    name: str
    version: str
    description: str
    module: str


def _field(text: str, key: str) -> str:
    m = re.search(rf'^{key}\s*=\s*"([^"]*)"', text, re.M)
    if not m:
        raise ValueError(f'no {key} = "..." line')
    return m[1]


def read_project(path: Path, text: str | None = None) -> Project:
    text = (path / "pyproject.toml").read_text() if text is None else text
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    return Project(
        path=path,
        name=_field(project, "name"),
        version=_field(project, "version"),
        description=_field(project, "description"),
        module=_field(text.split("[tool.uv.build-backend]", 1)[1], "module-name"),
    )


def projects(root: Path = ROOT) -> list[Project]:
    """The packages in packages/ (sorted by folder), then kernelkit-shared."""
    paths = sorted(p.parent for p in root.glob("packages/*/pyproject.toml"))
    return [read_project(p) for p in [*paths, root / "shared"]]


def package_table(root: Path = ROOT) -> str:
    rows = ["| package | import | what | version |", "|---|---|---|---|"]
    for p in projects(root):
        link = p.path.relative_to(root).as_posix()
        rows.append(f"| [`{p.name}`]({link}) | `{p.module}` | {p.description} | {p.version} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    label: str  # what the row shows
    package: str  # folder under packages/
    results: str  # results/<this>.json
    op: str  # extra_info["op"]
    tag: str  # extra_info["tag"]
    x: int | str  # extra_info["x"]
    peer: str  # the provider the ratio is against
    unit: str = "copy"  # "copy": % of copy bandwidth (pct_copy); "tflops": TFLOP/s


H100, H200 = "NVIDIA-H100-80GB-HBM3", "NVIDIA-H200"
SEED = "batch12-head12-dim128-act_{}-bf16"
FA = "tokens16384-head{}-dim{}-causal{}-bf16"
RESULT_ROWS = [
    Row("act silu, x (12, 12, 32768, 128)", "act", H200, "act", SEED.format("silu"), 32768, "torch_compile"),
    Row("act softmax over D", "act", H200, "act", SEED.format("softmax-dim_-1"), 32768, "torch"),
    Row("act softmax over the 32k sequence", "act", H200, "act", SEED.format("softmax-dim_-2"), 32768, "torch"),
    Row("lrpe-rotate none, x (12, 32768, 12, 128)", "lrpe-rotate", H100, "lrpe_rotate", SEED.format("none"), 32768, "torch_compile"),
    Row("lrpe-rotate silu", "lrpe-rotate", H100, "lrpe_rotate", SEED.format("silu"), 32768, "torch_compile"),
    Row("lrpe-cosine none", "lrpe-cosine", H100, "lrpe_cosine", SEED.format("none"), 32768, "torch_compile"),
    Row("lrpe-cosine silu", "lrpe-cosine", H100, "lrpe_cosine", SEED.format("silu"), 32768, "torch_compile"),
    Row("lrpe-cosine none", "lrpe-cosine", H200, "lrpe_cosine", SEED.format("none"), 32768, "torch_compile"),
    Row("lrpe-cosine silu", "lrpe-cosine", H200, "lrpe_cosine", SEED.format("silu"), 32768, "torch_compile"),
    Row("md-lrpe-cosine 1-D, 32768 tokens", "md-lrpe-cosine", H100, "md_lrpe_cosine", "batch12-head12-dim128-bf16-1d-l0", 32768, "torch_compile"),
    Row("md-lrpe-cosine 2-D, 128² tokens", "md-lrpe-cosine", H100, "md_lrpe_cosine", "batch12-head12-dim128-bf16-2d-l0", 128, "torch_compile"),
    Row("md-lrpe-cosine 3-D, 32³ tokens", "md-lrpe-cosine", H100, "md_lrpe_cosine", "batch12-head12-dim128-bf16-3d-l0", 32, "torch_compile"),
    Row("flash-attn d64, N 16k", "flash-attn", H100, "flash_attn", FA.format(32, 64, 0), 16384, "sdpa_cudnn", "tflops"),
    Row("flash-attn d64 causal, N 16k", "flash-attn", H100, "flash_attn", FA.format(32, 64, 1), 16384, "sdpa_cudnn", "tflops"),
    Row("flash-attn d128, N 16k", "flash-attn", H100, "flash_attn", FA.format(16, 128, 0), 16384, "sdpa_cudnn", "tflops"),
    Row("flash-attn d128 causal, N 16k", "flash-attn", H100, "flash_attn", FA.format(16, 128, 1), 16384, "sdpa_cudnn", "tflops"),
    Row("flash-attn leaderboard (16, 16384, 64) causal", "flash-attn", H100, "flash_attn_leaderboard", "batch16-head1-dim64-causal1-bf16", 16384, "sdpa_cudnn", "tflops"),
    Row("flash-attn d64 causal, N 16k", "flash-attn", H200, "flash_attn", FA.format(32, 64, 1), 16384, "sdpa_cudnn", "tflops"),
    Row("flash-attn d128 causal, N 16k", "flash-attn", H200, "flash_attn", FA.format(16, 128, 1), 16384, "sdpa_cudnn", "tflops"),
    Row("flash-attn leaderboard (16, 16384, 64) causal", "flash-attn", H200, "flash_attn_leaderboard", "batch16-head1-dim64-causal1-bf16", 16384, "sdpa_cudnn", "tflops"),
]  # fmt: skip


@cache
def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


@cache
def results_version(root: Path, package: str, json_path: Path) -> str:
    """The first package version that shipped the code a results file measured: the version
    that the first version change at or after the commit that last changed the file set (the
    file committed with a bump: that version), the working tree's version counting as the last
    change. No bump since: "<version>+" (measured after that release). Uncommitted results:
    the working tree's version."""
    pkg = f"packages/{package}/pyproject.toml"
    rel = json_path.relative_to(root).as_posix()
    if _git(root, "diff", "--quiet", "HEAD", "--", rel).returncode != 0:
        return read_project(root / "packages" / package).version
    commit = _git(root, "log", "-1", "--format=%H", "--", rel).stdout.strip()
    if not commit:
        raise RuntimeError(f"{rel}: no git history (needs a clone with history, not an export)")

    def version_at(rev: str) -> str | None:
        shown = _git(root, "show", f"{rev}:{pkg}")
        return read_project(root, shown.stdout).version if shown.returncode == 0 else None

    before = version_at(f"{commit}^")
    later = _git(root, "log", "--reverse", "--format=%H", f"{commit}~1..HEAD", "--", pkg)
    if later.returncode != 0:  # the results file's commit is the root commit
        later = _git(root, "log", "--reverse", "--format=%H", "HEAD", "--", pkg)
    for rev in later.stdout.split():
        v = version_at(rev)
        if v != before:
            return v
    current = read_project(root / "packages" / package).version  # a bump not committed yet
    return current if current != before else f"{before}+"


def _cells(run: dict, row: Row) -> dict:
    found = {}
    for b in run["benchmarks"]:
        e = b.get("extra_info", {})
        if (e.get("op"), e.get("tag"), e.get("x")) == (row.op, row.tag, row.x):
            found[(e.get("direction"), e.get("provider"))] = e
    return found


def _ours(cell: dict | None, unit: str) -> str:
    if not cell or cell.get("ms") is None:
        return "—"
    if unit == "tflops":
        return f"{cell['tflops']:.0f} TFLOP/s"
    return f"{cell['ms']:.3f} ms, {cell['pct_copy']:.0f}% of copy"


def _ratio(ours: dict | None, peer: dict | None) -> str:
    if not ours or not peer or not ours.get("ms") or not peer.get("ms"):
        return "—"
    return f"{peer['ms'] / ours['ms']:.2f}×"  # noqa: RUF001


def result_row(root: Path, row: Row) -> str:
    path = root / "packages" / row.package / "benchmarks" / "results" / f"{row.results}.json"
    run = _load(path)
    cells = _cells(run, row)
    if not cells:
        raise ValueError(f"{path.name}: no cells for {row}")
    fwd, bwd = cells.get(("fwd", "triton")), cells.get(("bwd", "triton"))
    vs = (
        f"{_ratio(fwd, cells.get(('fwd', row.peer)))} / {_ratio(bwd, cells.get(('bwd', row.peer)))}"
    )
    info = run.get("machine_info", {}).get("kernelkit", {})
    gpu = info.get("gpu", "?").removeprefix("NVIDIA ").replace(" 80GB HBM3", "")
    date = str(run.get("datetime", "?"))[:10]
    version = results_version(root, row.package, path)
    peer = row.peer.replace("_", " ")
    return (
        f"| {row.label} | {_ours(fwd, row.unit)} | {_ours(bwd, row.unit)} | {vs} {peer} "
        f"| {version} | {gpu} | {date} |"
    )


def results_table(root: Path = ROOT) -> str:
    rows = [
        "| case (bf16) | forward | backward | speed-up fwd / bwd vs | version | GPU | date |",
        "|---|---|---|---|---|---|---|",
    ]
    rows += [result_row(root, r) for r in RESULT_ROWS]
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# README rewriting
# ---------------------------------------------------------------------------------------------

TABLES = {"packages": package_table, "results": results_table}


def rewrite(text: str, root: Path = ROOT) -> str:
    """`text` with every generated block replaced by what the files say now."""
    for name, make in TABLES.items():
        begin = f"<!-- generated: {name} -->"
        if text.count(begin) != 1:
            raise ValueError(f"README: expected one {begin!r} marker")
        head, rest = text.split(begin, 1)
        if END not in rest:
            raise ValueError(f"README: {begin!r} has no {END!r}")
        _, tail = rest.split(END, 1)
        text = f"{head}{begin}\n{make(root)}\n{END}{tail}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if README.md is stale")
    args = ap.parse_args()
    readme = ROOT / "README.md"
    old = readme.read_text()
    new = rewrite(old)
    if args.check:
        if new != old:
            sys.stdout.writelines(
                difflib.unified_diff(
                    old.splitlines(True), new.splitlines(True), "README.md", "generated"
                )
            )
            print("README.md is stale: run python ci/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    print("README.md: tables rewritten" if new != old else "README.md: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
