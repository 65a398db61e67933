"""The end-of-session compile check under pytest-xdist, as the nox test sessions run it without a
GPU (`-n 2 --dist loadscope`): every worker's launches reach the controller's one check,
kernels defined in test modules (imported by the workers only) are found, and a kernel that
does not compile for sm_90 fails the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

KERNELS = """
import triton
import triton.language as tl
from kernelkit.shared.compile_check import record_launch


@triton.jit
def copy_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def broken_kernel(x_ptr, BLOCK: tl.constexpr):
    acc = 0  # an int here, a tensor after the loop: the GPU compiler rejects the type change
    for _ in range(2):
        acc = tl.load(x_ptr + tl.arange(0, BLOCK))
    tl.store(x_ptr + tl.arange(0, BLOCK), acc)


def record(kernel, block):
    import torch

    record_launch(kernel, (torch.empty(block),), {"BLOCK": block, "num_warps": 4})
"""


def _run(tmp_path, modules: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "kernels_under_test.py").write_text(KERNELS)
    for name, body in modules.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("KERNELKIT_COMPILE_RECORD", None)  # this session's own record file
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
           "--dist", "loadscope", *modules]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _module(block: int, kernel: str = "copy_kernel") -> str:
    return f"""
        import os

        from kernels_under_test import {kernel}, record

        def test_launch():
            record({kernel}, {block})
            with open("workers.txt", "a") as f:
                f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
        """


def test_workers_launches_reach_one_compile_check(tmp_path):
    """Three configurations that compile and one that does not, over two workers: the
    controller's check lowers all four, names the broken one and fails the run."""
    pytest.importorskip("xdist")
    modules = {f"test_m{i}.py": _module(16 << i) for i in range(3)}
    modules["test_broken.py"] = _module(16, "broken_kernel")
    proc = _run(tmp_path, modules)
    out = proc.stdout + proc.stderr
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == len(modules) and len(set(workers)) == 2, (workers, out)
    assert "compile check: 4 kernel configurations" in out and "1 failed" in out, out
    assert "FAILED kernels_under_test.broken_kernel {'BLOCK': 16}" in out, out
    assert "4 passed" in out and proc.returncode == 1, out
