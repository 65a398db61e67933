"""pytest plugin for kernelkit packages (entry point `kernelkit`; `-p kernelkit.shared.pytest_plugin`
when running from source).

* Without a GPU it switches the Triton interpreter on (`TRITON_INTERPRET=1`) at import time,
  which is before any test module imports a kernel: the same tests then run the real kernels
  on CPU tensors.
* Fixtures: `device` (cuda when present, else cpu) and `poison_empty` (autouse: freshly
  allocated float tensors hold NaN, so an output element a kernel forgot to write fails).
* Benchmarks: GPU, torch, triton and CUDA versions plus the measured copy bandwidth go into
  pytest-benchmark's machine_info; autosaved runs are stored per GPU so that
  `pytest-benchmark compare` compares runs on the same card.
"""

from __future__ import annotations

import os


def _gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if not _gpu_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_slug() -> str:
    from .report import slug

    return slug(gpu_name())


def pytest_addoption(parser):
    parser.addoption(
        "--no-compile-check",
        action="store_true",
        help="kernelkit: skip compiling the interpreter-launched kernels for sm_90 at the end",
    )


_RECORD_KEY = "kernelkit_compile_record"
_PATH_KEY = "kernelkit_sys_path"


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (too slow for the interpreter)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and not config.getoption(
        "--no-compile-check"
    ):
        import tempfile

        from kernelkit.shared.compile_check import ENV

        if _is_xdist_worker(config):  # pytest-xdist: record into the controller's file
            path = config.workerinput.get(_RECORD_KEY)
        else:
            fd, path = tempfile.mkstemp(prefix="kernelkit-launches-", suffix=".jsonl")
            os.close(fd)
        if path:
            os.environ[ENV] = path
    opt = config.option
    storage = getattr(opt, "benchmark_storage", None)
    if storage is not None and storage.rstrip("/").endswith(".benchmarks"):
        opt.benchmark_storage = f"{storage.rstrip('/')}/{gpu_slug()}"


def pytest_collection_modifyitems(config, items):
    _check_versions(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _check_versions(items) -> None:
    """Each tested package's `__version__` (and kernelkit-shared's, run from a source tree) is its
    pyproject.toml's version: stale ones had shipped in five packages. The package is the
    directory above a test file's `tests/`; kernelkit-foo-bar is the module kernelkit.foo_bar."""
    import importlib
    import re
    from pathlib import Path

    tests = {Path(str(item.path)).parent for item in items}
    roots = {t.parent for t in tests if t.name == "tests"}
    roots.add(Path(__file__).resolve().parents[3])  # kernelkit-shared itself, from a source tree
    for root in sorted(roots):
        pyproject = root / "pyproject.toml"
        if not pyproject.is_file():
            continue
        # [project]'s name and version lines (tomllib needs Python 3.11)
        table = pyproject.read_text().partition("[project]")[2].partition("\n[")[0]
        name, version = (
            re.search(rf'^{k}\s*=\s*"([^"]*)"', table, re.M) for k in ("name", "version")
        )
        if not (name and version and name[1].startswith("kernelkit-")):
            continue
        module = importlib.import_module(name[1].replace("-", ".", 1).replace("-", "_"))
        found = getattr(module, "__version__", None)
        if found != version[1]:
            raise pytest.UsageError(
                f"{name[1]}: __version__ is {found!r}, pyproject.toml says {version[1]!r}"
            )


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def poison_empty(request):
    """torch.empty fills float tensors with NaN while a test runs (deterministic-mode feature).

    Benchmarks are left alone: the fill is an extra pass that must not be timed.
    """
    if "benchmark" in request.fixturenames:
        yield
        return
    import torch.utils.deterministic as det

    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    yield
    det.fill_uninitialized_memory = prev_fill
    torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)


def pytest_benchmark_update_machine_info(config, machine_info):
    import triton

    info = {
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "interpreter": os.environ.get("TRITON_INTERPRET", "0"),
    }
    if torch.cuda.is_available():
        from kernelkit.shared.bench import copy_bandwidth_gbs

        props = torch.cuda.get_device_properties(0)
        info.update(sm_count=props.multi_processor_count, copy_gbs=copy_bandwidth_gbs())
    machine_info["kernelkit"] = info


_WORKER_PATHS = pytest.StashKey[list]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist (controller): each worker appends its launches to the controller's record
    file, which the controller compiles once at the end."""
    from kernelkit.shared.compile_check import ENV

    if os.environ.get(ENV):
        node.workerinput[_RECORD_KEY] = os.environ[ENV]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist (controller): a worker's import path (its test directories, where kernels
    defined in test modules live) for the compile check."""
    paths = getattr(node, "workeroutput", {}).get(_PATH_KEY, [])
    node.config.stash.setdefault(_WORKER_PATHS, []).extend(paths)


def pytest_sessionfinish(session, exitstatus):
    """Compile every kernel configuration the interpreter launched for a Hopper GPU (under
    pytest-xdist: the controller, once, for every worker's launches)."""
    import sys

    from kernelkit.shared.compile_check import ENV

    if _is_xdist_worker(session.config):
        session.config.workeroutput[_PATH_KEY] = list(sys.path)
        return
    path = os.environ.pop(ENV, None)
    if not path or not os.path.getsize(path):
        return
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [*sys.path, *session.config.stash.get(_WORKER_PATHS, [])]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    proc = subprocess.run(
        [sys.executable, "-m", "kernelkit.shared.compile_check", path],
        env=env,
        capture_output=True,
        text=True,
    )
    os.unlink(path)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    out = (proc.stdout + proc.stderr).strip()
    if reporter is not None:
        reporter.write_line(out)
    if proc.returncode != 0:
        session.exitstatus = 1
