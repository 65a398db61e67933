"""The READMEs work as written (issue 27): every Python block runs, the install recipes install,
the generated tables are current, every relative link resolves, and a benchmark run without a
GPU leaves the source tree as it was. Run by `nox -s docs` (tagged test, so `nox -t test` and CI
run it); the environment holds every workspace package.

Python blocks: the blocks of one README run in order as one script, in a fresh process (under
the Triton interpreter that the kernelkit pytest plugin switched on when there is no GPU). A
block that uses "cuda" must carry the marker line MARKER; without a GPU "cuda" is replaced by
"cpu" in it, as the marker tells a reader to do.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))

import readme_tables  # noqa: E402

MARKER = '# No GPU: replace "cuda" with "cpu".'
READMES = [
    ROOT / "README.md",
    ROOT / "shared" / "README.md",
    *sorted(ROOT.glob("packages/*/README.md")),
]
GPU = torch.cuda.is_available()


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def runnable(block: str, where: str) -> str:
    """The block as CI runs it: with "cuda" -> "cpu" without a GPU (marked blocks only)."""
    if '"cuda"' in block and MARKER not in block:
        raise AssertionError(f"{where}: a block uses 'cuda' without the line {MARKER!r}")
    return block if GPU else block.replace('"cuda"', '"cpu"')


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("readme", READMES, ids=_rel)
def test_python_blocks_run(readme, tmp_path):
    code = [runnable(b, _rel(readme)) for b in blocks(readme.read_text(), "python")]
    if not code:
        pytest.skip("no python blocks")
    script = tmp_path / "readme.py"
    script.write_text("\n".join(code))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{_rel(readme)}:\n{proc.stdout}\n{proc.stderr}"


def test_marker_rule_can_fail():
    with pytest.raises(AssertionError, match="without the line"):
        runnable('x = torch.ones(1, device="cuda")\n', "example")


# ---------------------------------------------------------------------------------------------
# Generated tables, links
# ---------------------------------------------------------------------------------------------


def test_readme_tables_are_current():
    text = (ROOT / "README.md").read_text()
    assert readme_tables.rewrite(text) == text, "README.md is stale: python ci/readme_tables.py"


def test_version_table_check_can_fail():
    """A wrong version in the package table is caught."""
    text = (ROOT / "README.md").read_text()
    act = readme_tables.read_project(ROOT / "packages" / "act")
    row = next(line for line in text.splitlines() if line.startswith(f"| [`{act.name}`]"))
    stale = text.replace(row, row.replace(f"| {act.version} |", "| 0.0.1 |"))
    assert stale != text
    assert readme_tables.rewrite(stale) == text


def test_version_table_matches_pyproject():
    """Independently of the generator: every pyproject version is in its README row."""
    text = (ROOT / "README.md").read_text()
    for pyproject in [ROOT / "shared", *ROOT.glob("packages/*")]:
        p = readme_tables.read_project(pyproject)
        assert f"| [`{p.name}`]({_rel(pyproject)}) | `{p.module}` |" in text, p.name
        row = next(line for line in text.splitlines() if line.startswith(f"| [`{p.name}`]"))
        assert row.endswith(f"| {p.version} |"), (p.name, p.version, row)


def markdown_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).exists()]


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def dead_links(md: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M)  # not in code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # nor in code spans
    dead = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor
        path = (md.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            dead.append(target)
    return dead


def test_relative_links_resolve_inside_the_repository():
    dead = {_rel(md): d for md in markdown_files() if (d := dead_links(md))}
    assert not dead, dead


def test_dead_link_check_can_fail(tmp_path):
    md = ROOT / "packages" / "act" / "links-check.md"
    try:
        md.write_text("[spec](../../../shared/specs/act.md) [ok](README.md) [web](https://x.org)")
        assert dead_links(md) == ["../../../shared/specs/act.md"]
    finally:
        md.unlink()


def test_no_paths_to_the_companys_shared_folder():
    """Docstrings and docs may not point at ../shared/specs or seeds (not in a clone)."""
    pattern = re.compile(r"shared/specs|shared/seeds|\.\./shared/(?!src)")
    hits = []
    for path in ROOT.rglob("*"):
        if path.suffix not in (".py", ".md") or any(
            part.startswith(".") for part in path.relative_to(ROOT).parts
        ):
            continue
        if path == Path(__file__).resolve():
            continue
        hits += [f"{_rel(path)}: {m[0]}" for m in pattern.finditer(path.read_text())]
    assert not hits, hits


# ---------------------------------------------------------------------------------------------
# The install recipes of the root README
# ---------------------------------------------------------------------------------------------


def _install_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## Install one kernel à la carte", 1)[1].split("\n## ", 1)[0]


def _uv() -> str:
    uv = shutil.which("uv")
    assert uv, "the install recipe check needs uv on PATH"
    return uv


def _run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_wheel_recipe_installs_and_runs(tmp_path):
    """The wheel recipe as written (wheels into a temporary dist/, `pip install` as `uv pip
    install` into a fresh venv, offline from uv's cache when it can), then the README's snippet
    in that venv, whose CPU path is the PyTorch reference (no interpreter, no numpy)."""
    uv, dist = _uv(), tmp_path / "dist"
    recipe = next(b for b in blocks(_install_section(), "bash") if "uv build" in b)
    install = None
    for line in recipe.splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["uv", "build"]:
            words[words.index("--out-dir") + 1] = str(dist)
            _run(uv, *words[1:], "-q", cwd=ROOT)
        elif words[:2] == ["pip", "install"]:
            install = words[2:]
            install[install.index("--find-links") + 1] = str(dist)
    assert install and any(w.startswith("torch==") for w in install), "the recipe pins torch"
    assert any(w.startswith("triton==") for w in install), "the recipe pins triton"
    py = _fresh_venv(tmp_path)
    cmd = [uv, "pip", "install", "-q", "--python", py, *install]
    if subprocess.run([*cmd, "--offline"], capture_output=True).returncode != 0:
        _run(*cmd)  # the cache lacks an index page: resolve online (wheels still cached)
    frozen = _run(uv, "pip", "freeze", "--python", py).stdout
    assert "torch==2.11" in frozen and "triton==3.6" in frozen, frozen
    snippet = runnable(blocks(_install_section(), "python")[0], "README.md install snippet")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    _run(py, "-c", snippet, cwd=tmp_path, env=env, timeout=300)


def _closure(dist: str) -> set[str]:
    by_name = {
        readme_tables.read_project(p).name: p for p in [ROOT / "shared", *ROOT.glob("packages/*")]
    }
    seen, todo = set(), [dist]
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            text = (by_name[d] / "pyproject.toml").read_text()
            deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
            todo += [n for n in re.findall(r'"(kernelkit-[a-z-]+)', deps) if n in by_name]
    return seen


def _fresh_venv(tmp_path: Path) -> str:
    venv = tmp_path / "venv"
    _run(_uv(), "venv", "-q", "--python", sys.executable, str(venv))
    return str(venv / "bin" / "python")


def test_git_recipe_installs(tmp_path):
    """The git-subdirectory recipe as written, with <repo-url> this clone (its committed HEAD):
    the four packages build from their subdirectories and import."""
    if _run("git", "rev-parse", "--is-inside-work-tree", cwd=ROOT).stdout.strip() != "true":
        pytest.fail("the git recipe check needs a git clone")
    recipe = next(b for b in blocks(_install_section(), "bash") if "git+" in b)
    words = shlex.split(recipe.replace("\\\n", " ").replace("<repo-url>", ROOT.as_uri()))
    assert words[:2] == ["pip", "install"], words[:2]
    py = _fresh_venv(tmp_path)
    cmd = [_uv(), "pip", "install", "-q", "--python", py, *words[2:]]
    if subprocess.run([*cmd, "--offline"], capture_output=True).returncode != 0:
        _run(*cmd)
    code = "import kernelkit.lrpe_rotate as m, kernelkit.lrpe_core, kernelkit.act; print(m.__version__)"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    _run(py, "-c", code, cwd=tmp_path, env=env)


def test_git_recipe_names_every_kernelkit_dependency():
    recipe = next(b for b in blocks(_install_section(), "bash") if "git+" in b)
    pairs = re.findall(r'"(kernelkit-[a-z-]+) @ git\+<repo-url>#subdirectory=([\w/-]+)"', recipe)
    for name, sub in pairs:
        assert readme_tables.read_project(ROOT / sub).name == name, (name, sub)
    assert {n for n, _ in pairs} == _closure("kernelkit-lrpe-rotate")
    assert '"torch==2.11.*"' in recipe and '"triton==3.6.*"' in recipe


# ---------------------------------------------------------------------------------------------
# Benchmarks without a GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(GPU, reason="checks the run without a GPU")
def test_bench_without_gpu_writes_nothing():
    def status() -> list[str]:  # every changed, new or ignored path but bytecode caches
        out = _run("git", "status", "--porcelain", "--ignored", "packages", cwd=ROOT).stdout
        return [line for line in out.splitlines() if "__pycache__" not in line]

    before = status()
    proc = _run(sys.executable, "ci/bench.py", "act", "-k", "fwd and relu", cwd=ROOT, timeout=600)
    assert proc.stdout.count("bench: no GPU found") == 1, proc.stdout
    assert "--benchmark-disable" in proc.stdout
    assert status() == before


@pytest.mark.skipif(GPU, reason="checks the run without a GPU")
def test_multi_gpu_bench_without_gpu_writes_nothing():
    """ring-attn's suite (benchmarks/scaling.py, torchrun over the GPUs): one line, exit 0, no
    files; its tests run the ring on CPU processes instead."""
    results = ROOT / "packages" / "ring-attn" / "benchmarks" / "results"
    before = sorted(p.name for p in results.iterdir())
    proc = _run(sys.executable, "ci/bench.py", "ring-attn", cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("bench: no GPU found") == 1, proc.stdout
    assert "runs on 2 or more GPUs; nothing is run or written" in proc.stdout
    assert sorted(p.name for p in results.iterdir()) == before
