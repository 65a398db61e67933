"""The switch of kernelkit.shared's direct launch path (`fast_launch`): `KERNELKIT_TRITON_LAUNCH=1`
(read once, at import: `runtime.DIRECT_LAUNCH`), another Triton version or missing Triton
internals send every launch through Triton's own `kernel[grid](...)`, with the same results.

The switch is read when kernelkit.shared is imported, so each setting runs in a fresh process
(launch_switch_run.py): under the interpreter, the real kernels on CPU tensors (the results of
every call must be bit-identical to the direct path's); and without it, against the fake CUDA
driver, the GPU launch path (every launch must pass the same compiled kernel the same
arguments, and with the switch off every launch must go through Triton's `kernel.run`). Each
run also reports which launcher ran (`_run` calls of Triton's own path and of the direct one).
The runtime's own tests live here, in act's suite (no test session runs kernelkit-shared's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from kernelkit.shared import fast_launch

SCRIPT = Path(__file__).with_name("launch_switch_run.py")
SWITCH = fast_launch.ENV


def run(mode, tmp_path, *options, switch=None):
    """launch_switch_run.py in a fresh process: (its report, its output file)."""
    env = {k: v for k, v in os.environ.items() if k not in (SWITCH, "TRITON_INTERPRET")}
    env.pop("KERNELKIT_COMPILE_RECORD", None)  # the session's compile check: not this kernel
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    if switch is not None:
        env[SWITCH] = switch
    out = tmp_path / f"{mode}-{switch}-{'-'.join(options)}.out"
    cmd = [sys.executable, str(SCRIPT), mode, str(out), *options]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), out


def results(out):
    return torch.load(out)


def launches(out):
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    """The default (direct path) runs, interpreted and against the fake driver."""
    tmp = tmp_path_factory.mktemp("direct")
    report, out = run("interpret", tmp)
    fake_report, fake_out = run("fake", tmp)
    return report, results(out), fake_report, launches(fake_out)


def assert_direct(report):
    assert report["direct_launch"] is True and report["disabled_because"] is None
    assert report["warnings"] == []
    assert report["calls"]["direct"] > 0 and report["calls"]["triton"] == 0


def assert_triton_path(report):
    """The switch turned the direct path off: no direct launcher ran, Triton's path did."""
    assert report["direct_launch"] is False
    assert report["calls"]["direct"] == 0 and report["calls"]["triton"] > 0


def assert_same_results(got, expected):
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def test_direct_path_is_the_default(direct):
    report, _, fake_report, fake_launches = direct
    assert_direct(report)
    assert_direct(fake_report)
    # the GPU launch path: most launches skip Triton's kernel.run (cached launchers)
    assert fake_report["calls"]["kernel.run"] < fake_report["launches"] == len(fake_launches)


@pytest.mark.parametrize("mode", ["interpret", "fake"])
def test_switch_sends_every_launch_through_triton(mode, direct, tmp_path):
    """KERNELKIT_TRITON_LAUNCH=1: same results (interpreter) and the same launches (the GPU
    path against the fake driver) as the direct path, every one through Triton's own path."""
    report, out = run(mode, tmp_path, switch="1")
    assert_triton_path(report)
    assert report["disabled_because"] == f"{SWITCH}=1"
    assert report["warnings"] == []  # asked for: no warning
    if mode == "interpret":
        assert_same_results(results(out), direct[1])
    else:
        assert launches(out) == direct[3]
        assert report["calls"]["kernel.run"] == report["launches"]  # kernel[grid] every time
        assert report["traced"] == direct[2]["traced"] == "TraceableTritonKernelWrapper"


def test_switch_value_zero_keeps_the_direct_path(tmp_path):
    report, _ = run("fake", tmp_path, switch="0")
    assert_direct(report)


@pytest.mark.parametrize("mode", ["interpret", "fake"])
def test_other_triton_version_warns_once_and_falls_back(mode, direct, tmp_path):
    report, out = run(mode, tmp_path, "--triton-version", "3.7.0")
    assert_triton_path(report)
    assert len(report["warnings"]) == 1
    (warning,) = report["warnings"]
    assert warning.startswith("RuntimeWarning: Triton 3.7.0: kernelkit's direct launch path")
    assert "3.6" in warning and "kernel[grid]" in warning
    if mode == "interpret":
        assert_same_results(results(out), direct[1])
    else:
        assert launches(out) == direct[3]
        assert report["calls"]["kernel.run"] == report["launches"]


def test_missing_internals_warn_and_fall_back(direct, tmp_path):
    report, out = run("interpret", tmp_path, "--break-internals")
    assert_triton_path(report)
    (warning,) = report["warnings"]
    assert "an internal the direct launch path needs is missing" in warning
    assert "_BASE_ARGS_FORMAT" in warning
    assert_same_results(results(out), direct[1])


def test_configure():
    """The decision itself: the switch, the version (major.minor), the internals."""

    def quiet(*args):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none of these warns
            return fast_launch._configure(*args)

    assert quiet(None, "3.6.0") == (True, None)
    assert quiet("", "3.6.1+git0123abc") == (True, None)
    assert quiet("0", "3.6.0", lambda: None) == (True, None)
    assert quiet("1", "3.6.0") == (False, f"{SWITCH}=1")
    assert quiet("yes", "2.0") == (False, f"{SWITCH}=yes")  # switched off: no version warning
    for version in ("3.5.0", "3.7.0", "4.6", "3", "nightly"):
        with pytest.warns(RuntimeWarning, match=f"Triton {version}: .* written against Triton 3.6"):
            on, why = fast_launch._configure(None, version)
        assert not on and why.startswith(f"Triton {version}")

    def missing():
        raise ImportError("No module named 'triton.backends.nvidia'")

    with pytest.warns(RuntimeWarning, match="missing .ImportError: No module named"):
        assert fast_launch._configure(None, "3.6.0", missing)[0] is False


def test_runtime_exposes_the_decision():
    from kernelkit.shared import runtime

    assert runtime.DIRECT_LAUNCH is fast_launch.DIRECT_LAUNCH
    assert isinstance(runtime.DIRECT_LAUNCH, bool)
    assert runtime.DIRECT_LAUNCH is (fast_launch.DISABLED_BECAUSE is None)
    if os.environ.get(SWITCH, "") not in ("", "0"):
        assert not runtime.DIRECT_LAUNCH
