"""Forward + backward calls of flash_attn / flash_attn_varlen for kernelkit.shared.launch_check:
each call twice, so the second replays the launch sequence recorded by the first (dense,
split-KV decoding, window, softcap, the LSE's gradient, float32, packed batches, one tensor
passed as q, k and v or one cu_seqlens as both); see
test_replayed_launches_match_the_full_host_path."""

import functools

import torch


def _fwd_bwd(fn, tensors, lse_grad=False, same_qkv=False, **kw):
    """Forward and backward of fn on clones of `tensors` (q, k, v the same clone with same_qkv).
    The output gradients are random tensors (a plain .sum() gives stride-0 gradients, which the
    backward copies: such a layout is never replayed)."""
    tensors = [
        t.clone().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t
        for t in tensors
    ]
    if same_qkv:
        tensors[1] = tensors[2] = tensors[0]
    o, lse = fn(*tensors, return_lse=True, **kw)
    g = torch.Generator().manual_seed(0)
    loss = (o.float() * torch.randn(o.shape, generator=g)).sum()
    if lse_grad:
        loss = loss + (lse * torch.randn(lse.shape, generator=g)).sum()
    loss.backward()


def launch_calls():
    import kernelkit.flash_attn.op as op
    from kernelkit.flash_attn import flash_attn, flash_attn_varlen

    op.use_triton = lambda t: True

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape).to(dtype)

    dense = [
        ((r(2, 40, 4, 64), r(2, 40, 2, 64), r(2, 40, 2, 64)), {"causal": True}),
        ((r(1, 33, 2, 80), r(1, 50, 2, 80), r(1, 50, 2, 80)), {"causal": False}),
        ((r(2, 1, 4, 64), r(2, 600, 1, 64), r(2, 600, 1, 64)), {"causal": True}),  # split-KV
        ((r(1, 48, 2, 32), r(1, 48, 2, 32), r(1, 48, 2, 32)), {"window_size": (8, 0)}),
        ((r(1, 48, 2, 64), r(1, 48, 2, 64), r(1, 48, 2, 64)), {"softcap": 5.0}),
        ((r(1, 30, 2, 16, dtype=torch.float32),) * 3, {"causal": True}),
        ((r(1, 40, 64), r(1, 40, 64), r(1, 40, 64)), {"causal": True}),  # 3-D: one head
    ]
    for tensors, kw in dense:
        for lse_grad in (False, True):
            for _ in range(2):
                yield functools.partial(_fwd_bwd, flash_attn, tensors, lse_grad, **kw)
    # One tensor as q, k and v, then distinct tensors of the same layout: a replay of the first
    # recording would pass the same tensor three times.
    x = r(2, 40, 2, 64)
    for same in (True, True, False, False):
        yield functools.partial(_fwd_bwd, flash_attn, (x, x, x), same_qkv=same, causal=True)
    # Self-attention passes one cu_seqlens twice; then distinct ones of the same shape.
    cu, cu2 = (torch.tensor(c, dtype=torch.int32) for c in ([0, 7, 7, 30, 31], [0, 3, 20, 20, 31]))
    q, k, v = r(31, 4, 64), r(31, 2, 64), r(31, 2, 64)
    for causal in (False, True):
        for cu_k in (cu, cu, cu2, cu2):
            packed = (q, k, v, cu, cu_k, 23, 23)
            yield functools.partial(_fwd_bwd, flash_attn_varlen, packed, causal=causal)
