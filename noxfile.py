"""nox sessions, generated from packages/*/pyproject.toml.

Per package <op> (session names use underscores, e.g. test-lrpe_rotate):
  test-<op>   sync only that package and what it needs (uv sync --locked --package), then run its
              tests and its benchmark files once in smoke mode (--benchmark-disable). Without a
              GPU the kernels run under the Triton interpreter; on a GPU machine, on the GPU.
  bench-<op>  the benchmark suite on the GPU, rendered by ci/bench.py into benchmarks/results/
              (only for packages with a benchmarks/ folder). Without a GPU: one line says so
              and a smoke run (each benchmark once, --benchmark-disable) runs; nothing is written.
  build-<op>  build the wheels (the package and the kernelkit packages it needs), install them
              into a fresh environment and check that only torch/triton (+ their own needs) and
              kernelkit packages come along.
Plus `docs` (tagged test: every workspace package in one environment; ci/tests: every README's
Python blocks run, the root README's install recipe installs and its snippet runs, the generated
README tables are current, relative links resolve, a no-GPU bench run writes nothing), `lint`
(ruff check + format check) and `lock` (uv.lock is up to date).
`nox -t test` runs every test session.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = []  # nothing by default: name a session or a tag

ROOT = Path(__file__).parent
RUFF = "ruff==0.17.6"


def _project(path: Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())["project"]


def _sync(session: nox.Session, dist: str) -> None:
    """Install exactly `dist` + its dependencies + its test group from the committed lock."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--package",
        dist,
        "--group",
        "test",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _kernelkit_closure(dist: str, projects: dict[str, Path]) -> list[str]:
    """dist and every kernelkit distribution it depends on, transitively."""
    seen: list[str] = []
    todo = [dist]
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.append(d)
        for req in _project(projects[d]).get("dependencies", []):
            name = req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
            if name in projects:
                todo.append(name)
    return seen


# Without a GPU the kernels run under the Triton interpreter, one CPU core per pytest process:
# pytest-xdist spreads a package's tests over up to 4 processes (kernelkit.shared's plugin
# gathers every worker's launches into one compile check). On a GPU machine the tests share one
# GPU, so they run in one process. `nox -s test-act -- -n 0` runs in one process anyway.
WORKERS = 1 if shutil.which("nvidia-smi") else min(4, os.cpu_count() or 1)
XDIST = ["-n", str(WORKERS), "--dist", "loadscope"] if WORKERS > 1 else []

PROJECTS = {_project(p.parent)["name"]: p.parent for p in ROOT.glob("*/pyproject.toml")}
PROJECTS.update(
    {_project(p.parent)["name"]: p.parent for p in ROOT.glob("packages/*/pyproject.toml")}
)


def _make_sessions(pkg: Path) -> None:
    dist = _project(pkg)["name"]
    op = pkg.name.replace("-", "_")
    rel = pkg.relative_to(ROOT).as_posix()

    @nox.session(name=f"test-{op}", tags=["test"])
    def test(session: nox.Session) -> None:
        _sync(session, dist)
        paths = [f"{rel}/{d}" for d in ("tests", "benchmarks") if (pkg / d).is_dir()]
        session.run(
            "python", "-m", "pytest", *paths, "--benchmark-disable", "-q", *XDIST, *session.posargs
        )

    if (pkg / "benchmarks").is_dir():  # no session that cannot succeed (lrpe-core has none)

        @nox.session(name=f"bench-{op}", tags=["bench"])
        def bench(session: nox.Session) -> None:
            _sync(session, dist)
            session.run("python", "ci/bench.py", pkg.name, *session.posargs)

    @nox.session(name=f"build-{op}", tags=["build"])
    def build(session: nox.Session) -> None:
        tmp = Path(session.create_tmp())
        out = tmp / "dist"
        closure = _kernelkit_closure(dist, PROJECTS)
        for d in closure:
            session.run(
                "uv", "build", "--package", d, "--out-dir", str(out), "--wheel", external=True
            )
        # Install the wheel alone into a fresh environment; compare with torch + triton alone.
        pins = tmp / "pins.txt"
        pins.write_text("torch==2.11.*\ntriton==3.6.*\n")
        base = _fresh_env(session, tmp / "base", "torch", "triton", "-c", str(pins))
        mine = _fresh_env(session, tmp / "mine", dist, "--find-links", str(out), "-c", str(pins))
        extra = sorted(mine - base - set(closure))
        session.log(f"{dist} pulls: torch, triton + {sorted(set(closure))}")
        if extra:
            session.error(f"unexpected runtime dependencies of {dist}: {extra}")
        mod = "kernelkit." + op
        py = str(tmp / "mine" / "bin" / "python")
        session.run(py, "-c", f"import {mod} as m; print(m.__name__, m.__version__)", external=True)


def _fresh_env(session: nox.Session, path: Path, *install: str) -> set[str]:
    """Create a venv at `path`, install `install` into it; return its distribution names."""
    session.run("uv", "venv", "--clear", "-q", str(path), external=True)
    py = str(path / "bin" / "python")
    session.run("uv", "pip", "install", "-q", "--python", py, *install, external=True)
    frozen = session.run("uv", "pip", "freeze", "--python", py, external=True, silent=True)
    pins = [line for line in frozen.splitlines() if "==" in line or " @ " in line]
    return {line.split("==")[0].split(" @ ")[0].strip().lower() for line in pins}


for _pkg in sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml")):
    _make_sessions(_pkg)


@nox.session(tags=["test"])
def docs(session: nox.Session) -> None:
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--all-packages",
        "--all-extras",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )
    session.run("python", "-m", "pytest", "ci/tests", "-q", "--no-compile-check", *session.posargs)


@nox.session(tags=["check"])
def lint(session: nox.Session) -> None:
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(tags=["check"], venv_backend="none")
def lock(session: nox.Session) -> None:
    session.run("uv", "lock", "--check", external=True)
