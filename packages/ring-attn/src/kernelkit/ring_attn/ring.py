"""The ring loops, registered as ops: `ring_fwd` and `ring_bwd`.

Forward, on every rank, W steps (W = the group's size): at step s it holds the key/value shard
of rank src = rank - s, posts the transfer of that shard to the next rank, runs `flash_attn` on
the blocks `layout.step_blocks` names and merges their (o, LSE) into float32 accumulators, then
waits for the next shard. Backward, W steps over the same shards: `flash_attn_backward` with
the final o and LSE gives each block's dq share and its dk, dv; the dk/dv accumulators of the
shard in hand (float32) travel one rank on after each step, so that after W steps every rank
holds the complete dk, dv of its own shard. Every sum runs in a fixed order: the gradients are
bitwise the same from run to run (with flash-attn's deterministic backward, the default).
While a transfer is in flight (every step but the forward's last), the attention kernels leave
`sm_margin` multiprocessors to it.

The ops are opaque to torch.compile (`define_opaque_op`): a compiled graph calls them as they
are, so the communication never enters Inductor's graph and the rest of the model compiles
around them. Nothing in the loops reads a value back to the host.
"""

from __future__ import annotations

import math

import torch

from kernelkit.flash_attn import flash_attn, flash_attn_backward
from kernelkit.shared.runtime import define_opaque_op

from .comm import Ring, resolve
from .layout import step_blocks

# Multiprocessors the attention kernels leave to the ring's transfers while one is in flight
# (`default_sm_margin`): NCCL's send/receive kernel needs a few, and a persistent kernel
# launched first would hold them all until it ends, exposing the transfer. The margin costs
# the kernels that share of the GPU, which at long shards outweighs the transfer it hides.
# Measured on 4x H200 (NOTES.md): 16 SMs up to 64k tokens per rank, none above.
SM_MARGIN = 16
SM_MARGIN_MAX_N_LOCAL = 65536


def default_sm_margin(n_local: int) -> int:
    """`ring_attn`'s sm_margin for shards of n_local tokens."""
    return SM_MARGIN if n_local <= SM_MARGIN_MAX_N_LOCAL else 0


def merge(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge a block's (o_b (B, n, H, D), lse_b (B, H, n)) into the float32 accumulators (out,
    lse) in place: softmax over the union of both key sets. A row that has seen no key yet has
    lse -inf and takes the block's values; rows that see no key in either stay 0 / -inf."""
    a = lse.transpose(1, 2).unsqueeze(-1)  # (B, n, H, 1), like out
    b = lse_b.transpose(1, 2).unsqueeze(-1)
    m = torch.maximum(a, b)
    m = torch.where(m == -math.inf, 0.0, m)
    wa, wb = torch.exp(a - m), torch.exp(b - m)
    total = wa + wb
    out.mul_(wa).add_(o_b.float() * wb).div_(torch.where(total > 0, total, 1.0))
    lse.copy_((m + torch.log(total)).squeeze(-1).transpose(1, 2))


def _fwd_fake(q, k, v, group, causal, scale, softcap, layout, deterministic, sm_margin):
    b, n, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)


@define_opaque_op("kernelkit_ring_attn::ring_fwd", fake=_fwd_fake)
def ring_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: str,
    causal: bool,
    scale: float,
    softcap: float,
    layout: str,
    deterministic: bool,  # (the backward's)
    sm_margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = Ring.of(resolve(group))
    b, n, h, d = q.shape
    out = q.new_zeros((b, n, h, d), dtype=torch.float32)
    lse = q.new_full((b, h, n), -math.inf, dtype=torch.float32)
    kv = (k, v)
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        pending = None if last else ring.exchange(kv)
        src = (ring.rank - step) % ring.world_size
        for blk in step_blocks(ring.rank, src, ring.world_size, n, causal, layout):
            q_, k_, v_ = q[:, blk.q_rows], kv[0][:, blk.k_rows], kv[1][:, blk.k_rows]
            o_b, lse_b = flash_attn(q_, k_, v_, blk.causal, scale, True, softcap=softcap,
                                    sm_margin=0 if last else sm_margin)  # fmt: skip
            merge(out[:, blk.q_rows], lse[:, :, blk.q_rows], o_b, lse_b)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _bwd_fake(do, q, k, v, o, lse, dlse, group, causal, scale, softcap, layout, deterministic,
              sm_margin):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@define_opaque_op("kernelkit_ring_attn::ring_bwd", fake=_bwd_fake)
def ring_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    group: str,
    causal: bool,
    scale: float,
    softcap: float,
    layout: str,
    deterministic: bool,
    sm_margin: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = Ring.of(resolve(group))
    n = q.shape[1]
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = (k, v)
    grads = None  # the transfer of the dk/dv accumulators (the next shard's, once received)
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        pending = None if last else ring.exchange(kv)
        src = (ring.rank - step) % ring.world_size
        blocks = []
        for blk in step_blocks(ring.rank, src, ring.world_size, n, causal, layout):
            rows, keys = blk.q_rows, blk.k_rows
            dq_b, dk_b, dv_b = flash_attn_backward(
                do[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], o[:, rows],
                lse[:, :, rows], blk.causal, scale, softcap=softcap,
                dlse=None if dlse is None else dlse[:, :, rows], deterministic=deterministic,
                sm_margin=sm_margin,
            )  # fmt: skip
            dq[:, rows] += dq_b
            blocks.append((keys, dk_b, dv_b))
        # The accumulators of this shard: what the ranks before this one added (received; its
        # send is done too once waited for), or zeros on its own rank; this step adds in place.
        if grads is None:
            dk = torch.zeros_like(k, dtype=torch.float32)
            dv = torch.zeros_like(v, dtype=torch.float32)
        else:
            dk, dv = grads.wait()
        for keys, dk_b, dv_b in blocks:
            dk[:, keys] += dk_b
            dv[:, keys] += dv_b
        del blocks
        if ring.world_size == 1:  # the only shard: complete
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        grads = ring.exchange((dk, dv))
        del dk, dv
        if pending is not None:
            kv = pending.wait()
    dk, dv = grads.wait()  # this rank's own shard, complete
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _setup(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.options = tuple(options)
    ctx.save_for_backward(q, k, v, *output)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = ring_bwd(do, q, k, v, o, lse, dlse, *ctx.options)
    return dq, dk, dv, *(None,) * len(ctx.options)


ring_fwd.register_autograd(_backward, setup_context=_setup)

__all__ = ["SM_MARGIN", "default_sm_margin", "merge", "ring_bwd", "ring_fwd"]
