"""Forward + backward calls of lrpe_rotate for kernelkit.shared.launch_check (every position
form, act, theta fixed and learnable); see test_prepared_launches_match_tritons_path."""

import functools

import torch


def _fwd_bwd(fn, x, theta, **kw):
    x = x.clone().requires_grad_()
    y = fn(x, theta, **kw)
    y.backward(torch.ones_like(y))


def launch_calls():
    import kernelkit.lrpe_rotate.op as op
    from kernelkit.lrpe_rotate import lrpe_rotate

    op.use_triton = lambda t: True
    x, packed = torch.randn(3, 20, 2, 16), torch.randn(1, 20, 2, 16)
    # (offset 11 replays offset 4's recorded launches with its own value)
    wheres = ({"offset": 4}, {"offset": 11}, {"offset": torch.tensor([1, 5, 9])},
              {"positions": torch.randint(0, 99, (3, 20))},
              {"cu_seqlens": torch.tensor([0, 7, 7, 20], dtype=torch.int32)})  # fmt: skip
    for grad in (False, True):
        for where in wheres:
            xw = packed if "cu_seqlens" in where else x
            for act, dim in (("none", None), ("silu", None), ("softmax", -1), ("softmax", 1)):
                theta = torch.rand(2, 8).requires_grad_(grad)
                yield functools.partial(_fwd_bwd, lrpe_rotate, xw, theta, act=act, dim=dim, **where)
