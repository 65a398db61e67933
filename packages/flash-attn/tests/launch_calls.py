"""Forward + backward calls of flash-attn's host path (`launch.forward` / `launch.backward`, what
the registered ops behind flash_attn / flash_attn_varlen run: no config, so the chooser decides
and the launches are replayed per layout) for kernelkit.shared.launch_check: each call three
times: the second replays the launch sequence recorded by the first through its prepared
launches, the third calls the compiled kernels' launchers that replay kept (dense, split-KV
decoding, window, softcap, the LSE's gradient, float32, packed batches with and without
seqused_k, one tensor passed as q, k and v or one cu_seqlens as both); see
test_replayed_launches_match_the_full_host_path. The calls take the launch functions directly
(as flash_attn's ops do once their arguments are checked), so nothing of flash-attn is patched
to force the kernels on CPU tensors."""

import functools

import torch


def _fwd_bwd(tensors, causal=False, window_size=(-1, -1), softcap=0.0, lse_grad=False,
             same_qkv=False):  # fmt: skip
    """launch.forward and launch.backward on clones of `tensors` (q, k, v the same clone with
    same_qkv), as flash_attn / flash_attn_varlen's ops get them: q, k, v (4-D; 3-D ones as one
    head), or (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k[, seqused_k])
    packed. The output gradient is a random tensor (a plain .sum() gives a stride-0 gradient,
    which the backward copies: such a layout is never replayed), the LSE's one too with lse_grad
    (else None, as autograd passes it)."""
    from kernelkit.flash_attn import launch
    from kernelkit.flash_attn.config import Varlen
    from kernelkit.flash_attn.validation import window_for

    tensors = [t.clone() if torch.is_tensor(t) and t.is_floating_point() else t for t in tensors]
    if same_qkv:
        tensors[1] = tensors[2] = tensors[0]
    q, k, v, *packed = tensors
    varlen = Varlen(*packed) if packed else None
    if varlen is None and q.dim() == 3:  # flash_attn's one head
        q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    nq, nk = (q.shape[1], k.shape[1]) if varlen is None else (varlen.max_q, varlen.max_k)
    window = window_for(window_size, causal, nq, nk)
    scale = q.shape[-1] ** -0.5
    o, lse = launch.forward(q, k, v, causal, scale, softcap=softcap, window=window, varlen=varlen)
    g = torch.Generator().manual_seed(0)
    do = torch.randn(o.shape, generator=g).to(o.dtype)
    dlse = torch.randn(lse.shape, generator=g) if lse_grad else None
    launch.backward(do, q, k, v, o, lse, dlse, causal, scale, softcap=softcap, window=window,
                    varlen=varlen)  # fmt: skip


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` at storage offset 0 whose data pointer is 2 bytes past 16-byte alignment
    (a foreign buffer's, say): the replay key (storage offset alignment) cannot tell it from an
    aligned one, the compiled kernel (data pointer alignment) can."""
    nbytes = t.numel() * t.element_size()
    buf = torch.empty(nbytes + 32, dtype=torch.uint8)
    start = (2 - buf.data_ptr()) % 16
    out = torch.frombuffer(memoryview(buf.numpy()), dtype=t.dtype, offset=start, count=t.numel())
    out = out.view(t.shape)
    out._buffer = buf  # keeps the memory alive
    return out.copy_(t)


def _misaligned_fwd_bwd(shape) -> None:
    """Forward and backward on misaligned bf16 q, k, v (not clones: copies would be aligned)."""
    from kernelkit.flash_attn import launch

    g = torch.Generator().manual_seed(1)
    q, k, v = (_misaligned(torch.randn(shape, generator=g).to(torch.bfloat16)) for _ in range(3))
    scale = shape[-1] ** -0.5
    o, lse = launch.forward(q, k, v, True, scale, window=(-1, 0))
    do = torch.randn(o.shape, generator=g).to(o.dtype)
    launch.backward(do, q, k, v, o, lse, None, True, scale, window=(-1, 0))


def launch_calls():
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
            for _ in range(3):
                yield functools.partial(_fwd_bwd, tensors, lse_grad=lse_grad, **kw)
    # One tensor as q, k and v, then distinct tensors of the same layout: a replay of the first
    # recording would pass the same tensor three times.
    x = r(2, 40, 2, 64)
    for same in (True,) * 3 + (False,) * 3:
        yield functools.partial(_fwd_bwd, (x, x, x), same_qkv=same, causal=True)
    # Aligned inputs (recorded, replayed, then the replay's kept launchers), then inputs of the
    # same layout whose data pointers are not 16-byte aligned: a replay must not take the
    # launchers kept for aligned ones.
    shape = (1, 24, 2, 32)
    for _ in range(3):
        yield functools.partial(_fwd_bwd, [r(*shape)] * 3, causal=True)
    for _ in range(2):
        yield functools.partial(_misaligned_fwd_bwd, shape)
    # Self-attention passes one cu_seqlens twice; then distinct ones of the same shape.
    cu, cu2 = (torch.tensor(c, dtype=torch.int32) for c in ([0, 7, 7, 30, 31], [0, 3, 20, 20, 31]))
    q, k, v = r(31, 4, 64), r(31, 2, 64), r(31, 2, 64)
    for causal in (False, True):
        for cu_k in (cu,) * 3 + (cu2,) * 3:
            packed = (q, k, v, cu, cu_k, 23, 23)
            yield functools.partial(_fwd_bwd, packed, causal=causal)
    # seqused_k (a replay passes each call's own), then none after it: the same layout else.
    used, used2 = (torch.tensor(u, dtype=torch.int32) for u in ([5, 0, 17, 1], [7, 0, 2, 0]))
    for seqused in (used,) * 3 + (used2,) * 3 + (None,) * 2:
        yield functools.partial(_fwd_bwd, (q, k, v, cu, cu, 23, 23, seqused), causal=True)
