"""The course assignment's interface on top of the registered ops.

`FlashAttentionFunction.apply(q, k, v, is_causal)` takes (B, N, D) tensors (one head) and saves
the log-sum-exp as a (B, Nq) float32 tensor first among its saved tensors, as
`ctx.save_for_backward(L, q, k, v, o)`, which is what that assignment's tests look for.
"""

from __future__ import annotations

import math

import torch

from .op import attn_bwd, attn_fwd, validate
from .validation import check_bool


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        if q.dim() != 3:
            raise ValueError(f"q: expected (B, N, D), got shape {tuple(q.shape)}")
        validate(q, k, v, check_bool("is_causal", is_causal), None)
        scale = 1.0 / math.sqrt(q.shape[-1])
        o, lse = attn_fwd(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), is_causal, scale)
        o, L = o.squeeze(2), lse.squeeze(1)
        ctx.save_for_backward(L, q, k, v, o)
        ctx.is_causal, ctx.scale = is_causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        L, q, k, v, o = ctx.saved_tensors
        dq, dk, dv = attn_bwd(
            do.unsqueeze(2),
            q.unsqueeze(2),
            k.unsqueeze(2),
            v.unsqueeze(2),
            o.unsqueeze(2),
            L.unsqueeze(1),
            None,
            ctx.is_causal,
            ctx.scale,
        )
        return dq.squeeze(2), dk.squeeze(2), dv.squeeze(2), None
