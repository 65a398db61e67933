"""PyTorch reference of `flash_attn`: the test oracle (run on float64 inputs), the CPU fallback
and the "torch" benchmark provider (eager attention that materialises the score matrix).

The matmuls run in the input dtype (PyTorch accumulates half precision in float32) and the
softmax in float32 inside torch.softmax, the way eager attention is usually written.
"""

from __future__ import annotations

import math

import torch


def causal_visible(nq: int, nk: int, device) -> torch.Tensor:
    """(Nq, Nk) bool: query i sees key j iff j <= i + (Nk - Nq) (bottom-right aligned)."""
    return window_visible(nq, nk, -1, 0, device)


def window_visible(nq: int, nk: int, left: int, right: int, device) -> torch.Tensor:
    """(Nq, Nk) bool: query i sees key j iff i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right
    (a bound of -1 is absent)."""
    i = torch.arange(nq, device=device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=device)[None, :]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    return visible


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
):
    """softmax(q k^T * scale) v for q (B, Nq, H, D), k/v (B, Nk, Hkv, D), or 3-D (B, N, D).

    Same contract as `flash_attn`: GQA by repeating kv heads, bottom-right causal mask, rows that
    see no key give zeros (LSE -inf), natural-log LSE (B, H, Nq) (or (B, Nq)) in float32;
    softcap > 0 replaces the scores s by softcap * tanh(s / softcap); window_size (left, right)
    restricts query i to keys i + Nk - Nq - left ..= i + Nk - Nq + right (-1: unbounded; causal
    means right = 0).
    """
    three_d = q.dim() == 3
    if three_d:
        q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = q.shape[1], k.shape[1]
    left, right = window_size
    if causal:
        right = 0
    empty = None
    if left >= 0 or right >= 0:
        visible = window_visible(nq, nk, left, right, q.device)
        s = s.masked_fill(~visible, -math.inf)
        if right >= 0 and nk - nq + right < 0:  # the first rows see no key: softmax them
            empty = ~visible.any(-1, keepdim=True)  # over zeros, then zero them
            s = s.masked_fill(empty, 0.0)
    p = torch.softmax(s, dim=-1)
    if empty is not None:
        p = p.masked_fill(empty, 0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    if three_d:
        o = o.squeeze(2)
    if not return_lse:
        return o
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    if empty is not None:
        lse = lse.masked_fill(empty.squeeze(-1), -math.inf)
    if three_d:
        lse = lse.squeeze(1)
    return o, lse


def attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """`flash_attn_varlen`'s contract by a loop over the sequences of `attention_reference`:
    q (total_q, H, D), k/v (total_k, Hkv, D), o like q, LSE (H, total_q). max_seqlen_* are
    accepted for a matching signature and not needed. Reads cu_seqlens on the host."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        o, lse = attention_reference(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale,
            return_lse=True, softcap=softcap, window_size=window_size,
        )  # fmt: skip
        outs.append(o[0])
        lses.append(lse[0])
    o = torch.cat(outs)
    return (o, torch.cat(lses, dim=1)) if return_lse else o
