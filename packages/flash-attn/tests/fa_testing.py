"""Helpers shared by the flash-attn test files (test_flash_attn.py, test_varlen.py,
test_split_kv.py, test_gluon.py, test_api.py, test_gpu_sizes.py): imported as `fa_testing`
from beside them, as attn_cases.py is (pytest puts this folder on sys.path).

* inputs: `make`, `qkv`, `packed` (with `cu_seqlens`, `random_lengths`) for packed batches;
* checks against a float64 evaluation of the reference (and, for half precision, the reference
  evaluated in q.dtype): `check` (flash_attn), `check_varlen` (flash_attn_varlen),
  `check_with_configs` (configs of a test's own, through `with_configs`), `check_launches`
  (launch.forward / backward with given configs), all on `run_fwd_bwd` and `check_fn`;
* the chooser's view: `problems` (of a call on real tensors), `meta_problem` (on meta tensors,
  as an H100 sees it by default), `table_fwd`; targets `NO_GLUON` (a GPU with TMA on which the
  Gluon kernels cannot run) and `INTERPRETER`, besides `config.H100`;
* `need_sm90` (skip where the Gluon configs cannot run), `launch_names` (a probe's kernels).

What runs is decided once per call by the chooser (choose.py: a `Problem` in, a `FwdConfig` /
`BwdConfig` out). Tests that want another choice pass a config of their own to
`launch.forward` / `launch.backward` (`dataclasses.replace` on the chosen one); tests that ask
what an H100 would run pass `target=H100` (config.py) to the chooser or the probes
(`families.probe_*`), from any machine.
"""

import math

import pytest
import torch

from kernelkit.flash_attn import flash_attn, flash_attn_varlen
from kernelkit.flash_attn import launch as fa_launch
from kernelkit.flash_attn import validation as fa_validation
from kernelkit.flash_attn.choose import portable_fwd_config, table_tiles
from kernelkit.flash_attn.config import H100, BwdConfig, FwdConfig, Problem, Target, Varlen
from kernelkit.flash_attn.families import kernel_name
from kernelkit.flash_attn.reference import attention_reference, attention_varlen_reference
from kernelkit.shared.testing import assert_close

HALF = (torch.float16, torch.bfloat16)
# A GPU with TMA on which the Gluon kernels cannot run (an sm_100, say): where the chooser falls
# back to the portable kernels.
NO_GLUON = Target(interpreter=False, tma=True, gluon=False, sms=132)
# The Triton interpreter on CPU tensors (4 stand-in SMs), whatever runs these tests.
INTERPRETER = Target(interpreter=True, tma=True, gluon=False, sms=4)


def make(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def qkv(b, nq, nk, h, hkv, d, dtype, device, seed=0):
    return (
        make((b, nq, h, d), dtype, device, seed),
        make((b, nk, hkv, d), dtype, device, seed + 1),
        make((b, nk, hkv, d), dtype, device, seed + 2),
    )


def finite(t):
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def run_fwd_bwd(fn, q, k, v, do, dlse, **kw):
    """Forward and backward of fn on leaves aliasing q, k, v (strides kept, unlike a clone):
    (o, lse, (dq, dk, dv))."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*leaves, return_lse=True, **kw)
    outs, grads = [o], [do.to(o.dtype)]
    if dlse is not None:  # the LSE is differentiable too; empty rows (-inf) are left out
        outs.append(finite(lse))
        grads.append(dlse.to(lse.dtype))
    dq, dk, dv = torch.autograd.grad(outs, leaves, grads)
    return o, lse, (dq, dk, dv)


def check(q, k, v, causal=False, softmax_scale=None, with_dlse=True, **options):
    """flash_attn vs the float64 reference (and, for half precision, the reference evaluated in
    q.dtype: the error may be at most 2x that one's): o, LSE, dq, dk, dv. options: softcap,
    window_size."""
    lse_shape = (q.shape[0], q.shape[1]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    kw = dict(causal=causal, softmax_scale=softmax_scale, **options)
    return check_fn(flash_attn, attention_reference, q, k, v, lse_shape, with_dlse, **kw)


def check_fn(fn, reference, q, k, v, lse_shape, with_dlse, **kw):
    do = make(q.shape[:-1] + (v.shape[-1],), q.dtype, q.device, seed=7)
    dlse = make(lse_shape, torch.float32, q.device, seed=8) if with_dlse else None
    o, lse, grads = run_fwd_bwd(fn, q, k, v, do, dlse, **kw)
    o64, lse64, grads64 = run_fwd_bwd(reference, q.double(), k.double(), v.double(), do, dlse, **kw)
    lowp = q.dtype in HALF
    if lowp:
        o_l, _, grads_l = run_fwd_bwd(reference, q, k, v, do, dlse, **kw)
    assert o.dtype == q.dtype and o.shape == q.shape[:-1] + (v.shape[-1],)
    assert lse.dtype == torch.float32 and lse.shape == lse_shape
    assert_close(o, o64, ref_lowp=o_l if lowp else None, name="o")
    # Rows that see no key: LSE -inf exactly where the reference has it, output zeros.
    empty = torch.isneginf(lse64.cpu())
    assert torch.equal(torch.isneginf(lse.cpu()), empty), "LSE -inf rows differ"
    assert not torch.isnan(lse).any()
    assert_close(finite(lse), finite(lse64), bound=2e-5, name="lse")
    for g, g64, name, i in zip(grads, grads64, ("dq", "dk", "dv"), range(3)):
        assert g.dtype == q.dtype and g.shape == (q, k, v)[i].shape
        assert_close(g, g64, ref_lowp=grads_l[i] if lowp else None, name=name)
    return o, lse, grads


def problems(q, k, v, causal=False, softcap=0.0, window_size=(-1, -1), varlen=None,
             deterministic=True, target=None, do=None):  # fmt: skip
    """(forward, backward) `Problem` of a flash_attn call on q, k, v (4-D, or packed with
    `varlen`: window_size per sequence, as flash_attn_varlen takes it) as `target` sees it
    (None: their device), for the chooser; the backward's output gradient `do`, or one
    contiguous like the tests' (`check_fn`)."""
    nq, nk = (q.shape[1], k.shape[1]) if varlen is None else (varlen.max_q, varlen.max_k)
    window = fa_validation.window_for(window_size, causal, nq, nk)
    if do is None:
        do = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return (
        fa_launch.forward_problem(q, k, v, causal, softcap, window, varlen, target),
        fa_launch.backward_problem(
            do, q, k, v, causal, softcap, window, varlen, deterministic, target
        ),
    )


def meta_problem(b, nq, nk, h, hkv, d, dtype=torch.bfloat16, causal=False, window_size=(-1, -1),
                 softcap=0.0, packed=False, deterministic=True, target=H100) -> Problem:  # fmt: skip
    """The (backward's) `Problem` of a call on meta tensors (nothing allocated or read), as an
    H100 sees it by default; packed: b sequences of nq query and nk key rows. The forward's
    chooser reads the same fields."""
    if packed:
        q = torch.empty(b * nq, h, d, dtype=dtype, device="meta")
        k = torch.empty(b * nk, hkv, d, dtype=dtype, device="meta")
        cu = torch.empty(b + 1, dtype=torch.int32, device="meta")
        varlen = Varlen(cu, cu, nq, nk)
    else:
        q = torch.empty(b, nq, h, d, dtype=dtype, device="meta")
        k = torch.empty(b, nk, hkv, d, dtype=dtype, device="meta")
        varlen = None
    window = fa_validation.window_for(window_size, causal, nq, nk)
    return Problem.of(q, k, k, causal, window, softcap, varlen, q, deterministic, target)


def with_configs(fwd: FwdConfig | None = None, bwd: BwdConfig | None = None,
                 deterministic: bool = True):  # fmt: skip
    """flash_attn (4-D q, k, v) as the registered ops run it, but through
    `launch.forward(config=fwd)` and `launch.backward(config=bwd)` (None: the chooser's): for
    `check_fn` on configs of a test's own."""

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale, softcap, window):
            o, lse = fa_launch.forward(q, k, v, causal, scale, softcap=softcap, window=window,
                                       config=fwd)  # fmt: skip
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.options = causal, scale, softcap, window
            ctx.set_materialize_grads(False)  # an unused output's gradient stays None
            return o, lse

        @staticmethod
        def backward(ctx, do, dlse):
            q, k, v, o, lse = ctx.saved_tensors
            causal, scale, softcap, window = ctx.options
            if do is None:
                do = torch.zeros_like(o)
            grads = fa_launch.backward(do, q, k, v, o, lse, dlse, causal, scale, softcap=softcap,
                                       window=window, deterministic=deterministic, config=bwd)  # fmt: skip
            return (*grads, None, None, None, None)

    def fn(q, k, v, causal=False, softmax_scale=None, return_lse=False, window_size=(-1, -1),
           softcap=0.0):  # fmt: skip
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        window = fa_validation.window_for(window_size, causal, q.shape[1], k.shape[1])
        o, lse = Attention.apply(q, k, v, causal, scale, softcap, window)
        return (o, lse) if return_lse else o

    return fn


def check_with_configs(q, k, v, causal=False, fwd=None, bwd=None, deterministic=True, with_dlse=True,
                  **options):  # fmt: skip
    """`check` of a call through configs of the test's own (`with_configs`)."""
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    fn = with_configs(fwd, bwd, deterministic)
    return check_fn(
        fn, attention_reference, q, k, v, lse_shape, with_dlse, causal=causal, **options
    )


def table_fwd(p: Problem) -> FwdConfig:
    """The portable forward with the table's tile for `p` (the dense kernel, where the chooser
    might take the split-KV or the Gluon one)."""
    return portable_fwd_config(p, table_tiles(p)[0])


def cu_seqlens(lengths, device):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def packed(lens_q, lens_k, h, hkv, d, dtype, device, seed=0):
    """q (total_q, H, D), k/v (total_k, Hkv, D) and flash_attn_varlen's cu_seqlens/max_seqlen
    keyword arguments."""
    q = make((sum(lens_q), h, d), dtype, device, seed)
    k = make((sum(lens_k), hkv, d), dtype, device, seed + 1)
    v = make((sum(lens_k), hkv, d), dtype, device, seed + 2)
    kw = dict(cu_seqlens_q=cu_seqlens(lens_q, device), cu_seqlens_k=cu_seqlens(lens_k, device),
              max_seqlen_q=max(1, *lens_q), max_seqlen_k=max(1, *lens_k))  # fmt: skip
    return q, k, v, kw


def random_lengths(n, longest, seed):
    """n lengths in 0..longest, with a 0 and a 1 among them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest + 1, (n,), generator=g).tolist()
    lengths[seed % n], lengths[(seed + 2) % n] = 0, 1
    return lengths


def check_varlen(q, k, v, with_dlse=True, **kw):
    """flash_attn_varlen against the loop over sequences of the dense reference."""
    lse_shape = (q.shape[1], q.shape[0])
    return check_fn(flash_attn_varlen, attention_varlen_reference, q, k, v, lse_shape, with_dlse,
                  **kw)  # fmt: skip


def check_launches(fwd, bwd, q, k, v, causal, deterministic=True):
    """launch.forward/backward with configs `fwd` and `bwd` (None: the chooser's) against the
    float64 reference and, no worse than twice its error, the reference evaluated in q's
    dtype."""
    do = make(q.shape, q.dtype, q.device, seed=9)
    scale = 1 / math.sqrt(q.shape[-1])
    o, lse = fa_launch.forward(q, k, v, causal, scale, config=fwd)
    grads = fa_launch.backward(do, q, k, v, o, lse, None, causal, scale,
                               deterministic=deterministic, config=bwd)  # fmt: skip
    o64, lse64, grads64 = run_fwd_bwd(
        attention_reference, q.double(), k.double(), v.double(), do, None, causal=causal
    )
    o_l, _, grads_l = run_fwd_bwd(attention_reference, q, k, v, do, None, causal=causal)
    assert_close(o, o64, ref_lowp=o_l, name="o")
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(lse64.cpu()))
    assert_close(finite(lse), finite(lse64), bound=2e-5, name="lse")
    for g, g64, gl, name in zip(grads, grads64, grads_l, ("dq", "dk", "dv")):
        assert_close(g, g64, ref_lowp=gl, name=name)
    return o, lse, grads


def need_sm90(device) -> None:
    """Skip where a test's Gluon configs cannot run (a GPU other than sm_90: check_* refuses
    them; the CPU and interpreter runs compile-check their launches instead)."""
    if not Target.of(device).gluon:
        pytest.skip("the Gluon kernels run on sm_90 only")


def launch_names(probe) -> list[str]:
    """The kernels a probe recorded, by name, in launch order."""
    return [kernel_name(kernel) for kernel, *_ in probe.launches]
