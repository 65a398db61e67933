"""Compile, for a Hopper GPU, every kernel configuration the CPU test run launched.

The Triton interpreter accepts code the GPU compiler rejects (loop-carried type changes,
non-constexpr globals, default-valued constexpr parameters, ...). Under the interpreter, the
kernelkit launcher records each distinct launch (kernel, argument types, constexprs, warps)
with `record_launch`; at the end of the session the pytest plugin runs this module in a
process without the interpreter, which compiles every record for sm_90 with Triton's own
toolchain (no GPU or driver needed) and fails the run if one does not compile. Each record is
also analysed the way torch.compile analyses a traced launch (which tensors it writes): where
that analysis fails, torch assumes every tensor is written, so a traced op copies all its
inputs and some graphs cannot be partitioned. Kernels that only run on a GPU (never launched
by the interpreter) can be recorded by a test directly.

    python -m kernelkit.shared.compile_check RECORDS.jsonl
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

ENV = "KERNELKIT_COMPILE_RECORD"
_seen: set[str] = set()

_DTYPES = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float64": "fp64",
    "torch.int64": "i64",
    "torch.int32": "i32",
    "torch.int16": "i16",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.bool": "i1",
}
_OPTIONS = ("num_warps", "num_stages")


def _is_constexpr(annotation) -> bool:
    return "constexpr" in (annotation if isinstance(annotation, str) else repr(annotation))


def record_launch(kernel, args, kwargs) -> None:
    """Append this launch's configuration to the record file named by $KERNELKIT_COMPILE_RECORD."""
    path = os.environ.get(ENV)
    if not path:
        return
    import torch

    fn = kernel.fn
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    signature, constexprs, values = {}, {}, {}
    for name, value in bound.items():
        if _is_constexpr(params[name].annotation) or value is None or isinstance(value, str):
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[str(value.dtype)]
        elif isinstance(value, bool):
            signature[name], values[name] = "i1", value
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            values[name] = value
        elif isinstance(value, float):
            signature[name], values[name] = "fp32", value
        else:
            return  # not a type this check knows; the GPU run covers it
    rec = {
        "module": fn.__module__,
        "name": fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs},
    }
    key = _config_key(rec)
    if key in _seen:
        return
    _seen.add(key)
    # One write() on an O_APPEND descriptor: pytest-xdist workers append to one file.
    line = (json.dumps({**rec, "values": values}, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _config_key(rec: dict) -> str:
    """One record per configuration, whatever the sizes (`values`)."""
    return json.dumps({k: v for k, v in rec.items() if k != "values"}, sort_keys=True)


def _analyse_traced_launch(kernel, rec) -> None:
    """torch.compile's analysis of which tensors a traced launch writes must succeed: where it
    fails, torch assumes every tensor is written, copies each before the launch, and some graphs
    then cannot be partitioned (see kernelkit.shared.testing.written_arguments)."""
    import torch

    from .testing import written_arguments

    dtypes = {v: getattr(torch, k.split(".")[1]) for k, v in _DTYPES.items()}
    kwargs = {}
    for name, ty in rec["signature"].items():
        if ty == "constexpr":
            kwargs[name] = rec["constexprs"][name]
        elif ty.startswith("*"):
            kwargs[name] = torch.empty(1, dtype=dtypes[ty[1:]])
        else:
            kwargs[name] = rec["values"][name]
    written_arguments(kernel, kwargs)


def _compile(key: str) -> str | None:
    """Front end + the TTIR and TTGIR pipelines for sm_90: where the interpreter and the GPU
    compiler disagree. (PTX/ptxas would add seconds per kernel and has not been a source of
    such differences.)"""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    rec = json.loads(key)
    try:
        kernel = getattr(importlib.import_module(rec["module"]), rec["name"])
        if kernel.is_gluon():  # Gluon kernels (recorded by tests) start at TTGIR
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        src = ASTSource(fn=kernel, signature=rec["signature"], constexprs=rec["constexprs"])
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        options = backend.parse_options(rec["options"])
        stages: dict = {}
        backend.add_stages(stages, options, src.language)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = src.make_ir(
            target,
            options,
            backend.get_codegen_implementation(options),
            backend.get_module_map(),
            context,
        )
        metadata = {"hash": "compile-check", "target": target, **options.__dict__}
        for stage in ("ttir", "ttgir"):
            if stage in stages:
                module = stages[stage](module, metadata)
        if not kernel.is_gluon():
            _analyse_traced_launch(kernel, rec)
    except Exception as e:  # report every failure, not just the first
        first = str(e).strip().splitlines()
        return (
            f"{rec['module']}.{rec['name']} {rec['constexprs']} {rec['options']}:\n  "
            + "\n  ".join(first[-12:])
        )
    return None


def main(path: str) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run without TRITON_INTERPRET: the check compiles real Triton kernels")
    with open(path) as f:  # pytest-xdist workers may each record a configuration once
        records = {}
        for line in f.read().splitlines():
            if line:
                records.setdefault(_config_key(json.loads(line)), line)
        keys = sorted(records.values())
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [r for r in pool.map(_compile, keys) if r]
    print(
        f"kernelkit compile check: {len(keys)} kernel configurations lowered to TTGIR for sm_90 "
        "and analysed as torch.compile traces them, "
        f"{len(failures)} failed"
    )
    for msg in failures:
        print("FAILED", msg)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
