"""Argument checks of `flash_attn` and `flash_attn_varlen` (ValueErrors that name the argument)."""

from __future__ import annotations

import math

import torch

from kernelkit.shared.packed import check_cu_seqlens
from kernelkit.shared.runtime import plain_call

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q: dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on device {t.device}, but q is on {q.device}")


def _check_head_dim(q, k) -> int:
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: head dim {k.shape[-1]} differs from q's {q.shape[-1]}")
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D={d} outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    return d


def _check_value_dim(k, v, layout: str) -> None:
    """v like k except its last dim, the value head dim Dv, which may differ from D."""
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)} {layout} "
                         "except the last dim (the value head dim)")  # fmt: skip
    dv = v.shape[-1]
    if not MIN_HEAD_DIM <= dv <= MAX_HEAD_DIM:
        raise ValueError(f"v: value head dim Dv={dv} outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")


def _check_heads(h: int, hkv: int) -> None:
    if h < 1 or hkv < 1:
        raise ValueError(f"q, k: need at least one head, got H={h}, Hkv={hkv}")
    if h % hkv:
        raise ValueError(f"k: q's H={h} heads are not a multiple of k/v's Hkv={hkv} heads")


def _check_scale(causal, softmax_scale, d: int) -> float:
    check_bool("causal", causal)
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: must be finite, got {softmax_scale}")
    return float(softmax_scale)


_T = torch.Tensor


def validate(q, k, v, causal, softmax_scale) -> float:
    """Check the arguments of `flash_attn`; returns the softmax scale to use."""
    # The common call first: plain tensors that pass every tensor check below, tested in one
    # expression. Anything else (tensor subclasses and traced calls too) takes the checks one by
    # one, which raise the error that names the argument.
    if q.__class__ is _T and k.__class__ is _T and v.__class__ is _T:
        qs, ks, vs = q.shape, k.shape, v.shape
        n, dtype, device = len(qs), q.dtype, q.device
        if (  # (index by index: slicing a torch.Size costs more than the whole comparison)
            (n == 4 or n == 3)
            and len(ks) == n
            and len(vs) == n
            and vs[0] == ks[0]
            and vs[1] == ks[1]
            and (n == 3 or vs[2] == ks[2])
            and MIN_HEAD_DIM <= vs[-1] <= MAX_HEAD_DIM
            and dtype in FLOAT_DTYPES
            and k.dtype == dtype
            and v.dtype == dtype
            and ks[0] == qs[0]
            and ks[-1] == qs[-1]
            and MIN_HEAD_DIM <= qs[-1] <= MAX_HEAD_DIM
            and qs[1] >= 1
            and ks[1] >= 1
            and (n == 3 or (qs[2] >= 1 and ks[2] >= 1 and qs[2] % ks[2] == 0))
            and k.device == device
            and v.device == device
        ):
            if softmax_scale is None and causal.__class__ is bool:
                return 1.0 / math.sqrt(qs[-1])
            return _check_scale(causal, softmax_scale, qs[-1])
    _check_tensors(q, k, v)
    if q.dim() not in (3, 4):
        raise ValueError(f"q: expected shape (B, Nq, H, D) or (B, Nq, D), got {tuple(q.shape)}")
    layout = "(B, Nk, Hkv, D)" if q.dim() == 4 else "(B, Nk, D)"
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(f"{name}: expected {layout} like q, got shape {tuple(t.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: batch size {k.shape[0]} differs from q's {q.shape[0]}")
    d = _check_head_dim(q, k)
    _check_value_dim(k, v, layout)
    if q.shape[1] < 1:
        raise ValueError("q: the query sequence is empty (Nq must be >= 1)")
    if k.shape[1] < 1:
        raise ValueError("k: the key sequence is empty (Nk must be >= 1)")
    if q.dim() == 4:
        _check_heads(q.shape[2], k.shape[2])
    return _check_scale(causal, softmax_scale, d)


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale, seqused_k=None) -> float:  # fmt: skip
    """Check the arguments of `flash_attn_varlen`; returns the softmax scale to use.

    Always checked (host metadata only): tensors, dtypes, devices, shapes, cu_seqlens int32 and
    1-D with at least two entries, max_seqlen ints >= 1, seqused_k None or int32 (num_seqs,)
    contiguous on q's device. The values of cu_seqlens (first entry 0, non-decreasing, last
    entry = total rows, lengths <= max_seqlen) and of seqused_k (0 <= seqused_k[b] <= sequence
    b's keys) are checked only where that is free: on the CPU outside torch.compile tracing.
    Reading CUDA values would synchronise with the device (and break CUDA-graph capture), so
    there, as in FlashAttention, they are the caller's contract."""
    _check_tensors(q, k, v)
    if q.dim() != 3:
        raise ValueError(f"q: expected shape (total_q, H, D), got {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name}: expected shape (total_k, Hkv, D), got {tuple(t.shape)}")
    d = _check_head_dim(q, k)
    _check_value_dim(k, v, "(total_k, Hkv, D)")
    _check_heads(q.shape[1], k.shape[1])
    lengths = [
        check_cu_seqlens(cu, t.shape[0], q.device, name=name)
        for name, cu, t in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k))
    ]
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k: {cu_seqlens_k.shape[0] - 1} sequences, cu_seqlens_q has "
            f"{cu_seqlens_q.shape[0] - 1}"
        )
    for name, m, lens in zip(
        ("max_seqlen_q", "max_seqlen_k"), (max_seqlen_q, max_seqlen_k), lengths
    ):
        if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)):
            raise ValueError(f"{name}: expected an int, got {type(m).__name__}")
        if m < 1:
            raise ValueError(f"{name}: must be >= 1, got {m}")
        if lens is not None and max(lens) > m:
            raise ValueError(f"{name}: {m} is less than the longest sequence ({max(lens)})")
    if seqused_k is not None:
        _check_seqused_k(seqused_k, cu_seqlens_k.shape[0] - 1, q.device, lengths[1])
    return _check_scale(causal, softmax_scale, d)


def _check_seqused_k(seqused_k, num_seqs: int, device, lengths: list[int] | None) -> None:
    """`flash_attn_varlen`'s seqused_k: int32 (num_seqs,) contiguous on q's device; its values
    (0 <= seqused_k[b] <= lengths[b], sequence b's keys) where they are free to read."""
    if not isinstance(seqused_k, torch.Tensor):
        raise ValueError(
            f"seqused_k: expected a torch.Tensor or None, got {type(seqused_k).__name__}"
        )
    if seqused_k.dtype != torch.int32:
        raise ValueError(f"seqused_k: dtype must be torch.int32, got {seqused_k.dtype}")
    if seqused_k.dim() != 1 or seqused_k.shape[0] != num_seqs:
        raise ValueError(
            f"seqused_k: expected shape (num_seqs,) = ({num_seqs},), got {tuple(seqused_k.shape)}"
        )
    if seqused_k.device != device:
        raise ValueError(f"seqused_k: on device {seqused_k.device}, but q is on {device}")
    if seqused_k.stride(0) != 1 and num_seqs > 1:  # the kernels read entry b at seqused_k + b
        raise ValueError(f"seqused_k: must be contiguous, got stride {seqused_k.stride(0)}")
    if lengths is None or seqused_k.device.type != "cpu" or torch.compiler.is_compiling():
        return
    for b, (n, length) in enumerate(zip(seqused_k.tolist(), lengths)):
        if not 0 <= n <= length:
            raise ValueError(
                f"seqused_k: entry {b} is {n}, outside 0..{length} (sequence {b}'s keys in "
                "cu_seqlens_k)"
            )


def window_for(window_size, causal: bool, nq: int, nk: int) -> tuple[int, int]:
    """(left, right) of a sliding window, -1 = unbounded: query i sees keys j with
    i + Nk - Nq - left <= j <= i + Nk - Nq + right (FlashAttention's convention). causal=True
    is right = 0; an explicit right > 0 with it is an error. Bounds that no row of an (Nq, Nk)
    problem can reach (left >= Nk - 1, or an explicit right >= Nq - 1) become -1, so such
    windows run the plain kernels."""
    if (  # the common form first: a tuple of two ints
        window_size.__class__ is not tuple
        or len(window_size) != 2
        or window_size[0].__class__ is not int
        or window_size[1].__class__ is not int
    ) and (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise ValueError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size: sizes must be >= 0, or -1 for unbounded; got ({left}, {right})"
        )
    if causal:
        if right > 0:
            raise ValueError(
                f"window_size: right={right} conflicts with causal=True (causal means right = 0;"
                " for a window that looks ahead pass causal=False)"
            )
        right = 0
    elif right >= nq - 1:
        right = -1
    if left >= nk - 1:
        left = -1
    return left, right


def validate_stats(q, do, o, lse, dlse, v=None) -> None:
    """Check `flash_attn_backward`'s do, o (like 4-D q, with v's head dim Dv: v's last dim, or
    q's without a tensor v) and lse, dlse ((B, H, Nq) float32)."""
    if q.dim() != 4:
        raise ValueError(f"q: expected shape (B, Nq, H, D), got {tuple(q.shape)}")
    b, nq, h, d = q.shape
    dv = v.shape[-1] if isinstance(v, torch.Tensor) and v.dim() == 4 else d
    for name, t, shape, dtype in (
        ("do", do, (b, nq, h, dv), q.dtype),
        ("o", o, (b, nq, h, dv), q.dtype),
        ("lse", lse, (b, h, nq), torch.float32),
        ("dlse", dlse, (b, h, nq), torch.float32),
    ):
        if t is None and name == "dlse":
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on device {t.device}, but q is on {q.device}")


NO_WINDOW = (-1, -1)  # the public functions' default window_size (one object: `plain_options`)


def plain_options(causal, softmax_scale, window_size, softcap, return_lse) -> bool:
    """Whether the options `flash_attn` and `flash_attn_with_kvcache` share have the plain types
    (bool, float or None, the default window or a tuple of two ints), whose values compare
    equal only to values the checks treat alike (unlike 1 and True), so that a shortcut key may
    hold the values; and whether the call is eager (no tracing, no functorch transform)."""
    return (
        causal.__class__ is bool
        and return_lse.__class__ is bool
        and softcap.__class__ is float
        and (softmax_scale is None or softmax_scale.__class__ is float)
        and (
            window_size is NO_WINDOW
            or (
                window_size.__class__ is tuple
                and len(window_size) == 2
                and window_size[0].__class__ is int
                and window_size[1].__class__ is int
            )
        )
        and plain_call()
    )


def check_bool(name: str, value) -> bool:
    """A boolean option: True or False only (a truthy "no" is an error, not True)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def check_sm_margin(sm_margin) -> int:
    """`sm_margin`: how many multiprocessors the kernels leave free, an int >= 0."""
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
        raise ValueError(f"sm_margin: expected an int >= 0, got {sm_margin!r}")
    return sm_margin


def check_softcap(softcap) -> float:
    """`softcap` as a float: 0 (off) or a positive finite cap."""
    if softcap.__class__ is float and 0.0 <= softcap < math.inf:
        return softcap
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise ValueError(f"softcap: expected a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be finite and >= 0 (0 = no cap), got {softcap}")
    return float(softcap)


__all__ = [
    "FLOAT_DTYPES",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "NO_WINDOW",
    "check_sm_margin",
    "check_softcap",
    "plain_options",
    "validate",
    "validate_stats",
    "validate_varlen",
    "window_for",
]
