"""What a call launches, without launching it: the host path run on (fake) tensors with the
launches recorded (`probe_forward`, `probe_backward`), the kernel family those launches form
(`family`), and whether Inductor may trace them (`opaque`).

A family names the kernels a call runs and the compile-time switches that make them different
programs: the Gluon kernels by head dim, causal, schedule and dq mode; the portable ones by the
masking code they carry ("causal": a right edge, the causal diagonal or a window's; "local": a
window's left edge; packed sequences, "seqused": packed with `seqused_k`; softcap). Two calls
of one family run the same code paths, so a test that covers each family covers every path
the plan chooser can take; `tests/test_kernel_families.py` derives the families from the
chooser and fails on one without a case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelkit.shared.replay import Probe
from kernelkit.shared.runtime import inductor_compiles

from . import kvcache
from .choose import choose_bwd, choose_fwd
from .config import BwdConfig, FwdConfig, KVCache, Problem, Target, Varlen
from .launch import _backward, _forward, backward_problem, forward_problem
from .strides import unit_d

# The compile-time arguments that tell a kernel's families apart, by kernel name; kernels not
# listed (the backward's preprocess, the split-KV merge, the dq conversion) go with the ones
# that are, and the portable dq kernel with the dk/dv kernel beside it. Sizes are not switches:
# the portable kernels' BLOCK_D and BLOCK_DV (a value head dim of its own) run the same code.
FAMILY_SWITCHES = {
    "attn_fwd_kernel": ("CAUSAL", "LOCAL", "VARLEN", "SEQUSED", "SOFTCAP", "FIXED_SHIFT"),
    "attn_fwd_split_kernel": ("CAUSAL", "LOCAL", "SOFTCAP", "VAR_K", "PAGED", "DIRECT"),
    "attn_fwd_gluon_kernel": (
        "BLOCK_D",
        "CAUSAL",
        "LOCAL",
        "PAIRS",
        "SOFTCAP",
        "FIXED_SHIFT",
        "DYNAMIC",
    ),
    "attn_bwd_dkdv_kernel": ("CAUSAL", "LOCAL", "VARLEN", "SEQUSED", "SOFTCAP"),
    "attn_bwd_gluon_kernel": (
        "BLOCK_D",
        "CAUSAL",
        "LOCAL",
        "SOFTCAP",
        "DQ_MODE",
        "DQ_HALVES",
        "PERSISTENT",
        "DYNAMIC",
    ),
}
_SHORT = {
    "attn_fwd_kernel": "fwd",
    "attn_fwd_split_kernel": "fwd-split",
    "attn_fwd_gluon_kernel": "fwd-gluon",
    "attn_bwd_dkdv_kernel": "bwd",
    "attn_bwd_gluon_kernel": "bwd-gluon",
}
# DQ_MODE of the Gluon backward: dq by the dq kernel beside it, or summed in the kernel.
_DQ_MODES = {0: "dq-kernel", 1: "dq-any-order", 2: "dq-ordered"}
# PAGED of the split-KV forward over a paged KV cache: a page per row or per key block (TMA).
_PAGED = {0: None, 1: "paged-rows", 2: "paged-tma"}


def kernel_name(kernel) -> str:
    """The Python name of a @triton.jit / @gluon.jit kernel."""
    return getattr(kernel, "fn", kernel).__name__


def _tag(name: str, value) -> str | None:
    if name == "BLOCK_D":
        return f"d{value}"
    if name == "DQ_MODE":
        return _DQ_MODES[value]
    if name == "PAGED":
        return _PAGED[value]
    if name in ("DQ_HALVES", "FIXED_SHIFT"):
        return name.lower().replace("_", "-") if value else None
    return name.lower() if value else None


def family(probe: Probe) -> str:
    """The family of the launches a probe recorded, e.g. "fwd-gluon(d64,causal,pairs)" or
    "bwd(local,softcap)"; "" for a call that launches nothing (an empty batch)."""
    parts = []
    for kernel, _, _, kwargs in probe.launches:
        name = kernel_name(kernel)
        if name not in FAMILY_SWITCHES:
            continue
        tags = [_tag(s, kwargs[s]) for s in FAMILY_SWITCHES[name]]
        tags = [t for t in tags if t]
        parts.append(f"{_SHORT[name]}({','.join(tags)})" if tags else _SHORT[name])
    return "+".join(parts)


def opaque(probe: Probe) -> bool:
    """Whether a traced call must stay opaque to Inductor: it launches a kernel Inductor cannot
    compile (Gluon)."""
    return not all(inductor_compiles(kernel) for kernel in probe.kernels)


class CallProbe(Probe):
    """A `Probe` of one direction of a call, with the config the chooser took (`config`)."""

    config: FwdConfig | BwdConfig | None = None


def probe_forward(q, k, v, causal, scale, softcap=0.0, window=(-1, -1), varlen=None,
                  target: Target | None = None) -> CallProbe:  # fmt: skip
    """`launch.forward`'s chosen config and launches, recorded instead of launched, for
    `target` (None: q's device); `.outputs` holds its (o, lse), allocated as the call would
    (fake tensors in, fake tensors out)."""
    probe = CallProbe()
    q, k, v = unit_d(q), unit_d(k), unit_d(v)
    probe.config = choose_fwd(forward_problem(q, k, v, causal, softcap, window, varlen, target))
    probe.outputs = _forward(probe, q, k, v, causal, scale, softcap, window, varlen,
                             probe.config, target)  # fmt: skip
    return probe


def probe_backward(do, q, k, v, o, lse, dlse, causal, scale, softcap=0.0, window=(-1, -1),
                   varlen=None, deterministic=True, target: Target | None = None) -> CallProbe:  # fmt: skip
    """`launch.backward`'s chosen config and launches, recorded instead of launched;
    `.outputs` holds its (dq, dk, dv)."""
    probe = CallProbe()
    do, q, k, v, o = (unit_d(t) for t in (do, q, k, v, o))
    problem = backward_problem(do, q, k, v, causal, softcap, window, varlen, deterministic, target)
    probe.config = choose_bwd(problem)
    probe.outputs = _backward(probe, do, q, k, v, o, lse, dlse, causal, scale, softcap, window,
                              varlen, deterministic, probe.config, target)  # fmt: skip
    return probe


def probe_kvcache(q, k_cache, v_cache, k, v, cache: KVCache, causal, scale, softcap=0.0,
                  window=(-1, -1), target: Target | None = None) -> CallProbe:  # fmt: skip
    """`flash_attn_with_kvcache`'s chosen config and launches (the append, the split-KV
    forward), recorded instead of launched; `.outputs` holds its (o, lse)."""
    probe = CallProbe()
    problem = Problem.of_cache(q, k_cache, v_cache, cache, causal, window, softcap, target)
    probe.config = choose_fwd(problem)
    probe.outputs = kvcache._kvcache_forward(probe, q, k_cache, v_cache, k, v, cache, causal,
                                             scale, softcap, window, probe.config, target)  # fmt: skip
    return probe


def probe_call(q, k, v, causal=False, softcap=0.0, window=(-1, -1), varlen: Varlen | None = None,
               deterministic=True, target: Target | None = None) -> tuple[CallProbe, CallProbe]:  # fmt: skip
    """(forward, backward) probes of a `flash_attn` (or, with `varlen`, `flash_attn_varlen`)
    call on q, k, v (real or fake tensors: nothing is read or launched), with window as
    `validation.window_for` returns it, on `target` (None: q's device; `config.H100` asks what
    an H100 would run). For tools and tests asking "which kernels run?"."""
    scale = q.shape[-1] ** -0.5
    fwd = probe_forward(q, k, v, causal, scale, softcap, window, varlen, target)
    o, lse = fwd.outputs
    do = torch.empty_like(o)
    bwd = probe_backward(do, q, k, v, o, lse, None, causal, scale, softcap, window, varlen,
                         deterministic, target)  # fmt: skip
    return fwd, bwd


# The compile-time arguments `explain` shows for each launch (tile, schedule), when present.
_SHOWN = ("HEAD_DIM", "BLOCK_D", "HEAD_DIM_V", "BLOCK_DV", "BLOCK_M", "BLOCK_N", "BLOCK_R",
          "STAGES", "CAUSAL", "LOCAL", "VARLEN", "SEQUSED", "SOFTCAP", "TMA", "PAIRS", "Q_REGS",
          "DQ_MODE", "DQ_HALVES", "KV_REGS", "PERSISTENT", "num_warps", "num_stages")  # fmt: skip


def _launch_line(kernel, grid, kwargs) -> str:
    shown = " ".join(f"{k}={kwargs[k]}" for k in _SHOWN if k in kwargs)
    return f"{kernel_name(kernel)} grid={tuple(grid)} {shown}"


@dataclass(frozen=True)
class Explanation:
    """What a call runs: the forward's and the backward's configs (`forward_config.why` says
    why each was chosen), kernel families and launches."""

    forward_config: FwdConfig
    backward_config: BwdConfig
    forward: str
    backward: str
    forward_launches: tuple[str, ...]
    backward_launches: tuple[str, ...]

    def __str__(self) -> str:
        lines = []
        for name, cfg, fam, launches in (
            ("forward", self.forward_config, self.forward, self.forward_launches),
            ("backward", self.backward_config, self.backward, self.backward_launches),
        ):
            lines += [f"{name}: {cfg}", f"  why: {cfg.why}", f"  family: {fam}"]
            lines += [f"  {x}" for x in launches]
        return "\n".join(lines)


def explanation(fwd: CallProbe, bwd: CallProbe) -> Explanation:
    """The `Explanation` of a call's forward and backward probes."""
    return Explanation(
        fwd.config,
        bwd.config,
        family(fwd),
        family(bwd),
        tuple(_launch_line(kn, g, kw) for kn, g, _, kw in fwd.launches),
        tuple(_launch_line(kn, g, kw) for kn, g, _, kw in bwd.launches),
    )
