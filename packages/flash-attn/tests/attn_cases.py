"""FlashAttention's accuracy rule for the flash-attn tests, and the calls they make.

The rule: max|ours - ref_hi| <= factor * max|ref_lowp - ref_hi| + atol, where ref_hi is the
PyTorch reference in float64 and ref_lowp the same reference computed in the input dtype;
factor 2 for the output, 3 for gradients (FlashAttention's tests). Inputs of large magnitude
(q x 5, k and v x 3 in FlashAttention's overflow test) take that test's bound on gradients,
5x + 1e-3: dS = P (dP - delta) then cancels to near 0, and delta = rowsum(dO * O) uses the
rounded O, as FlashAttention's does, whose rounding the large values magnify. Every value must
be finite where ref_hi is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelkit.flash_attn import flash_attn, flash_attn_varlen
from kernelkit.flash_attn.reference import attention_reference, attention_varlen_reference

ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}
RULE = (2.0, 3.0)  # (output, gradients)
OVERFLOW_RULE = (2.0, 5.0)
OVERFLOW_ATOL = 1e-3


def assert_rule(out, ref_hi, ref_lowp, factor: float, name: str, atol: float) -> None:
    """FlashAttention's rule (module docstring) for one tensor."""
    assert out.shape == ref_hi.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref_hi.shape)}"
    out64, hi = out.detach().double(), ref_hi.detach().double()
    finite = torch.isfinite(hi)
    bad = finite & ~torch.isfinite(out64)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} non-finite values where the reference is finite"
    )
    err = (out64 - hi)[finite].abs().max().item() if finite.any() else 0.0
    base = (ref_lowp.detach().double() - hi)[finite].abs()
    base = base.nan_to_num(nan=float("inf")).max().item() if finite.any() else 0.0
    limit = factor * base + atol
    assert err <= limit, f"{name}: max error {err:.3e} > {factor} x {base:.3e} + atol ({out.dtype})"


@dataclass(frozen=True)
class Call:
    """One `flash_attn` call (or `flash_attn_varlen` with `lengths`: per-sequence (Nq, Nk), and
    with `seqused` its seqused_k: the keys each sequence uses); dv: v's head dim where it is not
    d (o and do have it too)."""

    b: int = 1
    nq: int = 128
    nk: int = 128
    h: int = 2
    hkv: int = 1
    d: int = 64
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    deterministic: bool = True
    lengths: tuple[tuple[int, int], ...] | None = None
    seqused: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.bfloat16
    scale_q: float = 1.0  # input magnitudes (overflow cases)
    scale_kv: float = 1.0
    dv: int | None = None

    def __str__(self) -> str:
        shape = f"b{self.b}-q{self.nq}-k{self.nk}-h{self.h}-{self.hkv}-d{self.d}"
        if self.lengths is not None:
            shape = f"varlen{len(self.lengths)}-h{self.h}-{self.hkv}-d{self.d}"
        if self.dv is not None:
            shape += f"-dv{self.dv}"
        opts = [
            "causal" if self.causal else "",
            f"win{self.window[0]}_{self.window[1]}" if self.window != (-1, -1) else "",
            f"cap{self.softcap:g}" if self.softcap else "",
            "" if self.deterministic else "anyorder",
            "" if self.seqused is None else "seqused",
            str(self.dtype).removeprefix("torch."),
            f"x{self.scale_q:g}_{self.scale_kv:g}"
            if (self.scale_q, self.scale_kv) != (1, 1)
            else "",
        ]
        return "-".join([shape, *[o for o in opts if o]])

    def inputs(self, device, seed: int = 0):
        """(q, k, v, do): float64 draws rounded to the call's dtype (v and do with dv)."""
        g = torch.Generator().manual_seed(seed)
        dv = self.d if self.dv is None else self.dv
        if self.lengths is None:
            shapes = [(self.b, n, heads, d) for n, heads, d in ((self.nq, self.h, self.d),
                      (self.nk, self.hkv, self.d), (self.nk, self.hkv, dv),
                      (self.nq, self.h, dv))]  # fmt: skip
        else:
            tq = sum(n for n, _ in self.lengths)
            tk = sum(n for _, n in self.lengths)
            shapes = [(tq, self.h, self.d), (tk, self.hkv, self.d), (tk, self.hkv, dv),
                      (tq, self.h, dv)]  # fmt: skip
        scales = (self.scale_q, self.scale_kv, self.scale_kv, 1.0)
        return [
            (torch.randn(s, generator=g, dtype=torch.float64) * c).to(self.dtype).to(device)
            for s, c in zip(shapes, scales)
        ]

    def cu_seqlens(self, device):
        """(cu_seqlens_q, cu_seqlens_k, seqused_k or None) of the packed call on `device`."""
        cu = torch.zeros(2, len(self.lengths) + 1, dtype=torch.int32)
        cu[:, 1:] = torch.tensor(self.lengths, dtype=torch.int32).t().cumsum(1)
        used = None
        if self.seqused is not None:
            used = torch.tensor(self.seqused, dtype=torch.int32).to(device)
        return cu[0].to(device), cu[1].to(device), used

    def forward(self, q, k, v, cu=None, fn=None, reference=False):
        """o of the call (of the PyTorch reference with reference=True); cu: the packed call's
        `cu_seqlens` on q's device (made here if None)."""
        if self.lengths is None:
            if reference:
                return attention_reference(q, k, v, self.causal, window_size=self.window,
                                           softcap=self.softcap)  # fmt: skip
            return (fn or flash_attn)(q, k, v, self.causal, window_size=self.window,
                                      softcap=self.softcap,
                                      deterministic=self.deterministic)  # fmt: skip
        cu_q, cu_k, used = self.cu_seqlens(q.device) if cu is None else cu
        max_q = max(1, *(n for n, _ in self.lengths))
        max_k = max(1, *(n for _, n in self.lengths))
        f = attention_varlen_reference if reference else (fn or flash_attn_varlen)
        return f(q, k, v, cu_q, cu_k, max_q, max_k, causal=self.causal, window_size=self.window,
                 softcap=self.softcap, seqused_k=used)  # fmt: skip


def fwd_bwd(call: Call, q, k, v, do, fn=None, reference=False, cu=None):
    """(o, dq, dk, dv) of the call on fresh leaves (fn: call.forward or a compiled one)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = call.forward(*leaves, cu=cu, reference=reference) if fn is None else fn(*leaves, cu)
    return (o.detach(), *torch.autograd.grad(o, leaves, do))


def check_call(call: Call, got, q, k, v, do) -> None:
    """`got` = (o, dq, dk, dv) against the float64 and the low-precision references by the rule
    (the overflow test's where the inputs are large)."""
    hi = fwd_bwd(call, q.double(), k.double(), v.double(), do.double(), reference=True)
    lowp = fwd_bwd(call, q, k, v, do, reference=True)
    large = call.scale_q * call.scale_kv > 1
    (f_out, f_grad), atol = (OVERFLOW_RULE, OVERFLOW_ATOL) if large else (RULE, ATOL[call.dtype])
    for name, g, r_hi, r_lo, factor in zip(("o", "dq", "dk", "dv"), got, hi, lowp,
                                           (f_out, f_grad, f_grad, f_grad)):  # fmt: skip
        assert g.dtype == call.dtype, f"{name}: dtype {g.dtype}"
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        assert_rule(g, r_hi, r_lo, factor, f"{call} {name}", atol)
