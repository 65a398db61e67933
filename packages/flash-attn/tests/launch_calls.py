"""Forward + backward calls of flash_attn / flash_attn_varlen for kernelkit.shared.launch_check:
each call twice, so the second replays the launch sequence recorded by the first (dense,
split-KV decoding, window, softcap, the LSE's gradient, float32, packed batches); see
test_replayed_launches_match_the_full_host_path."""

import functools

import torch


def _fwd_bwd(fn, tensors, lse_grad=False, **kw):
    tensors = [
        t.clone().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t
        for t in tensors
    ]
    o, lse = fn(*tensors, return_lse=True, **kw)
    loss = o.float().sum() + (lse.sum() if lse_grad else 0.0)
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
    cu = torch.tensor([0, 7, 7, 30, 31], dtype=torch.int32)
    packed = (r(31, 4, 64), r(31, 2, 64), r(31, 2, 64), cu, cu, 23, 23)
    for causal in (False, True):
        for _ in range(2):
            yield functools.partial(_fwd_bwd, flash_attn_varlen, packed, causal=causal)
