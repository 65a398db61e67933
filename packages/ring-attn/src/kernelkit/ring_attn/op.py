"""The public function `ring_attn`: checks, then the `ring_fwd` op (with its autograd)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernelkit.flash_attn.validation import check_bool, check_sm_margin, check_softcap, validate

from .comm import check_shards, checked, group_name, resolve
from .layout import check_layout
from .ring import default_sm_margin, ring_fwd


def _local_error(q, k, v, causal, softmax_scale, softcap, layout, deterministic, return_lse,
                 sm_margin):  # fmt: skip
    """This rank's argument error as a message (None: none), and the softmax scale."""
    try:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected a 4-D shard (B, N_local, H, D), got {shape}")
        scale = validate(q, k, v, causal, softmax_scale)
        if k.shape[1] != q.shape[1]:
            raise ValueError(
                f"k: holds {k.shape[1]} tokens but q holds {q.shape[1]}; ring attention shards "
                f"one sequence, so q, k and v hold the same tokens (N_local)"
            )
        softcap = check_softcap(softcap)
        check_layout(layout)
        check_bool("deterministic", deterministic)
        check_bool("return_lse", return_lse)
        if sm_margin is not None:
            check_sm_margin(sm_margin)
        if causal and layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(
                f"q: zigzag sharding holds two equal chunks per rank, so N_local must be even, "
                f"got {q.shape[1]}"
            )
        return None, scale, softcap
    except ValueError as e:
        return str(e), None, None


def ring_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    *,
    softcap: float = 0.0,
    deterministic: bool = True,
    sm_margin: int | None = None,
):
    """Attention over a sequence sharded across the ranks of `group` (None: the default group),
    each rank passing its own shard: `flash_attn` of the full sequence, restricted to this
    rank's query rows.

    q (B, N_local, H, D), k/v (B, N_local, Hkv, D) with H % Hkv == 0, the same shapes on every
    rank; float16/bfloat16 (float32 accepted). layout: how the sequence is sharded, "zigzag"
    (rank r holds chunks r and 2W-1-r of 2W: balanced under a causal mask; N_local even) or
    "contiguous" (rank r holds chunk r of W); `shard` / `unshard` / `positions` convert.
    causal: the full sequence's causal mask (query i sees keys j <= i). softcap and
    deterministic: as in flash_attn. Returns o like q, and with return_lse=True also the LSE
    (B, H, N_local) float32 over the full sequence. Differentiable in q, k, v (and through the
    LSE); dk and dv come back to the rank that holds k and v. sm_margin: multiprocessors the
    attention kernels leave free for the transfers (flash_attn's `sm_margin`): the persistent
    forward kernel holds every multiprocessor until it ends, so a transfer launched after it
    would wait instead of overlapping (None: `default_sm_margin`, measured: NOTES.md).

    Collective: every rank of the group calls it, in the same order as its other collectives.
    The first eager call on each group also checks the ranks against each other
    (`check_shards`: one host sync; a compiled graph skips it); on a later call, shards of different shapes on different ranks are the
    caller's error (they fail inside the transfers, or hang). A rank whose own arguments are
    wrong raises at once (on the first call: every rank raises it).
    """
    name = group_name(group)
    error, scale, softcap_ = _local_error(q, k, v, causal, softmax_scale, softcap, layout,
                                          deterministic, return_lse, sm_margin)  # fmt: skip
    if not torch.compiler.is_compiling() and not checked(name):
        check_shards(q, k, v, resolve(name), causal=causal, layout=layout,
                     softmax_scale=softmax_scale, softcap=softcap, local_error=error)  # fmt: skip
    if error is not None:
        raise ValueError(error)
    if scale < 0:  # the kernels take scale >= 0 (as flash_attn does): negate q instead
        q, scale = -q, -scale
    if sm_margin is None:
        sm_margin = default_sm_margin(q.shape[1])
    o, lse = ring_fwd(q, k, v, name, causal, scale, softcap_, layout, deterministic, sm_margin)
    return (o, lse) if return_lse else o


__all__ = ["ring_attn"]
