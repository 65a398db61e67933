"""Forward + backward calls of lrpe_cosine and md_lrpe_cosine for
kernelkit.shared.launch_check (position forms, grids, the angle cache, acts, theta fixed and
learnable); see test_prepared_launches_match_tritons_path."""

import functools

import torch


def _fwd_bwd(fn, x, theta, **kw):
    x = x.clone().requires_grad_()
    y = fn(x, theta, **kw)
    y.backward(torch.ones_like(y))


def launch_calls():
    import kernelkit.lrpe_cosine.op as cosine_op
    import kernelkit.md_lrpe_cosine.op as md_op
    from kernelkit.lrpe_cosine import lrpe_cosine
    from kernelkit.md_lrpe_cosine import md_lrpe_cosine

    cosine_op.use_triton = md_op.use_triton = lambda t: True
    x, xg = torch.randn(3, 20, 2, 16), torch.randn(3, 1 + 12, 2, 16)
    packed = torch.randn(1, 20, 2, 16)
    # (offset 11 replays offset 4's recorded launches with its own value)
    wheres = ({"offset": 4}, {"offset": 11}, {"offset": torch.tensor([1, 5, 9])},
              {"positions": torch.randint(0, 99, (3, 20))},
              {"cu_seqlens": torch.tensor([0, 7, 7, 20], dtype=torch.int32)})  # fmt: skip
    acts = (("none", None), ("silu", None), ("softmax", -1), ("softmax", 1))
    for grad in (False, True):
        for where in wheres:
            xw = packed if "cu_seqlens" in where else x
            for act, dim in acts:
                theta = torch.rand(2, 16).requires_grad_(grad)
                yield functools.partial(_fwd_bwd, lrpe_cosine, xw, theta, act=act, dim=dim, **where)
        for cache in (False, True):
            for act, dim in acts:
                theta = torch.rand(2, 8).requires_grad_(grad)
                yield functools.partial(
                    _fwd_bwd,
                    md_lrpe_cosine,
                    xg,
                    theta,
                    shape=(3, 4),
                    l=1,
                    act=act,
                    dim=dim,
                    cache=cache,
                )
