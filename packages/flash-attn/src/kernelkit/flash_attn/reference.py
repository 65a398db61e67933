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
    """softmax(q k^T * scale) v for q (B, Nq, H, D), k/v (B, Nk, Hkv, D), or 3-D (B, N, D); v may
    have a head dim of its own (Dv), which o then has.

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
    k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
    s, empty = _masked(_scores(q, k, scale, softcap), causal, window_size)
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


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v (B, Nk, Hkv, D) with each kv head repeated for the H / Hkv query heads it serves."""
    group = heads // t.shape[2]
    return t.repeat_interleave(group, dim=2) if group > 1 else t


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """(B, H, Nq, Nk) scores q k^T * scale, softcapped, before any mask (k has H heads)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return softcap * torch.tanh(s / softcap) if softcap else s


def _masked(s: torch.Tensor, causal: bool, window_size: tuple[int, int]):
    """(scores with the keys a query does not see at -inf, rows that see no key (B, H, Nq, 1)
    bool or None); those rows' scores are 0 so that their softmax stays finite (and is zeroed
    by the caller)."""
    nq, nk = s.shape[-2:]
    left, right = window_size
    if causal:
        right = 0
    empty = None
    if left >= 0 or right >= 0:
        visible = window_visible(nq, nk, left, right, s.device)
        s = s.masked_fill(~visible, -math.inf)
        if right >= 0 and nk - nq + right < 0:  # the first rows see no key
            empty = ~visible.any(-1, keepdim=True)
            s = s.masked_fill(empty, 0.0)
    return s, empty


def attention_reference_grads(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    dlse: torch.Tensor | None = None,
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    *,
    o: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """(dq, dk, dv) of `attention_reference`'s (o, lse) for 4-D inputs, given the gradients do
    (like o) and dlse ((B, H, Nq), or None for zero), in closed form: without autograd, so that
    torch.compile can trace it inside an op (the CPU fallback's backward). Computed in float32
    (float64 inputs: float64), returned in the inputs' dtypes.

    o and lse (both or neither): the output and LSE of a larger softmax that these keys are one
    block of (ring attention): P = exp(S - lse) and rowsum(P * dP) = rowsum(dO * o) then come
    from them, and the gradients are this block's share. Without them, this block's own.

    With P the probabilities and S the capped scores: dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(P * dP) + dLSE) (d LSE / d S = P), times 1 - (S / softcap)^2 under a
    softcap, then dQ = scale * dS K and dK = scale * dS^T Q, summed over each kv head's group.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, nk, hkv, d = k.shape
    heads = q.shape[2]
    q_, do_ = q.to(ct), do.to(ct)
    k_, v_ = _repeat_kv(k.to(ct), heads), _repeat_kv(v.to(ct), heads)
    s = _scores(q_, k_, scale, softcap)
    masked, empty = _masked(s, causal, window_size)
    if (o is None) != (lse is None):
        raise ValueError("o, lse: give both (a larger softmax's statistics) or neither")
    if lse is None:
        p = torch.softmax(masked, dim=-1)
    else:  # rows that see no key at all (lse -inf) have P = 0
        lse_ = lse.to(ct)[..., None]
        p = torch.exp(masked - torch.where(lse_ == -math.inf, math.inf, lse_))
    if empty is not None:
        p = p.masked_fill(empty, 0.0)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do_)
    dp = torch.einsum("bqhd,bkhd->bhqk", do_, v_)
    if o is None:
        ds = dp - (p * dp).sum(-1, keepdim=True)
    else:
        ds = dp - torch.einsum("bqhd,bqhd->bhq", do_, o.to(ct))[..., None]
    if dlse is not None:
        ds = ds + dlse.to(ct)[..., None]
    ds = p * ds
    if softcap:  # S = c tanh(x / c): dS/dx = 1 - tanh^2 (masked entries: P = 0 there)
        ds = ds * (1.0 - (s / softcap) ** 2)
    ds = ds * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q_)
    group = heads // hkv
    dk = dk.view(b, nk, hkv, group, d).sum(3)
    dv = dv.view(b, nk, hkv, group, dv.shape[-1]).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _key_ranges(cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor | None):
    """(first keys, ends of the used keys) of the sequences of a packed batch: cu_seqlens_k[b]
    and cu_seqlens_k[b + 1], or cu_seqlens_k[b] + seqused_k[b]."""
    ck = cu_seqlens_k.tolist()
    if seqused_k is None:
        return ck[:-1], ck[1:]
    return ck[:-1], [k + n for k, n in zip(ck, seqused_k.tolist())]


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
    *,
    seqused_k: torch.Tensor | None = None,
):
    """`flash_attn_varlen`'s contract by a loop over the sequences of `attention_reference`:
    q (total_q, H, D), k/v (total_k, Hkv, D), o like q, LSE (H, total_q); seqused_k: sequence b
    sees only its first seqused_k[b] keys. max_seqlen_* are accepted for a matching signature
    and not needed. Reads cu_seqlens and seqused_k on the host."""
    cq = cu_seqlens_q.tolist()
    outs, lses = [], []
    for q0, q1, k0, k1 in zip(cq, cq[1:], *_key_ranges(cu_seqlens_k, seqused_k)):
        o, lse = attention_reference(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale,
            return_lse=True, softcap=softcap, window_size=window_size,
        )  # fmt: skip
        outs.append(o[0])
        lses.append(lse[0])
    o = torch.cat(outs)
    return (o, torch.cat(lses, dim=1)) if return_lse else o


def attention_varlen_reference_grads(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    dlse: torch.Tensor | None = None,
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    *,
    seqused_k: torch.Tensor | None = None,
):
    """`attention_reference_grads` of `attention_varlen_reference`, sequence by sequence:
    do like q (total_q, H, D), dlse (H, total_q) or None; keys past seqused_k get zeros. Reads
    cu_seqlens and seqused_k on the host."""
    cq = cu_seqlens_q.tolist()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q1, k0, k1 in zip(cq, cq[1:], *_key_ranges(cu_seqlens_k, seqused_k)):
        if q1 == q0 or k1 == k0:  # no rows, or rows that see no key: zero gradients
            continue
        seq_dlse = None if dlse is None else dlse[None, :, q0:q1]
        grads = attention_reference_grads(
            do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal,
            softmax_scale, seq_dlse, softcap, window_size,
        )  # fmt: skip
        for out, g, lo, hi in zip((dq, dk, dv), grads, (q0, k0, k0), (q1, k1, k1)):
            out[lo:hi] = g[0]
    return dq, dk, dv


def kvcache_append_reference(k_cache, v_cache, k, v, cache_seqlens, block_table=None) -> None:
    """Write k, v (B, Nnew, Hkv, D) into the cache in place at positions cache_seqlens[b] ..
    + Nnew of each sequence: contiguous (B, S, Hkv, D), or paged through block_table."""
    batch, n_new = k.shape[:2]
    pos = cache_seqlens.to(torch.long)[:, None] + torch.arange(n_new, device=k.device)
    if block_table is None:
        rows = (torch.arange(batch, device=k.device)[:, None].expand(batch, n_new), pos)
    else:
        page_size = k_cache.shape[1]
        rows = (block_table.to(torch.long).gather(1, pos // page_size), pos % page_size)
    k_cache.index_put_(rows, k)
    v_cache.index_put_(rows, v)


def attention_kvcache_reference(q, k_cache, v_cache, seqlens, block_table=None, causal=False,
                                softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                return_lse=False):  # fmt: skip
    """`flash_attn_with_kvcache`'s attention (after its append): query row b of q (B, Nq, H, D)
    sees cache positions [0, seqlens[b]) of a contiguous (B, S, Hkv, D) cache or, with
    block_table (B, max_blocks), a paged one; causal and window bottom-right aligned per
    sequence (query i at position seqlens[b] - Nq + i). Rows that see no key give zeros (LSE
    -inf). Traceable: the per-sequence lengths become a mask, not slices."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    k, v = k_cache, v_cache
    if block_table is not None:  # (B, max_blocks * page_size, Hkv, D), the pages in order
        # (entries past the pages in use may hold anything: clamped, their keys masked below)
        pages = block_table.to(torch.long).clamp(0, k_cache.shape[0] - 1)
        k, v = k_cache[pages].flatten(1, 2), v_cache[pages].flatten(1, 2)
    nq, nk = q.shape[1], k.shape[1]
    lengths = seqlens.to(torch.long)[:, None, None]
    i = torch.arange(nq, device=q.device)[None, :, None] + lengths - nq
    j = torch.arange(nk, device=q.device)[None, None, :]
    visible = j < lengths
    left, right = window_size
    if causal:
        right = 0
    if right >= 0:
        visible = visible & (j <= i + right)
    if left >= 0:
        visible = visible & (j >= i - left)
    k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
    s = _scores(q, k, scale, softcap).masked_fill(~visible[:, None], -math.inf)
    empty = ~visible.any(-1)[:, None, :, None]  # (B, 1, Nq, 1)
    s = s.masked_fill(empty, 0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1).masked_fill(empty, 0.0), v)
    if not return_lse:
        return o
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    return o, lse.masked_fill(empty.squeeze(-1), -math.inf)
