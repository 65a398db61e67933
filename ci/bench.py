#!/usr/bin/env python3
"""Run one package's benchmark suite and render its results. Standard library + PYTHONPATH only,
so it works from a source checkout on an offline GPU machine (no uv, no nox).

    python ci/bench.py act                  # full suite on the GPU -> packages/act/benchmarks/results/
    python ci/bench.py act -k "fwd and relu" # a subset (pytest -k)
    python ci/bench.py act --render-only packages/act/benchmarks/results/NVIDIA-H100-80GB-HBM3.json
    python ci/bench.py act -k model --merge  # re-measure a subset, keep the other committed cells
    python ci/bench.py flash-attn -k flash_table --name flash-table  # results/<GPU>-flash-table.*
    python ci/bench.py ring-attn --lengths 32768 65536  # multi-GPU: results/<GPU>-x2.*, -x4.*

Writes results/<GPU>.json (pytest-benchmark JSON), results/<GPU>.md (seed-style tables: one column
per provider, speed and memory, fwd and bwd, plus GB/s or TFLOP/s) and results/<GPU>.png (a plot).
With --name NAME the files are results/<GPU>-NAME.*: a subset run does not replace the full one.

Without a GPU (torch.cuda.is_available() is False) it says so in one line and runs a smoke run
instead: every benchmark of the suite once, under the Triton interpreter, with
--benchmark-disable (the same check as the test sessions). Nothing is timed and no results file
is written: results come from a real GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC_PATHS = [ROOT / "shared" / "src", *sorted(ROOT.glob("packages/*/src"))]


def source_env() -> dict:
    env = dict(os.environ)
    paths = [str(p) for p in SRC_PATHS]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def gpu_present() -> bool:
    """Whether torch (as the suite will import it) sees a CUDA GPU."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    proc = subprocess.run([sys.executable, "-c", probe], env=source_env(), capture_output=True)
    return proc.returncode == 0


def smoke_run(package: str, extra: list[str]) -> int:
    """No GPU: run every benchmark once (pytest --benchmark-disable), write nothing."""
    print(
        f"bench: no GPU found (torch.cuda.is_available() is False): running a smoke run of "
        f"packages/{package}/benchmarks instead (each benchmark once under the Triton "
        f"interpreter, --benchmark-disable); nothing is timed and no results are written",
        flush=True,
    )
    cmd = _pytest(package, "--benchmark-disable", *extra)
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=source_env()).returncode


def _pytest(package: str, *args: str) -> list[str]:
    """The pytest command over a package's benchmark files, with the kernelkit plugin."""
    benchmarks = str(ROOT / "packages" / package / "benchmarks")
    return [sys.executable, "-m", "pytest", "-p", "kernelkit.shared.pytest_plugin", benchmarks,
            "-q", *args]  # fmt: skip


def run_suite(package: str, json_path: Path, extra: list[str]) -> int:
    cmd = _pytest(
        package, "--benchmark-json", str(json_path), "--benchmark-columns=median,iqr,rounds", *extra
    )
    print("+", " ".join(cmd), flush=True)
    # On SIGINT (e.g. `timeout -s INT`) pytest stops after the current benchmark and still writes
    # the JSON of what it measured; this process waits for it and renders the partial run.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=source_env())
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            print("interrupted: waiting for pytest to write the partial results", flush=True)


def gpus() -> tuple[int, str]:
    """(how many CUDA GPUs torch sees, the first one's name)."""
    probe = "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name())"
    out = subprocess.run([sys.executable, "-c", probe], env=source_env(), capture_output=True,
                         text=True, check=True).stdout.split(maxsplit=1)  # fmt: skip
    return int(out[0]), out[1].strip()


def run_distributed(package: str, results: Path, extra: list[str]) -> int:
    """A multi-GPU suite (benchmarks/scaling.py, one process per GPU through torchrun) at 2, 4
    and 8 GPUs as far as the machine has them, into results/<GPU>-x<W>.json, rendered by the
    package's benchmarks/render.py."""
    sys.path.insert(0, str(ROOT / "shared" / "src"))
    from kernelkit.shared.report import slug

    bench = ROOT / "packages" / package / "benchmarks"
    count, name = gpus()
    worlds = [w for w in (2, 4, 8) if w <= count]
    if not worlds:
        print(f"bench: {package}'s suite needs at least 2 GPUs, this machine has {count}")
        return 2
    results.mkdir(parents=True, exist_ok=True)
    written, rc = [], 0
    for w in worlds:
        out = results / f"{slug(name)}-x{w}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={w}", str(bench / "scaling.py"), "--out", str(out), *extra]  # fmt: skip
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=source_env()).returncode or rc
        if out.exists():
            written.append(str(out))
    if written:
        subprocess.run([sys.executable, str(bench / "render.py"), *written], check=True)
    return rc


def _cell_key(bench: dict):
    e = bench.get("extra_info", {})
    if "op" not in e:  # a cell of wide tables only (the host tables): its rows and columns
        seed = e.get("seed") or []
        seed = [seed] if isinstance(seed, dict) else seed
        return tuple((s["table"], repr(s["row"]), tuple(s.get("values", {}))) for s in seed)
    return (e.get("op"), e.get("direction"), e.get("tag"), e.get("x"), e.get("provider"))


def merge(new: dict, old: dict) -> dict:
    """The new run plus the cells of an older run of the same GPU that it did not re-measure
    (same table coordinates); machine_info says which runs the file holds."""
    fresh = {_cell_key(b) for b in new.get("benchmarks", [])}
    kept = [b for b in old.get("benchmarks", []) if _cell_key(b) not in fresh]
    merged = dict(new, benchmarks=new.get("benchmarks", []) + kept)
    runs = old.get("machine_info", {}).get("kernelkit", {}).get("runs", [old.get("datetime")])
    info = merged.setdefault("machine_info", {}).setdefault("kernelkit", {})
    info["runs"] = [*runs, new.get("datetime")]
    return merged


def _slug(run: dict, name: str | None) -> str:
    sys.path.insert(0, str(ROOT / "shared" / "src"))
    from kernelkit.shared.report import slug

    gpu = run.get("machine_info", {}).get("kernelkit", {}).get("gpu", "unknown")
    return slug(gpu if not name else f"{gpu}-{name}")


def render(package: str, runs: list[dict], results: Path, name: str | None = None) -> Path:
    sys.path.insert(0, str(ROOT / "shared" / "src"))
    from kernelkit.shared.report import render_markdown, render_plot

    gpu = runs[0].get("machine_info", {}).get("kernelkit", {}).get("gpu", "unknown")
    slug = _slug(runs[0], name)
    results.mkdir(parents=True, exist_ok=True)
    md = render_markdown(runs, f"{package} benchmarks on {gpu}")
    (results / f"{slug}.md").write_text(md + "\n")
    if render_plot(runs, results / f"{slug}.png", f"{package} on {gpu}"):
        print(f"wrote {results / (slug + '.png')}")
    print(md)
    return results / f"{slug}.md"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("package", help="folder name under packages/, e.g. act or lrpe-rotate")
    ap.add_argument("-k", help="pytest -k expression selecting a subset")
    ap.add_argument(
        "--render-only", nargs="+", metavar="JSON", help="render saved JSON, run nothing"
    )
    ap.add_argument(
        "--results", help="output folder (default packages/<package>/benchmarks/results)"
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the cells of the committed results/<GPU>.json that this run did not measure",
    )
    ap.add_argument("--name", help="results/<GPU>-NAME.* instead of results/<GPU>.*")
    args, extra = ap.parse_known_args()
    results = (
        Path(args.results)
        if args.results
        else ROOT / "packages" / args.package / "benchmarks" / "results"
    )
    if args.render_only:
        runs = [json.loads(Path(p).read_text()) for p in args.render_only]
        render(args.package, runs, results, args.name)
        return 0
    if args.k:
        extra += ["-k", args.k]
    if not (ROOT / "packages" / args.package / "benchmarks").is_dir():
        print(f"bench: packages/{args.package} has no benchmarks/ folder", file=sys.stderr)
        return 2
    distributed = (ROOT / "packages" / args.package / "benchmarks" / "scaling.py").exists()
    if not gpu_present():
        if distributed:  # its tests ran it (ring_worker.py); its suite needs GPUs
            print(f"bench: no GPU found (torch.cuda.is_available() is False): {args.package}'s "
                  f"suite runs on 2 or more GPUs; nothing is run or written")  # fmt: skip
            return 0
        return smoke_run(args.package, extra)
    if distributed:
        return run_distributed(args.package, results, extra)
    with tempfile.TemporaryDirectory() as tmp:
        json_path = Path(tmp) / "run.json"
        rc = run_suite(args.package, json_path, extra)
        if not json_path.exists():
            print(f"no benchmark JSON written (pytest exit code {rc})", file=sys.stderr)
            return rc or 1
        run = json.loads(json_path.read_text())
    slug = _slug(run, args.name)
    results.mkdir(parents=True, exist_ok=True)
    if args.merge and (results / f"{slug}.json").exists():
        run = merge(run, json.loads((results / f"{slug}.json").read_text()))
    (results / f"{slug}.json").write_text(json.dumps(run, indent=1) + "\n")
    render(args.package, [run], results, args.name)
    return rc


if __name__ == "__main__":
    sys.exit(main())
